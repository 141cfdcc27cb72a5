"""The ``compiled:<budget>`` options: a block run as one ``torch.compile``d graph whose partitioner
keeps at most ``budget`` of what the block would save (``activation_memory_budget``).

# NOTE [ Compiled blocks ]
torch.compile's min-cut partitioner decides, op by op, what a compiled graph saves for its
backward and what its backward recomputes inside its fused kernels; ``torch._functorch.config.
activation_memory_budget`` (1.0: the fastest, 0: the least) bounds what it saves. Eager options
cannot recompute a softmax or a dropout inside a fused kernel, so at tight budgets a compiled block
can be much cheaper than an eager recompute. ``compiled:0.5`` is that block compiled at budget 0.5:
a per-block option like the others, measured with every block on it (``remat.measure.compiled``),
mixed with eager options and segments by the solver, applied by giving the block this forward.
- One compiled function per (block class, budget), each with its own code object: torch.compile
  caches compiled code on the code object and reads the budget when it first compiles a graph, so
  two budgets sharing one would share the first one's graph. Blocks of one class share theirs
  (identical blocks compile once: the parameters are the graph's inputs).
- The budget is set around every call (a recompile for new shapes reads it too) and put back.
- Only a training call with gradients runs compiled; ``eval()`` and ``no_grad`` run the block's
  own eager forward (nothing is saved there, so the budget has nothing to bound).
- Outputs and gradients equal the eager block's to round-off (fused kernels sum in another
  order), and not at all with active dropout: compiled code draws its own random numbers.
- It is opt-in (``remat.profile(..., compile_budgets=(0.5, 0.2))``): each budget costs a compile
  (tens of seconds on a CPU) and the blocks' step time includes the generated code's speed, which
  is not the eager block's (slower on a CPU with dropout, faster on a GPU without).
The forward is data, not a closure (NOTE [ The module form is data ]).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat.errors import InvalidValue

__all__ = [
    "PREFIX",
    "compile_block",
    "compile_budget",
    "compiled_budget_of",
    "compiled_option",
    "uncompile_block",
]

PREFIX = "compiled:"
_RECORD = "_remat_compiled"
_FUNCTIONS: dict[tuple[type, float], Callable[..., Any]] = {}


def compile_budget(option: str) -> float | None:
    """The activation budget of a ``compiled:<budget>`` option, None for any other option."""
    if not isinstance(option, str) or not option.startswith(PREFIX):
        return None
    text = option.removeprefix(PREFIX)
    try:
        budget = float(text)
    except ValueError:
        budget = math.nan
    if not 0 < budget <= 1:
        raise InvalidValue(
            f"option {option!r}: expected 'compiled:<budget>' with a budget in (0, 1], the share "
            f"of the block's saved activations the compiled graph may keep (e.g. 'compiled:0.5'); "
            f"got {text!r}"
        )
    return budget


def compiled_option(budget: float) -> str:
    """The option name of a block compiled at ``budget`` (checked), e.g. ``"compiled:0.5"``."""
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget <= 1:
        raise InvalidValue(
            f"a compile budget is a number in (0, 1] (torch's activation_memory_budget: the share of "
            f"a block's saved activations its compiled graph may keep), got {budget!r}"
        )
    return f"{PREFIX}{float(budget):g}"


def _call_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The template of every compiled function: the block's own (class) forward.
    return type(module).forward(module, *args, **kwargs)


def _function(cls: type, budget: float) -> Callable[..., Any]:
    key = (cls, budget)
    if key not in _FUNCTIONS:
        tag = f"{budget:g}".replace(".", "_")
        code = _call_forward.__code__.replace(co_name=f"remat_{cls.__name__}_budget_{tag}")
        fn = types.FunctionType(code, _call_forward.__globals__, code.co_name)
        _FUNCTIONS[key] = torch.compile(fn, dynamic=False)
    return _FUNCTIONS[key]


class CompiledForward:
    """The ``forward`` of a compiled block (NOTE [ Compiled blocks ])."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def budget(self) -> float:
        return float(self.module.__dict__[_RECORD])

    @property
    def __wrapped__(self) -> Any:
        return type(self.module).forward.__get__(self.module, type(self.module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if not module.training or not torch.is_grad_enabled():
            return type(module).forward(module, *args, **kwargs)
        import torch._functorch.config as functorch_config

        budget, before = self.budget, functorch_config.activation_memory_budget
        functorch_config.activation_memory_budget = budget  # read if this call compiles
        try:
            return _function(type(module), budget)(module, *args, **kwargs)
        finally:
            functorch_config.activation_memory_budget = before


def compile_block(module: nn.Module, budget: float) -> None:
    """Run ``module`` compiled at ``budget`` from its next training call on, in place (nothing is
    compiled until then)."""
    compiled_option(budget)  # it checks
    if "forward" in module.__dict__ and _RECORD not in module.__dict__:
        raise InvalidValue(
            f"option 'compiled:{budget:g}' replaces the forward of a {type(module).__name__}, which "
            "already has another one set on the instance; remove that first (remat.remove)"
        )
    object.__setattr__(module, _RECORD, float(budget))
    object.__setattr__(module, "forward", CompiledForward(module))


def uncompile_block(module: nn.Module) -> None:
    """Undo ``compile_block``: the module's own forward again. A no-op otherwise."""
    if module.__dict__.pop(_RECORD, None) is not None:
        module.__dict__.pop("forward", None)


def compiled_budget_of(module: nn.Module) -> float | None:
    """The budget ``module`` runs compiled at, or None."""
    budget = module.__dict__.get(_RECORD)
    return float(budget) if budget is not None else None
