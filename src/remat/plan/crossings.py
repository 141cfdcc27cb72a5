"""Tensors that cross a block boundary, as the state of the prefix-sum searches: side-input groups
and handovers by one rule. Pure numbers: no torch.

# NOTE [ What crosses a block boundary, as state ]
NOTE [ Every peak candidate is a prefix sum ] (``remat.plan.chain``) lets a search carry, per
partial plan, only the bytes kept so far (K). A tensor that crosses a block boundary ties the
numbers of one block to the option of an earlier one; the search then also carries a small state,
a bit mask, and every number of block i depends on the blocks before it only through K and that
mask. The rule, for both kinds:
1. A bit is set by the option of the block that decides it: a side-input group's by the first
   block whose option holds it (NOTE [ A side input's extra life ] in ``remat.plan.sides``); a
   handover's (shape 2 of NOTE [ Tensors that cross a block boundary ] in ``remat.crossing``) by
   its maker: bits that count up through the values of what its death leaves held under the
   maker's options (``held_under``: itself when saved, less its graph when kept; one bit for two
   values, two for three), one for "its option offloads it". Where the maker's options all agree
   there is no bit: the value is a constant.
2. A bit lives while it can still move a number: a side-input group's and a handover's that dies
   in the head to the end of the forward; one that dies in block k's forward is dropped after
   block k (``clears``), so BLOOM's and x-transformers' one handover per layer cost two bits at a
   time, not two per layer. Handovers alive at the same block get different bits; after one is
   dropped its bits serve a later one.
3. Per block and state the bits add bytes to the block's kept bytes, its forward candidate and
   its backward candidate; per state, to the head's candidate. Against each option's own run
   (where the maker ran the same option), a handover of size s that dies in block k moves k's
   kept bytes by (held under the maker's option - held under k's), and k's forward by s when the
   maker offloads it; one that dies in the head moves the backward of every block from its maker
   on by (held under the maker's - held under that block's option), and the head as
   ``remat.plan.handovers`` says. The part that depends on the block's own option alone is folded
   into its numbers (``static``), the part of the maker's bits is the state's.
4. A bit set never lowers a number (a held side input, a saved or offloaded handover only add),
   and the lowest state adds nothing (a handover's lowest value, below 0 where a kept graph dies
   with it, is in the static columns), so the lowest state is a lower bound for every state: the
   floors, bounds and relaxations of the searches rely on it (the bounded search lost the plan
   it had found where a state added a graph's negative bytes).
5. Handovers take at most ``HANDOVER_BITS`` bits at a time; one that finds too few free takes
   none, and reads as the most held and offloaded wherever an option of its maker does either
   (pinned): by rule 4 the highest its numbers can be, so a plan the search finds fits is never
   predicted under its cost (``estimate`` prices the plan itself), and the floor named is the
   lowest of the plans ``estimate`` prices (``remat.plan.costmodel.priced_picks``), each a plan
   ``solve`` returns where the search finds none. BS-RoFormer hands the outputs
   of its 65 band-split MLPs to the code after the last of them, all alive together: the search
   asked for 2**65 states and crashed (OverflowError).
``remat.plan.costmodel.estimate`` applies the same rule to one plan (``handed_over``, the side
groups' methods); tests/test_costmodel.py checks the two forms equal on random chains with both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from remat.plan.handovers import OFFLOADS, held_under, placed
from remat.plan.sides import SideGroups, side_groups
from remat.records import OptionCost, Profile

__all__ = ["HANDOVER_BITS", "Crossings", "StateTables"]

HANDOVER_BITS = 10
"""The most bits handovers take at a time (rule 5): 1,024 states times the side groups'."""

Rows: TypeAlias = Sequence[Sequence[int]]
Table: TypeAlias = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class _Field:
    """A number of a handover that its maker's option decides (rule 1): per chain option its value,
    and the state bits that say which of its values holds (none: a constant), or ``pinned`` (rule
    5). The bits count up through its values from the lowest."""

    values: tuple[int, ...]
    bits: tuple[int, ...] = ()
    pinned: bool = False

    @functools.cached_property
    def levels(self) -> list[int]:
        """Its values, each once, lowest first: the bits count through them."""
        return sorted(set(self.values))

    @property
    def low(self) -> int:
        """Its lowest value, which the static columns hold (rule 4: a graph's bytes make one below 0)."""
        return self.levels[0]

    def read(self, state: int) -> int:
        if self.pinned or not self.bits:
            return self.levels[-1]
        k = sum((state >> b & 1) << n for n, b in enumerate(self.bits))
        return self.levels[min(k, len(self.levels) - 1)]

    def sets(self, o: int) -> int:
        """The bits the maker's option ``o`` sets."""
        k = self.levels.index(self.values[o])
        return sum((k >> n & 1) << b for n, b in enumerate(self.bits))

    @property
    def mask(self) -> int:
        return sum(1 << b for b in self.bits)


@dataclass(frozen=True)
class _Handed:
    """One handover in the state (rule 1): its maker, the block it dies in (None: the head), what
    its death leaves held and what its maker copies to the host, per the maker's option."""

    maker: int
    dies: int | None
    holds: _Field
    copies: _Field
    kept_holds: int
    """What ``keep``'s run holds: the run the head's numbers come from."""

    def mine(self, state: int) -> int:
        return self.holds.read(state)

    def copied(self, state: int) -> int:
        return self.copies.read(state)

    def sets(self, o: int) -> int:
        """The bits the maker's option ``o`` sets."""
        return self.holds.sets(o) | self.copies.sets(o)

    @property
    def bits(self) -> int:
        return self.holds.mask | self.copies.mask


@dataclass(frozen=True, kw_only=True)
class StateTables:
    """The state columns of ``ChainConstraints`` (NOTE [ What crosses a block boundary, as state ])."""

    holds: Table
    """[block][option]: the bits the option sets."""
    clears: tuple[int, ...]
    """[block]: the bits dropped after the block."""
    kept_delta: Table
    """[block][state]: bytes the state adds to the block's kept bytes."""
    fwd_delta: Table
    """[block][state]: bytes the state adds to the block's forward candidate."""
    delta: Table
    """[block][state]: bytes the state adds to the block's backward candidate."""
    tails: tuple[int, ...]
    """[state]: the head's candidate minus every block's kept bytes."""
    low: Table
    """[block][option]: the block's candidate in the lowest state it can be in (its own bits)."""


class Crossings:
    """A profile's side-input groups and handovers as state bits over the chain's ``options``."""

    def __init__(self, profile: Profile, options: Sequence[str]) -> None:
        self.sides: SideGroups = side_groups(profile)
        self.options = tuple(options)
        self.n = len(profile.blocks)
        self.side_mask = self.sides.masks - 1
        handed: list[_Handed] = []
        free_after: list[int] = []  # per bit above the side groups': the last block that uses it

        def field(values: tuple[int, ...], maker: int, dies: int | None) -> _Field:
            """``values`` with bits free from ``maker`` until ``dies`` to tell them apart (rule 2):
            none when they agree (rule 1), pinned when too few are free (rule 5)."""
            width = (len(set(values)) - 1).bit_length()
            free = [b for b, last in enumerate(free_after) if last < maker]
            free += range(len(free_after), len(free_after) + width - len(free))
            if width == 0 or free[width - 1] >= HANDOVER_BITS:
                return _Field(values, pinned=width > 0)
            for b in free[:width]:
                free_after[b:b + 1] = [self.n if dies is None else dies]
            return _Field(values, tuple(len(self.sides.size_bytes) + b for b in free[:width]))

        for p in sorted(placed(profile), key=lambda p: p.maker):
            maker, dies, h = p.maker, p.dies, p.record
            assert dies is None or dies > maker, f"a handover dies after its maker: {h}"
            holds = field(tuple(held_under(h, o) for o in options), maker, dies)
            copies = field(tuple(p.size * (o in OFFLOADS) for o in options), maker, dies)
            handed.append(_Handed(maker=maker, dies=dies, holds=holds, copies=copies,
                                  kept_holds=held_under(h, "keep")))
        self.handed = handed
        self.states = self.sides.masks << len(free_after)
        self.pinned = any(h.holds.pinned or h.copies.pinned for h in handed)
        """Whether a handover took no bit (rule 5)."""

    def static(self, columns: Sequence[Sequence[OptionCost]]) -> list[list[OptionCost]]:
        """The option columns with rule 3's part of each block's own option folded in."""
        kept = [[0] * self.n for _ in columns]
        bwd = [[0] * self.n for _ in columns]
        for h in self.handed:
            for o in range(len(columns)):
                if h.dies is not None:
                    kept[o][h.dies] -= h.holds.values[o] - h.holds.low
                else:
                    for b in range(h.maker, self.n):
                        bwd[o][b] -= h.holds.values[o] - h.holds.low
        return [[dataclasses.replace(c, kept_bytes=c.kept_bytes + kept[o][i],
                                     bwd_peak_bytes=c.bwd_peak_bytes + bwd[o][i]) for i, c in enumerate(col)]
                for o, col in enumerate(columns)]

    def tables(self, fwds: Rows, bwds: Rows, tail_fwd: int, tail_bwd: int) -> StateTables:
        """The state columns from the replay's forward and backward candidates per [block][option]
        (of ``static``'s columns) and the head's two."""
        sides, n, states = self.sides, self.n, range(self.states)
        width = len(self.options)
        holds = [[sides.holds(i, o) for o in self.options] for i in range(n)]
        clears = [0] * n
        kept = [[0] * self.states for _ in range(n)]
        fwd = [[sides.fwd_delta_bytes(s & self.side_mask, i) for s in states] for i in range(n)]
        bwd = [[sides.delta_bytes(s & self.side_mask, i) for s in states] for i in range(n)]
        tail_f = [tail_fwd + sides.post_fwd_extra_bytes(s & self.side_mask) for s in states]
        tail_b = [tail_bwd + sides.post_bwd_extra_bytes(s & self.side_mask) for s in states]
        for h in self.handed:
            for o in range(width):
                holds[h.maker][o] |= h.sets(o)
            for s in states:
                mine, copied = h.mine(s), h.copied(s)
                over = mine - h.holds.low  # rule 4: what the state adds is never below 0
                if h.dies is not None:
                    kept[h.dies][s] += over
                    fwd[h.dies][s] += copied
                    bwd[h.dies][s] += over  # its backward holds its own kept bytes
                    continue
                for b in range(h.maker, n):
                    bwd[b][s] += over
                moved = mine - h.kept_holds
                tail_f[s] += max(0, moved) + copied  # freed in the head, maybe after its peak
                tail_b[s] += moved
            if h.dies is not None:
                clears[h.dies] |= h.bits
        tails = tuple(max(f, b) for f, b in zip(tail_f, tail_b))
        low = tuple(tuple(max(f + fwd[i][h], b + bwd[i][h]) for f, b, h in zip(fwds[i], bwds[i], holds[i]))
                    for i in range(n))
        return StateTables(holds=_table(holds), clears=tuple(clears), kept_delta=_table(kept),
                           fwd_delta=_table(fwd), delta=_table(bwd), tails=tails, low=low)

def _table(rows: Sequence[Sequence[int]]) -> Table:
    return tuple(tuple(r) for r in rows)
