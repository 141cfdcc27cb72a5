"""Gradient accumulation planned together with checkpointing, the pure half: given a profile per
micro-batch size, which micro-batch and which plan. ``remat.train.accumulation`` profiles.

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

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from remat.errors import InfeasibleBudget
from remat.plan.costmodel import smallest_feasible
from remat.plan.solver import solve
from remat.records import Plan, Profile
from remat.units import format_bytes

__all__ = [
    "AccumulationPlan",
    "Candidate",
    "InfeasibleTraining",
    "choose",
    "extra_bytes",
    "micro_batch_sizes",
]

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


def extra_bytes(*, grad_bytes: int, global_batch: int, micro_batch: int, seq_len: int) -> int:
    """Bytes a step of ``global_batch`` sequences run as micro-batches of ``micro_batch`` holds
    beyond the single-step profile at ``micro_batch`` (NOTE [ Accumulation and checkpointing,
    planned together ], Memory): with more than one micro-batch, every gradient and a loss per
    micro-batch; always, the token ids of the rest of the global batch."""
    k = global_batch // micro_batch
    accumulated = grad_bytes + k * _SCALAR_BYTES if k > 1 else 0
    return accumulated + (global_batch - micro_batch) * seq_len * _ID_BYTES


def choose(
    sizes: list[int],
    profile_at: Callable[[int, int], Profile | InfeasibleBudget | None],
    *,
    budget_bytes: int,
    global_batch: int,
    seq_len: int,
    grad_bytes: int,
    opt_ms: float,
) -> AccumulationPlan:
    """The micro-batch among ``sizes`` and its plan with the highest predicted tokens/s under
    ``budget_bytes``. ``profile_at(m, within)`` is the step's profile at micro-batch m for the budget
    its plans are solved for, ``within``, or its refusal of it (None: it ran out of memory), asked
    for only when needed.
    Raises ``InfeasibleTraining`` when none fits."""
    rows: list[Candidate] = []
    plans: dict[int, Plan] = {}
    closest: tuple[int, int, str] | None = None  # (smallest peak, micro-batch, dominant)
    too_big = False
    for m in sizes:
        base = Candidate(micro_batch=m, accumulation_steps=global_batch // m)
        if too_big and m != global_batch:
            rows.append(dataclasses.replace(base, note="skipped: a smaller one does not fit"))
            continue
        extra = extra_bytes(grad_bytes=grad_bytes, global_batch=global_batch, micro_batch=m,
                            seq_len=seq_len)
        if extra >= budget_bytes:  # the gradients and token ids alone
            rows.append(dataclasses.replace(base, fits=False, predicted_peak_bytes=extra,
                                            note="does not fit: the accumulated gradients and token ids alone"))
            too_big = too_big or m != global_batch
            continue
        prof = profile_at(m, budget_bytes - extra)
        if prof is None:
            rows.append(dataclasses.replace(base, fits=False, note="out of memory in profiling"))
            too_big = too_big or m != global_batch
            continue
        row, plan, low = _candidate(base, prof, extra, budget_bytes=budget_bytes,
                                    grad_bytes=grad_bytes, opt_ms=opt_ms,
                                    tokens=global_batch * seq_len)
        rows.append(row)
        if plan is not None:
            plans[m] = plan
        else:
            too_big = too_big or m != global_batch
            if low is not None and (closest is None or low[0] < closest[0]):
                closest = (low[0], m, low[1])
    return _pick(rows, plans, closest, sizes=sizes, budget_bytes=budget_bytes,
                 global_batch=global_batch)


def _candidate(
    base: Candidate, prof: Profile | InfeasibleBudget, extra: int, *, budget_bytes: int, grad_bytes: int,
    opt_ms: float, tokens: int,
) -> tuple[Candidate, Plan | None, tuple[int, str] | None]:
    """One profiled micro-batch (or the profiler's refusal of it): its row, its plan (None when it
    cannot fit) and, when it cannot, its smallest peak and what dominates it."""
    k = base.accumulation_steps
    if isinstance(prof, InfeasibleBudget):
        smallest, dominant = prof.smallest_bytes, prof.dominant
    else:
        smallest, dominant = smallest_feasible(prof)
    if smallest + extra > budget_bytes:
        if k > 1:
            dominant += f", plus {format_bytes(grad_bytes)} of gradients accumulated over micro-batches"
        row = dataclasses.replace(base, predicted_peak_bytes=smallest + extra, fits=False,
                                  note="does not fit, even all recomputed")
        return row, None, (smallest + extra, dominant)
    assert isinstance(prof, Profile)  # a refusal's smallest is over the budget less ``extra``
    plan = solve(prof, budget_bytes - extra, method="optimal")
    if k > 1:
        plan = dataclasses.replace(plan, notes=[*plan.notes, (
            f"solved for the budget minus {format_bytes(extra)}: gradients that stay live "
            f"across {k} accumulated micro-batches, and the rest of the global batch")])
    step_ms = k * max(plan.estimate.step_ms - opt_ms, 0.0) + opt_ms
    row = dataclasses.replace(
        base, plan_summary=plan.summary(), predicted_peak_bytes=plan.estimate.peak_bytes + extra,
        fits=True, step_ms=step_ms, tokens_per_s=tokens / step_ms * 1e3)
    return row, plan, None


def _pick(rows: list[Candidate], plans: dict[int, Plan], closest: tuple[int, int, str] | None,
          *, sizes: list[int], budget_bytes: int, global_batch: int) -> AccumulationPlan:
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
