"""What a traced step's parts save for the backward, and what outlives a block's forward in a
replay's cache: the saving hook (``noting_saved``), the mark of a block's first gradient, and the
outputs that ``selective`` keeps (NOTE [ A replay's cache holds the block's output ], NOTE [ A skip
from a block's output ] in ``remat.measure.sides``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from remat.crossing import Crossing
from remat.measure.cpu_record import inside_an_op
from remat.measure.handovers import note_saved
from remat.measure.notes import StepNotes
from remat.measure.sides import first_death
from remat.measure.storages import storage_key

__all__ = ["backward_mark", "cached_skips", "noting_saved", "replay_holds_output"]


def backward_mark(hooks: StepNotes, i: int, mark: Callable[[str], None]) -> Callable[[Any], None]:
    """The hook on block i's outputs: at the first gradient, marks ``bs{i}`` and notes that block
    i's backward began."""
    def hook(grad: Any) -> None:
        if i not in hooks.began:
            hooks.began.add(i)
            mark(f"bs{i}")

    return hook


# NOTE [ A replay's cache holds the block's output ]
# ``selective`` keeps the outputs of a block's matmuls in its replay's cache until the block's
# backward; when the block's last op is a matmul, that is the block's output. Its numbers charge the
# output to the next block, which under every option measured holds it (a checkpoint saves its
# inputs) or, kept, lets it go in its forward when it saves nothing of it (``lin(sin(x + s))``):
# there a selective block before a kept one held 128 KiB more than its plan's prediction. So where
# the selective run's output outlived the start of its own backward (and the recompute run's did
# not), and the kept next block let it go, the selective option keeps the output's bytes too: exact
# before a kept block, an over-estimate by the output's bytes before a checkpointed one.


def replay_holds_output(selective: StepNotes, recompute: StepNotes, keep: StepNotes) -> list[int]:
    """The blocks whose output outlived the start of their own backward with every block on
    ``selective`` (a replay's cache held it) but not on ``recompute``, and whose next block, kept,
    let it go in the forward (NOTE [ A replay's cache holds the block's output ])."""
    held = {i for i, n in selective.returned_outlived - recompute.returned_outlived if (i, n) in selective.returned_hidden}
    first_of = keep.first_of
    return sorted(i for i in held if any(first_of.get(j) == i and first_death(keep, j) is not None for j in first_of))


@contextmanager
def noting_saved(
    hooks: StepNotes, saved: dict[Any, set[int]] | None, mark: Callable[[str], None] | None = None,
    hold: bool = True,
) -> Iterator[None]:
    """With ``saved``, note there the storages each part saves for the backward while the step
    runs (a block by its index, the model's code by ``"pre"`` before the blocks and ``("after", i)``
    after block i started); with ``mark``, mark ``sv{i}`` each time block i saves one
    (the last such mark is where a replay of the block stops: ``BlockProfile.stop_peak_bytes``)
    and ``un{i}`` each time the backward reads one (the first is where a replay of the block
    starts: ``BlockProfile.unpack_bytes``), and note where each dies (``note_saved``); nothing
    without either. The tensors are saved as they
    are, so the step's memory is unchanged (NOTE [ What the saving hook holds ]); ``hold=False``:
    nothing is saved (a forward with no backward after it)."""
    if saved is None and mark is None and hold:
        yield
        return

    @inside_an_op
    def pack(t: torch.Tensor) -> Any:
        who = hooks.running[-1] if hooks.running else (("after", hooks.order[-1]) if hooks.order else "pre")
        if saved is not None:
            saved.setdefault(who, set()).add(storage_key(t))
        if mark is not None and hooks.running:
            mark(f"sv{who}")
            note_saved(hooks, hooks.running[-1], t)  # NOTE [ A handover's graph ] in remat.measure.handovers
            return who, t.detach()  # whose it is, for the mark when it is read
        return t.detach() if hold else None

    @inside_an_op
    def unpack(packed: Any) -> Any:
        if isinstance(packed, tuple):
            assert mark is not None
            mark(f"un{packed[0]}")
            return packed[1]
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


# NOTE [ What the saving hook holds ]
# The hook packs a tensor without its graph (``detach``: the same storage). Packed as it came, an
# output an op saves of itself (``amax``, ``exp``) holds its own node, a cycle that keeps the node
# and what it saved alive where the step lets them go: a branch the model's code cuts off with
# ``.detach()`` (the ``x - x.amax(-1).detach()`` of a softmax kernel, performer-pytorch's) or a
# graph it frees after a ``retain_graph`` backward. There the profile's plain step measured above
# the real one (Reformer 17.65 MB for 9.74 MB; tests/test_profiler.py), and so did every plan.


def cached_skips(sides: list[Crossing], selective: StepNotes, recompute: StepNotes,
                 names: list[str]) -> list[Crossing]:
    """``sides`` with ``selective`` among the options of each maker whose replay's cache held what
    it returned of the side's size (NOTE [ A skip from a block's output ]); ``names`` by hook index."""
    cached = {(names[i], selective.returned[i][n]) for i, n in selective.returned_outlived - recompute.returned_outlived}
    return [dataclasses.replace(s, saved_by=s.saved_by | {maker: [*s.saved_by.get(maker, []), "selective"]})
            if (maker := s.made_by) is not None and (maker, s.size_bytes) in cached else s for s in sides]
