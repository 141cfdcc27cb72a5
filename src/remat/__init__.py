"""remat: make PyTorch training fit a memory budget with the least slowdown.

The public surface is a handful of verbs; everything heavy is imported on first use so that
``import remat`` stays cheap and the pure planner (``remat.plan``) never pulls in torch.

# NOTE [ The house ]
Folders by job, each importing only from the floors below it (``tests/test_layout.py`` checks, with
no import circle, function-level imports counted):
- ``errors``, ``units``, ``records`` (Profile, Plan, the option vocabulary), ``devices``; ``models``
  (built-in models, the zoo, transformers builders): the ground.
- ``plan/``: the step's schedule, the cost model, the solvers and their exact search, per-rank
  sharding, the pure half of accumulation planning. No torch anywhere below it.
- ``manual/``: ``checkpoint`` and friends, the per-module option, finding blocks.
- ``measure/``: the step's calling convention, the memory tracer, fake tensors, the profiler and
  its attribution (traces -> numbers).
- ``applier`` (apply, remove, the wrapping order) <- ``distributed``, ``verifier`` <- ``autoplan``.
- ``report/`` (tables, plots), ``gradnorm``; ``train/`` (config, loop, steps, state, data, the torch
  half of accumulation) and ``demo``; ``cli/`` on top.
No submodule is named after an exported name (a ``remat/apply/`` would replace ``remat.apply``).

# NOTE [ Lazy at run time, real to a type checker ]
At run time ``remat.solve`` is found by ``__getattr__`` below, which imports its module on first
use. A type checker does not run that: under ``TYPE_CHECKING`` the same names are real imports, so
mypy and pyright see ``remat.solve`` as the function it is (``n: int = remat.solve`` is an error).
``tests/test_typing.py`` checks that the two lists agree and that mypy reads them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from remat.applier import applied_plan, apply, remove
    from remat.autoplan import auto
    from remat.errors import InfeasibleBudget, RematError
    from remat.gradnorm import GradNorm
    from remat.manual.checkpoint import checkpoint, checkpoint_call, checkpoint_sequential
    from remat.manual.head import chunked_cross_entropy
    from remat.manual.module_form import checkpoint_module, uncheckpoint_module
    from remat.manual.options import option_of
    from remat.measure.profiler import profile
    from remat.measure.step_memory import StepMemory, measure_step
    from remat.plan.costmodel import estimate
    from remat.plan.solver import solve
    from remat.records import Estimate, Plan, Profile
    from remat.verifier import Report, verify
    from remat.vocabulary import OPTIONS, Option

__version__ = "0.1.0"

_EXPORTS = {
    "InfeasibleBudget": "remat.errors",
    "RematError": "remat.errors",
    "Profile": "remat.records",
    "Plan": "remat.records",
    "Estimate": "remat.records",
    "Option": "remat.vocabulary",
    "OPTIONS": "remat.vocabulary",
    "checkpoint": "remat.manual.checkpoint",
    "checkpoint_call": "remat.manual.checkpoint",
    "checkpoint_sequential": "remat.manual.checkpoint",
    "chunked_cross_entropy": "remat.manual.head",
    "checkpoint_module": "remat.manual.module_form",
    "uncheckpoint_module": "remat.manual.module_form",
    "option_of": "remat.manual.options",
    "measure_step": "remat.measure.step_memory",
    "StepMemory": "remat.measure.step_memory",
    "profile": "remat.measure.profiler",
    "estimate": "remat.plan.costmodel",
    "solve": "remat.plan.solver",
    "apply": "remat.applier",
    "remove": "remat.applier",
    "applied_plan": "remat.applier",
    "verify": "remat.verifier",
    "Report": "remat.verifier",
    "auto": "remat.autoplan",
    "GradNorm": "remat.gradnorm",
}

__all__ = [
    "OPTIONS",
    "Estimate",
    "GradNorm",
    "InfeasibleBudget",
    "Option",
    "Plan",
    "Profile",
    "RematError",
    "Report",
    "StepMemory",
    "applied_plan",
    "apply",
    "auto",
    "checkpoint",
    "checkpoint_call",
    "checkpoint_module",
    "checkpoint_sequential",
    "chunked_cross_entropy",
    "estimate",
    "measure_step",
    "option_of",
    "profile",
    "remove",
    "solve",
    "uncheckpoint_module",
    "verify",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'remat' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
