"""The cost model's arithmetic as prefix-sum constraints, the form the solvers search (NOTE [ Every
peak candidate is a prefix sum ]): ``chain_constraints(profile)`` per block and option, with the
state that tensors crossing a block boundary add (``remat.plan.crossings``).
``remat.plan.costmodel.estimate`` replays the same step phase by phase; tests/test_costmodel.py
checks the two equal on random chains. Pure numbers: no torch, no numpy, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from remat.errors import InvalidValue, did_you_mean
from remat.plan.crossings import Crossings
from remat.plan.schedule import phase_bytes, step_phases
from remat.records import OptionCost, Profile
from remat.vocabulary import OPTIONS, STANDS_IN, in_option_order

__all__ = ["ChainConstraints", "chain_constraints"]


# NOTE [ Every peak candidate is a prefix sum ]
# Write K_i for the bytes kept by blocks 1..i under some assignment (K_0 = 0), c_i for block i's
# chosen option, lead = base + pre.kept, and G_{>i} for the grad_bytes of the blocks after i.
# Replaying ``_phases`` gives each candidate as a constant plus K of some prefix:
#   forward of block i   lead + K_{i-1} + fwd_peak(c_i) + gather
#   backward of block i  lead + post.grad + G_{>i} + K_i + bwd_peak(c_i) + gather,
#                        because the backward frees what blocks i+1..n kept and adds their grads;
#                        K_i = K_{i-1} + kept(c_i), so this too is K_{i-1} + a term of (i, c_i)
#   forward/backward of the head   lead + K_n + post.fwd_peak, resp. + post.kept + post.bwd_peak
#   embeddings, optimizer step     constants: everything the blocks kept is freed by then
# So  peak = max(fixed, max_i (K_{i-1} + need_i(c_i)), K_n + tail),  with need_i the larger of the
# block's two terms. Every constraint "peak <= budget" is a bound on a prefix sum: smaller prefixes
# are always at least as good, which is what lets the solvers keep, per prefix, only the states
# that are not dominated, and lets ``suffix_floor_bytes`` compute the lowest peak in one pass.
# tests/test_costmodel.py checks this form against ``estimate`` on random chains.


@dataclass(frozen=True, kw_only=True)
class ChainConstraints:
    """A profile's peak as prefix-sum constraints, per block and option (see NOTE [ Every peak
    candidate is a prefix sum ]). Rows are blocks in forward order, columns are ``options``."""

    options: tuple[str, ...]
    """The options the columns stand for, in ``OPTIONS`` order."""
    kept_bytes: tuple[tuple[int, ...], ...]
    """[block][option]: bytes the block keeps from its forward until its backward."""
    need_bytes: tuple[tuple[int, ...], ...]
    """[block][option]: the block's higher peak candidate (forward or backward) minus the bytes
    kept by the blocks before it."""
    extra_ms: tuple[tuple[float, ...], ...]
    """[block][option]: extra step time of the option, milliseconds."""
    tail_bytes: int
    """The head's higher peak candidate minus the bytes kept by all the blocks."""
    fixed_bytes: int
    """The highest candidate no choice changes (embeddings' forward and backward, optimizer)."""
    holds: tuple[tuple[int, ...], ...] = ()
    """With side inputs (NOTE [ A side input's extra life ]), else empty. [block][option]: the
    side-input groups the option holds, a mask; the state after block i is the union up to it."""
    fwd_need_bytes: tuple[tuple[int, ...], ...] = ()
    """[block][option]: the forward's candidate minus the prefix (side inputs do not change it)."""
    bwd_need_bytes: tuple[tuple[int, ...], ...] = ()
    """[block][option]: the backward's candidate minus the prefix, side inputs as the plain step."""
    delta_bytes: tuple[tuple[int, ...], ...] = ()
    """[block][state]: bytes the held side inputs add to the block's backward."""
    tail_held_bytes: tuple[int, ...] = ()
    """[state]: the head's candidate minus all kept bytes, with that state at the end."""
    fwd_delta_bytes: tuple[tuple[int, ...], ...] = ()
    """[block][state]: bytes held side inputs add to its forward (NOTE [ Where a side input dies ])."""
    kept_delta_bytes: tuple[tuple[int, ...], ...] = ()
    """With handovers that set bits: [block][state] bytes the state adds to the block's kept bytes
    (NOTE [ What crosses a block boundary, as state ] in ``remat.plan.crossings``); else empty."""
    bound: bool = False
    """Whether a handover took no bit of the state (rule 5 of NOTE [ What crosses a block boundary,
    as state ]): the numbers are then upper bounds, and a plan's own estimate may be lower."""
    clears: tuple[int, ...] = ()
    """With handovers that set bits: [block] the bits dropped after it; else empty (none)."""
    runs: tuple[tuple[str, ...], ...] = ()
    """[block][option]: what the block runs for the column, its own option or the one that stands
    in for it (``STANDS_IN`` in remat.vocabulary: ``tiled`` on a block without an MLP is kept);
    empty where every block offers every column's option."""

    def chosen(self, picks: Sequence[int]) -> list[str]:
        """The option each block runs under ``picks``, one column per block."""
        return [self.runs[i][o] if self.runs else self.options[o] for i, o in enumerate(picks)]

    def need_at(self, i: int, o: int, held: int) -> int:
        """Block i's candidate with option o, minus the prefix, in state ``held`` (which includes
        the option's own holds)."""
        if not self.holds:
            return self.need_bytes[i][o]
        return max(
            self.fwd_need_bytes[i][o] + self.fwd_delta_bytes[i][held],
            self.bwd_need_bytes[i][o] + self.delta_bytes[i][held],
        )

    def tail_at(self, held: int) -> int:
        return self.tail_held_bytes[held] if self.holds else self.tail_bytes

    def kept_at(self, i: int, o: int, held: int) -> int:
        """Block i's kept bytes with option o in state ``held`` (as ``need_at``)."""
        return self.kept_bytes[i][o] + (self.kept_delta_bytes[i][held] if self.kept_delta_bytes else 0)

    def entering(self, i: int, o: int, held: int) -> int:
        """The state at block i with option o, from ``held`` before it: with the option's bits."""
        return held | self.holds[i][o] if self.holds else 0

    def leaving(self, i: int, now: int) -> int:
        """The state after block i, from ``now`` at it: its dropped bits cleared."""
        return now & ~self.clears[i] if self.clears else now

    def peak_bytes(self, picks: Sequence[int]) -> int:
        """The peak for one option index per block; equals ``estimate(...).peak_bytes``."""
        assert len(picks) == len(self.kept_bytes)
        peak, prefix, held = self.fixed_bytes, 0, 0
        for i, o in enumerate(picks):
            now = self.entering(i, o, held)
            peak = max(peak, prefix + self.need_at(i, o, now))
            prefix += self.kept_at(i, o, now)
            held = self.leaving(i, now)
        return max(peak, prefix + self.tail_at(held))

    def suffix_floor_bytes(self) -> list[int]:
        """``floors[i]``: the lowest peak blocks i.. and the head can reach with nothing kept before
        block i (and no side input held). A prefix K before block i can still meet budget B only
        if K + floors[i] <= B, since every candidate from there on is K plus a term that holding
        more side inputs never lowers: floors[i] = min over options of max(need_i, kept_i +
        floors[i+1]), and floors[n] = tail. Exact for i = 0."""
        return [row[0] for row in self.suffix_floors()]

    def suffix_floors(self) -> list[list[int]]:
        """[i][state]: ``suffix_floor_bytes`` entering block i in that side-input state."""
        states = len(self.tail_held_bytes) if self.holds else 1
        floors = [[self.tail_at(h) for h in range(states)]]
        for i in range(len(self.kept_bytes) - 1, -1, -1):
            after = floors[-1]
            row = []
            for h in range(states):
                best = None
                for o in range(len(self.options)):
                    now = self.entering(i, o, h)
                    value = max(self.need_at(i, o, now), self.kept_at(i, o, now) + after[self.leaving(i, now)])
                    best = value if best is None else min(best, value)
                assert best is not None
                row.append(best)
            floors.append(row)
        floors.reverse()
        return floors


def chain_constraints(profile: Profile, options: Sequence[str] | None = None) -> ChainConstraints:
    """``profile`` as prefix-sum constraints over ``options`` (default: those every block offers,
    itself or by a stand-in, ``STANDS_IN``)."""
    offered = plannable(profile)
    if options is None:
        options = offered
    not_offered = [o for o in options if o not in offered]
    if not_offered:
        raise InvalidValue(
            f"options {not_offered} are not offered by every block of this profile; expected a "
            f"subset of {list(offered)}{did_you_mean(str(not_offered[0]), offered)}"
        )
    if profile.blocks and not options:
        raise InvalidValue(
            f"the blocks of this {profile.model} profile have no option in common (each offers "
            f"some of {list(OPTIONS)}); re-profile it so that every block offers at least 'keep'"
        )
    names = [b.name for b in profile.blocks]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise InvalidValue(
            f"block name {duplicate!r} appears twice in this profile; expected unique names"
        )
    options = tuple(o for o in OPTIONS if o in options) + tuple(
        o for o in options if o not in OPTIONS
    )
    runs = tuple(tuple(o if o in b.options else STANDS_IN[o] for o in options) for b in profile.blocks)
    for block, row in zip(profile.blocks, runs):
        for o in row:
            if not math.isfinite(block.options[o].extra_ms):
                raise InvalidValue(
                    f"block {block.name!r} option {o!r} has extra_ms={block.options[o].extra_ms}; "
                    "expected a finite number of milliseconds (re-profile the model)"
                )
    columns = [[b.options[row[c]] for b, row in zip(profile.blocks, runs)] for c in range(len(options))]
    runs = runs if any(r != options for r in runs) else ()
    crossings = Crossings(profile, options) if profile.crossings else None
    if crossings is not None:  # NOTE [ What crosses a block boundary, as state ]
        columns = crossings.static(columns)
    fwds, bwds, (tail_fwd, tail_bwd), fixed = _prefix_terms(profile, columns)
    n = len(profile.blocks)
    kept = tuple(tuple(c[i].kept_bytes for c in columns) for i in range(n))
    extra_ms = tuple(tuple(c[i].extra_ms for c in columns) for i in range(n))
    if crossings is None:
        needs = tuple(tuple(max(f, b) for f, b in zip(fr, br)) for fr, br in zip(fwds, bwds))
        return ChainConstraints(
            options=options, kept_bytes=kept, need_bytes=needs, extra_ms=extra_ms,
            tail_bytes=max(tail_fwd, tail_bwd), fixed_bytes=fixed, runs=runs,
        )  # fmt: skip
    t = crossings.tables(fwds, bwds, tail_fwd, tail_bwd)
    if crossings.states == 1:  # no bit: the constants folded in
        kept = tuple(tuple(k + t.kept_delta[i][0] for k in row) for i, row in enumerate(kept))
        return ChainConstraints(options=options, kept_bytes=kept, need_bytes=t.low, extra_ms=extra_ms,
                                tail_bytes=t.tails[0], fixed_bytes=fixed, runs=runs, bound=crossings.pinned)
    moves = any(any(row) for row in t.kept_delta)  # only handovers move kept bytes and clear bits
    return ChainConstraints(
        options=options, kept_bytes=kept, need_bytes=t.low, extra_ms=extra_ms, tail_bytes=t.tails[0],
        fixed_bytes=fixed, holds=t.holds, fwd_need_bytes=tuple(tuple(r) for r in fwds),
        bwd_need_bytes=tuple(tuple(r) for r in bwds), delta_bytes=t.delta, tail_held_bytes=t.tails,
        fwd_delta_bytes=t.fwd_delta, kept_delta_bytes=t.kept_delta if moves else (),
        clears=t.clears if any(t.clears) else (), runs=runs, bound=crossings.pinned,
    )  # fmt: skip


def plannable(profile: Profile) -> tuple[str, ...]:
    """The options a plan may choose for every block of ``profile``: those every block offers, and
    those some block offers that the others run by a stand-in (``STANDS_IN``)."""
    blocks = profile.blocks
    some = {o for b in blocks for o in b.options}
    return in_option_order({o for o in some if all(o in b.options or STANDS_IN.get(o) in b.options for b in blocks)}
                           if blocks else set(OPTIONS))


def _prefix_terms(
    profile: Profile, columns: Sequence[Sequence[OptionCost]]
) -> tuple[list[list[int]], list[list[int]], tuple[int, int], int]:
    """Replay the step (NOTE [ The step's schedule ]) with the blocks' kept bytes left out, as
    NOTE [ Every peak candidate is a prefix sum ] writes it: per block and option column the
    forward and backward candidates minus the prefix kept before it, the head's two (minus all
    blocks' kept bytes), and the highest candidate no choice changes."""
    n = len(profile.blocks)
    needs: list[list[int]] = [[] for _ in range(n)]
    bwds: list[list[int]] = [[] for _ in range(n)]
    tails: list[int] = []
    fixed: list[int] = []
    acts = grads = 0  # live bytes outside what the blocks keep
    for phase in step_phases(n):
        level = profile.base_bytes + acts + grads
        if phase.block is not None:
            terms = []
            for costs in columns:
                kept, transient, _ = phase_bytes(profile, costs, phase)
                own = kept if phase.stage == "backward" else 0  # its backward: its own kept too
                terms.append(level + own + transient)
            (bwds if phase.stage == "backward" else needs)[phase.block] = terms
            if phase.stage == "backward":
                grads += profile.blocks[phase.block].grad_bytes
            continue
        kept, transient, grad = phase_bytes(profile, [], phase)
        (tails if phase.part == "post" else fixed).append(level + transient)
        if phase.stage == "forward":
            acts += kept
        elif phase.stage == "backward":
            acts, grads = acts - kept, grads + grad
    assert len(tails) == 2, "the head runs a forward and a backward"
    return needs, bwds, (tails[0], tails[1]), max(fixed)
