"""The record of a tensor that crosses a block boundary besides the hidden state (``Crossing``), a
field of ``remat.records.Profile``. No torch here.

# NOTE [ Tensors that cross a block boundary ]
Besides the hidden state, tensors cross block boundaries, and each is one ``Crossing`` record,
counted once however many blocks it touches (found by storage identity): its bytes, the blocks it
enters (``consumers``), the block that returned it (``made_by``), the blocks whose forward saves it
for the backward and under which options (``saved_by``, measured), and where the plain step frees
it (``dies_after``). Two shapes, one record:
1. **One that enters blocks** (``consumers``): an attention mask, a position bias, rotary cos/sin
   made once in the model's forward, an encoder's output feeding cross-attention, T5's position
   bias that its first layer makes and the later ones take, a block's hidden input that the
   model's code keeps for a skip (NOTE [ A first input the model's code keeps for a skip ] in
   remat.measure.sides), a block's output that a later block takes besides its hidden input
   (``made_by`` that block: NOTE [ A skip from a block's output ] there). Its consumers hold it: a
   checkpointed one (``recompute``, ``selective``) holds its inputs until its backward, a kept one
   when its forward saves it, and so does its maker on an option whose forward saves it. The
   numbers are those of the plain step, where it dies at the end of the forward (or in
   ``dies_after``'s forward), or at the backward of the first kept block that saves it. Under a
   plan it lives until the backward of the first block (in forward order) that holds it; the cost
   model adds the difference (``remat.plan.sides``, NOTE [ A side input's extra life ]).
2. **One that enters none** (``made_by``, no ``consumers``): a block returns it besides its hidden
   output (BLOOM's layers return their attention probabilities) and the model's code holds it until
   a later block returns (``outputs = block(...)``) or the head runs. Its maker holds it: under an
   option whose forward saves it (``keep`` saves the probabilities) it lives on to the maker's
   backward and dropping it frees nothing; under one that does not (``recompute``), dropping it frees
   it. Each option's numbers are measured with every block on that option, so a block's kept bytes
   carry the free of the tensor the block before it made as that run had it, which a plan mixing
   options does not (BLOOM: a recomputed block after a kept one, 64 KiB more than its profile
   said). ``estimate`` corrects the parts measured under another saving than the plan's
   (``remat.plan.handovers``; one freed in the head's forward counts as live at the head's peak,
   which may come first). Inside a segment its maker is recomputed in the forward and kept in the
   replay (NOTE [ Handovers in a segment ] in ``remat.plan.segment_estimate``).
   Its autograd graph may hold more than itself (``graph_bytes``): Griffin's cache, cut from the
   keys by a ``gather`` whose backward saves the int64 index (twice the cache's bytes); a kept
   maker's forward saves the index, a checkpointed one's saves nothing, and its death frees the
   index with it. So a maker's option decides what its death frees: its bytes when the option does
   not save it, and its graph's when the option keeps the graph (``keep``). Counted as its storage
   alone, every plan mixing options missed by one index per maker (NOTE [ A handover's graph ] in
   ``remat.measure.handovers``).
The searches carry both as state bits set by the block that decides them, by one rule (NOTE [ What
crosses a block boundary, as state ] in ``remat.plan.crossings``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Crossing"]


@dataclass(frozen=True, kw_only=True)
class Crossing:
    """A tensor that crosses a block boundary besides the hidden state, counted once (NOTE [ Tensors
    that cross a block boundary ])."""

    size_bytes: int
    """Bytes of its storages."""
    consumers: list[str] = field(default_factory=list)
    """The blocks it enters, in forward order (besides their hidden input, or as the hidden input
    of the first where the model's code keeps that for a skip); empty: it enters none, and the
    model's code holds what ``made_by`` returned."""
    made_by: str | None = None
    """The block that returned it (for one that enters blocks, when a block did); None: the model's
    code made it."""
    saved_by: dict[str, list[str]] = field(default_factory=dict)
    """Per block, the options measured under which that block's forward saves it for the backward:
    a consumer's kept forward (``["keep"]``), the maker's runs that saved it (BLOOM's: ``keep``)."""
    saved_after: str | None = None
    """The first block after which the model's code (between the blocks, or the head after the
    last) saves it for its backward: every plan holds it through that code's backward, which runs
    in the next block's backward phase, or the head's (NOTE [ A side input the model's code saves ]
    in ``remat.plan.sides``); None: no code saves it."""
    dies_after: str | None = None
    """The block in whose forward phase the plain step (for one that enters no block: a run whose
    maker does not save it) frees it, when that comes before the head: T5's position bias dies
    where its stack ends, BLOOM's probabilities in the next block (NOTE [ Where a side input dies ]
    in ``remat.plan.sides``); None: in the head's forward, or, saved, in the backward."""
    graph_bytes: int = 0
    """For one that enters no block: bytes its maker's kept forward (``keep``) saved for the
    backward that only its autograd graph held, freed with it where it dies (shape 2 of the
    NOTE); a checkpointed maker saves none."""

    @property
    def enters_blocks(self) -> bool:
        """Whether its consumers hold it (shape 1 of the NOTE); else its maker does (shape 2)."""
        return bool(self.consumers)

    @property
    def savers(self) -> tuple[str, ...]:
        """The blocks whose kept forward saves it."""
        return tuple(b for b, options in self.saved_by.items() if "keep" in options)

    @property
    def cachers(self) -> tuple[str, ...]:
        """The blocks whose ``selective`` forward saves it: a maker whose replay's cache holds its
        output (NOTE [ A skip from a block's output ] in ``remat.measure.sides``)."""
        return tuple(b for b, options in self.saved_by.items() if "selective" in options)

    def misplaced(self, blocks: list[str]) -> str | None:
        """What is wrong with where it says it goes among ``blocks`` (in forward order), or None."""
        named = [*self.consumers, *self.saved_by, *filter(None, (self.made_by, self.dies_after, self.saved_after))]
        if unknown := [n for n in named if n not in blocks]:
            return f"names {unknown}, which are not among the profile's blocks (expected names such as {blocks[:2]})"
        if not self.consumers and self.made_by is None:
            return "expected the blocks it enters (consumers) or the block that made it (made_by), got neither"
        if self.made_by is not None and self.consumers and (
                blocks.index(self.made_by) >= blocks.index(self.consumers[0])):
            return (f"is made by {self.made_by!r}, which does not come before the first block it enters "
                    f"({self.consumers[0]!r})")
        holders = {*self.consumers, *filter(None, [self.made_by])}
        if strangers := sorted(set(self.saved_by) - holders):
            return f"is saved by {strangers}, expected only by the blocks that hold it ({sorted(map(str, holders))})"
        if self.graph_bytes and self.consumers:
            return f"holds graph_bytes={self.graph_bytes} and enters blocks; expected graph bytes only on one that enters none"
        if self.made_by is not None and self.dies_after is not None and (
                blocks.index(self.dies_after) <= blocks.index(self.made_by)):
            return f"dies in {self.dies_after!r}, which does not come after {self.made_by!r}, its maker"
        return None
