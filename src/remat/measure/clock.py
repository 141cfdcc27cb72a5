"""Timing steps: the clock step times are taken with (NOTE [ CPU time on a shared CPU ]), and
steps timed on it with the garbage collector held."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

import torch
from torch import nn

from remat.measure.step import Batch, LossFn, train_step

__all__ = ["no_gc", "step_clock_ms", "sync", "timed_step", "timed_steps"]


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def step_clock_ms(device: torch.device | str) -> float:
    """Now, in milliseconds, on the clock that step times are taken with on ``device``.

    # NOTE [ CPU time on a shared CPU ]
    On a CPU shared with other processes, a step's wall-clock time depends on how much of the
    cores the others take at that moment: on a 2-core machine, plain steps of one model varied by
    +-30% from one step to the next while another process ran, and a plan measured against plain
    could come out faster than plain. The CPU time this process spends (``time.process_time``,
    all its threads) counts the step's work, not its waiting. So on a CPU every step time and
    every option cost is process CPU time; on CUDA it is wall-clock time after synchronising, the
    only meaningful clock there. (Intra-op threads that spin while waiting for a core also count
    as CPU time; the demo times on one thread for that reason.)
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter() * 1e3
    return time.process_time() * 1e3


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The garbage collector runs before, not inside, what this times."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def timed_steps(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn | None,
    optimizer: torch.optim.Optimizer | None,
    *,
    repeats: int,
    device: torch.device,
) -> list[float]:
    """Milliseconds of ``repeats`` steps on ``step_clock_ms`` (the caller warms up first)."""
    with no_gc():
        return [timed_step(model, batch, loss_fn, optimizer, device=device) for _ in range(repeats)]


def timed_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn | None,
    optimizer: torch.optim.Optimizer | None,
    *,
    device: torch.device,
) -> float:
    """Milliseconds of one step on ``step_clock_ms`` (the caller holds the garbage collector)."""
    t0 = step_clock_ms(device)
    train_step(model, batch, loss_fn, optimizer)
    return step_clock_ms(device) - t0
