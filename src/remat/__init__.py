"""remat: make PyTorch training fit a memory budget with the least slowdown.

The public surface is a handful of verbs; everything heavy is imported on first use so that
``import remat`` stays cheap and the pure planner (``remat.plan.solver``) never pulls in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "checkpoint": "remat.manual.checkpoint",
    "checkpoint_call": "remat.manual.checkpoint",
    "checkpoint_sequential": "remat.manual.checkpoint",
    "checkpoint_module": "remat.manual.checkpoint",
    "uncheckpoint_module": "remat.manual.checkpoint",
    "measure_step": "remat.measure.tracer",
    "StepMemory": "remat.measure.tracer",
    "profile": "remat.measure.profiler",
    "Profile": "remat.records",
    "Plan": "remat.records",
    "Estimate": "remat.records",
    "estimate": "remat.plan.costmodel",
    "solve": "remat.plan.solver",
    "InfeasibleBudget": "remat.plan.solver",
    "apply": "remat.applier",
    "remove": "remat.applier",
    "applied_plan": "remat.applier",
    "option_of": "remat.manual.options",
    "verify": "remat.verifier",
    "Report": "remat.verifier",
    "auto": "remat.autoplan",
    "GradNorm": "remat.gradnorm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'remat' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
