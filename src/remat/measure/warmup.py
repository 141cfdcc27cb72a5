"""The warm-up step that settles the blocks: the module calls of one training step (watched by
``remat.measure.calls_seen``) settle which modules are blocks (NOTE [ Blocks by what runs ] in
``remat.manual.settle``), the lower floor of rule 9's two lists picks one, and where nothing can be
planned the refusals say why. The measured and the estimated profile both start here."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from remat.errors import ProfileError, first_names
from remat.manual.blocks import inside, no_blocks
from remat.manual.module_form import checkpoint_record
from remat.manual.options import checkpointed, touched
from remat.manual.settle import by_calls
from remat.manual.stages import coarser
from remat.measure.calls_seen import seen_calls
from remat.measure.marked import outside_remat

__all__ = ["NEAR_TIE", "Blocks", "by_floor", "running"]

log = logging.getLogger(__name__)


def _cut_off(names: list[str]) -> ProfileError:
    """The refusal for blocks no gradient reaches (rule 1 of NOTE [ Blocks by what runs ])."""
    return ProfileError(f"no gradient reached the outputs of blocks {first_names(names)} in the training step: the model detaches "
                        "or quantizes what they return, or the loss does not use it, so they have no backward to "
                        "recompute in. Name the blocks whose outputs the loss depends on with blocks=")


Blocks = list[tuple[str, nn.Module]]


def running(model: nn.Module, named: Blocks, explicit: bool, batch: Any, loss_fn: Any,
            optimizer: Any, mark: Callable[[str], None] = lambda _: None) -> tuple[Blocks, list[Blocks], list[str]]:
    """The blocks, settled by what runs in a warm-up step on ``batch``: named ones must run; found
    ones are settled by the module calls (NOTE [ Blocks by what runs ] in remat.manual.settle),
    with the other candidate lists of rule 9 (``coarser``); and the modules that ran more
    than once, not checkpointed (``Profile.repeated``; rule 6). ``mark``: where its memory record may be
    cut (``remat.measure.tracer.sized``)."""
    _refuse_users_checkpoints_over(model, named)
    seen = seen_calls(model, batch, loss_fn, optimizer, mark)
    calls, late = seen.calls, seen.late
    if explicit:
        if missing := [n for n, _ in named if n not in calls.count]:
            if set(missing) & late:
                raise _in_backward(sorted(set(missing) & late))
            raise ProfileError(f"blocks {missing} did not run in the training step; remat plans blocks that run "
                               "once per step with gradients (check blocks=, and that the model trains)")
        if cut := [n for n, _ in named if n not in calls.grads]:
            raise _cut_off(cut)
        if changing := [n for n, _ in named if n in calls.mutates]:
            raise ProfileError(
                f"blocks {changing[:4]} change a buffer in place in their forward ({calls.mutates[changing[0]]}: an "
                "EMA codebook, a step counter), which a recompute would run again, replaying on the changed "
                "values; remat plans blocks that can be replayed: leave them out of blocks=")
        return named, [], []
    kept, repeated = by_calls(model, named, calls)
    modules = dict(model.named_modules())
    # inside a block, one replays them (rule 6); the advice taken: quiet
    if unchecked := [n for n in repeated if not checkpointed(modules[n]) and not any(inside(n, b) for b, _ in kept)]:
        warnings.warn(
            f"{first_names(unchecked)} ran more than once in one training step "
            "(weight-tied layers); remat plans modules that run once per step, so these keep their "
            "activations as in the plain step unless no plan fits a budget without: a profile made "
            "with budget= (and remat.auto) then checkpoints every call of them (Plan.tied). To do so "
            "yourself, run remat.checkpoint_module(model.get_submodule(name)) on each before profiling: "
            "remat then plans around them, and leaves them checkpointed (NOTE [ Blocks by what runs ] in "
            "remat.manual.settle, rule 6)",
            stacklevel=outside_remat())
    if not kept:
        if in_backward := [b for b, _ in named if b in late] or sorted(
                n for n in late if any(n.startswith(b + ".") for b, _ in named)):
            theirs = [n for n, m in modules.items() if n and checkpointed(m)]
            if all(any(inside(n, c) for c in theirs) for n in in_backward):
                raise _all_theirs(theirs)
            raise _in_backward(in_backward)
        if repeated:
            raise ProfileError(
                f"every block remat found ran more than once in one training step ({first_names(repeated)}"
                "): a model called twice per step (a twin encoder of "
                "a contrastive pair) or one layer run for every depth. remat plans modules that run once "
                "per step: plan the shared module on one call's batch (remat.auto(encoder, one_batch, "
                "budget) with the budget split between its calls; the plan then holds for every call), or "
                "checkpoint every call of it with remat.checkpoint_module(model.get_submodule(name))")
        if cut := [n for n, m in named if n in calls.count and n not in calls.grads and any(True for _ in m.parameters())]:
            raise _cut_off(cut)
        raise no_blocks(model)
    if left := sorted({n for n, _ in named} - {n for n, _ in kept}):
        log.info("blocks found by the model's containers that do not run as blocks in a training step: %s", left)
    _refuse_users_checkpoints_over(model, kept)
    return kept, coarser(model, kept, calls), unchecked


def _refuse_users_checkpoints_over(model: nn.Module, blocks: Blocks) -> None:
    """Refuse a module the user checkpointed (``remat.checkpoint_module``) that holds ``blocks``:
    its replay would run them again in the backward, and remat leaves it in place (NOTE [ A
    module's own checkpointing ] in remat.manual.options)."""
    for name, module in model.named_modules():
        if checkpoint_record(module) is None or touched(module):
            continue
        if inner := [n for n, _ in blocks if n != name and inside(n, name)]:
            where = f"model.get_submodule({name!r})" if name else "model"
            raise ProfileError(
                f"{repr(name) if name else 'the model'} is checkpointed with remat.checkpoint_module and holds blocks "
                f"{first_names(inner)}: its replay would run them again in the "
                f"backward, and remat plans what they recompute. Take it off first "
                f"(remat.uncheckpoint_module({where})), or name blocks outside it with blocks=")


NEAR_TIE = 0.01
"""How much lower than the finer list's floor a coarser one's must be to be taken (rule 9): a
diffusers UNet's up stages whole floored 1 KiB lower than split, where the finer list's plans choose
per part above the floor."""


def by_floor(finer: Blocks, coarser: list[Blocks], floor_of: Callable[[list[str]], int]) -> Blocks:
    """Of rule 9's candidate lists, finest first, the one with the lowest floor (``floor_of`` block
    names, from steps on fake tensors); a coarser one only where it floors lower than the one
    taken by more than a near tie; the finest where the model runs no step on fake tensors (NOTE
    [ Blocks by what runs ] in remat.manual.settle)."""
    if not coarser:
        return finer
    try:
        floors = [floor_of([n for n, _ in blocks]) for blocks in (finer, *coarser)]
    except Exception as e:  # a forward that reads tensor values, a model deepcopy cannot copy: a choice lost
        whole = sorted({n for blocks in coarser for n, _ in blocks} - {n for n, _ in finer})
        log.info("remat: the blocks %s cannot be compared on fake tensors (%s: %s); keeping their parts",
                 whole, type(e).__name__, str(e).split("\n")[0][:200])
        return finer
    taken = 0
    for i in range(1, len(floors)):
        if floors[i] < floors[taken] * (1 - NEAR_TIE):
            taken = i
    log.info("remat: blocks floor at %s bytes, finest first: taking the %s", floors,
             "finest" if taken == 0 else f"stages whole ({taken} of {len(coarser)})")
    return (finer, *coarser)[taken]


def _all_theirs(checkpointed: list[str]) -> ProfileError:
    """The refusal where every module remat would plan runs inside the user's checkpoints."""
    return ProfileError(
        f"every module remat would plan runs inside modules checkpointed with remat.checkpoint_module "
        f"({first_names(checkpointed)}), whose replays run them again in the backward: nothing is left for remat "
        "to plan. The step with those checkpoints is the plan (remat.measure_step measures it); or take some "
        "off (remat.uncheckpoint_module) and let remat plan what they hold")


def _in_backward(names: list[str]) -> ProfileError:
    return ProfileError(
        f"{first_names(names)} run with gradients only after the model's forward "
        "returned: the model runs them without gradients and again in its own backward (a reversible "
        "network), so they keep no activations for checkpointing to drop and remat has nothing to plan "
        "there. Name blocks that run with gradients in the forward with blocks=, or train without remat")
