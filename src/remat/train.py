"""train(): a real training run of a language model on text, planned to fit a memory budget.

The run: byte-level text (``remat.data``), a model (the built-in GPT by default), AdamW with a linear
warm-up and a cosine decay, optional mixed precision and gradient clipping; gradient accumulation
and activation checkpointing chosen together to fit the budget (``remat.accumulation``); evaluation on
held-out text; checkpoints of the whole training state that a resumed run continues from exactly
(``remat.train_state``). The library prints nothing: progress goes to the ``on_plan`` / ``on_step``
callbacks (``remat train`` draws them), files go to ``config.out``.

# NOTE [ Exact resume ]
A resumed run must produce the losses the uninterrupted run would have, bit for bit on the CPU. So
everything that decides a number is either rebuilt from the config or restored from the checkpoint:
the weights, AdamW's moments and step counts, the scheduler's position, the GradScaler, the torch /
CUDA / Python RNG states (dropout draws from the global torch generator), the data sampler's own
generator and position, and the micro-batch and plan (a different micro-batch sums gradients in a
different order). Checkpoints are written only between optimizer steps; a Ctrl-C during a step is
held until the step ends (a second one stops at once, and then the last checkpoint stands).
Evaluation and memory measurement draw no random numbers, so they may differ between the runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat import step as _step
from remat.accumulation import AccumulationPlan, Candidate, plan_accumulation
from remat.applier import apply
from remat.blocks import fingerprint
from remat.data import Sampler, build_text_model, eval_windows, load_text, text_loss
from remat.files import same_file
from remat.measure import MemoryTracer
from remat.models import GPTConfig, LlamaConfig, lm_loss
from remat.records import Plan
from remat.train_state import (
    CheckpointError,
    EvalLog,
    StepLog,
    TrainResult,
    config_dict,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    write_outputs,
)
from remat.units import check_budget

__all__ = [
    "PRECISIONS",
    "CheckpointError",
    "EvalLog",
    "StepLog",
    "TrainConfig",
    "TrainInterrupted",
    "TrainResult",
    "accumulate",
    "build_text_model",
    "text_loss",
    "train",
]

log = logging.getLogger(__name__)

#: ``precision`` values: plain float32, or autocast to bfloat16 / float16 (float16 with a GradScaler).
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_MIN_LR_RATIO = 0.1  # the cosine decays to 10% of the peak learning rate (nanoGPT, Chinchilla)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run. Every field but ``out``, ``eval_every``, ``checkpoint_every`` and
    ``device`` must match when a run resumes from a checkpoint."""

    model: str | GPTConfig | LlamaConfig = "gpt-tiny"
    """A zoo name of a language model (``gpt-tiny``, ``llama-tiny``, ``gpt2``, ...), a
    ``GPTConfig`` / ``LlamaConfig``, or ``"package.module:factory"``: a zero-argument callable that
    returns a module mapping (batch, seq) int64 ids to (batch, seq, >= 256) logits (or a
    ``(model, batch, loss_fn)`` tuple, as the other commands take: the model is used). Built-in
    shapes get a vocabulary of 256 (bytes) and ``seq_len`` positions."""
    text: str | None = None
    """A text file to train on; None: Python's own ``pydoc_data.topics``."""
    budget: int | str | None = None
    """Peak memory of a training step: bytes, ``"2GiB"``, or ``"60%"`` of the plain step's peak
    with the whole global batch at once. None: no plan, no accumulation unless ``micro_batch``."""
    steps: int = 200
    """Optimizer steps."""
    global_batch: int = 16
    """Sequences per optimizer step."""
    micro_batch: int | None = None
    """Sequences per forward/backward; must divide ``global_batch``. None: chosen with the plan."""
    seq_len: int = 128
    """Tokens (bytes) per sequence."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    warmup: int = 20
    """Steps of linear warm-up; then a cosine decay to 10% of ``lr`` at ``steps``."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay."""
    precision: str = "fp32"
    """``fp32``, or autocast to ``bf16`` or ``fp16`` (with a GradScaler); weights stay float32."""
    clip: float | None = 1.0
    """Clip the gradients' global norm to this; None or 0: no clipping."""
    eval_every: int = 50
    """Evaluate on the held-out text every this many steps, and at the end; 0: at the end only."""
    checkpoint_every: int = 50
    """Write a checkpoint every this many steps, and at the end; 0: at the end only."""
    out: str | None = None
    """Folder for ``checkpoint.pt``, ``log.json`` and ``loss.png``; None: write nothing."""
    seed: int = 0
    """Seed of the weights, dropout and the data order."""
    device: str | None = None
    """``cpu``, ``cuda``, ``cuda:1``...; None: CUDA when there is one."""


class TrainInterrupted(KeyboardInterrupt):
    """The run was stopped (Ctrl-C); ``checkpoint`` holds the state after ``step`` steps."""

    def __init__(self, *, step: int, checkpoint: Path | None) -> None:
        super().__init__(step, checkpoint)
        self.step = step
        """Optimizer steps completed."""
        self.checkpoint = checkpoint
        """The checkpoint to resume from (None when the run has no ``out`` folder)."""


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    on_plan: Callable[[AccumulationPlan], None] | None = None,
    on_step: Callable[[StepLog], None] | None = None,
) -> TrainResult:
    """Train as ``config`` says; with ``resume``, continue from ``config.out``'s checkpoint.

    Raises ``InfeasibleBudget`` when no micro-batch and plan fit the budget, ``CheckpointError``
    for a checkpoint that cannot be resumed (or, without ``resume``, one that would be
    overwritten), and ``TrainInterrupted`` (a ``KeyboardInterrupt``) after saving on Ctrl-C.
    """
    _validate(config)
    device = _device(config.device)
    data = load_text(config.text)
    out = Path(config.out) if config.out is not None else None
    ckpt_path = out / "checkpoint.pt" if out is not None else None
    expected = config_dict(config, data.sha256)
    state: dict[str, Any] | None = None
    if resume:
        if ckpt_path is None:
            raise CheckpointError("resume needs the run's folder: set out= (--out) to it")
        state = load_checkpoint(ckpt_path, expected)
    elif ckpt_path is not None and ckpt_path.exists():
        raise CheckpointError(
            f"{ckpt_path} already holds a training checkpoint; resume it (--resume), or choose "
            "another --out (or delete the file) to start a new run"
        )

    _seed_everything(config.seed)
    model = build_text_model(config.model, seq_len=config.seq_len, device=device)
    model.train()
    sampler = Sampler(data, seq_len=config.seq_len, seed=config.seed)
    windows = eval_windows(data, seq_len=config.seq_len)
    optimizer = _make_optimizer(model.parameters(), config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(config))
    scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
    autocast = _autocast(device, config.precision)

    plan: Plan | None
    if state is not None:
        if state["fingerprint"] != fingerprint(model):
            raise CheckpointError(
                f"{ckpt_path} was written by a model of another structure (fingerprint "
                f"{state['fingerprint']}, this model has {fingerprint(model)}); it was left as it is"
            )
        try:  # a checksummed file of this run that still does not fit: say so, not a traceback
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            scaler.load_state_dict(state["scaler"])
            sampler.load_state_dict(state["sampler"])
            set_rng_state(state["rng"])
            plan = Plan.from_json(state["plan"]) if state["plan"] is not None else None
            micro = int(state["micro_batch"])
            history = state["history"]
            start = int(state["step"])
            decided = AccumulationPlan(
                micro_batch=micro, plan=plan,
                candidates=[Candidate(**c) for c in history["candidates"]],
                budget_bytes=history["budget_bytes"])
        except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as e:
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            raise CheckpointError(f"{ckpt_path} does not fit this run's model and settings "
                                  f"({reason}); it was left as it is") from None
    else:
        decided = plan_accumulation(
            model, budget=config.budget, global_batch=config.global_batch,
            micro_batch=config.micro_batch, seq_len=config.seq_len, loss_fn=text_loss,
            make_optimizer=lambda params: _make_optimizer(params, config), autocast=autocast,
            device=device,
        )
        plan, micro = decided.plan, decided.micro_batch
        history = {"steps": [], "evals": [], "measured_peak_bytes": None,
                   "candidates": [dataclasses.asdict(c) for c in decided.candidates],
                   "budget_bytes": decided.budget_bytes}
        start = 0
    if on_plan is not None:
        on_plan(decided)
    if plan is not None:
        apply(model, plan)

    def save(step: int) -> Path | None:
        if ckpt_path is None:
            return None
        save_checkpoint(ckpt_path, {
            "config": expected, "fingerprint": fingerprint(model), "step": step,
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            "sampler": sampler.state_dict(), "rng": rng_state(),
            "plan": plan.to_json() if plan is not None else None, "micro_batch": micro,
            "history": history,
        })
        return ckpt_path

    def result(step: int) -> TrainResult:
        return TrainResult(
            config=config, steps=[StepLog(**s) for s in history["steps"]],
            evals=[EvalLog(**e) for e in history["evals"]], plan=plan, micro_batch=micro,
            accumulation_steps=config.global_batch // micro, candidates=decided.candidates,
            budget_bytes=decided.budget_bytes,
            measured_peak_bytes=history["measured_peak_bytes"], completed_steps=step,
            checkpoint=ckpt_path if ckpt_path is not None and ckpt_path.exists() else None,
        )

    params = [p for p in model.parameters() if p.requires_grad]
    tokens = config.global_batch * config.seq_len
    completed, saved_at, in_step, traced = start, -1, False, False
    try:
        with _HeldInterrupt() as interrupt:
            for index in range(start, config.steps):
                in_step = True
                t0 = time.perf_counter()
                ids = sampler.next(config.global_batch, device)
                lr = optimizer.param_groups[0]["lr"]
                # The first step builds AdamW's state only at its end: measure a step that has it.
                trace = not traced and bool(optimizer.state)
                traced = traced or trace
                optimizer.zero_grad(set_to_none=True)
                with _peak_meter(model, optimizer, ids, device, trace=trace) as meter:
                    loss = accumulate(model, ids, micro_batch=micro, loss_fn=text_loss,
                                      autocast=autocast, scaler=scaler)
                    scaler.unscale_(optimizer)
                    norm = nn.utils.clip_grad_norm_(params, config.clip) if config.clip else None
                    scale = scaler.get_scale()
                    scaler.step(optimizer)
                    scaler.update()
                    if scaler.get_scale() >= scale:  # a lower fp16 scale: inf grads, step skipped
                        scheduler.step()
                loss_value = float(loss)  # waits for the device
                grad_norm = float(norm) if norm is not None else None
                elapsed = time.perf_counter() - t0
                del ids, loss, norm  # freed here, not inside the next step's memory trace
                in_step, completed = False, index + 1
                peak = meter.peak_bytes
                if peak is not None:
                    history["measured_peak_bytes"] = max(peak, history["measured_peak_bytes"] or 0)
                entry = StepLog(step=completed, loss=loss_value, lr=lr, tokens_per_s=tokens / elapsed,
                                grad_norm=grad_norm, peak_bytes=peak)
                history["steps"].append(dataclasses.asdict(entry))
                last = completed == config.steps
                if last or (config.eval_every and completed % config.eval_every == 0):
                    eval_loss = evaluate(model, windows.to(device), micro_batch=micro, autocast=autocast)
                    history["evals"].append(dataclasses.asdict(EvalLog(step=completed, loss=eval_loss)))
                if last or (config.checkpoint_every and completed % config.checkpoint_every == 0):
                    save(completed)
                    saved_at = completed
                if on_step is not None:
                    on_step(entry)
                if interrupt.pending:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        path = ckpt_path if ckpt_path is not None and ckpt_path.exists() else None
        if not in_step and saved_at != completed:
            try:
                path = save(completed)
            except KeyboardInterrupt:  # another Ctrl-C while saving: the file on disk stands
                log.warning("stopped while saving step %d: the last checkpoint stands", completed)
                completed = saved_at if saved_at >= 0 else start
                path = ckpt_path if ckpt_path is not None and ckpt_path.exists() else None
        elif in_step:
            completed = saved_at if saved_at >= 0 else start
            log.warning("stopped inside step %d: the last checkpoint (step %d) stands",
                        completed + 1, completed)
        if out is not None and path is not None:
            write_outputs(result(completed), out)
        raise TrainInterrupted(step=completed, checkpoint=path) from None
    final = result(completed)
    if out is not None:
        write_outputs(final, out)
    return final


# --- pieces ---------------------------------------------------------------------------------------


def accumulate(
    model: nn.Module,
    ids: torch.Tensor,
    *,
    micro_batch: int,
    loss_fn: Callable[[Any, Any], torch.Tensor] = lm_loss,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> torch.Tensor:
    """Forward and backward of ``ids`` (global batch, seq) in micro-batches of ``micro_batch`` rows.

    Each micro-batch's mean loss is divided by the number of micro-batches before its backward, so
    the gradients that add up in ``.grad`` are those of the whole batch's mean loss (micro-batches
    of equal size: the mean of their means is the mean). Returns that mean loss, detached.
    """
    if ids.shape[0] % micro_batch:
        raise ValueError(f"micro_batch={micro_batch} does not divide the batch of {ids.shape[0]}")
    chunks = ids.split(micro_batch)
    losses = []
    for chunk in chunks:
        with autocast() if autocast is not None else contextlib.nullcontext():
            loss = _step.forward_loss(model, (chunk,), loss_fn)
        losses.append(loss.detach())
        if len(chunks) > 1:  # one micro-batch: no extra tensor, the very step that was profiled
            loss = loss / len(chunks)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        del loss
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


def _validate(config: TrainConfig) -> None:
    def positive_int(name: str, value: Any, low: int = 1) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")

    positive_int("steps", config.steps)
    positive_int("global_batch", config.global_batch)
    positive_int("seq_len", config.seq_len, 2)
    positive_int("warmup", config.warmup, 0)
    positive_int("eval_every", config.eval_every, 0)
    positive_int("checkpoint_every", config.checkpoint_every, 0)
    if config.micro_batch is not None:
        positive_int("micro_batch", config.micro_batch)
        if config.global_batch % config.micro_batch:
            raise ValueError(f"micro_batch={config.micro_batch} must divide "
                             f"global_batch={config.global_batch}")
    if config.precision not in PRECISIONS:
        raise ValueError(f"unknown precision {config.precision!r}; expected one of {list(PRECISIONS)}")
    if not (math.isfinite(config.lr) and config.lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {config.lr!r}")
    if config.clip is not None and not (math.isfinite(config.clip) and config.clip >= 0):
        raise ValueError(f"clip must be a finite number >= 0 (0: no clipping), got {config.clip!r}")
    if config.budget is not None:
        check_budget(config.budget)
    _device(config.device)
    if config.text is not None and config.out is not None:
        for name in ("checkpoint.pt", "log.json", "loss.png"):
            if same_file(config.text, Path(config.out) / name):
                raise ValueError(f"the text {config.text} is the run's own {name}, which the run "
                                 "rewrites; train on another file, or choose another out folder")


def _device(name: str | None) -> torch.device:
    """The device of ``TrainConfig.device``, checked: one torch knows, and one this machine has."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}; expected cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"remat train runs on cpu or cuda[:N], not {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: CUDA is not available here (torch "
                             f"{torch.__version__}); train on the CPU with device='cpu'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} "
                             "CUDA device(s)")
    return device


def _make_optimizer(params: Any, config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95),
                             weight_decay=config.weight_decay)


def _lr_factor(config: TrainConfig) -> Callable[[int], float]:
    """Linear warm-up to 1 over ``warmup`` steps, then a cosine from 1 to 0.1 at ``steps``."""
    warmup, steps = config.warmup, config.steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return _MIN_LR_RATIO + (1 - _MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _autocast(device: torch.device, precision: str) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
    dtype = PRECISIONS[precision]
    if dtype is None:
        return None
    return lambda: torch.autocast(device.type, dtype=dtype)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too


@dataclass
class _Meter:
    peak_bytes: int | None = None


@contextlib.contextmanager
def _peak_meter(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor,
                device: torch.device, *, trace: bool) -> Iterator[_Meter]:
    """The step's measured peak: CUDA's allocator counters every step; on the CPU the allocator
    trace of ``MemoryTracer`` when ``trace`` (once per process: it slows the step down)."""
    meter = _Meter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield meter
        meter.peak_bytes = torch.cuda.max_memory_allocated(device)
        return
    if not trace:
        yield meter
        return
    seen: set[int] = set()
    base = _step.storage_bytes([*model.parameters(), *model.buffers(), ids], seen=seen)
    base += _step.storage_bytes([dict(s) for s in optimizer.state.values()], seen=seen)
    with MemoryTracer(device) as tracer:
        yield meter
    meter.peak_bytes = base + tracer.trace.peak_bytes


class _HeldInterrupt:
    """Ctrl-C during a step sets ``pending`` (the loop stops after the step); a second one raises.
    Only the main thread can own SIGINT; elsewhere KeyboardInterrupt arrives as usual."""

    def __init__(self) -> None:
        self.pending = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def __enter__(self) -> _HeldInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

