"""The warm-up step that settles the blocks: the module calls of one training step, which modules
run once, and which a gradient reaches (NOTE [ Blocks by what runs ] in ``remat.manual.settle``),
and the refusals where nothing can be planned. The measured and the estimated profile both start
here."""

from __future__ import annotations

import itertools
import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from remat.errors import ProfileError, RematError
from remat.manual.blocks import no_blocks
from remat.manual.settle import Calls, by_calls, coarser
from remat.measure import step as _step
from remat.measure.marked import outside_remat
from remat.measure.sides import first_tensor as _first_tensor
from remat.measure.sides import storage_key

__all__ = ["NEAR_TIE", "Blocks", "by_floor", "running"]

log = logging.getLogger(__name__)


def _cut_off(names: list[str]) -> ProfileError:
    """The refusal for blocks no gradient reaches (rule 1 of NOTE [ Blocks by what runs ])."""
    shown = f"{names[:4]}{' ...' if len(names) > 4 else ''}"
    return ProfileError(f"no gradient reached the outputs of blocks {shown} in the training step: the model detaches "
                        "or quantizes what they return, or the loss does not use it, so they have no backward to "
                        "recompute in. Name the blocks whose outputs the loss depends on with blocks=")


Blocks = list[tuple[str, nn.Module]]


def running(model: nn.Module, named: Blocks, explicit: bool, batch: Any, loss_fn: Any,
            optimizer: Any) -> tuple[Blocks, Blocks | None]:
    """The blocks, settled by what runs in a warm-up step on ``batch``: named ones must run; found
    ones are settled by the module calls (NOTE [ Blocks by what runs ] in remat.manual.settle),
    with the other candidate list of rule 9 (``coarser``), or None."""
    calls = Calls(count={}, start={}, end={}, grads=set(), grad_inputs=set(), fed=set(), made=set())
    returned: dict[str, list[weakref.ref[torch.Tensor]]] = {}  # per module in its first call: its modules' outputs
    batch_ids = {id(t) for t in _step.tensors_in(batch)}
    names = {id(m): n for n, m in model.named_modules()}
    ticks = itertools.count()
    clock = 0  # how many of ``ticks`` were taken: where in the calls' starts and ends a tensor is saved
    holding = {n for n, m in model.named_modules() if any(True for _ in m.parameters())}
    outputs: dict[int, weakref.ref[torch.Tensor]] = {}  # what modules holding parameters returned (rule 9)
    inputs: dict[str, set[int]] = {}  # what they were called with, while they run
    late: set[str] = set()  # called with gradients only after the model's forward returned
    done = False
    first: list[str] = []  # the modules in their first call, innermost last
    saved: set[str] = set()  # of those, the ones whose call saved a tensor for the backward (rule 1)
    read: set[str] = set()  # and the ones whose saved tensor the backward read

    def holder() -> str | None:
        """The innermost module in its first call that holds parameters: whose code runs now."""
        return next((n for n in reversed(first) if n in holding), None)

    def worked() -> None:  # rule 9
        if (name := holder()) is not None:
            calls.work.setdefault(name, []).append(clock)

    def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
        nonlocal clock
        if torch.is_grad_enabled():
            name = names[id(module)]
            if done:
                late.add(name)
                return
            calls.count[name] = calls.count.get(name, 0) + 1
            if name not in calls.start:
                calls.start[name], clock = next(ticks), clock + 1
                x = _first_tensor((args, kwargs))
                if (x is not None and x.requires_grad and (h := holder()) is not None and id(x) not in inputs.get(h, ())
                        and not ((r := outputs.get(id(x))) is not None and r() is x)):
                    worked()  # made by the code of the module that calls this one
                first.append(name)
                if name in holding:
                    inputs[name] = {id(t) for t in _step.tensors_in((args, kwargs))}
                if x is not None and x.requires_grad:
                    calls.grad_inputs.add(name)
                elif x is not None and id(x) in batch_ids:
                    calls.fed.add(name)

    def post(module: nn.Module, args: Any, output: Any) -> None:
        nonlocal done, clock
        if torch.is_grad_enabled() and not done and (name := names[id(module)]) not in calls.end:
            calls.end[name], clock = next(ticks), clock + 1
            if name in first:
                first.remove(name)
            inputs.pop(name, None)
            y = _first_tensor(output)
            if y is not None and name in holding:
                outputs[id(y)] = weakref.ref(y)
            if y is not None and not any(r() is y for r in returned.pop(name, [])):
                calls.made.add(name)  # rule 8
            if y is not None and (parent := name.rpartition(".")[0]) in calls.start and parent not in calls.end:
                returned.setdefault(parent, []).append(weakref.ref(y))
            for t in _step.tensors_in(output):
                if t.requires_grad:  # a backward runs through it only where a gradient reaches it
                    t.register_hook(lambda _, name=name: calls.grads.add(name))
        done = done or module is model

    def pack(t: torch.Tensor) -> tuple[tuple[str, ...], torch.Tensor]:
        saved.update(first)
        worked()
        return tuple(first), t.detach()  # NOTE [ What the saving hook holds ] in remat.measure.saved

    def unpack(packed: tuple[tuple[str, ...], torch.Tensor]) -> torch.Tensor:
        read.update(packed[0])
        return packed[1]

    def written(buffer: str) -> None:  # rule 1: a replay would change it again
        for name in first:
            calls.mutates.setdefault(name, buffer)

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), _BufferWrites(model, written):
            _step.train_step(model, batch, loss_fn, optimizer)
    finally:
        for h in handles:
            h.remove()
    calls.idle.update(saved - read)
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
        return named, None
    kept, repeated = by_calls(model, named, calls)
    if repeated:
        warnings.warn(
            f"{repeated[:4]}{' ...' if len(repeated) > 4 else ''} ran more than once in one training step "
            "(weight-tied layers); remat plans modules that run once per step, so these keep their "
            "activations as in the plain step. To checkpoint them, wrap each call in the model's code with "
            "remat.checkpoint (NOTE [ Blocks by what runs ] in remat.manual.settle, rule 6)",
            stacklevel=outside_remat())
    if not kept:
        if inside := [b for b, _ in named if b in late] or sorted(
                n for n in late if any(n.startswith(b + ".") for b, _ in named)):
            raise _in_backward(inside)
        if repeated:
            raise ProfileError(
                f"every block remat found ran more than once in one training step ({repeated[:4]}"
                f"{' ...' if len(repeated) > 4 else ''}): a model called twice per step (a twin encoder of "
                "a contrastive pair) or one layer run for every depth. remat plans modules that run once "
                "per step: plan the shared module on one call's batch (remat.auto(encoder, one_batch, "
                "budget) with the budget split between its calls; the plan then holds for every call), or "
                "wrap each call in your code with remat.checkpoint")
        if cut := [n for n, m in named if n in calls.count and n not in calls.grads and any(True for _ in m.parameters())]:
            raise _cut_off(cut)
        raise no_blocks(model)
    if left := sorted({n for n, _ in named} - {n for n, _ in kept}):
        log.info("blocks found by the model's containers that do not run as blocks in a training step: %s", left)
    return kept, coarser(model, kept, calls)


NEAR_TIE = 0.01
"""How much lower than the finer list's floor the coarser's must be to be taken (rule 9): a
diffusers UNet's up stages whole floored 1 KiB lower than split, where the finer list's plans choose
per part above the floor."""


def by_floor(finer: Blocks, coarser: Blocks | None, floor_of: Callable[[list[str]], int]) -> Blocks:
    """Of rule 9's two candidate lists, the one with the lower floor (``floor_of`` block names, from
    steps on fake tensors); the finer where they (nearly) tie, or where the model runs no step on fake
    tensors (NOTE [ Blocks by what runs ] in remat.manual.settle)."""
    if coarser is None:
        return finer
    try:
        floors = [floor_of([n for n, _ in blocks]) for blocks in (finer, coarser)]
    except RematError:
        raise
    except Exception as e:  # a forward that reads tensor values, an op fake tensors cannot run
        log.info("remat: the blocks %s cannot be compared on fake tensors (%s: %s); keeping their parts",
                 sorted({n for n, _ in coarser} - {n for n, _ in finer}), type(e).__name__, str(e).split("\n")[0][:200])
        return finer
    chosen = coarser if floors[1] < floors[0] * (1 - NEAR_TIE) else finer
    log.info("remat: stages whole floor at %d bytes, split at %d: taking them %s", floors[1], floors[0],
             "whole" if chosen is coarser else "split")
    return chosen


class _BufferWrites(TorchDispatchMode):
    """Calls ``written(name)`` for each op that writes into one of ``model``'s buffers, however it
    is reached (``buffer.data.lerp_``, which no version counter sees), on real or fake tensors; not
    for a training norm's running statistics, which a replay puts back (NOTE [ BatchNorm in
    recompute ] in remat.manual.batchnorm)."""

    def __init__(self, model: nn.Module, written: Callable[[str], None]) -> None:
        super().__init__()
        self.written = written
        self.buffers = {storage_key(t): name for name, t in model.named_buffers(remove_duplicate=False)
                        if not _replayed(model.get_submodule(name.rpartition(".")[0]))}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.buffers:
            for k, arg in enumerate(func._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    t = args[k] if k < len(args) else kwargs.get(arg.name)
                    if isinstance(t, torch.Tensor) and (name := self.buffers.get(storage_key(t))) is not None:
                        self.written(name)
        return func(*args, **kwargs)


def _replayed(module: nn.Module) -> bool:
    """Whether a replay puts back what ``module``'s forward changes in its buffers: a training norm's
    running statistics."""
    return isinstance(module, nn.modules.batchnorm._NormBase) and module.training


def _in_backward(names: list[str]) -> ProfileError:
    return ProfileError(
        f"{names[:4]}{' ...' if len(names) > 4 else ''} run with gradients only after the model's forward "
        "returned: the model runs them without gradients and again in its own backward (a reversible "
        "network), so they keep no activations for checkpointing to drop and remat has nothing to plan "
        "there. Name blocks that run with gradients in the forward with blocks=, or train without remat")
