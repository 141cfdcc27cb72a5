"""apply(): make each block of a model behave as a plan says; remove() gives the original back.

# NOTE [ Applying without replacing modules ]
remat never swaps a block for a wrapper module: it replaces the block's ``forward`` on the
instance (``remat.manual.module_form.checkpoint_module``), or, for transformers layers that have their own
checkpointing hook (``GradientCheckpointingLayer``), it sets that hook. Parameter names,
``state_dict`` keys and values, ``named_modules``, hooks and ``train()/eval()`` stay exactly those
of the user's model, so optimizers, FSDP, ``save_pretrained`` and checkpoint files are unaffected.
One addition: a transformers model with ``config.use_cache`` gets a forward pre-hook that turns
the K/V cache off while it trains (NOTE [ No K/V cache in a planned training step ] in
``remat.models.hf``); ``remove`` takes it away again, and the config is never touched.

# NOTE [ Order: remat first, then DDP or fully_shard ]
remat's ``apply`` replaces ``forward`` on each block instance (NOTE [ Applying without replacing
modules ] above); ``fully_shard`` changes each sharded module's class to a dynamic
``FSDP<Block>`` subclass and registers forward pre/post hooks that all-gather and free the block's
parameters. Hooks run in ``nn.Module.__call__`` around whatever ``forward`` is, so the checkpoint
always runs inside FSDP's hooks, whichever came first: the recompute in backward happens after
FSDP's pre-backward hook has all-gathered the parameters again, and never re-enters the hooks. Both
orders train to the same numbers on torch 2.13 (tests/dist_worker.py checks it). remat still
allows one order only, apply first:
- a plan is checked against the structure of the plain model (``Plan.fingerprint``); after
  ``fully_shard`` the blocks' classes are renamed (``FSDPBlock``), so the fingerprint no longer
  matches and the plan could only be applied unchecked (``strict=False``);
- the per-rank profile below assumes every planned block is its own FSDP group, which
  ``apply_distributed`` guarantees and an arbitrary pre-sharded model does not;
- it is the order torchtitan uses (activation checkpointing, then ``fully_shard``).
DDP does not change the module it wraps, so a DDP-wrapped model is accepted: the plan is applied to
``ddp.module`` (whose names are the plan's names; on the wrapper they carry a ``module.`` prefix).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from remat.errors import InvalidType, PlanMismatch, WrappingError, did_you_mean
from remat.manual.blocks import fingerprint, inside
from remat.manual.compiled import compile_budget
from remat.manual.head import set_head_chunk
from remat.manual.lm_head import chunk_of_option, clear_head, set_head
from remat.manual.module_form import expect_module
from remat.manual.options import clear_option, set_option
from remat.manual.segments import apply_segments, remove_segments
from remat.measure.step import check_compiled, switched_off
from remat.models.hf import layerdrop_blocks
from remat.records import Plan
from remat.vocabulary import OPTIONS

__all__ = ["PlanMismatch", "WrappingError", "applied_plan", "apply", "check_wrapping", "remove"]

log = logging.getLogger(__name__)

_PLAN_ATTR = "_remat_plan"
_UNDO_ATTR = "_remat_undo"
"""What ``apply`` turned off for the plan, each undone by its ``remove()`` in ``remove``: the K/V cache's
hooks, the model's own checkpointing flags (NOTE [ A model's own checkpointing ])."""


# Class names, compared by name so that checking needs no torch.distributed import.
_SHARDED = ("FSDPModule", "FullyShardedDataParallel")
_DDP = "DistributedDataParallel"


def _mro_names(module: Any) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def check_wrapping(model: nn.Module) -> nn.Module:
    """The module a plan is applied to: ``model``, or ``model.module`` for a DDP wrapper.

    Raises ``WrappingError`` when ``model`` or one of its submodules is already sharded by
    ``fully_shard`` (or FSDP1): remat's ``apply`` must come first (NOTE [ Order: remat first,
    then DDP or fully_shard ]).
    """
    if _DDP in _mro_names(model):
        inner = model.module
        assert not isinstance(inner, type(model)), "DDP wrapping DDP"
        return check_wrapping(inner)  # type: ignore[arg-type]
    for name, module in model.named_modules():
        names = _mro_names(module)
        if names & set(_SHARDED):
            where = f"its submodule {name!r}" if name else "it"
            kind = "fully_shard" if "FSDPModule" in names else "FullyShardedDataParallel"
            raise WrappingError(
                f"cannot apply a remat plan to this {type(model).__name__}: {where} is already "
                f"wrapped by {kind} (class {type(module).__name__}). Apply the plan to the plain "
                "model first, then shard it: remat.distributed.apply_distributed(model, plan, "
                "mode='fsdp') does both in that order."
            )
    return model


def apply(model: nn.Module, plan: Plan, *, strict: bool = True) -> nn.Module:
    """Apply ``plan`` to ``model`` in place and return the model. Applying again replaces it.

    With ``strict`` (the default) the model's structure must be the one the plan was made for
    (same fingerprint); ``strict=False`` only requires the plan's block names to exist.
    """
    expect_module(model, "remat.apply")
    check_compiled(model, "remat.apply")
    if not isinstance(plan, Plan):
        raise InvalidType(f"apply expects a remat Plan, got {type(plan).__name__}; load one with Plan.load(path)")
    wrapper, model = model, check_wrapping(model)  # NOTE [ Order: remat first, then DDP or fully_shard ]
    modules = dict(model.named_modules())
    for name, option in plan.choices.items():
        if name not in modules:
            hint = did_you_mean(name, [n for n in modules if n])
            raise PlanMismatch(
                f"the plan was made for a {plan.model}; its block {name!r} is not in this "
                f"{type(model).__name__}{hint}"
            )
        if option not in OPTIONS and compile_budget(option) is None:  # it checks a compiled one
            raise PlanMismatch(f"the plan asks for option {option!r} on {name!r}; expected one of "
                               f"{OPTIONS} or 'compiled:<budget>'")
    if strict and plan.fingerprint != fingerprint(model):
        raise PlanMismatch(
            f"the plan was made for a {plan.model} of another shape (fingerprint {plan.fingerprint}, "
            f"this {type(model).__name__} has {fingerprint(model)}): its block names match, but its "
            "layers' sizes or dtypes do not. Make a plan for this model (or, from Python, apply it with strict=False)."
        )
    for name in plan.tied:  # NOTE [ Every call of a tied module ] in remat.measure.tied
        if name not in modules:
            raise PlanMismatch(f"the plan checkpoints every call of {name!r} (Plan.tied), which is not in this "
                               f"{type(model).__name__}{did_you_mean(name, [n for n in modules if n])}")
        if clash := next((b for b in plan.choices if inside(b, name) or inside(name, b)), None):
            raise PlanMismatch(f"the plan checkpoints every call of {name!r} (Plan.tied), and {clash!r}, which "
                               f"{'holds or is' if inside(name, clash) else 'is inside'} it, is one of its blocks: "
                               "a tied module is no block, nor in one, nor holds one. Make the plan again")
    chunk_of_option(plan.head)  # NOTE [ The head's options ] in remat.records; it checks
    if plan.head != "keep" and plan.head_module not in modules:
        raise PlanMismatch(f"the plan chunks the head {plan.head_module!r}, which is not in this "
                           f"{type(model).__name__}{did_you_mean(plan.head_module, list(modules))}")
    spans = _spans(plan)
    _check_layerdrop(model, plan)
    remove(model)
    for name, option in plan.choices.items():
        set_option(modules[name], option)
    for name in plan.tied:
        set_option(modules[name], "recompute")  # remove's clear_option takes it off, as a block's
    names = list(plan.choices)
    apply_segments([modules[n] for n in names], spans, names)  # over the options just set
    if plan.head != "keep":
        set_head(model, plan.head_module, plan.head, causal_lm=plan.head_causal_lm)
    object.__setattr__(model, _PLAN_ATTR, plan)
    object.__setattr__(model, _UNDO_ATTR, switched_off(model))
    log.info("applied %s plan: %s", plan.method, plan.summary())
    return wrapper


def remove(model: nn.Module) -> nn.Module:
    """Undo ``apply``: every block runs as it did before (its own forward, or the user's own
    checkpointing: NOTE [ A module's own checkpointing ]). A no-op on a plain model."""
    expect_module(model, "remat.remove")
    remove_segments(list(model.modules()))  # segments sit over the options: off first
    for module in model.modules():
        clear_option(module)
        clear_head(module)
        set_head_chunk(module, None)
        module.__dict__.pop(_PLAN_ATTR, None)  # on the inner module of a DDP wrapper too
        for handle in module.__dict__.pop(_UNDO_ATTR, []):
            handle.remove()
    return model


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan applied to ``model`` (or to the module a DDP wrapper holds), or None."""
    expect_module(model, "remat.applied_plan")
    inner = getattr(model, "module", None) if type(model).__name__ == "DistributedDataParallel" else None
    return model.__dict__.get(_PLAN_ATTR) or (inner.__dict__.get(_PLAN_ATTR) if inner is not None else None)


def _spans(plan: Plan) -> list[tuple[int, int]]:
    """The plan's segments as (first, last) positions in its blocks, checked."""
    index = {name: i for i, name in enumerate(plan.choices)}
    spans = []
    for seg in plan.segments:
        if len(seg) != 2 or any(n not in index for n in seg) or index[seg[0]] > index[seg[1]]:
            raise PlanMismatch(
                f"the plan's segment {seg!r} is not a [first, last] pair of its blocks in forward "
                f"order; expected two of {list(index)[:3]}..."
            )
        first, last = index[seg[0]], index[seg[1]]
        inside = [n for n in list(plan.choices)[first : last + 1] if plan.choices[n] != "keep"]
        if inside:
            raise PlanMismatch(
                f"the plan's segment {seg[0]}..{seg[1]} holds block {inside[0]!r} with option "
                f"{plan.choices[inside[0]]!r}; blocks inside a segment take 'keep' (the segment "
                "recomputes them)"
            )
        spans.append((first, last))
    return spans


def _check_layerdrop(model: nn.Module, plan: Plan) -> None:
    """Refuse a segment over a layer that layerdrop may skip (NOTE [ layerdrop ] in remat.models.hf)."""
    skipped = layerdrop_blocks(model) if any(a != b for a, b in plan.segments) else {}
    names = list(plan.choices)
    for a, b in plan.segments:
        held = names[names.index(a) : names.index(b) + 1]
        layer = next((n for n in held if n in skipped), None) if a != b else None
        if layer is not None:
            raise PlanMismatch(
                f"the plan's segment {a}..{b} holds {layer}, a layer that layerdrop "
                f"({skipped[layer]}) may skip in a training step, and a segment's blocks must all run. "
                "Make the plan without segments (remat.solve on the model's profile does so: "
                "Profile.layerdrop; or segments=False), or turn layerdrop off"
            )
