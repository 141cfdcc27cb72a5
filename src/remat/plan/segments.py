"""Multi-block segments in the cost model: a plan's peak and time when runs of blocks are
recomputed as one unit, nested or not, from the Profile's per-block numbers. Pure: no torch.

# NOTE [ A segment's costs from per-block numbers ]
Write in_j for block j's input bytes, and K/F/B for an option's kept, forward-peak and
backward-peak bytes (keep: Kk, Fk, Bk; recompute: Kr, Fr, Br, and Tr its extra time, one
re-forward); Fs_j is the kept forward's peak up to the block's last saved tensor
(``BlockProfile.stop_peak_bytes``). A checkpoint's kept bytes beyond its input, rng_j = Kr_j - in_j,
are what it stashes, the RNG state (on the CPU; the least rng_j of the profile, with the side inputs
that die in its block back, "fork" below),
plus what the code after the block keeps (a stack's last norm: "extra"), and what the model's
code holds past the block (a handover: not stashed, NOTE [ Handovers in a segment ] in
``remat.plan.segment_estimate``); a segment stashes as much per call. Everything is read off the profile, nothing is measured for segments
(``remat.manual.segments`` is the mechanism, and this is what its frames do):
- the forward of a segment [s..e] is that of recomputed blocks whose inputs, but the first, are
  not kept: block s keeps Kr_s, each later block rng_j, and each runs at its Fr_j;
- its backward starts with the replay, set off where the last block's backward first reads a
  tensor it saved, on top of what that backward made before (Ue, ``BlockProfile.unpack_bytes``:
  PVT's layer copies the transposed gradient that comes in; 8,192 B over before), and with the
  running statistics of its blocks' BatchNorms, which the replay snapshots until it ends
  (``BlockProfile.stats_bytes``; PatchTST's layers, 528 B over before): the items of
  the segment in order, each either a block kept during the replay (it keeps Kk_j, runs at Fk_j)
  or an inner segment, which keeps only its input in_a and runs its blocks without keeping
  anything (an F_0 pass, at most Fr over them; the inner frames it makes hold an RNG state per
  call until the replay ends); the first item shares
  the segment's own input; each replayed call holds one more RNG state while it runs (the replay
  forks the RNG); the last block stops at its last saved tensor (at Fs_e: the rest would only
  make its output), and an inner segment that ends the segment is not run at all (the replay
  stops once its input is kept); where the code after the first block frees more than its
  checkpoint stashes (Kr_s < in_s: diffusers' UNet3D lets its temporal transformer's residual go
  after that transformer's last block), the segment's kept Kr_s has that free and the replayed
  Kk_s has it again, so the backward adds it back once (the replay of that block is then counted
  that much high, on the safe side; a one-block segment measured 27,712 B over before);
- when the replay ends the frame lets go of what it held: the RNG states of its own calls (an
  inner segment's stay with the inner frame until its own replay ends), as far as the outer
  level counts them (not where the code after a block drops more than its checkpoint stashes,
  rng_j = 0: Swin's stage drops the stage before's handover, and a one-block segment over it
  measured 5,056 B over while the model let that state go), and the side inputs its
  calls received, which stay live only where something else holds them (a block before the
  segment, an inner segment not yet replayed, a kept block that saved them);
- then the items' backwards in reverse, without those, and without what the items after them
  stashed (their backwards are over): a kept block j (the last one too) at its Bk_j with what the
  items before it keep, an inner segment by the same rules, one level down. What the code after
  block j keeps counts until block j's backward is over: on the safe side (it is let go just
  before; counted gone, T5's and BART's last encoder block measured 2 KiB over the prediction);
- the live level under all of it is the cost model's (NOTE [ Every peak candidate is a prefix
  sum ]): parameters, what the blocks before the segment keep, the gradients so far; the side
  inputs its blocks receive are held from its forward until its replay ends (NOTE [ A side
  input's extra life ]), and through later forwards where the plain step would have freed them;
- time: what its blocks cost kept (nothing, in a measured profile), and each block of a replay
  runs once per replay it is part of (Tr_j each): a kept block once, an inner segment's blocks
  once in the outer replay's F_0 pass (unless it ends the segment) and then as many times as
  their own replays run them.
So a segment of one block costs what a recomputed block costs in time, but can peak lower than
torch's checkpoint (which holds its stash and its inputs through the block's whole backward), and
the search offers it too. Every candidate is a constant of the segment plus the bytes kept before
it, so a top-level segment is one more option spanning several blocks for the prefix-sum search
(``remat.plan.segment_search``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from remat.errors import InvalidValue
from remat.plan.bounds import FreeOption
from remat.plan.chain import ChainConstraints, chain_constraints
from remat.plan.handovers import Placed, handovers, placed, saved_under
from remat.plan.sides import side_groups, side_inputs
from remat.records import Profile

__all__ = ["SegmentModel", "Tree", "forest", "held_in_forward"]

_TICKS_PER_MS = 1_000_000  # as remat.plan.search: NOTE [ Time in integer ticks ]
_NONE = -(2**62)


@dataclass(frozen=True)
class Tree:
    """A segment and the segments directly inside it (block positions, inclusive)."""

    span: tuple[int, int]
    children: tuple[Tree, ...] = ()

    def spans(self) -> list[tuple[int, int]]:
        return [self.span, *(s for c in self.children for s in c.spans())]


def forest(spans: Sequence[tuple[int, int]], n: int) -> list[Tree]:
    """The top-level segments of ``spans`` with their nested ones; refuses partial overlaps."""
    clean = sorted({(int(a), int(b)) for a, b in spans}, key=lambda s: (s[0], -s[1]))
    for a, b in clean:
        if not 0 <= a <= b < n:
            raise InvalidValue(f"segment ({a}, {b}) is not a span of the {n} blocks")

    def build(lo: int, hi: int, pool: list[tuple[int, int]]) -> tuple[Tree, ...]:
        out, i = [], 0
        while i < len(pool):
            a, b = pool[i]
            inner = [s for s in pool[i + 1 :] if s[0] <= b]
            if any(s[1] > b for s in inner):
                raise InvalidValue(f"segments ({a}, {b}) and {next(s for s in inner if s[1] > b)} "
                                   "overlap without one containing the other")
            out.append(Tree((a, b), build(a, b, inner)))
            i += 1 + len(inner)
        return tuple(out)

    return list(build(0, n - 1, clean))


def held_in_forward(profile: Profile, options: Sequence[str]) -> list[Placed]:
    """The handovers of ``profile`` that the model's code holds when their makers run the forward
    on ``options`` (one per block): those no maker's option saves (NOTE [ Handovers in a segment ]
    in remat.plan.segment_estimate)."""
    return [p for p in placed(profile) if not saved_under(p.record, options[p.maker])]


class SegmentModel:
    """A profile's per-block numbers for segments (NOTE [ A segment's costs from per-block
    numbers ]); None-like when a block offers no ``keep`` or no ``recompute``."""

    def __init__(self, profile: Profile, chain: ChainConstraints | None = None,
                 replayed: Profile | None = None, handed: Sequence[Placed] = ()) -> None:
        """``replayed``: the profile whose ``keep`` numbers a replay runs at, when they differ from
        ``profile``'s; ``handed``: the handovers the model's code holds in a segment's forward
        (NOTE [ Handovers in a segment ] in remat.plan.segment_estimate). A profile with handovers
        is the search's: its chain is each option's own run and ``handed`` its makers' recomputed,
        whatever is passed; ``estimate_segments`` passes a corrected one, without them."""
        self.profile = profile
        if handovers(profile):  # the search's: its moves see each option's own run, without the state
            self.chain = chain_constraints(dataclasses.replace(profile, crossings=side_inputs(profile)))
            handed = held_in_forward(profile, ["recompute"] * len(profile.blocks))
        else:
            self.chain = chain or chain_constraints(profile)
        blocks = profile.blocks
        self.n = n = len(blocks)
        k = [b.options["keep"] for b in (replayed or profile).blocks]
        r = [b.options["recompute"] for b in blocks]
        self.inp = [b.input_bytes for b in blocks]
        self.kk, self.fk, self.bk = [c.kept_bytes for c in k], [c.fwd_peak_bytes for c in k], [c.bwd_peak_bytes for c in k]
        self.fs = [c.fwd_peak_bytes if b.stop_peak_bytes is None else b.stop_peak_bytes for b, c in zip(blocks, k)]
        self.unpack = [b.unpack_bytes for b in blocks]
        self.stats_sum = [0, *itertools.accumulate(b.stats_bytes for b in blocks)]
        self.kr, self.fr, self.br = [c.kept_bytes for c in r], [c.fwd_peak_bytes for c in r], [c.bwd_peak_bytes for c in r]
        self.ms = [c.extra_ms for c in r]
        self.tr = [round(c.extra_ms * _TICKS_PER_MS) for c in r]
        self.rng = [max(0, kr - i) for kr, i in zip(self.kr, self.inp)]
        self._rng_sum = [0, *itertools.accumulate(self.rng)]
        # The RNG state alone: the least any checkpoint stashes; what a block's checkpoint keeps
        # beyond it is the code after the block's (a stack's last norm), whose backward comes first.
        self.handed = handed
        stash = list(self.rng)  # less what the model's code holds from a call on, more what it lets go
        for h in handed:
            stash[h.maker] -= h.size
            if h.dies is not None:
                stash[h.dies] += h.size
        sides = side_groups(profile)
        for nbytes, dies in zip(sides.size_bytes, sides.dies_after):  # off the kept bytes of the block
            if dies is not None:  # it dies in (NOTE [ Where a side input dies ])
                stash[dies] += nbytes
        fork = min([r for r in stash if r > 0], default=0)
        self.fork = [min(fork, max(0, r)) for r in stash]
        # What the outer level counts of a call's stash (rng_j: none where the code's frees outweigh
        # it, as Swin's stage that drops the stage before's handover), which the frame lets go.
        counted = [max(0, min(r, g)) for r, g in zip(stash, self.rng)]
        self.freed = [min(f, c) for f, c in zip(self.fork, counted)]
        self.extra = [c - f for c, f in zip(counted, self.freed)]
        self._fork_sum = [0, *itertools.accumulate(self.fork)]
        self._stash_sum = [0, *itertools.accumulate(counted)]
        skip = [profile.skip_bytes.get(b.name, 0) for b in blocks]
        self.reach = [0] * n  # [s]: the last block a segment from s may end at (no skip inside)
        for s in range(n - 1, -1, -1):
            self.reach[s] = s if s + 1 >= n or skip[s + 1] else self.reach[s + 1]
        for h in handed:  # NOTE [ A segment over where a handover dies ] in remat.plan.segment_estimate
            if h.dies is not None and h.maker < h.dies and not saved_under(h.record, "keep"):
                for s in range(h.dies + 1):
                    self.reach[s] = min(self.reach[s], h.dies - 1)  # no segment holds that block
        self.lead = profile.base_bytes + profile.pre.kept_bytes
        self.gather = profile.gather_bytes
        after = [0] * n  # gradients live at block j's backward start, beyond the parameters'
        acc = profile.post.grad_bytes
        for j in range(n - 1, -1, -1):
            after[j] = acc
            acc += blocks[j].grad_bytes
        self.grads_at = after
        self.sides = sides if side_inputs(profile) else None
        self.uses = [0] * n  # the side-input groups each block receives, as a mask
        self.saves = [0] * n  # those its kept forward saves (a maker's replay saves another: its own output)
        if self.sides is not None:
            for g, (users, savers) in enumerate(zip(self.sides.consumers, self.sides.savers)):
                for j in users:
                    self.uses[j] |= 1 << g
                for j in savers & users:
                    self.saves[j] |= 1 << g

    # --- one segment ---------------------------------------------------------------------------

    def delta(self, held: int, j: int) -> int:
        return self.sides.delta_bytes(held, j) if self.sides is not None else 0

    def free_option(self) -> FreeOption:
        """The extra option of the relaxation that bounds the time of every plan with segments
        (NOTE [ Searching segments ]): per block j, no more kept bytes and no higher a backward
        candidate than j meets inside any segment, and one recompute's ticks."""
        slack = sum(min(0, k) for k in self.kk) + min([0, *(kr - i for kr, i in zip(self.kr, self.inp))])
        need = [self.lead + self.grads_at[j] + self.gather + slack
                + min(self.kk[j] + self.bk[j], self.inp[j] + self.br[j]) for j in range(self.n)]
        return FreeOption(kept=[min(0, k) for k in self.kr], need=need, ticks=list(self.tr))

    def holds(self, s: int, e: int) -> int:
        mask = 0
        for j in range(s, e + 1):
            mask |= self.uses[j]
        return mask

    def stash(self, a: int, b: int) -> int:
        """What the calls of blocks a..b stash in the forward: an RNG state each (as a checkpoint's),
        and what the code after each block keeps; not what the model's code holds (NOTE [ Handovers
        in a segment ] in remat.plan.segment_estimate), which ``kept`` counts."""
        return self._stash_sum[b + 1] - self._stash_sum[a]

    def snapshot(self, a: int, b: int) -> int:
        """What a replay of blocks a..b snapshots until it ends: their BatchNorms' running statistics."""
        return self.stats_sum[b + 1] - self.stats_sum[a]

    def forks(self, a: int, b: int) -> int:
        """The RNG states alone of the calls of blocks a..b."""
        return self._fork_sum[b + 1] - self._fork_sum[a]

    def kept(self, s: int, e: int) -> int:
        """Bytes the segment keeps from its forward until its first block's backward ends."""
        return self.kr[s] + self._rng_sum[e + 1] - self._rng_sum[s + 1]

    def outer(self, s: int, e: int) -> int:
        """The level a top-level segment's backward starts from, above the parameters and what
        the blocks before it keep: its input and every call's stash, less what the model's code
        let go since. Unlike ``kept``, no free by the code after its first block (Kr_s < in_s):
        the replay's keep numbers of that block carry it (NOTE [ A segment's costs from per-block
        numbers ])."""
        return self.inp[s] + self._rng_sum[e + 1] - self._rng_sum[s] - self.gone(s, e)

    def gone(self, s: int, e: int) -> int:
        """What ``kept`` counts that the model's code lets go after the segment's forward and
        before its backward: what its blocks made and a later block's forward drops (NOTE
        [ Handovers in a segment ] in remat.plan.segment_estimate)."""
        return sum(h.size for h in self.handed if s <= h.maker <= e and h.dies is not None and h.dies > e)

    def forward_need(self, s: int, e: int, before: int = 0) -> tuple[int, int]:
        """The segment's highest forward candidate minus what the blocks before it keep, and at
        which block; ``before``: the side-input state before it (NOTE [ Where a side input dies ])."""
        best, at, level, held = _NONE, s, 0, before
        for j in range(s, e + 1):
            value = self.lead + level + self.fr[j] + self.gather
            if self.sides is not None:
                value += self.sides.fwd_delta_bytes(held, j)
            if value > best:
                best, at = value, j
            level += self.kr[s] if j == s else self.rng[j]
            held |= self.uses[j]
        return best, at

    def need(self, tree: Tree, before: int) -> tuple[int, int, str]:
        """(peak candidate minus the bytes kept before the segment, extra ticks, where) of a
        top-level segment with its inner ones; ``before``: the side-input state before it."""
        s, e = tree.span
        fwd, at = self.forward_need(s, e, before)
        peak, ticks, where = self.replay(tree, before)
        bwd = self.lead + self.outer(s, e) + peak
        if fwd >= bwd:
            return fwd, ticks, f"forward of {self.profile.blocks[at].name}"
        return bwd, ticks, where

    def replay(self, tree: Tree, before: int) -> tuple[int, int, str]:
        return _replay(self, tree, before)

    def fz(self, a: int, b: int) -> int:
        """The highest forward candidate of an F_0 pass over blocks a..b, above the level before
        it: the pass keeps the input and, per call, an RNG state; a replayed call holds one more
        while it runs (the replay's fork of the RNG)."""
        return max([self.fr[a] + self.fork[a]]
                   + [self.inp[a] + self.forks(a, j) + self.fr[j] for j in range(a + 1, b + 1)])


def _replay(m: SegmentModel, tree: Tree, before: int) -> tuple[int, int, str]:
    """(peak above the segment's outer level, ticks, where) of ``tree``'s backward: its replay
    and its items' backwards (NOTE [ A segment's costs from per-block numbers ]). The outer level
    is the live level without the gradients: everything kept outside, the segment's input and its
    calls' RNG states included; ``before``: the side-input groups held from outside the frame."""
    s, e = tree.span
    names = m.profile.blocks
    items: list[int | Tree] = []
    j, kids = s, list(tree.children)
    while j <= e:
        if kids and kids[0].span[0] == j:
            items.append(kids[0])
            j = kids.pop(0).span[1] + 1
        else:
            items.append(j)
            j += 1
    ge = m.grads_at[e] + m.delta(before | m.holds(s, e), e) + m.gather + m.unpack[e] + m.snapshot(s, e)
    best, where, ticks = _NONE, "", 0
    level = -m.inp[s]  # what the items before keep; the segment's input is in the outer level
    temp = 0  # the RNG states of the inner frames an F_0 pass makes, gone when the replay ends
    own = 0  # the RNG states of this frame's own calls, let go when its replay ends
    done = 0  # below: what the inner segments and the code after the blocks whose backward is over kept
    before_items: list[tuple[int, int]] = []  # (level, side-input state) before each item's backward
    state = before
    for item in items:  # the replay, forward
        before_items.append((level, state))
        if isinstance(item, Tree):
            a, b = item.span
            if b < e:
                value = ge + level + temp + m.fz(a, b)
                if value > best:
                    best, where = value, f"replay of {names[a].name}..{names[b].name}"
                ticks += sum(m.tr[a : b + 1])
                temp += m.forks(a, b)
            level += m.inp[a]
            state |= m.holds(a, b)
            continue
        value = ge + level + temp + m.fork[item] + (m.fk[item] if item < e else m.fs[item])
        if value > best:
            best, where = value, f"replay of {names[item].name}"
        ticks += m.tr[item]
        level += m.kk[item]
        own += m.freed[item]
        state |= m.saves[item]
    for item, (level, held) in zip(reversed(items), reversed(before_items)):  # the backward, in reverse
        if isinstance(item, Tree):
            peak, t, inner = _replay(m, item, held)
            value, ticks = level + m.inp[item.span[0]] + peak - own - done, ticks + t
            if value > best:
                best, where = value, inner
            done += m.stash(*item.span)
            continue
        g = m.grads_at[item] + m.delta(held | m.saves[item], item) + m.gather
        value = g + level + m.kk[item] + m.bk[item] - own - done
        done += m.extra[item]  # counted as live through the block's own backward: on the safe side
        if value > best:
            best, where = value, f"backward of {names[item].name} (segment {names[s].name}..{names[e].name})"
    return best, ticks, where
