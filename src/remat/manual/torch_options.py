"""torch's checkpoint options, taken with torch's meaning in every path of the manual tool.

# NOTE [ torch's option names ]
``remat.checkpoint(fn, *args, **kwargs)`` is a drop-in for ``torch.utils.checkpoint.checkpoint(fn,
*args, use_reentrant=False, **kwargs)``, so it reads torch's option keywords (``TORCH_OPTIONS``)
as torch does, and hands every other keyword to ``fn``. The rule is the same whatever runs: with
grad on, under ``no_grad`` / ``inference_mode``, in ``eval()``, and in every mode (recompute,
selective, offload): an option is validated and consumed even where it has no effect (nothing is
recomputed under ``no_grad``), so a call never changes meaning with the grad mode. Where torch
would silently take a keyword that ``fn`` also declares (``fn(x, *, early_stop=False)``), remat
refuses the call and names the way to pass it to ``fn``: ``checkpoint_call(fn, args, kwargs)``,
whose ``kwargs`` go to ``fn`` whole. torch's global switches (``set_checkpoint_debug_enabled``,
``set_checkpoint_early_stop``) are read at call time, as torch reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as _tc

from remat.errors import InvalidType, InvalidValue

__all__ = ["TORCH_OPTIONS", "TorchOptions", "pop_torch_options", "torch_options"]

#: The keywords ``torch.utils.checkpoint.checkpoint`` takes for itself.
TORCH_OPTIONS = ("use_reentrant", "preserve_rng_state", "determinism_check", "debug", "early_stop", "context_fn")

_REENTRANT = (
    "remat's checkpoint is torch's non-reentrant one (use_reentrant=False) only: the reentrant "
    "variant (use_reentrant=True) cannot take keyword arguments, does not work with "
    "torch.autograd.grad or inputs that do not require grad, and torch itself recommends against it. "
    "Pass use_reentrant=False, or leave it out"
)


def _determinism_checks() -> list[str]:
    return list(getattr(_tc, "_allowed_determinism_checks_to_fns", {"default": None, "none": None}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TorchOptions:
    """torch's checkpoint options, validated (``torch.utils.checkpoint.checkpoint`` documents each)."""

    preserve_rng_state: bool = True
    """Stash the RNG states and replay them in the recompute (dropout draws the same numbers)."""
    determinism_check: str = "default"
    """``"default"``: the recompute must save tensors of the same shapes, dtypes and devices."""
    debug: bool = False
    """On a mismatch, report the ops of the forward and of the recompute, with stack traces."""
    early_stop: bool = True
    """Stop the recompute as soon as every needed tensor is back."""
    context_fn: Callable[[], tuple[Any, Any]] | None = None
    """The user's (forward context, recompute context) factory, entered around remat's own."""

    def torch_kwargs(self) -> dict[str, Any]:
        """The keywords for ``torch.utils.checkpoint.checkpoint``."""
        return {
            "preserve_rng_state": self.preserve_rng_state,
            "determinism_check": self.determinism_check,
            "debug": self.debug,
            "early_stop": self.early_stop,
            "context_fn": self.context_fn or _tc.noop_context_fn,
        }

    def forward_context(self) -> Any:
        """For a call that runs plainly: torch's checks, then the user's forward context.

        torch checks ``debug`` against ``context_fn`` and calls ``context_fn`` even under
        ``no_grad``, but enters the forward context only while grad is on; so does this."""
        debug = _tc._checkpoint_debug_enabled
        if (self.debug if debug is None else debug) and self.context_fn is not None:
            raise InvalidValue(
                "debug=True is incompatible with non-default context_fn (as in torch): debug mode "
                "brings its own contexts. Leave out context_fn while debugging, or turn debug off"
            )
        if self.context_fn is None:
            return contextlib.nullcontext()
        fwd, _ = self.context_fn()
        return fwd if torch.is_grad_enabled() else contextlib.nullcontext()


def torch_options(
    *,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
) -> TorchOptions:
    """Validate torch's options (``use_reentrant=True`` is refused with the reason)."""
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise InvalidType(f"use_reentrant must be False (or left out), got {use_reentrant!r}")
    if use_reentrant:
        raise InvalidValue(_REENTRANT)
    for name, value in (("preserve_rng_state", preserve_rng_state), ("debug", debug), ("early_stop", early_stop)):
        if not isinstance(value, bool):
            raise InvalidType(f"{name} must be True or False, got {value!r}")
    checks = _determinism_checks()
    if determinism_check not in checks:
        raise InvalidValue(f"determinism_check should be one of {checks}, but got {determinism_check!r}")
    if context_fn is not None and not callable(context_fn):
        raise InvalidType(
            "context_fn must be a function returning two context managers (forward, recompute), "
            f"got {type(context_fn).__name__}"
        )
    if context_fn is _tc.noop_context_fn:  # torch's default, passed explicitly
        context_fn = None
    return TorchOptions(
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        debug=debug,
        early_stop=early_stop,
        context_fn=context_fn,
    )


def _declared(fn: Callable[..., Any]) -> set[str]:
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn  # not __call__'s (*args, **kwargs)
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # builtins and C callables without a signature
        return set()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in params if p.kind in kinds}


def pop_torch_options(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take torch's option keywords out of ``kwargs`` (NOTE [ torch's option names ])."""
    options = {name: kwargs.pop(name) for name in TORCH_OPTIONS if name in kwargs}
    clash = sorted(set(options) & _declared(fn)) if options else []
    if clash:
        name = clash[0]
        raise InvalidType(
            f"{name}= is one of torch's checkpoint options, and remat.checkpoint takes it as such, "
            f"as torch's checkpoint does; but {getattr(fn, '__name__', type(fn).__name__)} also has a "
            f"parameter {name!r}, which would silently get its default. To pass it to the function, "
            f"write remat.checkpoint_call(fn, args, {{{name!r}: ...}}) (its kwargs all go to fn)"
        )
    return options
