"""Gradient accumulation planned together with checkpointing: which micro-batch, and which plan.

# NOTE [ Accumulation and checkpointing, planned together ]
A global batch of G sequences can run as k = G / m micro-batches of m sequences, their gradients
summed in ``.grad`` before one optimizer step. A smaller m keeps fewer activations, so fewer blocks
need recomputing, but each forward and backward does less work per kernel call; a larger m is more
efficient per token but may need more recomputation to fit. So for each m (the powers of two that
divide G, and G itself) the step is profiled at micro-batch m (measured, one profile per m) and the
fastest plan under the budget is solved; the (m, plan) with the highest predicted tokens/s wins.

- Time. A profile's ``step_ms`` is one forward, backward *and optimizer step* at micro-batch m, but
  an accumulated step runs the optimizer once per k micro-batches. So the predicted time of one
  optimizer step is k * (plan step_ms - opt_ms) + opt_ms, with opt_ms the optimizer step's time,
  measured once here (it does not depend on m); tokens/s = G * seq / that. Charging every micro
  step an optimizer step instead would favour large m by k - 1 optimizer steps.
- Memory. With k > 1 every micro-batch after the first starts with all gradients live, which the
  single-step profile does not see (there gradients appear during the backward). All gradient
  bytes on top of the single-step peak bound any micro step's peak from above: forward phases gain
  exactly that, backward phases at most that, the optimizer step is the same. So for k > 1 the plan
  is solved for budget - gradient bytes and its predicted peak is its estimate + gradient bytes.
  The whole global batch of token ids is on the device through the step (micro-batches are views
  of it), (G - m) * seq * 8 bytes more than the profiled batch, and with k > 1 each micro-batch
  leaves its loss (a scalar) for the step's mean: charged the same way.
- Pruning. If micro-batch m < G cannot fit (even with every block recomputed), no larger m < G can
  (activations grow with m; the same gradient bytes are added), so those are not profiled. G itself
  (k = 1, no gradients added) is always tried.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat import step as _step
from remat.costmodel import smallest_feasible
from remat.data import VOCAB_SIZE
from remat.profiler import profile
from remat.records import OPTIONS, Plan, Profile
from remat.solver import InfeasibleBudget, solve
from remat.units import format_bytes, parse_budget

__all__ = [
    "AccumulationPlan",
    "Candidate",
    "InfeasibleTraining",
    "micro_batch_sizes",
    "plan_accumulation",
    "summary",
]

log = logging.getLogger(__name__)

_ID_BYTES = 8  # token ids are int64
_SCALAR_BYTES = 8  # a micro-batch's loss kept for the mean, and the loss / k it backpropagates


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One micro-batch size considered for the global batch: one row of the planner's table."""

    micro_batch: int
    """Sequences per forward/backward."""
    accumulation_steps: int
    """Micro-batches per optimizer step (global batch / micro-batch)."""
    plan_summary: str | None = None
    """The plan's options counted, e.g. ``"3 keep, 5 recompute"``; None when none was solved."""
    predicted_peak_bytes: int | None = None
    """Predicted peak of a step with accumulation (NOTE [ Accumulation and checkpointing, planned
    together ]); for a micro-batch that cannot fit, the smallest peak it could reach."""
    fits: bool | None = None
    """Whether a plan fits the budget; None without a budget or when not profiled."""
    step_ms: float | None = None
    """Predicted time of one optimizer step (all micro-batches), milliseconds."""
    tokens_per_s: float | None = None
    """Predicted training throughput."""
    chosen: bool = False
    """The candidate the run uses."""
    note: str = ""
    """Why a candidate was not profiled or cannot fit, for people."""


@dataclass(frozen=True, kw_only=True)
class AccumulationPlan:
    """What ``plan_accumulation`` decided."""

    micro_batch: int
    """The chosen micro-batch."""
    plan: Plan | None
    """The chosen checkpointing plan; None without a budget (every block kept)."""
    candidates: list[Candidate]
    """Every micro-batch considered, smallest first."""
    budget_bytes: int | None = None
    """The budget in bytes (a ``"60%"`` budget resolved); None without one."""


class InfeasibleTraining(InfeasibleBudget):
    """No micro-batch size with any plan fits the budget; ``candidates`` says how close each came."""

    def __init__(self, message: str, *, budget_bytes: int, smallest_bytes: int, dominant: str,
                 candidates: list[Candidate]) -> None:
        super().__init__(message, budget_bytes=budget_bytes, smallest_bytes=smallest_bytes,
                         dominant=dominant)
        self.candidates = candidates
        """Every micro-batch considered."""


def micro_batch_sizes(global_batch: int) -> list[int]:
    """The powers of two that divide ``global_batch``, and ``global_batch`` itself."""
    sizes = {global_batch}
    m = 1
    while m < global_batch and global_batch % m == 0:
        sizes.add(m)
        m *= 2
    return sorted(sizes)


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
    profiles: dict[int, Profile | None] = {}

    def get(m: int) -> Profile | None:
        if m not in profiles:
            profiles[m] = _profile(model, m, seq_len=seq_len, loss_fn=loss_fn,
                                   make_optimizer=make_optimizer, autocast=autocast,
                                   device=device, repeats=repeats)
        return profiles[m]

    if isinstance(budget, str) and budget.strip().endswith("%"):
        whole = get(global_batch)
        if whole is None:
            raise ValueError(f"budget {budget!r} is a share of the plain step's peak with the whole "
                             f"global batch of {global_batch}, which ran out of memory while "
                             "profiling; give the budget in bytes, e.g. '8GiB'")
        budget_bytes = parse_budget(budget, plain_peak_bytes=whole.plain_peak_bytes)
    else:
        budget_bytes = parse_budget(budget)
    grad_bytes = _step.trainable_bytes(model)
    opt_ms = _optimizer_ms(model, make_optimizer, device)
    tokens = global_batch * seq_len

    rows: list[Candidate] = []
    plans: dict[int, Plan] = {}
    closest: tuple[int, int, str] | None = None  # (smallest peak, micro-batch, dominant)
    too_big = False
    for m in sizes:
        k = global_batch // m
        base = Candidate(micro_batch=m, accumulation_steps=k)
        if too_big and m != global_batch:
            rows.append(dataclasses.replace(base, note="skipped: a smaller one does not fit"))
            continue
        prof = get(m)
        if prof is None:
            rows.append(dataclasses.replace(base, fits=False, note="out of memory in profiling"))
            too_big = too_big or m != global_batch
            continue
        extra = (grad_bytes + k * _SCALAR_BYTES if k > 1 else 0) + (global_batch - m) * seq_len * _ID_BYTES
        smallest, dominant = smallest_feasible(prof)
        if smallest + extra > budget_bytes:
            if k > 1:
                dominant += f", plus {format_bytes(grad_bytes)} of gradients accumulated over micro-batches"
            if closest is None or smallest + extra < closest[0]:
                closest = (smallest + extra, m, dominant)
            rows.append(dataclasses.replace(
                base, predicted_peak_bytes=smallest + extra, fits=False,
                note="does not fit, even all recomputed"))
            too_big = too_big or m != global_batch
            continue
        plan = solve(prof, budget_bytes - extra, method="optimal")
        if k > 1:
            plan = dataclasses.replace(plan, notes=[*plan.notes, (
                f"solved for the budget minus {format_bytes(extra)}: gradients that stay live "
                f"across {k} accumulated micro-batches, and the rest of the global batch")])
        step_ms = k * max(plan.estimate.step_ms - opt_ms, 0.0) + opt_ms
        plans[m] = plan
        rows.append(dataclasses.replace(
            base, plan_summary=summary(plan), predicted_peak_bytes=plan.estimate.peak_bytes + extra,
            fits=True, step_ms=step_ms, tokens_per_s=tokens / step_ms * 1e3))

    fitting = [r for r in rows if r.fits]
    if not fitting:
        assert closest is not None or all(r.note for r in rows)
        low, m_low, dominant = closest if closest is not None else (0, sizes[0], "out of memory")
        raise InfeasibleTraining(
            f"budget {format_bytes(budget_bytes)} is below the smallest feasible peak of every "
            f"micro-batch size of the global batch of {global_batch} sequences: the lowest is "
            f"{format_bytes(low)} at micro-batch {m_low} ({dominant}); raise the budget, or "
            "shorten the sequences (--seq) or the model",
            budget_bytes=budget_bytes, smallest_bytes=low, dominant=dominant, candidates=rows)
    best = max(fitting, key=lambda r: (r.tokens_per_s or 0.0, r.micro_batch))
    rows = [dataclasses.replace(r, chosen=True) if r is best else r for r in rows]
    return AccumulationPlan(micro_batch=best.micro_batch, plan=plans[best.micro_batch],
                            candidates=rows, budget_bytes=budget_bytes)


def summary(plan: Plan) -> str:
    """``"3 keep, 5 recompute"``: how many blocks take each option, in ``OPTIONS`` order."""
    counts = {o: sum(1 for c in plan.choices.values() if c == o) for o in OPTIONS}
    return ", ".join(f"{n} {o}" for o, n in counts.items() if n)


def _profile(model: nn.Module, m: int, *, seq_len: int, loss_fn: Any, make_optimizer: Any,
             autocast: Any, device: torch.device, repeats: int) -> Profile | None:
    # Token values do not change bytes or times; a private generator leaves the global RNG alone.
    gen = torch.Generator().manual_seed(m)
    batch = (torch.randint(VOCAB_SIZE, (m, seq_len), generator=gen).to(device),)
    try:
        with autocast() if autocast is not None else contextlib.nullcontext():
            return profile(model, batch, loss_fn=loss_fn, optimizer=make_optimizer, repeats=repeats)
    except torch.OutOfMemoryError:
        log.info("micro-batch %d ran out of memory while profiling", m)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def _optimizer_ms(model: nn.Module, make_optimizer: Callable[[Any], torch.optim.Optimizer],
                  device: torch.device, repeats: int = 3) -> float:
    """Median time of one optimizer step, milliseconds, on zero gradients (weights restored)."""
    params = [p for p in model.parameters() if p.requires_grad]
    with _step.preserved(model):
        optimizer = make_optimizer(params)
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()  # creates the state
        times = []
        for _ in range(repeats):
            t0 = _step.step_clock_ms(device)
            optimizer.step()
            times.append(_step.step_clock_ms(device) - t0)
    return statistics.median(times)
