"""The side inputs of a traced step, as ``SideInput`` records (NOTE [ Side inputs ] in
``remat.records``).

A block's hooks note, per block, the storages that enter it besides its first input; a plain
step run under a saved-tensors hook notes what each part saves. Storage keys live only as long as
one step, so the two steps are matched by the order in which side inputs first appear (the same
model and batch make the same calls in the same order). Left out: a tensor that is some block's
first input or output (a skip: the block it enters first is charged with it already) and one that
the part before the blocks saves (it lives to the end of the backward under every plan).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from remat.errors import ProfileError
from remat.measure import step as _step
from remat.records import Profile, SideInput

__all__ = [
    "SeenSides", "first_tensor", "hooks_of", "note_sides", "noting_saved", "side_inputs", "storage_key",
    "with_skips",
]  # fmt: skip


class SeenSides(Protocol):
    order: list[int]
    sides: dict[int, list[tuple[int, int]]]
    firsts: set[int]
    base_keys: set[int]
    running: list[int]


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (views share it), valid while the storage lives."""
    return int(t.untyped_storage()._cdata)


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first floating-point tensor in ``obj``: a block's hidden input or output."""
    for t in _step.tensors_in(obj):
        if t.is_floating_point():
            return t
    return None


def note_sides(hooks: SeenSides, i: int, x: torch.Tensor | None, inputs: Any) -> None:
    """Note the tensors entering block i besides ``x``, once per storage, on ``hooks``."""
    seen = set(hooks.base_keys)
    if x is not None:
        hooks.firsts.add(storage_key(x))
        seen.add(storage_key(x))
        _first_keys(hooks)[i] = storage_key(x)
    hooks.sides[i] = []
    for t in _step.tensors_in(inputs):
        if storage_key(t) not in seen and (x is None or t.device == x.device):
            seen.add(storage_key(t))
            hooks.sides[i].append((storage_key(t), t.untyped_storage().nbytes()))


@contextmanager
def noting_saved(hooks: SeenSides, saved: dict[Any, set[int]] | None) -> Iterator[None]:
    """With ``saved``, note there the storages each part (block index, "pre", "post") saves for
    the backward while the step runs; nothing without."""
    if saved is None:
        yield
        return

    def pack(t: torch.Tensor) -> torch.Tensor:
        who = hooks.running[-1] if hooks.running else ("post" if hooks.order else "pre")
        saved.setdefault(who, set()).add(storage_key(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    gc.collect()  # the packed outputs hold themselves


def hooks_of(hooks: Any) -> SeenSides:
    return hooks  # type: ignore[no-any-return]


def _in_order(hooks: SeenSides) -> list[tuple[int, int, list[int]]]:
    """(storage key, bytes, consumers) of each side input, in order of first appearance."""
    found: dict[int, tuple[int, list[int]]] = {}
    for i in hooks.order:
        for key, nbytes in hooks.sides.get(i, []):
            if key in hooks.firsts:
                continue
            found.setdefault(key, (nbytes, []))[1].append(i)
    return [(key, nbytes, users) for key, (nbytes, users) in found.items()]


def side_inputs(
    traced: SeenSides, saving: SeenSides, saved: dict[Any, set[int]], names: list[str]
) -> list[SideInput]:
    """The records of the traced step's side inputs; ``saving`` is the step that noted ``saved``."""
    seen, again = _in_order(traced), _in_order(saving)
    if [(b, u) for _, b, u in seen] != [(b, u) for _, b, u in again]:
        raise ProfileError(
            "the blocks received different extra inputs in two plain steps of the same batch; "
            "remat plans steps that repeat (check for randomness in the model's forward)"
        )
    records = []
    for (_, nbytes, users), (key, _, _) in zip(seen, again):
        if key in saved.get("pre", set()):
            continue
        records.append(
            SideInput(
                size_bytes=nbytes,
                consumers=[names[i] for i in users],
                saved_by=[names[i] for i in users if key in saved.get(i, set())],
            )
        )
    return records


def with_skips(traced: SeenSides, profile: Profile) -> Profile:
    """``profile`` with ``skip_bytes``: per block, the bytes of the long skips it receives (besides
    its first input, another block's first input: left out of the side inputs) or whose first
    input is one."""
    names = [b.name for b in profile.blocks]
    firsts = {key: i for i, key in _first_keys(traced).items()}
    skips: dict[str, int] = {}
    for i in traced.order:
        for key, nbytes in traced.sides.get(i, []):
            if key not in traced.firsts:
                continue
            # Both ends: the block receiving the skip, and the block whose first input it is
            # (that input outlives the block: the forward holds it for the other one).
            for j in {i, firsts.get(key, i)}:
                if j < len(names):
                    skips[names[j]] = skips.get(names[j], 0) + nbytes
    return dataclasses.replace(profile, skip_bytes=skips)


def _first_keys(hooks: SeenSides) -> dict[int, int]:
    """[block]: the storage key of its first input (kept on the hooks object)."""
    keys = getattr(hooks, "_first_keys", None)
    if keys is None:
        keys = {}
        setattr(hooks, "_first_keys", keys)  # noqa: B010 (not part of the SeenSides protocol)
    return keys  # type: ignore[no-any-return]
