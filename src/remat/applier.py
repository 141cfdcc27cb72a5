"""apply(): make each block of a model behave as a plan says; remove() gives the original back.

# NOTE [ Applying without replacing modules ]
remat never swaps a block for a wrapper module: it replaces the block's ``forward`` on the
instance (``remat._checkpoint.checkpoint_module``), or, for transformers layers that have their own
checkpointing hook (``GradientCheckpointingLayer``), it sets that hook. Parameter names,
``state_dict`` keys and values, ``named_modules``, hooks and ``train()/eval()`` stay exactly those
of the user's model, so optimizers, FSDP, ``save_pretrained`` and checkpoint files are unaffected.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from torch import nn

from remat import _checkpoint
from remat.blocks import fingerprint
from remat.errors import did_you_mean
from remat.records import OPTIONS, Plan
from remat.step import check_compiled

__all__ = ["PlanMismatch", "applied_plan", "apply", "remove"]

log = logging.getLogger(__name__)

_PLAN_ATTR = "_remat_plan"


class PlanMismatch(ValueError):
    """The plan was made for another model."""


def apply(model: nn.Module, plan: Plan, *, strict: bool = True) -> nn.Module:
    """Apply ``plan`` to ``model`` in place and return the model. Applying again replaces it.

    With ``strict`` (the default) the model's structure must be the one the plan was made for
    (same fingerprint); ``strict=False`` only requires the plan's block names to exist.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply expects an nn.Module, got {type(model).__name__}")
    check_compiled(model, "remat.apply")
    if not isinstance(plan, Plan):
        raise TypeError(f"apply expects a remat Plan, got {type(plan).__name__}; load one with Plan.load(path)")
    from remat.distributed import check_wrapping

    wrapper, model = model, check_wrapping(model)  # NOTE [ Order: remat first, then DDP or fully_shard ]
    modules = dict(model.named_modules())
    for name, option in plan.choices.items():
        if name not in modules:
            hint = did_you_mean(name, modules)
            raise PlanMismatch(
                f"the plan was made for a {plan.model}; its block {name!r} is not in this "
                f"{type(model).__name__}{hint}"
            )
        if option not in OPTIONS:
            raise PlanMismatch(f"the plan asks for option {option!r} on {name!r}; expected one of {OPTIONS}")
    if strict and plan.fingerprint != fingerprint(model):
        raise PlanMismatch(
            f"the plan was made for a {plan.model} of another shape (fingerprint {plan.fingerprint}, "
            f"this {type(model).__name__} has {fingerprint(model)}): its block names match, but its "
            "layers' sizes or dtypes do not. Make a plan for this model (or, from Python, apply it with strict=False)."
        )
    remove(model)
    for name, option in plan.choices.items():
        _set(modules[name], option)
    object.__setattr__(model, _PLAN_ATTR, plan)
    log.info("applied %s plan: %s", plan.method, _summary(plan))
    return wrapper


def remove(model: nn.Module) -> nn.Module:
    """Undo ``apply``: every block runs its own forward again. A no-op on a plain model."""
    for module in model.modules():
        if _is_hf_layer(module):
            _restore_hf(module)  # transformers' own settings back, as they were before apply
        else:
            _checkpoint.uncheckpoint_module(module)
        module.__dict__.pop(_PLAN_ATTR, None)  # on the inner module of a DDP wrapper too
    return model


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan applied to ``model`` (or to the module a DDP wrapper holds), or None."""
    inner = getattr(model, "module", None) if type(model).__name__ == "DistributedDataParallel" else None
    return model.__dict__.get(_PLAN_ATTR) or (inner.__dict__.get(_PLAN_ATTR) if inner is not None else None)


def _set(module: nn.Module, option: str) -> None:
    if _is_hf_layer(module):
        _set_hf(module, option)
        return
    if option == "keep":
        _checkpoint.uncheckpoint_module(module)
    else:
        _checkpoint.checkpoint_module(module, mode=option)


# NOTE [ transformers layers ]
# transformers (>= 4.50) makes each decoder layer a GradientCheckpointingLayer whose __call__
# routes through ``self._gradient_checkpointing_func`` when ``self.gradient_checkpointing`` is set
# and the model is training. remat sets that function to its own checkpoint with the chosen mode,
# so transformers keeps doing what it does around it (it passes cache objects and other non-tensor
# positional arguments, and turns use_cache off while checkpointing).


def _is_hf_layer(module: nn.Module) -> bool:
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)


_HF_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")


def _set_hf(module: nn.Module, option: str) -> None:
    state = module.__dict__
    if "_remat_hf_state" not in state:
        # First touch: remember transformers' own settings (activation_checkpointing_enable()) for
        # remove(); from here on the plan alone decides, so a "keep" layer keeps.
        object.__setattr__(module, "_remat_hf_state", {k: state[k] for k in _HF_ATTRS if k in state})
    if option == "keep":
        object.__setattr__(module, "gradient_checkpointing", False)
        state.pop("_gradient_checkpointing_func", None)
        state.pop("_remat_mode", None)
        return
    object.__setattr__(module, "gradient_checkpointing", True)
    object.__setattr__(module, "_gradient_checkpointing_func", functools.partial(_hf_call, option))
    object.__setattr__(module, "_remat_mode", option)


def _restore_hf(module: nn.Module) -> None:
    saved = module.__dict__.pop("_remat_hf_state", None)
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
    return _checkpoint.checkpoint_call(fn, args, kwargs, mode=option)


def _is_cache(obj: Any) -> bool:
    return any(c.__name__ == "Cache" for c in type(obj).__mro__)


def mode_of(module: nn.Module) -> str:
    """The option a module runs with: ``keep`` unless remat wrapped it."""
    if _is_hf_layer(module):
        return getattr(module, "_remat_mode", None) or "keep"
    return _checkpoint.is_checkpointed(module) or "keep"


def _summary(plan: Plan) -> str:
    counts: dict[str, int] = {}
    for option in plan.choices.values():
        counts[option] = counts.get(option, 0) + 1
    return ", ".join(f"{n} {o}" for o, n in counts.items())
