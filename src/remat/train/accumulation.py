"""Gradient accumulation planned together with checkpointing, the torch half: profile the step
at each micro-batch size and time the optimizer step, then let ``remat.plan.accumulation`` choose
(NOTE [ Accumulation and checkpointing, planned together ] is there).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat.errors import InfeasibleBudget, ProfileError
from remat.measure import clock
from remat.measure import step as _step
from remat.measure import storages as _storages
from remat.measure.estimated import plain_peak
from remat.measure.lean import lean_spec
from remat.measure.preserve import preserved
from remat.measure.profiler import profile
from remat.plan.accumulation import (
    AccumulationPlan,
    Candidate,
    InfeasibleTraining,
    choose,
    micro_batch_sizes,
)
from remat.records import Profile
from remat.train.data import VOCAB_SIZE
from remat.units import parse_budget

__all__ = [
    "AccumulationPlan",
    "Candidate",
    "InfeasibleTraining",
    "micro_batch_sizes",
    "plan_accumulation",
]

log = logging.getLogger(__name__)


def plan_accumulation(
    model: nn.Module,
    *,
    budget: int | str | None,
    global_batch: int,
    seq_len: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    micro_batch: int | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    device: torch.device | str = "cpu",
    repeats: int = 1,
) -> AccumulationPlan:
    """Choose the micro-batch and the checkpointing plan with the highest predicted throughput
    under ``budget`` (NOTE [ Accumulation and checkpointing, planned together ]).

    ``budget``: bytes, ``"2GiB"``, or ``"60%"`` of the plain step's peak with the whole global batch
    in one micro-batch. None: no plan; ``micro_batch`` (default the global batch) is used as is.
    ``micro_batch`` given: only that size is considered. The model is left as it was.
    Raises ``InfeasibleTraining`` when no candidate fits.
    """
    loss_fn = _step.resolve_loss_fn(loss_fn) or _step.default_loss
    sizes = [micro_batch] if micro_batch is not None else micro_batch_sizes(global_batch)
    if budget is None:
        m = sizes[-1]
        row = Candidate(micro_batch=m, accumulation_steps=global_batch // m, plan_summary="no plan",
                        chosen=True, note="no budget: every block kept")
        return AccumulationPlan(micro_batch=m, plan=None, candidates=[row], budget_bytes=None)

    device = torch.device(device)
    if isinstance(budget, str) and budget.strip().endswith("%"):
        # a share of the plain step's peak with the whole global batch: predicted, never run
        whole = _batch(global_batch, seq_len, device)
        with autocast() if autocast is not None else contextlib.nullcontext():
            plain = plain_peak(model, whole, loss_fn, make_optimizer(model.parameters()), lean_spec(device))
        budget_bytes = parse_budget(budget, plain_peak_bytes=plain)
    else:
        memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        budget_bytes = parse_budget(budget, device_memory_bytes=memory)
    profiles: dict[int, Profile | InfeasibleBudget | None] = {}

    def get(m: int, within: int) -> Profile | InfeasibleBudget | None:
        if m not in profiles:
            profiles[m] = _profile(model, m, seq_len=seq_len, loss_fn=loss_fn,
                                   make_optimizer=make_optimizer, autocast=autocast,
                                   device=device, repeats=repeats, budget_bytes=within)
        return profiles[m]

    return choose(sizes, get, budget_bytes=budget_bytes, global_batch=global_batch, seq_len=seq_len,
                  grad_bytes=_storages.trainable_bytes(model),
                  opt_ms=_optimizer_ms(model, make_optimizer, device))


def _batch(m: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor]:
    # Token values do not change bytes or times; a private generator leaves the global RNG alone.
    gen = torch.Generator().manual_seed(m)
    return (torch.randint(VOCAB_SIZE, (m, seq_len), generator=gen).to(device),)


def _profile(model: nn.Module, m: int, *, seq_len: int, loss_fn: Any, make_optimizer: Any,
             autocast: Any, device: torch.device, repeats: int,
             budget_bytes: int) -> Profile | InfeasibleBudget | None:
    """The profile at micro-batch ``m`` for ``budget_bytes`` (the budget less what accumulating
    holds besides), no step of it above that (NOTE [ Planning what does not fit ] in
    remat.measure.lean); its refusal where no plan of it fits; None where it ran out of memory."""
    batch = _batch(m, seq_len, device)
    try:
        with autocast() if autocast is not None else contextlib.nullcontext():
            return profile(model, batch, loss_fn=loss_fn, optimizer=make_optimizer, repeats=repeats,
                           budget=budget_bytes)
    except (InfeasibleBudget, ProfileError, torch.OutOfMemoryError) as e:  # this size does not fit
        log.info("micro-batch %d: %s", m, e)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return e if isinstance(e, InfeasibleBudget) else None  # a refusal says by how much


def _optimizer_ms(model: nn.Module, make_optimizer: Callable[[Any], torch.optim.Optimizer],
                  device: torch.device, repeats: int = 3) -> float:
    """Median time of one optimizer step, milliseconds, on zero gradients (weights restored)."""
    params = [p for p in model.parameters() if p.requires_grad]
    with preserved(model):
        optimizer = make_optimizer(params)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()  # creates the state
        times = []
        for _ in range(repeats):
            t0 = clock.step_clock_ms(device)
            optimizer.step()
            times.append(clock.step_clock_ms(device) - t0)
    return statistics.median(times)
