"""The steps ``verify`` runs and how it holds them together: gradients of one step, their
comparison, the key that makes two plans run alike, step times in turns (NOTE [ Step times in
turns ] in ``remat.verifier``), and what the caching allocator reserved.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from remat.applier import apply, remove
from remat.measure import clock
from remat.measure import step as _step
from remat.measure.copies import Copies
from remat.measure.preserve import preserved
from remat.records import Plan

__all__ = ["compare", "loss_and_grads", "plan_key", "reserved_peak", "times_in_turns"]


def reserved_peak(model: nn.Module, batch: Any, loss_fn: Any, optimizer: Any) -> int | None:
    """The caching allocator's most reserved bytes in one step, on CUDA (None elsewhere)."""
    device = _step.batch_device(model, batch)
    if device.type != "cuda":
        return None
    with preserved(model, optimizer, batch):
        torch.cuda.reset_peak_memory_stats(device)
        _step.train_step(model, batch, loss_fn, optimizer)
        return int(torch.cuda.max_memory_reserved(device))


def plan_key(plan: Plan) -> tuple[tuple[str, str], ...]:
    """What makes two plans run alike: the choices, the head, the segments and the tied modules (a
    plan of segments over blocks that all 'keep' is no plain step, nor one that ties a module)."""
    segments = tuple(("(segment)", f"{a}..{b}") for a, b in plan.segments)
    return (*sorted(plan.choices.items()), ("(head)", plan.head), *segments, *(("(tied)", n) for n in plan.tied))


def compare(plain: Copies, planned: Copies, *, exact: bool = True) -> tuple[float, bool]:
    """(largest absolute difference, equal) of two lists of loss and gradients: bit for bit, or
    with ``exact=False`` to round-off (within 1% of each tensor's largest magnitude). A piece of
    each at a time: two whole gradients and their difference would take three times the largest
    (NOTE [ Copies off the budget's memory ] in remat.measure.copies)."""
    diff, equal = 0.0, len(plain) == len(planned)
    for i in range(min(len(plain), len(planned))):
        shaped = plain.shape(i) == planned.shape(i)
        same, d, largest = shaped, 0.0, 0.0
        for a, b in zip(plain.pieces(i), planned.pieces(i)) if shaped else ():
            piece = float((a - b).abs().max())
            d = piece if math.isnan(piece) or piece > d else d  # a NaN stays: never equal to round-off
            largest = max(largest, float(a.abs().max()))
            same = same and torch.equal(a, b)
        diff = max(diff, d)
        rounded = not exact and shaped and plain.shape(i).numel() > 0
        equal = equal and (d <= 0.01 * largest + 1e-12 if rounded else same)
    return diff, equal


def loss_and_grads(model: nn.Module, batch: Any, loss_fn: Any, optimizer: Any, seed: int) -> Copies:
    """The loss and every gradient of one forward+backward from a fixed RNG state, copied off the
    device's memory: kept there, they would take room from the steps verify runs after (NOTE [
    Copies off the budget's memory ] in remat.measure.copies)."""
    with preserved(model, optimizer, batch):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        loss = _step.forward_loss(model, batch, loss_fn)
        loss.backward()
        return Copies([loss, *(p.grad for p in model.parameters() if p.grad is not None)])


def times_in_turns(
    model: nn.Module,
    configs: list[Plan | None],
    batch: Any,
    loss_fn: Any,
    optimizer: Any,
    repeats: int,
) -> list[list[float]]:
    """Step times (ms) of each configuration (None: plain), ``repeats`` each, taken in turns
    (NOTE [ Step times in turns ])."""
    device = _step.batch_device(model, batch)
    times: list[list[float]] = [[] for _ in configs]
    n = len(configs)

    def run(i: int, timed: bool) -> None:
        plan = configs[i]
        if plan is not None:
            apply(model, plan)
        try:
            if timed:
                times[i].append(clock.timed_step(model, batch, loss_fn, optimizer, device=device))
            else:
                _step.train_step(model, batch, loss_fn, optimizer)
        finally:
            remove(model)

    remove(model)  # none applied at the start, as at the end: NOTE [ A module's state is its buffers and its attributes ], rule 3
    with preserved(model, optimizer, batch):
        for i in range(n):  # one untimed step of each: lazy state, the allocator's caches
            run(i, timed=False)
        for r in range(repeats):
            shift = r * n // repeats
            order = list(range(shift, n)) + list(range(shift))
            with clock.no_gc():  # collected between rounds, never inside a timed step
                for i in reversed(order) if r % 2 else order:
                    run(i, timed=True)
    return times
