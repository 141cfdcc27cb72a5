"""The pieces of a training step and a run: accumulating micro-batches, evaluating, the optimizer and
its schedule, autocast, seeding, measuring a step's peak, holding a Ctrl-C until a step ends."""

from __future__ import annotations

import contextlib
import math
import random
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.errors import InvalidValue
from remat.measure import step as _step
from remat.measure import storages as _storages
from remat.measure.tracer import MemoryTracer
from remat.models import lm_loss
from remat.train.config import PRECISIONS, TrainConfig
from remat.train.data import text_loss

__all__ = [
    "MIN_LR_RATIO",
    "HeldInterrupt",
    "PeakMeter",
    "accumulate",
    "autocast_for",
    "build_optimizer",
    "evaluate",
    "lr_factor",
    "peak_meter",
    "seed_everything",
]

MIN_LR_RATIO = 0.1  # the cosine decays to 10% of the peak learning rate (nanoGPT, Chinchilla)


def accumulate(
    model: nn.Module,
    ids: torch.Tensor,
    *,
    micro_batch: int,
    loss_fn: Callable[[Any, Any], torch.Tensor] = lm_loss,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    scaler: torch.amp.GradScaler | None = None,
    part: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> torch.Tensor:
    """Forward and backward of ``ids`` (global batch, seq) in micro-batches of ``micro_batch`` rows.

    Each micro-batch's mean loss is divided by the number of micro-batches before its backward, so
    the gradients that add up in ``.grad`` are those of the whole batch's mean loss (micro-batches
    of equal size: the mean of their means is the mean). Returns that mean loss, detached. Each
    micro-batch runs inside ``part()`` (``PeakMeter.part``), and so does making the returned loss.
    """
    if ids.shape[0] % micro_batch:
        raise InvalidValue(f"micro_batch={micro_batch} does not divide the batch of {ids.shape[0]}")
    chunks = ids.split(micro_batch)
    losses = []
    for chunk in chunks:
        with part():
            with autocast() if autocast is not None else contextlib.nullcontext():
                loss = _step.forward_loss(model, (chunk,), loss_fn)
            losses.append(loss.detach())
            if len(chunks) > 1:  # one micro-batch: no extra tensor, the very step that was profiled
                loss = loss / len(chunks)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            del loss
    with part():
        return torch.stack(losses).float().mean() if len(losses) > 1 else losses[0].float()


def evaluate(
    model: nn.Module,
    windows: torch.Tensor,
    *,
    micro_batch: int,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> float:
    """Mean next-byte loss on ``windows`` in eval mode, without gradients (so checkpointed blocks
    run plainly). Draws no random numbers."""
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        with torch.no_grad(), autocast() if autocast is not None else contextlib.nullcontext():
            for chunk in windows.split(micro_batch):
                total += float(text_loss(model(chunk), (chunk,))) * len(chunk)
        return total / len(windows)
    finally:
        model.train(was_training)


def build_optimizer(params: Any, config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95),
                             weight_decay=config.weight_decay)


def lr_factor(config: TrainConfig) -> Callable[[int], float]:
    """Linear warm-up to 1 over ``warmup`` steps, then a cosine from 1 to 0.1 at ``steps``."""
    warmup, steps = config.warmup, config.steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def autocast_for(device: torch.device, precision: str) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
    dtype = PRECISIONS[precision]
    if dtype is None:
        return None
    return lambda: torch.autocast(device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too


@dataclass
class PeakMeter:
    """A step's measured peak. On the CPU the step is traced in parts (``part``: each micro-batch,
    then the update), so the tracer's own records, which live in the same memory as the tensors,
    grow with one part's ops rather than the whole step's (NOTE [ Tracing a step in parts ])."""

    peak_bytes: int | None = None
    tracing: bool = False
    live_bytes: int = 0
    """Bytes live when the next part starts: the base, plus what the parts so far left."""

    @contextlib.contextmanager
    def part(self) -> Iterator[None]:
        if not self.tracing:
            yield
            return
        with MemoryTracer(torch.device("cpu")) as tracer:
            yield
        trace = tracer.trace
        self.peak_bytes = max(self.peak_bytes or 0, self.live_bytes + trace.peak_bytes)
        self.live_bytes += trace.marks[-1].live_bytes


# NOTE [ Tracing a step in parts ]
# 1. On the CPU the allocator trace is torch.profiler's, whose event records take host memory, the
#    memory the budget is about. One record per op of the whole step grew with the accumulation
#    steps: gpt-tiny's global batch of 16 in micro-batches of 2 mapped 41 MiB more than in 8s.
# 2. So each part's records are read and freed before the next part runs. Nothing is allocated
#    between parts, so the bytes live at a part's start are the base (weights, buffers, the batch,
#    the optimizer's state) plus what every earlier part left: the peak is exact.


def base_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> int:
    """What is live before a step starts: weights, buffers, the batch, the optimizer's state."""
    seen: set[int] = set()
    base = _storages.storage_bytes([*model.parameters(), *model.buffers(), ids], seen=seen)
    return base + _storages.storage_bytes([dict(s) for s in optimizer.state.values()], seen=seen)


@contextlib.contextmanager
def peak_meter(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor,
                device: torch.device, *, trace: bool) -> Iterator[PeakMeter]:
    """The step's measured peak: CUDA's allocator counters every step; on the CPU the allocator
    trace of ``MemoryTracer`` when ``trace`` (once per process: it slows the step down), taken in
    the parts the step runs in ``meter.part()``."""
    meter = PeakMeter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield meter
        meter.peak_bytes = torch.cuda.max_memory_allocated(device)
        return
    if not trace:
        yield meter
        return
    meter.tracing, meter.live_bytes = True, base_bytes(model, optimizer, ids)
    yield meter
    meter.tracing = False


class HeldInterrupt:
    """Ctrl-C during a step sets ``pending`` (the loop stops after the step); a second one raises.
    Only the main thread can own SIGINT; elsewhere KeyboardInterrupt arrives as usual."""

    def __init__(self) -> None:
        self.pending = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def __enter__(self) -> HeldInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

