"""verify(): run real steps with a plan applied and hold them against the plan's prediction.

A plan passes when its measured peak is within its budget and its gradients equal the plain
model's: bit for bit, or, for a plan that sums in another order (a chunked head, a tiled MLP,
compiled blocks: NOTE [ The head's options ] in ``remat.records``), to round-off (every difference within 1% of
the tensor's largest magnitude; a wrong gradient is off by far more). Predicted vs measured peak and step time are reported, never adjusted: a plan whose
measured peak exceeds its budget is reported as failed.

# NOTE [ Step times in turns ]
Overheads are ratios of medians taken in one run: the plain step and every plan are timed in
turns (round r starts at a different place in the list and every other round runs backwards), so
a change in the machine's load hits all of them alike; on a CPU the clock is this process's CPU
time (NOTE [ CPU time on a shared CPU ]). The plain step is timed twice per round, as two
configurations, and the second over the first is reported as ``plain_self_overhead``: what
"plain against itself" measures in that same run is the noise floor of every overhead next to
it; and the median over the fastest of each configuration's times says how much the machine
disturbed the steps. A plan that changes nothing (every block kept) is the plain step: it gets the plain step's
numbers, overhead 0 by construction.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from remat.applier import applied_plan, apply, remove
from remat.errors import InvalidType, InvalidValue
from remat.measure import step as _step
from remat.measure.collector import collecting_once
from remat.measure.copies import Copies
from remat.measure.estimated import plain_peak
from remat.measure.lean import lean_spec
from remat.measure.step_memory import StepMemory, measure_step
from remat.records import Plan
from remat.verify_steps import compare, loss_and_grads, plan_key, reserved_peak, times_in_turns

__all__ = ["Report", "verify", "verify_many"]

REPORT_SCHEMA = 1


@dataclass(frozen=True, kw_only=True)
class Report:
    """What verifying a plan measured."""

    method: str
    """The plan's method."""
    budget_bytes: int | None
    """The plan's budget."""
    predicted_peak_bytes: int
    """The plan's predicted peak."""
    measured_peak_bytes: int
    """The measured peak of a step with the plan applied."""
    plain_peak_bytes: int
    """The measured peak of a plain step (no plan)."""
    predicted_overhead: float
    """The plan's predicted step-time overhead (0.1 = 10% slower than plain)."""
    measured_overhead: float
    """Median step time with the plan over the median plain step time, minus one."""
    plain_step_ms: float
    """Median plain step time, milliseconds."""
    step_ms: float
    """Median step time with the plan, milliseconds."""
    grads_equal: bool | None
    """Every gradient (and the loss) equal to the plain model's, bit for bit (to round-off for a plan
    with a chunked head, a tiled MLP or compiled blocks, whose sums run in another order; compiled
    blocks with active dropout draw other random numbers, and do not compare). None where they were
    not compared: no step to compare with fits the budget (``reference``)."""
    max_grad_diff: float
    """The largest absolute difference between a gradient and the plain model's."""
    repeats: int
    """Timed steps of each kind (taken in turns: NOTE [ Step times in turns ])."""
    plain_self_overhead: float | None = None
    """A second plain step timed in the same turns, its median over the plain median minus one:
    the noise floor of ``measured_overhead`` in this run (NOTE [ Step times in turns ])."""
    step_ms_spread: float | None = None
    """The largest of the median over the fastest of the plain step's and this plan's step
    times, minus one: how much the machine disturbed the steps (0.02 on a quiet CPU)."""
    plain_ran: bool = True
    """Whether the plain step ran. False when it is predicted over the budget (NOTE [ Verifying
    without the plain step ]): ``plain_peak_bytes`` and ``plain_step_ms`` are then predicted, the
    overhead is against the predicted plain time, and gradients are compared with ``reference``."""
    reference: str = "the plain step"
    """The step whose loss and gradients this plan's are compared with."""
    reserved_peak_bytes: int | None = None
    """On CUDA: the most the caching allocator reserved in the plan's step (``max_memory_reserved``),
    which is what the device must hold; ``measured_peak_bytes`` counts allocated bytes only."""
    schema_version: int = REPORT_SCHEMA
    """The record's schema version."""
    plain: StepMemory | None = field(default=None, compare=False, repr=False)
    """The plain step's memory (with its timeline), for plots; not in the JSON form."""
    planned: StepMemory | None = field(default=None, compare=False, repr=False)
    """The planned step's memory (with its timeline), for plots; not in the JSON form."""

    @property
    def fits(self) -> bool:
        """Measured peak within the budget (always true without a budget)."""
        return self.budget_bytes is None or self.measured_peak_bytes <= self.budget_bytes

    @property
    def peak_error(self) -> float:
        """Measured peak over predicted, minus one."""
        return self.measured_peak_bytes / self.predicted_peak_bytes - 1.0

    @property
    def passed(self) -> bool:
        """Fits its budget and gives the plain model's gradients, where they could be compared."""
        return self.fits and self.grads_equal is not False

    def to_json(self) -> str:
        data = {k: v for k, v in asdict(self).items() if k not in ("plain", "planned")}
        data.update(kind="report", fits=self.fits, passed=self.passed, peak_error=self.peak_error)
        return json.dumps(data, indent=2) + "\n"


def verify(
    model: nn.Module,
    batch: Any,
    plan: Plan,
    *,
    loss_fn: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    repeats: int = 5,
    seed: int = 0,
) -> Report:
    """Measure ``plan`` on ``model``: peak, step time against plain, gradients against plain.

    The model ends as it began: with whatever plan it had applied (or none), its weights,
    gradients, optimizer state and RNG state untouched.
    """
    (report,) = verify_many(
        model, batch, [plan], loss_fn=loss_fn, optimizer=optimizer, repeats=repeats, seed=seed
    )
    return report


@collecting_once  # NOTE [ One full collection per call ] in remat.measure.collector
def verify_many(
    model: nn.Module,
    batch: Any,
    plans: Sequence[Plan],
    *,
    loss_fn: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    repeats: int = 5,
    seed: int = 0,
) -> list[Report]:
    """``verify`` for several plans of one model, in one run: the plain step is measured once,
    plans with the same choices once, and all step times are taken in turns (NOTE [ Step times
    in turns ]). One report per plan, in order, each judged against its own budget.
    """
    if repeats < 1:
        raise InvalidValue(f"repeats must be >= 1, got {repeats}")
    _step.check_trainable(model, "remat.verify")
    bad = next((p for p in plans if not isinstance(p, Plan)), None)
    if bad is not None:
        raise InvalidType(
            f"remat.verify expects a remat Plan, got {type(bad).__name__}; load one with "
            "Plan.load(path)"
        )
    loss_fn = _step.resolve_loss_fn(loss_fn)
    unique: dict[tuple[tuple[str, str], ...], Plan] = {}
    for plan in plans:
        if plan.head != "keep" or plan.segments or plan.tied or any(o != "keep" for o in plan.choices.values()):
            unique.setdefault(plan_key(plan), plan)
    previous = applied_plan(model)
    budgets = [p.budget_bytes for p in plans if p.budget_bytes is not None]
    if budgets and not all(p.plain_ran for p in plans):
        remove(model)
        try:
            lean = _lean(model, batch, loss_fn, optimizer, plans, min(budgets))
        finally:
            if previous is not None:
                apply(model, previous)
        if lean is not None:
            return _verify_lean(model, batch, plans, loss_fn, optimizer, repeats, seed, lean)
    # The plain step as remat profiles it, without a K/V cache (NOTE [ No K/V cache in a planned
    # training step ]): with one, transformers' attention multiplies a concatenated key rather than
    # a view of it, which on some CPUs (an AMD EPYC's MKL) sums in another order, 1e-8 apart.
    with _step.as_planned(model):  # NOTE [ layerdrop ] in remat.models.hf
        try:
            remove(model)
            plain_mem = measure_step(model, batch, loss_fn=loss_fn, optimizer=optimizer, repeats=0)
            plain_grads = loss_and_grads(model, batch, loss_fn, optimizer, seed)
            measured: dict[tuple[tuple[str, str], ...], tuple[StepMemory, Copies]] = {}
            for key, plan in unique.items():
                apply(model, plan)
                mem = measure_step(model, batch, loss_fn=loss_fn, optimizer=optimizer, repeats=0)
                measured[key] = (mem, loss_and_grads(model, batch, loss_fn, optimizer, seed))
                remove(model)
            configs: list[Plan | None] = [None, *unique.values(), None]
            times = times_in_turns(model, configs, batch, loss_fn, optimizer, repeats)
        finally:
            remove(model)
            if previous is not None:
                apply(model, previous)
    plain_ms = statistics.median(times[0])
    plan_ms = {key: statistics.median(t) for key, t in zip(unique, times[1:-1])}
    spreads = [statistics.median(t) / min(t) - 1.0 for t in times]
    plain_spread = max(spreads[0], spreads[-1])
    plan_spread = {key: max(plain_spread, s) for key, s in zip(unique, spreads[1:-1])}
    self_overhead = statistics.median(times[-1]) / plain_ms - 1.0
    reports = []
    for plan in plans:
        key = plan_key(plan)
        mem, grads = measured.get(key, (plain_mem, plain_grads))
        ms = plan_ms.get(key, plain_ms)
        exact = plan.head == "keep" and not any(o == "tiled" or o.startswith("compiled:") for o in plan.choices.values())
        diff, equal = compare(plain_grads, grads, exact=exact)
        reports.append(Report(
            method=plan.method,
            budget_bytes=plan.budget_bytes,
            predicted_peak_bytes=plan.estimate.peak_bytes,
            measured_peak_bytes=mem.peak_bytes,
            plain_peak_bytes=plain_mem.peak_bytes,
            predicted_overhead=plan.estimate.overhead,
            measured_overhead=ms / plain_ms - 1.0,
            plain_step_ms=plain_ms,
            step_ms=ms,
            grads_equal=equal,
            max_grad_diff=diff,
            repeats=repeats,
            plain_self_overhead=self_overhead,
            step_ms_spread=plan_spread.get(key, plain_spread),
            plain=plain_mem,
            planned=mem,
        ))  # fmt: skip
    return reports


# NOTE [ Verifying without the plain step ]
# When the profile did not run the plain step (``Plan.plain_ran``: it was predicted over the budget
# the profile was given) and it is predicted over a plan's budget (from fake tensors, as the
# profiler predicts it: NOTE [ Planning what does not fit ] in remat.measure.lean), verify does
# not run it either. A profile made without a budget (a sweep of budgets, as the demo's) ran it.
# Gradients are compared with a reference step that fits: every block recomputed gives the plain
# step's gradients bit for bit in eager, and with the plan's chunked head to round-off; when
# neither is predicted within the budget there is no reference, and the gradients do not count as
# equal. A reference is predicted from fake tensors, which miss the kernels' scratch (a diffusers
# UNet's: predicted 50.14 MB under a 50.25 MB budget, it measured 55.57 MB and ran out of memory),
# while the plan's prediction holds measured corrections: so the reference runs only where its
# fake peak is no higher than the first plan's fake peak plus that plan's room under the budget.
# The gradients verify keeps wait on the host. The overhead is against the plain step time the plan
# predicts. The report says which (``plain_ran``, ``reference``).


def _compared(ref_grads: Copies, grads: Copies, plan: Plan,
              lean: _Lean) -> tuple[float, bool | None]:
    """(largest difference, equal) of a plan's gradients and the reference's; (nan, None) where
    there is none."""
    if not ref_grads:
        return float("nan"), None
    exact = plan.head == "keep" and lean.reference is not None and lean.reference.head == "keep" and not any(
        o == "tiled" or o.startswith("compiled:") for o in plan.choices.values())
    return compare(ref_grads, grads, exact=exact)


@dataclass(frozen=True)
class _Lean:
    plain_peak_bytes: int
    reference: Plan | None
    name: str


def _lean(model: nn.Module, batch: Any, loss_fn: Any, optimizer: Any, plans: Sequence[Plan],
          budget_bytes: int) -> _Lean | None:
    """None when the plain step is predicted within ``budget_bytes``; else the prediction and the
    reference step (NOTE [ Verifying without the plain step ])."""
    spec = lean_spec(_step.batch_device(model, batch))
    with _step.as_planned(model):
        plain = plain_peak(model, batch, loss_fn, optimizer, spec)
        if plain <= budget_bytes:
            return None
        plan = plans[0]
        # Fake peaks miss the kernels' scratch; the plan's prediction does not: the reference is
        # judged against the plan's own fake peak and room (NOTE [ Verifying without the plain step ]).
        ceiling = plain_peak(model, batch, loss_fn, optimizer, spec, configure=functools.partial(apply, plan=plan)) + (
            budget_bytes - plan.estimate.peak_bytes)
        recomputed = {name: "recompute" for name in plan.choices}
        candidates = [("every block recomputed", dataclasses.replace(
            plan, choices=recomputed, head="keep", segments=[], method="reference"))]
        if plan.head != "keep":
            candidates.append((f"every block recomputed, the head {plan.head}", dataclasses.replace(
                plan, choices=recomputed, segments=[], method="reference")))
        for name, ref in candidates:
            if plain_peak(model, batch, loss_fn, optimizer, spec, configure=functools.partial(apply, plan=ref)) <= ceiling:
                return _Lean(plain, ref, name)
    return _Lean(plain, None, "none: no reference step is predicted within the budget")


def _verify_lean(model: nn.Module, batch: Any, plans: Sequence[Plan], loss_fn: Any,
                 optimizer: Any, repeats: int, seed: int, lean: _Lean) -> list[Report]:
    """``verify_many`` without the plain step (NOTE [ Verifying without the plain step ])."""
    over = next((p for p in plans if p.budget_bytes is not None and p.estimate.peak_bytes > p.budget_bytes), None)
    if over is not None:
        raise InvalidValue(
            f"the {over.method} plan is predicted at {over.estimate.peak_bytes} bytes, over its budget of "
            f"{over.budget_bytes}, and the plain step does not fit that budget either: verify runs no step "
            "above the budget. Verify a plan solved for the budget (remat.solve), or raise the budget"
        )
    previous = applied_plan(model)
    measured: dict[tuple[tuple[str, str], ...], tuple[StepMemory, tuple[float, bool | None], int | None]] = {}
    with _step.as_planned(model):  # NOTE [ layerdrop ] in remat.models.hf
        try:
            ref_grads = Copies()
            if lean.reference is not None:
                apply(model, lean.reference)
                ref_grads = loss_and_grads(model, batch, loss_fn, optimizer, seed)
            for plan in plans:
                if plan_key(plan) not in measured:
                    apply(model, plan)
                    reserved = reserved_peak(model, batch, loss_fn, optimizer)
                    mem = measure_step(model, batch, loss_fn=loss_fn, optimizer=optimizer, repeats=0)
                    grads = loss_and_grads(model, batch, loss_fn, optimizer, seed)
                    measured[plan_key(plan)] = (mem, _compared(ref_grads, grads, plan, lean), reserved)
                    del grads
            keys = list(measured)
            by_key = {plan_key(p): p for p in plans}
            times = times_in_turns(model, [by_key[k] for k in keys], batch, loss_fn, optimizer, repeats)
        finally:
            remove(model)
            if previous is not None:
                apply(model, previous)
    plan_ms = {key: statistics.median(t) for key, t in zip(keys, times)}
    spread = {key: statistics.median(t) / min(t) - 1.0 for key, t in zip(keys, times)}
    reports = []
    for plan in plans:
        key = plan_key(plan)
        mem, (diff, equal), reserved = measured[key]
        plain_ms = plan.estimate.step_ms / (1.0 + plan.estimate.overhead)  # predicted
        reports.append(Report(
            method=plan.method, budget_bytes=plan.budget_bytes, predicted_peak_bytes=plan.estimate.peak_bytes,
            measured_peak_bytes=mem.peak_bytes, plain_peak_bytes=lean.plain_peak_bytes,
            predicted_overhead=plan.estimate.overhead, measured_overhead=plan_ms[key] / plain_ms - 1.0,
            plain_step_ms=plain_ms, step_ms=plan_ms[key], grads_equal=equal, max_grad_diff=diff,
            repeats=repeats, step_ms_spread=spread[key], plain_ran=False, reference=lean.name,
            reserved_peak_bytes=reserved, planned=mem,
        ))  # fmt: skip
    return reports
