"""The per-module option: make one module run with an option, read which one it runs with.

``set_option(module, "recompute")`` replaces the module's ``forward`` on the instance
(``remat.manual.module_form.checkpoint_module``), or, for a transformers layer with its own
checkpointing hook, sets that hook (NOTE [ transformers layers ]). ``option_of`` reads it back and
``clear_option`` undoes it. ``remat.apply`` does this for every block a plan names; the profiler
does it for every block at once.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, cast

from torch import nn

from remat.manual import checkpoint, module_form
from remat.manual.compiled import (
    compile_block,
    compile_budget,
    compiled_budget_of,
    compiled_option,
    uncompile_block,
)
from remat.manual.tiled import is_tiled, tile_block, untile_block
from remat.vocabulary import CheckpointOption

__all__ = ["as_written", "checkpointed", "clear_option", "is_hf_layer", "option_of", "set_option", "touched"]


def set_option(module: nn.Module, option: str) -> None:
    """Make ``module`` run with ``option`` (``"keep"`` undoes any other), in place."""
    untile_block(module)
    uncompile_block(module)
    if option == "tiled":  # NOTE [ The tiled MLP ] in remat.manual.tiled: the block kept, its MLP tiled
        set_option(module, "keep")
        tile_block(module)
        return
    if (budget := compile_budget(option)) is not None:  # NOTE [ Compiled blocks ] in remat.manual.compiled
        set_option(module, "keep")
        compile_block(module, budget)
        return
    if is_hf_layer(module):
        _set_hf(module, option)
        return
    if _OWN not in module.__dict__:  # NOTE [ A module's own checkpointing ]
        object.__setattr__(module, _OWN, module_form.checkpoint_record(module))
    if option == "keep":
        module_form.uncheckpoint_module(module)
    else:
        module_form.checkpoint_module(module, mode=cast(CheckpointOption, option))  # it checks


# NOTE [ A module's own checkpointing ]
# The user may have checkpointed a module before remat sets an option on it: transformers'
# ``gradient_checkpointing_enable()``, or ``remat.checkpoint_module`` on a weight-tied layer that
# runs more than once per step and is no block (rule 6 of NOTE [ Blocks by what runs ] in
# remat.manual.settle: ALBERT's shared layer, which the warning there names). ``set_option``
# remembers it on first touch, ``clear_option`` puts it back, and a module remat never set an option
# on is left as it is: ``remat.remove`` (which ``auto`` runs first) once took every module's
# checkpoint off, the user's too, and the profiler's runs put back an option where the user had
# their own (a policy lost, transformers' checkpointing turned off).
_OWN = "_remat_users_checkpoint"


def touched(module: nn.Module) -> bool:
    """Whether remat has set an option on ``module`` since it remembered the module's own
    checkpointing (NOTE [ A module's own checkpointing ])."""
    return _OWN in module.__dict__ or _HF_STATE in module.__dict__


# NOTE [ transformers layers ]
# transformers (>= 4.50) makes each decoder layer a GradientCheckpointingLayer whose __call__
# routes through ``self._gradient_checkpointing_func`` when ``self.gradient_checkpointing`` is set
# and the model is training. remat sets that function to its own checkpoint with the chosen mode,
# so transformers keeps doing what it does around it (it passes cache objects and other non-tensor
# positional arguments, and turns use_cache off while checkpointing).


def is_hf_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers layer with its own checkpointing hook."""
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)


_HF_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")
_HF_STATE = "_remat_hf_state"
"""Where a transformers layer keeps its own settings while remat sets its option."""


def _set_hf(module: nn.Module, option: str) -> None:
    state = module.__dict__
    if _HF_STATE not in state:
        # First touch: remember transformers' own settings (activation_checkpointing_enable()) for
        # remove(); from here on the plan alone decides, so a "keep" layer keeps.
        object.__setattr__(module, _HF_STATE, {k: state[k] for k in _HF_ATTRS if k in state})
    if option == "keep":
        object.__setattr__(module, "gradient_checkpointing", False)
        state.pop("_gradient_checkpointing_func", None)
        state.pop("_remat_mode", None)
        return
    object.__setattr__(module, "gradient_checkpointing", True)
    object.__setattr__(module, "_gradient_checkpointing_func", functools.partial(_hf_call, option))
    object.__setattr__(module, "_remat_mode", option)


def _restore_hf(module: nn.Module) -> None:
    saved = module.__dict__.pop(_HF_STATE, None)
    if saved is None:
        return
    for key in (*_HF_ATTRS, "_remat_mode"):
        module.__dict__.pop(key, None)
    module.__dict__.update(saved)


def _hf_call(option: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    # transformers calls this as func(partial(forward, layer, **kwargs), *args). Its hook drops a
    # cache passed by keyword; one passed positionally (GPT-2 does, and passes None only when the
    # *model's* gradient_checkpointing flag is set, which remat leaves alone) would be written again
    # by the recompute. Drop it as transformers does for keywords.
    layer = fn.args[0] if isinstance(fn, functools.partial) and fn.args else None
    if not getattr(layer, "_can_checkpoint_with_cache", False):
        args = tuple(None if _is_cache(a) else a for a in args)
    return checkpoint.checkpoint_call(fn, args, kwargs, mode=cast(CheckpointOption, option))  # it checks


def _is_cache(obj: Any) -> bool:
    return any(c.__name__ == "Cache" for c in type(obj).__mro__)


def option_of(module: nn.Module) -> str:
    """The option a module runs with: ``keep`` unless remat wrapped it."""
    module_form.expect_module(module, "option_of", "")
    if is_tiled(module):
        return "tiled"
    if (budget := compiled_budget_of(module)) is not None:
        return compiled_option(budget)
    if is_hf_layer(module):
        return getattr(module, "_remat_mode", None) or "keep"
    return module_form.is_checkpointed(module) or "keep"


def checkpointed(module: nn.Module) -> bool:
    """Whether every call of ``module`` is checkpointed now: by the user (``remat.checkpoint_module``,
    transformers' ``gradient_checkpointing`` on the layer) or by an option remat set."""
    if is_hf_layer(module):
        return module.__dict__.get("gradient_checkpointing") is True
    return module_form.checkpoint_record(module) is not None


@contextlib.contextmanager
def as_written(model: nn.Module) -> Iterator[None]:
    """``model`` with every module remat set an option on running as the user wrote it (its own
    forward, or its own checkpointing: NOTE [ A module's own checkpointing ]); the options put
    back after. An applied plan's blocks and tied modules (``Plan.tied``) are profiled so."""
    options = [(m, option_of(m)) for m in model.modules() if touched(m)]
    for m, _ in options:
        clear_option(m)
    try:
        yield
    finally:
        for m, option in options:
            set_option(m, option)


def clear_option(module: nn.Module) -> None:
    """Undo ``set_option`` on ``module``: its own forward again, or its own checkpointing as it was
    before remat set an option (transformers' settings, a ``checkpoint_module`` of the user's)."""
    untile_block(module)
    uncompile_block(module)
    if is_hf_layer(module):
        _restore_hf(module)  # transformers' own settings back, as they were before apply
    elif _OWN in module.__dict__:  # NOTE [ A module's own checkpointing ]
        own = module.__dict__.pop(_OWN)
        module_form.uncheckpoint_module(module)
        if own is not None:
            module_form.recheckpoint(module, own)
