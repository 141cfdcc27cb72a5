"""Side inputs in the cost model: how long each lives under a plan, against the plain step.

# NOTE [ A side input's extra life ]
A side input is a crossing that enters blocks (shape 1 of NOTE [ Tensors that cross a block
boundary ] in ``remat.records``). A profile's numbers are those of the plain step: a side input dies at the end of the forward (inside the head's forward), or, when a kept consumer saves
it, at the backward of the first such block. Under a plan it dies at the backward of the first
block, in forward order, that *holds* it: a ``recompute`` or ``selective`` consumer whose forward
saves something (a checkpoint holds its inputs until its backward through what it saves:
``BlockProfile.saves``), or a ``keep`` consumer that saves it. A segment holds the inputs of its
blocks when any of them saves. Offloaded blocks hold
only host copies. So a plan adds the side input's bytes to the live level of every backward phase
of block j >= that first holder, and of the head's backward; it takes them away where the plain
step held it and the plan does not (a saving block offloaded). In the head's forward, where the
plain step frees it part way, the plan's peak is the one measured with it held
(``Profile.post_fwd_peak_held_bytes``, from the step with every block recomputed).
Side inputs with the same consumers and savers live and die together: they form one *group*, and
a plan's state is the set of groups held so far, a bit mask over forward order. Every quantity the
solvers need depends on the blocks before block j only through that mask, so the exact search
carries it, with the handovers' bits (NOTE [ What crosses a block boundary, as state ] in
``remat.plan.crossings``). Pure: no torch.

# NOTE [ Where a side input dies ]
Not every side input lives to the head: one a block makes and hands to the blocks after it dies
where its stack's loop ends (T5's first layer makes the relative position bias; it dies with the
encoder). The profile says so (``Crossing.dies_after``, the block in whose forward phase the
plain step frees it), and its numbers are stated as if every run freed it there (the runs with
every block checkpointed hold it instead: ``remat.measure.attribution`` takes it off that block's
kept bytes). Held by a plan, it then adds its bytes to the forward of every block after that one
and to the head's forward, as well as to the backward phases as above. Its consumers all run by
then, so whether it is held is known from the state before the block.

# NOTE [ A side input the model's code saves ]
The model's code between the blocks, or the head after them, may save a side input for its own
backward: simple-hierarchical-transformer's loss compares the latent dynamics' predictions with
the tokens they took. Every plan then holds it through that code's backward (in the backward
phase of the block after it, or the head's), and a consumer that holds it longer adds it only to
the backward phases before its own. Read as freed in the head's forward, every plan that
recomputed such a consumer was predicted its bytes high there (on that model 393,216 B at the
head's backward, its floor 3.4% above torch's checkpoint on the same blocks; tests/test_crossings.py).
``Crossing.saved_after`` says after which block the code saves it, noted by the saving step.
Where the head's code saves it, the head's backward frees it part way, and its peak may come
after: held past it by a checkpoint, that peak is higher, as the step with every block recomputed
measured (``Profile.post_bwd_peak_held_bytes``): CoCa-pytorch's pooled image tokens, which its
contrastive loss saves and its cross-attention blocks take, measured 33,792 B over in every plan
that recomputed the first of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.crossing import Crossing
from remat.records import Profile

__all__ = ["HOLDING", "SideGroups", "group_sides", "saves_as_kept", "side_groups", "side_inputs"]

#: The options whose block holds every input until its backward (a checkpoint's inputs).
HOLDING = frozenset({"recompute", "selective"})


def saves_as_kept(option: str) -> bool:
    """Whether a block on ``option`` saves the side inputs its kept forward saves: ``keep``,
    ``tiled`` (only its MLP differs), and a compiled block (measured so: ``remat.measure.compiled``)."""
    return option in ("keep", "tiled") or option.startswith("compiled:")


@dataclass(frozen=True, kw_only=True)
class SideGroups:
    """A profile's side inputs as groups (NOTE [ A side input's extra life ])."""

    size_bytes: tuple[int, ...]
    """[group]: bytes of the group's side inputs together."""
    consumers: tuple[frozenset[int], ...]
    """[group]: the blocks (forward positions) they enter."""
    savers: tuple[frozenset[int], ...]
    """[group]: the consumers whose kept forward saves them."""
    post_held_extra_bytes: int
    """How much higher the head's forward peaks when the side inputs are held through it."""
    post_bwd_held_extra_bytes: int = 0
    """How much higher the head's backward peaks when the side inputs the head's code saves are
    held past it (NOTE [ A side input the model's code saves ])."""
    head_saved: frozenset[int] = frozenset()
    """The groups the head's code saves (``Crossing.saved_after`` the last block)."""
    dies_after: tuple[int | None, ...] = ()
    """[group]: the block (forward position) in whose forward the plain step frees them, or None
    (NOTE [ Where a side input dies ]); empty: None for every group."""
    unsaving: frozenset[int] = frozenset()
    """The blocks (forward positions) whose forward saves nothing: a checkpoint of one holds
    none of its inputs (``BlockProfile.saves``)."""
    cachers: tuple[frozenset[int], ...] = ()
    """[group]: the blocks whose ``selective`` forward saves them (``Crossing.cachers``); empty:
    none for every group."""
    saved_after: tuple[int | None, ...] = ()
    """[group]: the block (forward position) after which the model's code saves them, or None
    (NOTE [ A side input the model's code saves ]); empty: None for every group."""

    def _dies(self, g: int) -> int | None:
        return self.dies_after[g] if self.dies_after else None

    def fwd_delta_bytes(self, held: int, block: int | None) -> int:
        """Bytes live at the start of ``block``'s forward (None: the head's) with ``held`` held,
        over what the plain step has live there: the held groups it freed in an earlier block's
        forward (NOTE [ Where a side input dies ])."""
        return sum(
            b
            for g, b in enumerate(self.size_bytes)
            if held >> g & 1
            and (d := self._dies(g)) is not None
            and (block is None or d < block)
        )

    @property
    def masks(self) -> int:
        """The number of states: every subset of the groups."""
        return 1 << len(self.size_bytes)

    def holds(self, block: int, option: str) -> int:
        """The groups ``option`` at ``block`` holds until the block's backward, as a mask."""
        mask = 0
        checkpoint = option in HOLDING and block not in self.unsaving
        for g, (users, savers) in enumerate(zip(self.consumers, self.savers)):
            cached = option == "selective" and bool(self.cachers) and block in self.cachers[g]
            if (checkpoint and block in users) or (block in savers and saves_as_kept(option)) or cached:
                mask |= 1 << g
        return mask

    def code_held(self, block: int | None) -> int:
        """The groups the model's code holds at ``block``'s backward (None: the head's), under every
        plan (NOTE [ A side input the model's code saves ])."""
        mask = 0
        for g, after in enumerate(self.saved_after):
            if after is not None and (block is None or block > after):
                mask |= 1 << g
        return mask

    def plain_held(self, block: int | None) -> int:
        """The groups the plain step holds at ``block``'s backward (None: the head's backward)."""
        mask = self.code_held(block)
        for g, savers in enumerate(self.savers):
            if savers and (block is None or block >= min(savers)):
                mask |= 1 << g
        return mask

    def delta_bytes(self, held: int, block: int | None) -> int:
        """Bytes live at the start of ``block``'s backward (None: the head's) with ``held`` held,
        over what the plain step has live there."""
        held |= self.code_held(block)
        plain = self.plain_held(block)
        return sum(b for g, b in enumerate(self.size_bytes) if held >> g & 1) - sum(
            b for g, b in enumerate(self.size_bytes) if plain >> g & 1
        )

    def post_bwd_extra_bytes(self, held: int) -> int:
        """How much higher the head's backward peaks with ``held`` held past it: what is live at its
        start over the plain step (``delta_bytes``), and the groups the head's code saves, which its
        backward frees part way in the plain step."""
        longer = sum(b for g, b in enumerate(self.size_bytes) if held >> g & 1 and g in self.head_saved)
        return min(self.post_bwd_held_extra_bytes, longer) + self.delta_bytes(held, None)

    def post_fwd_extra_bytes(self, held: int) -> int:
        """How much higher the head's forward peaks with ``held`` held past the forward."""
        longer = sum(
            b
            for g, b in enumerate(self.size_bytes)
            # the plain step frees these in the head
            if held >> g & 1 and not self.savers[g] and not self.code_held(None) >> g & 1 and self._dies(g) is None
        )
        return min(self.post_held_extra_bytes, longer) + self.fwd_delta_bytes(held, None)


def side_groups(profile: Profile) -> SideGroups:
    """The side inputs of ``profile`` grouped by consumers, savers and death, in first-seen order."""
    sides = side_inputs(profile)
    return group_sides(
        sides,
        [b.name for b in profile.blocks],
        unsaving=frozenset(i for i, b in enumerate(profile.blocks) if not b.saves),
        post_held_extra_bytes=max(0, profile.post_fwd_peak_held_bytes - profile.post.fwd_peak_bytes) if sides else 0,
        post_bwd_held_extra_bytes=max(0, profile.post_bwd_peak_held_bytes - profile.post.bwd_peak_bytes) if sides else 0,
    )


def group_sides(
    sides: list[Crossing], names: list[str], *, unsaving: frozenset[int], post_held_extra_bytes: int = 0,
    post_bwd_held_extra_bytes: int = 0,
) -> SideGroups:
    """``sides`` (crossings that enter blocks) grouped by consumers, savers and death, in
    first-seen order; ``names`` the blocks in forward order, ``unsaving`` (positions) those whose
    forward saves nothing. The cost model's groups, and the ones attribution reads a run against."""
    index = {name: i for i, name in enumerate(names)}
    groups: dict[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], str | None, str | None], int] = {}
    for side in sides:  # they live and die together
        together = (tuple(side.consumers), side.savers, side.cachers, side.dies_after, side.saved_after)
        groups[together] = groups.get(together, 0) + side.size_bytes
    return SideGroups(
        size_bytes=tuple(groups.values()),
        consumers=tuple(frozenset(index[n] for n in users if n in index) for users, *_ in groups),
        savers=tuple(frozenset(index[n] for n in savers if n in index) for _, savers, *_ in groups),
        cachers=tuple(frozenset(index[n] for n in cachers if n in index) for _, _, cachers, *_ in groups),
        dies_after=tuple(index.get(d) if d is not None else None for _, _, _, d, _ in groups),
        saved_after=tuple(index.get(a) if a is not None else None for *_, a in groups),
        unsaving=unsaving,
        post_held_extra_bytes=post_held_extra_bytes,
        post_bwd_held_extra_bytes=post_bwd_held_extra_bytes,
        head_saved=frozenset(g for g, (*_, after) in enumerate(groups) if names and after == names[-1]),
    )


def side_inputs(profile: Profile) -> list[Crossing]:
    """The crossings of ``profile`` that enter blocks: its consumers hold them."""
    return [c for c in profile.crossings if c.enters_blocks]
