"""auto(): profile -> solve -> apply (-> verify), in one call.

# NOTE [ A verified plan fits ]
The cost model can under-predict a model it has not seen (a tensor that crosses blocks and lives
longer under checkpointing than in the plain step, say). With ``verify=True``, ``auto`` therefore
never returns a plan whose measured peak is over the budget: when a plan with multi-block segments
measures over, the budget is solved again with per-block options only (whose predictions are
exact on every model tested; segments' are not yet on all); when the measurement still exceeds it,
the plan is solved again for the budget less the measured excess (a warning says so, with the
numbers), applied and measured again, up to ``RESOLVES`` times; when no plan is predicted to fit
the tightened budget, or the last one still measures over, it raises ``InfeasibleBudget`` with the
measured numbers and leaves the model without a plan. The returned plan keeps the user's budget,
so its report's ``fits`` is judged against what the user asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
from torch import nn

from remat.applier import apply, remove
from remat.errors import InfeasibleBudget, InvalidValue, out_of_memory
from remat.measure.collector import collecting_once
from remat.measure.profiler import profile
from remat.measure.step import batch_device, check_trainable, resolve_loss_fn
from remat.plan.refusals import exact_bytes, ran_out_verifying
from remat.plan.solver import check_method, in_eval_mode, solve
from remat.records import Plan, Profile
from remat.units import check_budget, format_bytes
from remat.verifier import Report
from remat.verifier import verify as _verify

__all__ = ["RESOLVES", "auto"]

#: Re-solves with the measured excess before a verified ``auto`` gives up (NOTE [ A verified
#: plan fits ]).
RESOLVES = 3

log = logging.getLogger(__name__)


@overload
def auto(
    model: nn.Module, batch: Any, budget: int | str, *, loss_fn: Any = ..., optimizer: Any = ...,
    blocks: Sequence[str] | Sequence[nn.Module] | None = ..., method: str = ...,
    verify: Literal[False] = ..., repeats: int = ..., compile_budgets: Sequence[float] = ...,
) -> Plan: ...


@overload
def auto(
    model: nn.Module, batch: Any, budget: int | str, *, loss_fn: Any = ..., optimizer: Any = ...,
    blocks: Sequence[str] | Sequence[nn.Module] | None = ..., method: str = ...,
    verify: Literal[True], repeats: int = ..., compile_budgets: Sequence[float] = ...,
) -> tuple[Plan, Report]: ...


@collecting_once  # NOTE [ One full collection per call ] in remat.measure.collector
def auto(
    model: nn.Module,
    batch: Any,
    budget: int | str,
    *,
    loss_fn: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: Sequence[str] | Sequence[nn.Module] | None = None,
    method: str = "optimal",
    verify: bool = False,
    repeats: int = 3,
    compile_budgets: Sequence[float] = (),
) -> Plan | tuple[Plan, Report]:
    """Make one training step of ``model`` on ``batch`` fit ``budget`` at the least extra time.

    ``budget`` is the peak memory of the whole step on the device: bytes, ``"8GiB"``, ``"7.5GB"``,
    or a share of the plain step's peak, ``"60%"``. The model is changed in place (see
    ``remat.apply``); applying again replaces the previous plan. Returns the plan, and with
    ``verify=True`` also the ``Report`` of real steps measured with it. ``repeats``: timed steps
    per option while profiling, and of each kind while verifying. ``compile_budgets``: also plan
    with blocks compiled at these activation budgets (``remat.profile``'s; a compile per budget).

    Raises ``remat.InfeasibleBudget`` (naming the smallest budget that can be met) when no plan
    fits; the model is then left as it was. With ``verify=True`` the returned plan's measured peak
    is within the budget (NOTE [ A verified plan fits ]).
    """
    # Validate at the edge: every mistake that solve() would find is found before profiling.
    loss_fn = resolve_loss_fn(loss_fn)  # a loss_fn of neither form is refused
    check_trainable(model, "remat.auto")
    check_method(method)
    if budget is None and method in ("optimal", "greedy"):
        raise InvalidValue(f"remat.auto needs a budget for method={method!r}, e.g. budget='60%'")
    if budget is not None:
        check_budget(budget)
    remove(model)  # profile the model as the user wrote it
    # No step runs above the budget, the profiler's included (NOTE [ Planning what does not fit ]
    # in remat.measure.lean); NOTE [ Compiled blocks ] in remat.manual.compiled
    try:
        prof = profile(model, batch, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks, repeats=repeats,
                       compile_budgets=compile_budgets, budget=budget)
        plan = solve(prof, budget, method=method)
    except InfeasibleBudget as e:
        if model.training:
            raise
        raise in_eval_mode(e) from None
    apply(model, plan)
    log.info(
        "remat: %s plan, predicted peak %d bytes (budget %s), predicted overhead %.1f%%",
        plan.method, plan.estimate.peak_bytes, plan.budget_bytes, 100 * plan.estimate.overhead,
    )
    if not verify:
        return plan
    return _fitted(model, batch, prof, plan, loss_fn=loss_fn, optimizer=optimizer, method=method,
                   repeats=repeats)


def _fitted(
    model: nn.Module, batch: Any, prof: Profile, plan: Plan, *, loss_fn: Any, optimizer: Any,
    method: str, repeats: int,
) -> tuple[Plan, Report]:
    """Verify ``plan``; re-solve with the measured excess until it fits (NOTE [ A verified plan
    fits ])."""
    budget = plan.budget_bytes
    verified = functools.partial(_verified, model, batch, loss_fn=loss_fn, optimizer=optimizer, repeats=repeats)
    report = verified(plan)
    if budget is None:
        return plan, report
    target, segments = budget, True
    if not report.fits and plan.segments:
        segments = False
        # Per-block plans are predicted to the byte on every model tested; segment plans less so.
        log.warning("remat: the plan with segments measured %s against its budget %s (predicted "
                    "%s); solving again with per-block options only",
                    format_bytes(report.measured_peak_bytes), format_bytes(budget),
                    format_bytes(plan.estimate.peak_bytes))
        try:
            plan = solve(prof, budget, method=method, segments=segments)
        except InfeasibleBudget:
            pass
        else:
            apply(model, plan)
            report = verified(plan)
    for _ in range(RESOLVES):
        if report.fits:
            return plan, report
        target -= report.measured_peak_bytes - budget
        log.warning(
            "remat: the plan measured %s against its budget %s (predicted %s); solving again "
            "for %s, the budget less the excess",
            format_bytes(report.measured_peak_bytes), format_bytes(budget),
            format_bytes(plan.estimate.peak_bytes), format_bytes(max(target, 0)),
        )  # fmt: skip
        try:
            tighter = solve(prof, target, method=method, segments=segments) if target > 0 else None
        except InfeasibleBudget:
            tighter = None
        if tighter is None:
            break
        plan = dataclasses.replace(tighter, budget_bytes=budget)
        apply(model, plan)
        report = verified(plan)
    if report.fits:
        return plan, report
    remove(model)
    measured = report.measured_peak_bytes  # in bytes too where it reads as the budget (a few over)
    raise InfeasibleBudget(
        f"no plan measured within the budget {exact_bytes(budget, measured)}: the last one measured "
        f"{exact_bytes(measured, budget)} (predicted {exact_bytes(report.predicted_peak_bytes, measured)}), "
        f"and the cost model found none that fits the budget less the measured excess "
        f"({format_bytes(max(target, 0))}); raise the budget to at least {exact_bytes(measured, budget)}, "
        "or lower the batch. The model was left without a plan.",
        budget_bytes=budget,
        smallest_bytes=report.measured_peak_bytes,
        dominant="the measured peak of the last plan tried",
    )


def _verified(model: nn.Module, batch: Any, plan: Plan, **kwargs: Any) -> Report:
    """``verify`` the applied ``plan``; where its step runs out of memory, the model without a plan
    and a refusal (the step's memory is the device's: what the plan was for)."""
    try:
        return _verify(model, batch, plan, **kwargs)
    except (torch.OutOfMemoryError, RuntimeError, MemoryError) as e:
        if not out_of_memory(e):
            raise
        remove(model)
        budget = plan.budget_bytes if plan.budget_bytes is not None else plan.estimate.peak_bytes
        raise ran_out_verifying(budget, plan.estimate.peak_bytes, f"{type(e).__name__}: {str(e)[:300]}",
                                host=batch_device(model, batch).type == "cpu") from e
