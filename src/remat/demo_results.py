"""The demo's records: what it runs (``DemoSetup``), what it measured (``DemoResult``, a
``DemoRow`` per plan), and their forms for the comparison table and ``results.json``. The demo
itself is ``remat.demo``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remat.models import GPTConfig, zoo
from remat.records import Plan, Profile
from remat.report import ComparisonRow
from remat.units import format_bytes
from remat.verifier import Report

__all__ = ["RESULTS_SCHEMA", "DemoResult", "DemoRow", "DemoSetup", "comparison_rows", "results_dict"]

RESULTS_SCHEMA = 2


@dataclass(frozen=True, kw_only=True)
class DemoSetup:
    """What the demo runs on and how far it sweeps."""

    model: str | GPTConfig
    """A zoo name or a GPT config."""
    batch_size: int
    """Sequences per batch."""
    seq_len: int
    """Tokens per sequence."""
    shares: tuple[float, ...]
    """Budgets as shares of the plain step's peak, highest first; those below the smallest
    feasible budget are skipped, and the smallest feasible budget itself is always added."""
    plan_share: float
    """The share whose plan goes to ``plan.json`` and ``timeline.png`` (the nearest feasible)."""
    repeats: int
    """Timed steps per option while profiling (medians)."""
    rounds: int
    """Rounds of step times taken in turns over plain and every plan (medians)."""
    factory: str
    """``module:function`` that builds this setup, for the ``remat verify`` hint."""


@dataclass(frozen=True, kw_only=True)
class DemoRow:
    """One plan the demo measured."""

    label: str
    """What the plan is called, e.g. ``"remat 60%"`` or ``"all (every block)"``."""
    share: float | None
    """Its budget as a share of the plain peak (None for baselines)."""
    plan: Plan
    """The plan."""
    report: Report
    """What measuring it gave (shared between rows whose plans are the same)."""


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    """Everything the demo measured and wrote."""

    setup: DemoSetup
    """What it ran."""
    profile: Profile
    """The one profile every plan was solved from."""
    smallest_feasible_bytes: int
    """The lowest peak any plan reaches."""
    smallest_feasible_reason: str
    """What dominates that peak."""
    rows: list[DemoRow]
    """Plans in table order: the plain baseline, remat's by decreasing budget, other baselines."""
    chosen: DemoRow
    """The row whose plan is in ``plan.json`` and ``timeline.png``."""
    plain_self_overhead: float
    """Plain timed against itself in the same turns, minus one: the run's noise floor."""
    step_ms_spread: float
    """The largest median-over-fastest step time of any configuration, minus one."""
    timings_meaningful: bool
    """Plain against itself within ``NOISY`` and steps within ``DISTURBED``; otherwise
    overheads are withheld."""
    files: dict[str, Path]
    """What was written, by kind: profile, plan, frontier, timeline, results."""
    seconds: float
    """Wall time of the whole run."""


def comparison_rows(result: DemoResult) -> list[ComparisonRow]:
    """The rows of ``remat.report.comparison_table`` for the demo's plans."""
    return [
        ComparisonRow(
            label=r.label,
            method=r.plan.method,
            budget_bytes=r.plan.budget_bytes,
            predicted_peak_bytes=r.plan.estimate.peak_bytes,
            measured_peak_bytes=r.report.measured_peak_bytes,
            overhead=r.report.measured_overhead if result.timings_meaningful else None,
            fits=None if r.plan.budget_bytes is None else r.report.fits,
            grads_equal=r.report.grads_equal,
        )
        for r in result.rows
    ]


def results_dict(result: DemoResult) -> dict[str, Any]:
    """``results.json``: the setup, the profile's totals, and every row's numbers (bytes, ms)."""
    prof = result.profile
    model = result.setup.model
    return {
        "kind": "demo",
        "schema_version": RESULTS_SCHEMA,
        "model": {
            "name": model if isinstance(model, str) else type(model).__name__,
            "class": prof.model,
            "config": dataclasses.asdict(zoo.spec(model).config),
            "batch_shape": prof.batch_shape,
            "dtype": prof.dtype,
            "optimizer": "AdamW",
            "device": prof.device,
            "factory": result.setup.factory,
        },
        "profile": {
            "blocks": len(prof.blocks),
            "plain_peak_bytes": prof.plain_peak_bytes,
            "plain_step_ms": prof.plain_step_ms,
            "base_bytes": prof.base_bytes,
            "param_bytes": prof.param_bytes,
            "optimizer_bytes": prof.optimizer_bytes,
            "smallest_feasible_bytes": result.smallest_feasible_bytes,
            "smallest_feasible_reason": result.smallest_feasible_reason,
        },
        "rows": [
            {
                "label": r.label,
                "method": r.plan.method,
                "budget_bytes": r.plan.budget_bytes,
                "budget_share": r.share,
                "predicted_peak_bytes": r.plan.estimate.peak_bytes,
                "measured_peak_bytes": r.report.measured_peak_bytes,
                "plain_peak_bytes": r.report.plain_peak_bytes,
                "peak_error": r.report.peak_error,
                "predicted_overhead": r.plan.estimate.overhead,
                "measured_overhead": r.report.measured_overhead,
                "plain_step_ms": r.report.plain_step_ms,
                "step_ms": r.report.step_ms,
                "fits": None if r.plan.budget_bytes is None else r.report.fits,
                "grads_equal": r.report.grads_equal,
                "max_grad_diff": r.report.max_grad_diff,
                "choices": r.plan.choices,
            }
            for r in result.rows
        ],
        "plan": {
            "label": result.chosen.label,
            "budget_bytes": result.chosen.plan.budget_bytes,
            "budget": format_bytes(result.chosen.plan.budget_bytes or 0),
        },
        "timing": {
            "clock": "process CPU time, one intra-op thread, plain and plans in turns",
            "rounds": result.setup.rounds,
            "plain_self_overhead": result.plain_self_overhead,
            "step_ms_spread": result.step_ms_spread,
            "meaningful": result.timings_meaningful,
        },
        "files": {k: str(v) for k, v in result.files.items()},
        "seconds": result.seconds,
    }
