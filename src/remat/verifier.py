"""verify(): run real steps with a plan applied and hold them against the plan's prediction.

A plan passes when its measured peak is within its budget and its gradients equal the plain
model's. Predicted vs measured peak and step time are reported, never adjusted: a plan whose
measured peak exceeds its budget is reported as failed.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from remat import step as _step
from remat.applier import applied_plan, apply, remove
from remat.measure import StepMemory, measure_step
from remat.records import Plan

__all__ = ["Report", "verify"]

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
    grads_equal: bool
    """Every gradient (and the loss) equal to the plain model's, bit for bit."""
    max_grad_diff: float
    """The largest absolute difference between a gradient and the plain model's."""
    repeats: int
    """Timed steps of each kind (alternating plain and plan)."""
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
        """Fits its budget and gives the plain model's gradients."""
        return self.fits and self.grads_equal

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
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    _step.check_trainable(model, "remat.verify")
    if not isinstance(plan, Plan):
        raise TypeError(
            f"remat.verify expects a remat Plan, got {type(plan).__name__}; load one with "
            "Plan.load(path)"
        )
    previous = applied_plan(model)
    try:
        remove(model)
        plain_mem = measure_step(model, batch, loss_fn=loss_fn, optimizer=optimizer, repeats=0)
        plain_grads = _grads(model, batch, loss_fn, optimizer, seed)
        apply(model, plan)
        plan_mem = measure_step(model, batch, loss_fn=loss_fn, optimizer=optimizer, repeats=0)
        plan_grads = _grads(model, batch, loss_fn, optimizer, seed)
        plain_ms, plan_ms = _alternating_times(model, plan, batch, loss_fn, optimizer, repeats)
    finally:
        remove(model)
        if previous is not None:
            apply(model, previous)
    diff = max(
        (float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(plain_grads, plan_grads)),
        default=0.0,
    )
    equal = len(plain_grads) == len(plan_grads) and all(
        torch.equal(a, b) for a, b in zip(plain_grads, plan_grads)
    )
    return Report(
        method=plan.method,
        budget_bytes=plan.budget_bytes,
        predicted_peak_bytes=plan.estimate.peak_bytes,
        measured_peak_bytes=plan_mem.peak_bytes,
        plain_peak_bytes=plain_mem.peak_bytes,
        predicted_overhead=plan.estimate.overhead,
        measured_overhead=plan_ms / plain_ms - 1.0,
        plain_step_ms=plain_ms,
        step_ms=plan_ms,
        grads_equal=equal,
        max_grad_diff=diff,
        repeats=repeats,
        plain=plain_mem,
        planned=plan_mem,
    )


def _grads(model: nn.Module, batch: Any, loss_fn: Any, optimizer: Any, seed: int) -> list[torch.Tensor]:
    """The loss and every gradient of one forward+backward from a fixed RNG state."""
    with _step.preserved(model, optimizer):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        loss = _step.forward_loss(model, batch, loss_fn)
        loss.backward()
        out = [loss.detach().clone()]
        out += [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    return out


def _alternating_times(
    model: nn.Module, plan: Plan, batch: Any, loss_fn: Any, optimizer: Any, repeats: int
) -> tuple[float, float]:
    """Median plain and planned step times, measured alternately so drift hits both alike."""
    device = _step.batch_device(model, batch)
    plain: list[float] = []
    planned: list[float] = []
    with _step.preserved(model, optimizer):
        for _ in range(2):  # warm-up of both
            remove(model)
            _step.train_step(model, batch, loss_fn, optimizer)
            apply(model, plan)
            _step.train_step(model, batch, loss_fn, optimizer)
        for _ in range(repeats):
            remove(model)
            plain += _step.timed_steps(model, batch, loss_fn, optimizer, repeats=1, device=device)
            apply(model, plan)
            planned += _step.timed_steps(model, batch, loss_fn, optimizer, repeats=1, device=device)
    return statistics.median(plain), statistics.median(planned)
