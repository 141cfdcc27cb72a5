"""auto(): profile -> solve -> apply (-> verify), in one call."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal, overload

import torch
from torch import nn

from remat.applier import apply, remove
from remat.profiler import profile
from remat.records import Plan
from remat.solver import InfeasibleBudget, check_method, in_eval_mode, solve
from remat.step import check_trainable
from remat.units import check_budget
from remat.verifier import Report
from remat.verifier import verify as _verify

__all__ = ["auto"]

log = logging.getLogger(__name__)


@overload
def auto(
    model: nn.Module, batch: Any, budget: int | str, *, loss_fn: Any = ..., optimizer: Any = ...,
    blocks: Sequence[str] | Sequence[nn.Module] | None = ..., method: str = ...,
    verify: Literal[False] = ..., repeats: int = ...,
) -> Plan: ...


@overload
def auto(
    model: nn.Module, batch: Any, budget: int | str, *, loss_fn: Any = ..., optimizer: Any = ...,
    blocks: Sequence[str] | Sequence[nn.Module] | None = ..., method: str = ...,
    verify: Literal[True], repeats: int = ...,
) -> tuple[Plan, Report]: ...


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
) -> Plan | tuple[Plan, Report]:
    """Make one training step of ``model`` on ``batch`` fit ``budget`` at the least extra time.

    ``budget`` is the peak memory of the whole step on the device: bytes, ``"8GiB"``, ``"7.5GB"``,
    or a share of the plain step's peak, ``"60%"``. The model is changed in place (see
    ``remat.apply``); applying again replaces the previous plan. Returns the plan, and with
    ``verify=True`` also the ``Report`` of real steps measured with it.

    Raises ``remat.InfeasibleBudget`` (naming the smallest budget that can be met) when no plan
    fits; the model is then left as it was.
    """
    # Validate at the edge: every mistake that solve() would find is found before profiling.
    check_trainable(model, "remat.auto")
    check_method(method)
    if budget is None and method in ("optimal", "greedy"):
        raise ValueError(f"remat.auto needs a budget for method={method!r}, e.g. budget='60%'")
    if budget is not None:
        check_budget(budget)
    remove(model)  # profile the model as the user wrote it
    prof = profile(model, batch, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks, repeats=repeats)
    try:
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
    report = _verify(model, batch, plan, loss_fn=loss_fn, optimizer=optimizer)
    return plan, report
