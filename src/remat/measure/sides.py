"""The side inputs of a traced step, as ``Crossing`` records that enter blocks (shape 1 of NOTE
[ Tensors that cross a block boundary ] in ``remat.crossing``).

A block's hooks note, per block, the storages that enter it besides its first input; a plain
step run under a saved-tensors hook notes what each part saves. Storage keys live only as long as
one step, so the two steps are matched by the order in which side inputs first appear (the same
model and batch make the same calls in the same order). Left out: a tensor that is some block's
first input (a skip: the block it enters first is charged with it already, NOTE [ A first input the
model's code keeps for a skip ]) and one that the part before the blocks saves (it lives to the end
of the backward under every plan). A block's output that enters a later block besides its first
input is one, made by that block (NOTE [ A skip from a block's output ]).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from remat.crossing import Crossing
from remat.errors import ProfileError
from remat.measure import storages as _storages
from remat.measure.notes import DeathPoint, Side, StepNotes
from remat.records import Profile

__all__ = [
    "StepNotes",
    "death_point",
    "first_death",
    "first_tensor",
    "note_output",
    "note_sides",
    "noting_deaths",
    "read_held_firsts",
    "read_side_inputs",
    "storage_number",
    "with_skips",
]  # fmt: skip


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first floating-point tensor in ``obj``: a block's hidden input or output."""
    for t in _storages.tensors_in(obj):
        if t.is_floating_point():
            return t
    return None


def storage_number(hooks: StepNotes, t: torch.Tensor) -> int:
    """The number of ``t``'s storage among those ``hooks`` noted in this step: unlike its key,
    never another storage's (NOTE [ Storage keys are reused ]); where it dies is noted."""
    key, live = _storages.storage_key(t), hooks.live_numbers
    if key not in live:
        live[key] = number = hooks.numbered
        hooks.numbered += 1
        weakref.finalize(t.untyped_storage(), _died, hooks, key, number)
    return live[key]


def _died(hooks: StepNotes, key: int, number: int) -> None:
    del hooks.live_numbers[key]
    if (at := death_point(hooks)) is not None:
        hooks.deaths[number] = at


def note_sides(hooks: StepNotes, i: int, x: torch.Tensor | None, inputs: Any) -> None:
    """Note the tensors entering block i besides ``x``, once per storage, on ``hooks``."""
    seen = set(hooks.base_keys)
    if x is not None:
        number = storage_number(hooks, x)
        hooks.firsts.add(number)
        seen.add(_storages.storage_key(x))
        hooks.first_numbers[i] = number
        hooks.first_of[i] = -1 if (maker := output_of(hooks, number)) is None else maker
        if (j := next((j for j, (ref, version) in hooks.output_refs.items()
                       if ref() is x and x._version == version), None)) is not None:
            hooks.handed_on[i] = j
    hooks.sides[i] = []
    for t in _storages.tensors_in(inputs):
        if (key := _storages.storage_key(t)) not in seen and (x is None or t.device == x.device):
            seen.add(key)
            number = storage_number(hooks, t)
            hooks.sides[i].append(Side(key, number, t.untyped_storage().nbytes()))
            if (made := hooks.returned_alive.get(key)) is not None:
                hooks.side_makers.setdefault(number, made[0])
            if number in hooks.first_numbers.values():  # a block's first input (alive: here): a skip
                hooks.skips_in.add((i, number))


def output_of(hooks: StepNotes, number: int) -> int | None:
    """The block whose first output is storage ``number``, if any."""
    return next((j for j, n in hooks.output_numbers.items() if n == number), None)


def first_death(hooks: StepNotes, i: int) -> DeathPoint | None:
    """Where block i's first input died, when in the forward (NOTE [ The last block's input ] in
    ``remat.measure.attribution``)."""
    return hooks.deaths.get(hooks.first_numbers[i]) if i in hooks.first_numbers else None


def head_frees_last_input(hooks: StepNotes) -> int:
    """The bytes of the last block's first input when the step freed it in the head's forward,
    after that block ended (NOTE [ The last block's input ] in ``remat.measure.attribution``);
    else 0."""
    if not hooks.order:
        return 0
    last = hooks.order[-1]
    if first_death(hooks, last) != (len(hooks.order) - 1, True):
        return 0
    return hooks.in_bytes.get(last, 0)


def death_point(hooks: StepNotes) -> tuple[int, bool] | None:
    """Where in the forward a storage freed now dies: the position of the last block started and
    whether it has ended; None after the forward (NOTE [ Where a side input dies ])."""
    if hooks.forward_done or not hooks.order:
        return None
    return len(hooks.order) - 1, hooks.order[-1] not in hooks.running


@contextmanager
def noting_deaths(hooks: StepNotes, model: torch.nn.Module) -> Iterator[None]:
    """Note on ``hooks`` where the side inputs die before ``model``'s forward returns."""
    hooks.forward_done = False
    handle = model.register_forward_hook(lambda *_: setattr(hooks, "forward_done", True))
    try:
        yield
    finally:
        handle.remove()
        hooks.forward_done = True  # a storage freed later, in the backward or after, dies there


def note_output(hooks: StepNotes, i: int, y: torch.Tensor | None) -> None:
    """Note block i's first output (``y``), a storage that is no side input of later blocks."""
    if y is not None:
        number = storage_number(hooks, y)
        hooks.firsts.add(number)
        hooks.output_numbers[i] = number
        hooks.output_refs[i] = (weakref.ref(y), y._version)


# NOTE [ Storage keys are reused ]
# A storage key is an address, and a freed storage's address is soon another's: a UNet's
# interpolated and concatenated input can take the key of the output it was computed from, once
# that output is freed, and in some runs T5's decoder position bias took the key of the encoder's
# (the two plain steps of a profile then disagreed on the side inputs: a flaky ``ProfileError``).
# So what the hooks note of first inputs, outputs and side inputs is a storage's number in the step
# (``storage_number``), given while it lives, never another's; a key is only compared with storages
# alive at the same moment (the base, one call's inputs, what the forward saves).


def _in_order(hooks: StepNotes) -> list[tuple[Side, list[int]]]:
    """Each side input as it first entered a block, and the blocks it entered, in order of first
    appearance."""
    found: dict[int, tuple[Side, list[int]]] = {}
    for i in hooks.order:
        for side in hooks.sides.get(i, []):
            if (i, side.number) in hooks.skips_in:  # judged when it arrived
                continue
            found.setdefault(side.number, (side, []))[1].append(i)
    return list(found.values())


# NOTE [ A skip from a block's output ]
# A block's output may enter a later block besides its first input: MONAI's UNETR keeps each
# encoder's output in a local until a decoder concatenates it with its hidden input. It was left out
# of the side inputs, as charged to the block that made it; but that block's numbers have it die
# where the plain step frees it, while a checkpointed decoder holds it to its backward, and the
# encoder that made it may save it too (an in-place activation saves its output; ``selective``
# caches a last matmul's). On UNETR with whole decoders, a recomputed decoder among kept blocks
# measured 131,072 B over its prediction, and once made side inputs of their consumers alone, every
# plan among recomputed blocks 786,432 B under (two encoders save theirs); on tests/test_crossings.py
# one hidden state each way. So it is a side input (``made_by`` its maker) whose holders are its
# consumers and its maker on the options whose run saves it: ``keep`` where the kept step saved
# it, ``selective`` where that run's output outlived the start of its maker's backward and the
# recompute run's did not (``remat.measure.saved.cached_skips``). Its life is the side inputs' rule.
# But where the model's code between the blocks saves it before its first consumer runs (MONAI's
# VNet: the next stage's strided convolution takes the encoder's output, its decoder the same as a
# skip), every plan holds it at least as long as any consumer would, and every run measured it so:
# as a crossing, the plans that recomputed its maker measured 262,144 B over. It is none, as one the
# part before the blocks saves.
# A storage a block returns besides its first output is made by it the same way: nGPT's attentions
# return their values (a view of the projection's output, which the kept and selective runs save),
# and the model's code hands the first one's to every later attention. Read as made by the model's
# code, no holder kept it under a plan, and its 60% plan measured 132,096 B over its prediction
# (tests/test_crossings.py: a recomputed last feed-forward, 393,216 B over). The hooks note which
# block returned a side storage (``StepNotes.side_makers``), and ``selective`` holds it where the
# selective run's returned storage of its size outlived the start of its maker's backward.


# NOTE [ A side input that becomes a first input ]
# A storage may enter a block besides its hidden input and then a later block as its hidden input:
# simple-hierarchical-transformer's fine stream enters the merge of both streams, then the next
# fine block. Its record had the merge alone as consumer, dying in that fine block's forward phase,
# where the plain step frees it (that block's first op saves nothing of it); but a checkpoint of
# the fine block holds its input to its backward, and plans that recomputed it measured a hidden
# state over their prediction (131,072 B, tests/test_crossings.py). So the later blocks whose first
# input it is are among its consumers, as for a first input the model's code keeps (NOTE [ A first
# input the model's code keeps for a skip ]): its life under a plan is the side inputs' rule.


def read_side_inputs(
    traced: StepNotes, saving: StepNotes, saved: dict[Any, set[int]], names: list[str]
) -> list[Crossing]:
    """The records of the traced step's side inputs; ``saving`` is the step that noted ``saved``."""
    seen, again = _in_order(traced), _in_order(saving)
    if [(s.nbytes, u) for s, u in seen] != [(s.nbytes, u) for s, u in again]:
        raise ProfileError(
            "the blocks received different extra inputs in two plain steps of the same batch; "
            "remat plans steps that repeat (check for randomness in the model's forward)"
        )
    records = []
    position = {i: k for k, i in enumerate(traced.order)}
    for (side, users), (again_side, _) in zip(seen, again):
        key = again_side.key  # the key ``saved`` knows it by, in the run that noted it
        if key in saved.get("pre", set()) or side.number in traced.kept_past_step:
            continue
        maker = output_of(traced, side.number)
        if maker is None:
            maker = traced.side_makers.get(side.number)
        code_saved = _code_saved_after(saving, saved, again_side)
        if maker is not None and code_saved is not None and position[code_saved] < position[users[0]]:
            continue  # NOTE [ A skip from a block's output ]: the part before its consumers saves it
        later_firsts = [j for j in traced.order  # NOTE [ A side input that becomes a first input ]
                        if position[j] > position[users[0]] and traced.first_numbers.get(j) == side.number]
        users = sorted({*users, *later_firsts}, key=position.__getitem__)
        holders = [*users, *([] if maker is None else [maker])]  # NOTE [ A skip from a block's output ]
        records.append(
            Crossing(
                size_bytes=side.nbytes,
                consumers=[names[i] for i in users],
                made_by=None if maker is None else names[maker],
                saved_by={names[i]: ["keep"] for i in holders if key in saved.get(i, set())},
                saved_after=None if code_saved is None else names[code_saved],
                dies_after=_dies_after(traced, side.number, names),
            )
        )
    return records


def _code_saved_after(saving: StepNotes, saved: dict[Any, set[int]], side: Side) -> int | None:
    """The first block (hook index, in forward order) after which the model's code saves ``side``
    in the step ``saving``, or None (NOTE [ A side input the model's code saves ] in
    remat.plan.sides). A storage saved outlives the forward: the key of one that died there is
    another's (NOTE [ Storage keys are reused ])."""
    if side.number in saving.deaths:
        return None
    position = {i: k for k, i in enumerate(saving.order)}
    after = [who[1] for who, keys in saved.items() if isinstance(who, tuple) and side.key in keys]
    return min(after, key=position.__getitem__) if after else None


# NOTE [ A side input the model keeps past the step ]
# A side input still alive when the step has ended is held by the model's own state, not by the
# step: transformers' DETR caches its sine position embedding (``lru_cache(maxsize=1)``, the mask
# in its key), so the last step's lives until the next step makes its own. No plan shortens or
# lengthens its life, and every run measures it held; read as a crossing the plain step frees in
# the head, the rule added its bytes to every checkpointed plan's backward a second time, and
# the profile took them off the runs' peaks: every plan with a checkpoint measured 16,512 B over
# its prediction (tests/test_profiler.py). So it is no crossing.


def _dies_after(hooks: StepNotes, number: int, names: list[str]) -> str | None:
    """The block in whose forward phase side storage ``number`` died, or None: in the head's
    forward (after the last block ended) or later."""
    if number not in hooks.deaths:
        return None
    position, ended = hooks.deaths[number]
    if position == len(hooks.order) - 1 and ended:
        return None
    return names[hooks.order[position]]


# NOTE [ A first input the model's code keeps for a skip ]
# The model's code may hold a block's first input past the block: x-unet's and Karras' UNets keep
# each down block's input for a skip, diffusers' UNet3D its temporal layer's residual. Where no
# kept block saves it, the plain step frees it where that code drops it, in a later block's
# forward, and the profile's numbers say so; but a checkpoint of the block holds it to the block's
# backward. Read as the hidden state alone, recomputing the block was predicted one hidden state
# low and recomputing the block that drops it one high (tests/test_crossings.py: 131,072 B each
# way). So it is a crossing that enters the block and the later blocks it reaches as a skip (shape
# 1 of NOTE [ Tensors that cross a block boundary ] in remat.crossing), dying where the plain step
# frees it: its life under a plan is the side inputs' rule (NOTE [ A side input's extra life ] in
# remat.plan.sides), and no other part of the cost model changes.


def read_held_firsts(traced: StepNotes, names: list[str]) -> list[Crossing]:
    """The first inputs the traced step (every block kept) freed in a later block's forward, or in
    the head's, as crossings (NOTE [ A first input the model's code keeps for a skip ])."""
    position = {i: k for k, i in enumerate(traced.order)}
    records, seen = [], set()
    for i in traced.order:
        number = traced.first_numbers.get(i)
        died = first_death(traced, i)
        if number is None or number in seen or died is None or died[0] <= position[i] or not traced.in_bytes.get(i):
            continue
        seen.add(number)
        if any(side.number == number for j in traced.order[:position[i]] for side in traced.sides.get(j, [])):
            continue  # a side input first: its record holds it (NOTE [ A side input that becomes a first input ])
        enters = [j for j in traced.order if position[j] > position[i]
                  and (traced.first_numbers.get(j) == number or any(s.number == number for s in traced.sides.get(j, [])))]
        records.append(Crossing(size_bytes=traced.in_bytes[i], consumers=[names[j] for j in [i, *enters]],
                                dies_after=_dies_after(traced, number, names)))
    return records


# NOTE [ A first input the model's code holds ]
# A segment keeps only its first block's input; the later blocks' inputs it makes and lets go as it
# runs (NOTE [ A segment's costs from per-block numbers ] in remat.plan.segments). The model's code
# may hold one longer: diffusers' down blocks collect each block's output in a tuple for the up
# path, so the next block's input lives on whoever runs it. Every measured step hides that (a kept
# block saves its input, a checkpoint holds it), so ``sides_of`` runs one forward in which nothing
# is saved: a first input that outlives its block's forward there is held by the model's code, and
# the block is put after the first of no segment (``skip_bytes``). Before, a segment over diffusers'
# down path measured 88 KiB (and in another run's plan 246 KiB) over its prediction.


# NOTE [ A first input made between blocks ]
# A segment's frame finds a call's input among the outputs of its earlier calls by identity
# (``remat.manual.frames``); any other tensor it holds until its replay. A view the model's code
# makes of a block's output is another tensor over the same storage: wav2vec2 transposes its feature
# extractor's output before the feature projection, and the frame of a segment over both held it,
# 9,984 B over the prediction of the floor plan (hf zoo; tests/test_crossings.py: one hidden state).
# So a block whose first input is not the very tensor the block before it returned ends segments
# there, as one computed between blocks does; so does one the model's code changed in place between
# them (MONAI's SegResNetDS: ``x += skip``), whose change a replay cannot redo (the frame refuses to
# record it: ``remat.manual.frames``).


def with_skips(traced: StepNotes, profile: Profile, unsaved: StepNotes) -> Profile:
    """``profile`` with ``skip_bytes``: per block, the bytes a segment holding it after its first
    block would hold that the segment cost model does not count: the long skips it receives
    (besides its first input, another block's first input or output: left out of the side
    inputs), a first input that the forward holds for another block too, or a first input that is
    not the previous block's output (computed between the blocks, e.g. a pooling in the model's
    own forward), or a first input the model's code holds past its block in ``unsaved``, a
    forward that saves nothing (NOTE [ A first input the model's code holds ])."""
    # The hooks number blocks as found; the profile lists them as they ran.
    names = {i: block.name for i, block in zip(traced.order, profile.blocks)}
    first_numbers, first_of = traced.first_numbers, traced.first_of
    firsts = {number: i for i, number in first_numbers.items()}
    skips: dict[str, int] = {}

    def add(j: int, nbytes: int) -> None:
        if j in names:
            skips[names[j]] = skips.get(names[j], 0) + max(1, nbytes)

    for i in traced.order:
        for side in traced.sides.get(i, []):
            if side.number in traced.firsts:  # both ends: the block receiving it, the block whose input it is
                for j in {i, firsts.get(side.number, i)}:
                    add(j, side.nbytes)
    for a, b in zip(traced.order, traced.order[1:]):  # NOTE [ A first input made between blocks ]
        if b in first_numbers and (first_of.get(b) != a or traced.handed_on.get(b) != a):
            add(b, 0)
    position = {i: k for k, i in enumerate(unsaved.order)}
    for i in unsaved.order[1:]:  # NOTE [ A first input the model's code holds ]
        died = first_death(unsaved, i)
        if i in unsaved.first_numbers and (died is None or died[0] > position[i]):
            add(i, unsaved.in_bytes.get(i, 0))
    return dataclasses.replace(profile, skip_bytes=skips)
