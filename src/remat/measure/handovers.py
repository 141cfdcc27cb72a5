"""The handovers of traced steps, as ``Crossing`` records that enter no block (shape 2 of NOTE [ Tensors
that cross a block boundary ] in ``remat.crossing``).

A block's forward hook notes the storages it returns (besides its inputs and what lived before the
step), and when each one is freed: the forward position of the last block started and whether it
had ended, as for side inputs (NOTE [ Where a side input dies ]).
One freed after a later block ended and before the next one started (or the head ran) is a
handover in that run; one that outlives the forward is saved (or held to the end) in that run. A
storage that enters a later block is a side input, not a handover. The runs of each option are
matched by the order in which a block returns them (the same calls in the same order).

# NOTE [ A hidden output the model's code holds ]
A block's hidden output is usually the next block's first input, charged to that block (NOTE [ How
a block's bytes are attributed ] in remat.records), and so no handover: it enters a block. One that
enters no block is consumed by the model's code (diffusers' upsampler output, concatenated with a
skip before the next resnet runs) and may be held by it for longer: diffusers' UNet holds it in the
caller's frame until the next up block returns, so the plain step frees it in the head's forward.
Its life then depends on the maker's option like any handover's: ``selective`` keeps a last matmul's
output in its replay's cache until the block's backward, ``keep`` and ``recompute`` do not. It is a
handover when some option saves it (one no option saves moves nothing): before, a selective
upsampler put a plan 256 KiB over its prediction (tests/test_libs_zoo.py), and a selective block
after it 256 KiB under.

# NOTE [ A handover's graph ]
# A handover's autograd graph may hold what the maker's forward saved for it alone (shape 2 of NOTE
# [ Tensors that cross a block boundary ] in remat.crossing): Griffin's and native-sparse-attention's
# caches, cut from the keys by a ``gather`` that saves its int64 index. The model's code lets the
# cache go, and the index goes with it, in the kept run only (a checkpoint saves nothing). So the
# kept run notes where each storage a block saves dies (``note_saved``); those a block saved that
# die in the forward where one of its handovers dies are that handover's graph (``graph_bytes``).
# A storage the block took or returned is no graph's: its own record counts it, or the model's
# code holds it (a VQ quantizer's ``cdist`` saves its input, which the code frees as the forward
# returns, where its index handover dies too). Before, plans mixing options missed by one index
# per maker: Griffin's at 60% 33,104 B over (tests/test_handovers.py keeps a model in that shape).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from remat.crossing import Crossing
from remat.measure import storages as _storages
from remat.measure.notes import DeathPoint, StepNotes
from remat.measure.sides import death_point
from remat.measure.storages import storage_key

__all__ = ["note_handover_uses", "note_returned", "note_saved", "read_handovers"]

def note_returned(hooks: StepNotes, i: int, output: Any, y: torch.Tensor | None) -> None:
    """Note what block i returned besides its inputs, its hidden output ``y`` among them (the
    forward hook's; ``note_handover_uses`` noted the inputs)."""
    if y is None:
        return
    skip = {*hooks.base_keys, *hooks.input_keys.get(i, ())}
    found = hooks.returned.setdefault(i, [])
    alive = hooks.returned_alive
    hidden = storage_key(y)
    for t in _storages.tensors_in(output):
        if t.layout != torch.strided or t.device != y.device:
            continue  # a sparse tensor has no storage of its own to follow
        if (key := storage_key(t)) in skip or key in alive:
            continue  # one another block returned is that block's
        skip.add(key)
        if key in hooks.saved_alive:  # NOTE [ A handover's graph ]
            hooks.saved_alive[key] = None
        if key == hidden:  # NOTE [ A hidden output the model's code holds ]
            hooks.returned_hidden.add((i, len(found)))
        alive[key] = (i, len(found))
        weakref.finalize(t.untyped_storage(), _freed, hooks, i, len(found), key)
        found.append(t.untyped_storage().nbytes())


def note_handover_uses(hooks: StepNotes, i: int, inputs: Any) -> None:
    """Note block i's inputs (the pre-hook's): a returned storage entering a block is a side
    input there, not a handover."""
    alive = hooks.returned_alive
    keys = [storage_key(t) for t in _storages.tensors_in(inputs) if t.layout == torch.strided]
    hooks.input_keys[i] = keys
    for key in keys:
        if (who := alive.get(key)) is not None:
            hooks.returned_used.add(who)


def note_saved(hooks: StepNotes, i: int, t: torch.Tensor) -> None:
    """Note that block i's forward saved ``t`` for the backward, to learn where it dies (NOTE
    [ A handover's graph ])."""
    if t.layout != torch.strided or (key := storage_key(t)) in hooks.saved_alive or key in hooks.base_keys:
        return
    if any(key in hooks.input_keys.get(b, ()) for b in hooks.running):
        return  # made before the block: the model's code may hold it (VQ's hidden input)
    token = hooks.saved_alive[key] = object()
    weakref.finalize(t.untyped_storage(), _saved_freed, hooks, i, key, token, t.untyped_storage().nbytes())


def _saved_freed(hooks: StepNotes, i: int, key: int, token: object, nbytes: int) -> None:
    mine = hooks.saved_alive.get(key, False)
    if mine is token or mine is None:
        del hooks.saved_alive[key]
    if mine is token and (at := death_point(hooks)) is not None:
        hooks.graph_deaths[(i, at)] = hooks.graph_deaths.get((i, at), 0) + nbytes


def _freed(hooks: StepNotes, i: int, n: int, key: int) -> None:
    alive = hooks.returned_alive
    if alive.get(key) == (i, n):
        del alive[key]
    if (at := death_point(hooks)) is not None:
        hooks.returned_deaths[(i, n)] = at
    if i in hooks.began:
        hooks.returned_outlived.add((i, n))


def read_handovers(names: list[str], runs: Mapping[str, StepNotes]) -> list[Crossing]:
    """The handovers of the steps ``runs`` (option -> the hooks of a step with every block on it;
    ``keep`` among them), one record per maker and place of death, in forward order."""
    keep = runs["keep"]
    order: list[int] = keep.order
    found: dict[tuple[int, int | None], tuple[int, list[str]]] = {}
    for i in order:
        sizes = keep.returned.get(i, [])
        for n, nbytes in enumerate(sizes):
            deaths = {o: _death(h, order, i, n) for o, h in runs.items()}
            if any((i, n) in h.returned_used or h.returned.get(i, [])[n:n + 1] != [nbytes]
                   for h in runs.values()):
                continue  # a side input, or the runs disagree
            places = {d for d in deaths.values() if d != "saved"}
            if len(places) != 1 or None in places:
                continue  # saved under every option, freed where it is made, or freed in two places
            place = places.pop()
            saved = [o for o, d in deaths.items() if d == "saved"]
            if (i, n) in keep.returned_hidden and not saved:
                continue  # NOTE [ A hidden output the model's code holds ]
            key = (i, place if isinstance(place, int) else None)
            total, kept = found.get(key, (0, saved))
            if kept != saved:
                continue  # one record per maker and place: these live as one
            found[key] = (total + nbytes, saved)
    graphs: dict[tuple[int, int | None], int] = {}
    for (i, died), nbytes in keep.graph_deaths.items():  # NOTE [ A handover's graph ]
        if (place := _place(order, i, died)) is not None:
            key = (i, place if isinstance(place, int) else None)
            graphs[key] = graphs.get(key, 0) + nbytes
    return [
        Crossing(size_bytes=nbytes, made_by=names[i], dies_after=None if at is None else names[at],
                 saved_by={names[i]: kept} if kept else {}, graph_bytes=graphs.get((i, at), 0))
        for (i, at), (nbytes, kept) in found.items()
    ]


def _death(hooks: StepNotes, order: list[int], i: int, n: int) -> int | str | None:
    """Where returned storage n of block i died in that step: ``"saved"`` (it outlived the
    forward), the index of the block in whose forward phase it died after that block ended (a
    later block's), ``"head"`` (after the last block, one made before it), or None (anywhere else:
    in the phase that made it, inside a block)."""
    died = hooks.returned_deaths.get((i, n))
    return "saved" if died is None else _place(order, i, died)


def _place(order: list[int], i: int, died: DeathPoint) -> int | str | None:
    """Where a storage of block i that died at ``died`` died: ``_death``'s places but ``"saved"``."""
    position, ended = died
    if position == len(order) - 1 and ended:
        return "head"  # the last block's too: the head's numbers are the kept run's
    return order[position] if ended and position > order.index(i) else None
