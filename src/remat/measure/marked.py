"""The profiler's marked step: one training step with marks at each block's forward and backward
boundaries (``Hooks``), the runs of every option, and what the step's fixed tensors are
(``base_keys``). Measured, estimated and lean profiles all run it; which blocks run is settled
before, by the warm-up step (``remat.measure.warmup``).
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from remat.crossing import Crossing
from remat.errors import ProfileError
from remat.manual.settle import RANDOM_SKIPS
from remat.measure import step as _step
from remat.measure import storages as _storages
from remat.measure.handovers import note_handover_uses, note_returned
from remat.measure.notes import StepNotes
from remat.measure.runner import every_block
from remat.measure.saved import backward_mark, noting_saved
from remat.measure.sides import first_tensor as _first_tensor
from remat.measure.sides import (
    note_output,
    note_sides,
    noting_deaths,
    read_held_firsts,
    read_side_inputs,
)
from remat.measure.storages import storage_key as _storage_key
from remat.units import format_bytes

__all__ = [
    "RUN_OPTIONS", "Hooks", "Meter", "base_keys", "carried", "dtype_name", "marked_step", "option_runs", "outside_remat",
    "sides_of", "warn_carried",
]

log = logging.getLogger(__name__)


# NOTE [ A first input that needs no gradient ]
# A block's bytes are charged its hidden input on the grounds that whatever runs it, kept or
# checkpointed, holds that input until its backward (NOTE [ How a block's bytes are attributed ] in
# remat.records). An input that needs no gradient (behind a frozen embedding: a LoRA model's first
# layer) breaks that: a kept block saves nothing of it, a checkpoint holds it, and the model's code
# may hold it past the block (transformers' ``inputs_embeds``). Its life is that of a side input:
# made outside the block, held under a plan by a checkpointed consumer, freed where the plain step
# frees it. So it is noted as one (``in_bytes`` 0, not the block's first input), and the side
# inputs' rule (NOTE [ A side input's extra life ] in remat.plan.sides) gives its life under every
# plan. peft's LoRA Llama (tests/test_libs_zoo.py): the plans that mixed options on its first or
# last layer were 128 KiB (one hidden state) off their prediction, either way; now all exact.


class Hooks(StepNotes):
    """Marks at each block's forward start/end and backward start/end; what they see is noted on
    the ``StepNotes`` it is."""

    def __init__(self, named: list[tuple[str, nn.Module]], mark: Callable[[str], None]) -> None:
        super().__init__()
        self.mark = mark
        self.names = [name for name, _ in named]
        self.handles = []
        for i, (_, module) in enumerate(named):
            self.handles.append(module.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(i)))

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not torch.is_grad_enabled():
                return
            if i in self.order:
                if self.forward_done:  # a recompute in the backward: the model's own checkpointing
                    raise ProfileError(
                        f"block {self.names[i]} ran again in the backward: the model checkpoints it itself "
                        "(diffusers' enable_gradient_checkpointing(), open_clip's set_grad_checkpointing()). "
                        "Turn that off and let remat's plan decide what to recompute")
                raise ProfileError(
                    f"block {self.names[i]} ({type(module).__name__}) ran twice in one step; remat plans blocks "
                    "that run once per step (name other blocks with blocks=)"
                )
            self.order.append(i)
            self.running.append(i)
            self.mark(f"fs{i}")
            x = _first_tensor((args, kwargs))
            if x is not None and not x.requires_grad:
                x = None  # NOTE [ A first input that needs no gradient ]
            note_sides(self, i, x, (args, kwargs))
            note_handover_uses(self, i, (args, kwargs))
            self.in_bytes[i] = 0
            if x is not None:
                if _storage_key(x) not in self.base_keys:
                    self.in_bytes[i] = x.untyped_storage().nbytes()
                if x.requires_grad:  # removed with the rest: a tensor of the batch outlives the step
                    self.handles.append(x.register_hook(lambda g: self.mark(f"be{i}")))

        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            self.mark(f"fe{i}")
            self.running = [j for j in self.running if j != i]
            y = _first_tensor(output)
            note_output(self, i, y)
            note_returned(self, i, output, y)
            self.out_bytes[i] = y.untyped_storage().nbytes() if y is not None else 0
            began = backward_mark(self, i, self.mark)  # at the first gradient any output receives
            for t in _storages.tensors_in(output):  # the first may get none (Flux's last single block)
                if t.requires_grad:
                    self.handles.append(t.register_hook(began))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def marked_step(
    model: nn.Module,
    named: list[tuple[str, nn.Module]],
    batch: Any,
    loss_fn: Any,
    optimizer: Any,
    mark: Callable[[str], None],
    base_keys: set[int] | None = None,
    saved: dict[Any, set[int]] | None = None,
    saves: bool = False,
) -> Hooks:
    """One training step with marks at the phases and block boundaries (and ``noting_saved``;
    ``saves``: a mark at each tensor a block saves)."""
    hooks = Hooks(named, mark)
    hooks.base_keys = base_keys or set()
    try:
        with noting_saved(hooks, saved, mark if saves else None), noting_deaths(hooks, model):
            _step.train_step(model, batch, loss_fn, optimizer, mark=mark)
        hooks.kept_past_step = set(hooks.live_numbers.values())
    finally:
        hooks.remove()
    if missing := [named[i][0] for i in range(len(named)) if i not in hooks.order]:
        raise ProfileError(f"blocks {missing} did not run in this step; remat plans blocks that run in every "
                           f"{RANDOM_SKIPS}")
    return hooks


#: The options every block runs on together, one step each; their traces give the options' numbers.
RUN_OPTIONS = ("keep", "selective", "recompute")


class Meter(Protocol):
    """What traces one step: ``remat.measure.tracer.MemoryTracer`` on a device, ``FakeMeter`` on
    fake tensors; entered around the step, marked at its phases."""

    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: object) -> Any: ...
    def mark(self, label: str) -> Any: ...


M = TypeVar("M", bound=Meter)


def option_runs(model: nn.Module, named: list[tuple[str, nn.Module]], batch: Any, loss_fn: Any, optimizer: Any,
                keys: set[int], meter: Callable[[], M]) -> dict[str, tuple[M, Hooks]]:
    """After the warm-up, one marked step per option of ``RUN_OPTIONS`` with every block on it
    (``keep``'s marks what the blocks save), each traced by a new ``meter()``: per option, the
    meter and the step's hooks. Warns for tensors the model carries into the next step that these
    steps freed (NOTE [ A tensor carried from one step into the next ]). The measured and the
    estimated profile both take their numbers from here."""
    held = carried(model)
    runs: dict[str, tuple[M, Hooks]] = {}
    for option in RUN_OPTIONS:
        with every_block(named, option):
            model.zero_grad(set_to_none=True)
            m = meter()
            try:
                with m:
                    hooks = marked_step(model, named, batch, loss_fn, optimizer, m.mark, keys, saves=option == "keep")
            except RuntimeError as e:
                if option != "selective" or _MUTATED not in str(e):
                    raise
                _warn_no_selective(e)
                continue
            runs[option] = (m, hooks)
    warn_carried(held, model)
    return runs


# NOTE [ A kept output changed in place ]
# ``selective`` keeps the outputs of a block's matmuls for its replay, and torch refuses a replay
# whose kept output the block's forward then changed in place (fairseq's and ESM's ``q *=
# self.scaling`` after the query projection): the saved value is no longer the matmul's. Such a
# model is planned without ``selective``: its step under it fails in the profiler's run, which is
# then left out, and the profile offers keep, recompute and the rest.
_MUTATED = "cached during selective activation checkpoint has been mutated"


def _warn_no_selective(error: RuntimeError) -> None:
    warnings.warn(
        "a block changes in place the output of an op that remat's 'selective' option keeps for the "
        f"backward (torch: {error}), so the profile offers no 'selective'. To have it, make the change "
        "out of place (q = q * scaling for q *= scaling) (NOTE [ A kept output changed in place ])",
        stacklevel=outside_remat(),
    )


def base_keys(model: nn.Module, optimizer: Any, batch: Any) -> set[int]:
    tensors = [*model.parameters(), *model.buffers(), *_storages.batch_tensors(batch)]
    if optimizer is not None:
        tensors += list(_storages.tensors_in([dict(s) for s in optimizer.state.values()]))
    return {_storage_key(t) for t in tensors}


def dtype_name(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return str(p.dtype).removeprefix("torch.") if p is not None else "float32"


def sides_of(model: nn.Module, named: list[tuple[str, nn.Module]], batch: Any, loss_fn: Any,
             optimizer: Any, keys: set[int], traced: Hooks) -> tuple[list[Crossing], StepNotes]:
    """The side inputs of the step ``traced`` saw, after a plain step that notes what each block
    saves: which side inputs a kept block holds (NOTE [ Tensors that cross a block boundary ] in
    remat.crossing); and the notes of a forward with every block kept that saves nothing, where what
    the model's code holds shows (NOTE [ A first input the model's code holds ] in
    remat.measure.sides)."""
    saved: dict[Any, set[int]] = {}
    with every_block(named, "keep"):
        saving = marked_step(model, named, batch, loss_fn, optimizer, lambda _: None, keys, saved)
        model.zero_grad(set_to_none=True)
        unsaved = Hooks(named, lambda _: None)
        unsaved.base_keys = keys
        try:  # storage keys saved by nothing are soon reused: this forward notes deaths, not keys
            with noting_saved(unsaved, None, hold=False), noting_deaths(unsaved, model):
                _step.forward_loss(model, batch, loss_fn)
        finally:
            unsaved.remove()
    names = [n for n, _ in named]  # NOTE [ A first input the model's code keeps for a skip ] in remat.measure.sides
    return [*read_side_inputs(traced, saving, saved, names), *read_held_firsts(traced, names)], unsaved


# NOTE [ A tensor carried from one step into the next ]
# 1. A module may keep a tensor of the step on itself (``self.cache = ...``: a bucket cache, the
#    last attention map kept for a plot), replaced, dropped or set to None in a later step. Its
#    storage is allocated before the measured step starts and freed inside it. A trace that cannot
#    size that free (NOTE [ A free the CPU trace cannot size ] in remat.measure.tracer) stays that
#    storage's bytes too high from there on, unevenly across the runs of each option, and plans
#    mixing options miss their prediction (by tens of MiB on a small MLP: tests/test_profiler.py).
# 2. remat notes the storages behind the modules' plain attributes (tensors, and lists, tuples and
#    dicts of them; not parameters, buffers, or tensors inside other objects) after its warm-up
#    step, and warns, naming them, when the runs of its options freed any: a cache made once and
#    kept, or a new view of a storage that lives on, frees nothing and is not named. Under 1 KiB
#    in all (a step counter) it does not warn.
# 3. The warning says how to be sure: verify the plan, which measures it (a step may free them
#    elsewhere than the profiled ones did).
# 4. Every traced run sizes those frees: a real one after a warm-up under a memory profiler
#    (``sized``: the profiler's warm-up, and the lean steps' before their first), a fake one by its
#    meter, which takes the storages the modules hold as it starts (``FakeMeter(carrier=)``).
#    Without, vit-pytorch's ``Extractor`` (CoCa's image encoder keeps its output, not detached) was
#    counted twice on fake tensors, and the floor was named 131,072 B above torch's checkpoint on
#    every layer; the lean steps' first, after a warm-up that sized nothing, read it as scratch.

_QUIET_BYTES = 1024  # rule 2

Carried = dict[tuple[str, str], list[tuple[StorageWeakRef, int]]]
"""Per module name and attribute: the storages behind it, as weak references, and their bytes."""


def carried(model: nn.Module) -> Carried:
    """The storages ``model``'s modules hold in plain attributes (NOTE [ A tensor carried from one
    step into the next ], rule 2); taking them keeps nothing alive."""
    out: Carried = {}
    for name, attr, t in _storages.carried_tensors(model):
        storage = t.untyped_storage()
        out.setdefault((name, attr), []).append((StorageWeakRef(storage), storage.nbytes()))
    return out


def warn_carried(before: Carried, model: nn.Module) -> None:
    """Warn when the steps since ``before`` (``carried`` after a warm-up step) freed a storage a
    module held (NOTE [ A tensor carried from one step into the next ])."""
    sizes = {key: n for key, refs in before.items()
             if (n := sum(size for ref, size in refs if ref.expired()))}
    if sum(sizes.values()) < _QUIET_BYTES:
        return
    shown = ", ".join(f"{(name + '.') if name else ''}{attr} ({format_bytes(b)})" for (name, attr), b in sizes.items())
    warnings.warn(
        f"the model keeps tensors of each training step on its modules into the next step: {shown}. "
        "remat counts each as freed where the next of its steps freed it, but a step that frees them elsewhere "
        f"may peak above the prediction, by as much as these tensors "
        f"({format_bytes(sum(sizes.values()))} together) or more. Verify the plan before relying on it "
        "(remat.auto(..., verify=True), or `remat verify`), or keep such tensors off the modules "
        "(NOTE [ A tensor carried from one step into the next ])", stacklevel=outside_remat(),
    )


def outside_remat() -> int:
    """The ``stacklevel`` of the first caller outside remat, for a warning raised by our caller."""
    frame: FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "remat":
        frame, level = frame.f_back, level + 1
    return level
