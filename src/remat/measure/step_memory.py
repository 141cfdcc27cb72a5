"""Measuring one training step's memory with the tracer (``remat.measure.tracer``): ``measure_step``
and what it returns, ``StepMemory`` with its timeline, and the bytes live before a step begins."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat.errors import InvalidValue
from remat.manual.module_form import expect_module
from remat.measure import clock
from remat.measure import step as _step
from remat.measure import storages as _storages
from remat.measure.collector import collecting_once
from remat.measure.preserve import preserved
from remat.measure.tracer import MemoryTracer, Trace, sized

__all__ = ["StepMemory", "TimelinePoint", "base_bytes", "measure_step"]


@dataclass(frozen=True, kw_only=True)
class TimelinePoint:
    """One point of a step's memory timeline."""

    t_ms: float
    """Milliseconds since the step began (under the profiler on CPU: slower than a real step)."""
    live_bytes: int
    """Bytes live on the device at that moment, parameters and optimizer state included."""
    phase: str
    """``forward``, ``backward`` or ``optimizer``."""


@dataclass(frozen=True, kw_only=True)
class StepMemory:
    """The memory of one training step (forward, backward, optimizer step), measured."""

    device: str
    """Where it ran, e.g. ``"cpu"`` or ``"cuda:0"``."""
    peak_bytes: int
    """Peak bytes live on the device during the step, everything included."""
    kept_bytes: int
    """Bytes the forward left live for the backward (live at the forward/backward boundary minus
    live at the start of the step)."""
    base_bytes: int
    """Bytes live when the step began: parameters, optimizer state, the batch."""
    param_bytes: int
    """Bytes of the parameters."""
    grad_bytes: int
    """Bytes of the gradients the step produced."""
    optimizer_bytes: int
    """Bytes of optimizer state (0 without an optimizer)."""
    batch_bytes: int
    """Bytes of the batch."""
    forward_peak_bytes: int
    """Peak during the forward (with the loss)."""
    backward_peak_bytes: int
    """Peak during the backward."""
    optimizer_peak_bytes: int
    """Peak during the optimizer step (``base_bytes`` + grads when there is no optimizer)."""
    step_ms: float | None
    """Median time of a plain (unprofiled) step, milliseconds; None if not timed."""
    step_ms_all: list[float] = field(default_factory=list)
    """Every timed step, milliseconds."""
    timeline: list[TimelinePoint] = field(default_factory=list)
    """Live bytes through the step, at most ~2000 points."""


@collecting_once
def measure_step(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    repeats: int = 3,
    warmup: int = 1,
) -> StepMemory:
    """Measure the memory (and, separately, the time) of one training step.

    One warm-up step first, so that lazily created state (the optimizer's moments, autotuning) is
    there as it is in training; then one step under the memory tracer; then ``repeats`` plain steps
    for the time (median). The model, its gradients, buffers, the optimizer and the RNG state are put
    back afterwards: measuring trains nothing.
    """
    expect_module(model, "measure_step")
    if repeats < 0 or warmup < 0:
        raise InvalidValue(f"repeats and warmup must be >= 0, got repeats={repeats}, warmup={warmup}")
    loss_fn = _step.resolve_loss_fn(loss_fn)
    device = _step.batch_device(model, batch)
    with preserved(model, optimizer, batch):
        with sized(device) as mark:
            for _ in range(warmup):
                _step.train_step(model, batch, loss_fn, optimizer, mark=mark)
        memory = _measure_once(model, batch, loss_fn, optimizer, device)
        times = clock.timed_steps(model, batch, loss_fn, optimizer, repeats=repeats, device=device)
    step_ms = statistics.median(times) if times else None
    return StepMemory(**memory, step_ms=step_ms, step_ms_all=times)


def _measure_once(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
) -> dict[str, Any]:
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    params = _storages.param_bytes(model)
    opt = _storages.optimizer_bytes(optimizer)
    data = _storages.batch_bytes(batch)
    base = base_bytes(model, optimizer, batch, device)
    with MemoryTracer(device) as tracer:
        _step.train_step(model, batch, loss_fn, optimizer, mark=tracer.mark)
    trace = tracer.trace
    grads = _storages.storage_bytes([p.grad for p in model.parameters() if p.grad is not None])
    return {
        "device": str(device),
        "peak_bytes": base + trace.peak_bytes,
        "kept_bytes": trace.mark("backward").live_bytes - trace.mark("forward").live_bytes,
        "base_bytes": base,
        "param_bytes": params,
        "grad_bytes": grads,
        "optimizer_bytes": opt,
        "batch_bytes": data,
        "forward_peak_bytes": base + trace.peak_between("forward", "backward"),
        "backward_peak_bytes": base + trace.peak_between("backward", "optimizer"),
        "optimizer_peak_bytes": base + trace.peak_between("optimizer", "end"),
        "timeline": _timeline(trace, base),
    }


def base_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: Any, device: torch.device
) -> int:
    """Bytes live before a step: the allocator's count on CUDA; on the CPU the storages of the
    parameters, buffers, optimizer state and batch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    seen: set[int] = set()
    total = _storages.storage_bytes(list(model.parameters()), seen=seen)
    total += _storages.storage_bytes(list(model.buffers()), seen=seen)
    if optimizer is not None:
        total += _storages.storage_bytes([dict(s) for s in optimizer.state.values()], seen=seen)
    total += _storages.storage_bytes(list(_storages.batch_tensors(batch)), seen=seen)
    return total


def _timeline(trace: Trace, base: int, max_points: int = 2000) -> list[TimelinePoint]:
    bounds = [(m.t_ms, m.label) for m in trace.marks if m.label in ("forward", "backward", "optimizer")]

    def phase(t: float) -> str:
        current = "forward"
        for t_mark, label in bounds:
            if t >= t_mark:
                current = label
        return current

    start = trace.mark("forward").t_ms
    points = [(t, live) for t, live in trace.points if t >= start]
    stride = max(1, len(points) // max_points)
    kept = points[::stride]
    if points and kept[-1] != points[-1]:
        kept.append(points[-1])
    # keep the true peak in the downsampled curve
    if points:
        peak = max(points, key=lambda p: p[1])
        if peak not in kept:
            kept.append(peak)
            kept.sort()
    return [TimelinePoint(t_ms=t - start, live_bytes=base + live, phase=phase(t)) for t, live in kept]
