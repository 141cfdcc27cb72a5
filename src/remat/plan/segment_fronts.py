"""The segment search's fronts: per span and side-input state, the Pareto front of (need,
ticks) of a segment over its structures (NOTE [ Searching segments ] in
``remat.plan.segment_search``), with the arithmetic of NOTE [ A segment's costs from per-block
numbers ] (``remat.plan.segments``): as a DP over a segment's items on short chains (every
nesting), and for the flat and two-level families of long chains as arrays over every start and
end at once. Pure: numpy, no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from remat.plan.segments import SegmentModel, Tree

__all__ = ["Fronts", "SegmentMoves"]

_NONE = -(2**62)


class Fronts:
    """Per (span, side-input state): the Pareto front of (need, ticks, tree) of a top-level
    segment over its structures (NOTE [ Searching segments ])."""

    def __init__(self, model: SegmentModel, exact: bool, max_len: int) -> None:
        self.m, self.exact, self.max_len = model, exact, max_len
        self._singles = tuple(Tree((j, j)) for j in range(model.n))
        self.arrays = _Arrays(model)
        self._grads: dict[int, list[int]] = {}
        self._replays: dict[tuple[int, int, int], list[tuple[int, int, Tree]]] = {}
        self._tops: dict[tuple[int, int, int], list[tuple[int, int, Tree]]] = {}
        self._rows: dict[tuple[int, int], SegmentMoves] = {}

    def top(self, s: int, e: int, before: int) -> list[tuple[int, int, Tree]]:
        """The exact search's front of segment [s..e] over every structure (``before``: the
        side-input state before it): (need, replay ticks, tree), fastest first."""
        key = (s, e, before)
        if key not in self._tops:
            m = self.m
            fwd, _ = m.forward_need(s, e, before)
            base = m.lead + m.outer(s, e)
            self._tops[key] = _front2([(max(fwd, base + p), t, tree) for p, t, tree in self.replays(s, e, before)])
        return self._tops[key]

    def moves(self, s: int, before: int, live: list[bool] | None = None) -> SegmentMoves:
        """Every top-level segment from s (side-input state ``before`` before it): each point of
        each span's front, by end, fastest first; ``live[e - s]`` False: span [s..e] is not
        wanted (only read in the exact search, where fronts cost the most)."""
        if self.exact:
            ends = range(s, min(self.m.reach[s] + 1, s + self.max_len))
            points = [(n, t, e, tree) for e in ends if live is None or live[e - s]
                      for n, t, tree in self.top(s, e, before)]
            need, ticks, end = (np.array([[p[i] for p in points]], dtype=np.int64) for i in range(3))
            return self._finish(np.array([s]), before, need, ticks, end, np.ones(need.shape, dtype=bool),
                                trees=[[p[3] for p in points]])[0]
        if (s, before) not in self._rows:
            starts = range(self.m.n) if self.m.sides is None else [s]
            grid = _Grid(self, np.array(starts, dtype=np.int64), before)
            for start, found in zip(starts, grid.moves(self)):
                self._rows[(start, before)] = found
        return self._rows[(s, before)]

    def _finish(self, starts: np.ndarray, before: int, need: np.ndarray, ticks: np.ndarray, end: np.ndarray,
                keep: np.ndarray, *, trees: Sequence[Sequence[Tree]] | None = None,
                kinds: np.ndarray | None = None) -> list[SegmentMoves]:
        """Per row (a start s): the segments among ``keep`` [row, point] that are moves, with
        the bytes they keep, the state after them and their ticks with their blocks' kept
        run. A segment of one block keeps, holds and costs what recompute does: it is a move
        only where its peak is lower."""
        m, a = self.m, self.arrays
        s = starts[:, None]
        end = np.minimum(end, m.n - 1)  # cells past a row's length are not kept
        d = end - s
        spans = np.bitwise_or.accumulate(a.uses[np.minimum(s + np.arange(self.max_len), m.n - 1)], axis=1)
        held = np.take_along_axis(spans, d, axis=1) | before
        rec = m.chain.options.index("recompute")
        alone = np.array([[m.chain.need_at(q, rec, int(h))] for q, h in zip(starts.tolist(), spans[:, 0] | before)],
                         dtype=np.int64).reshape(-1, 1)
        keep = keep & ~((d == 0) & (need >= alone))
        kept = a.kr[s] + a.rng_sum[end + 1] - a.rng_sum[s + 1]  # SegmentModel.kept(s, e)
        total = ticks + a.kept_ticks[end + 1] - a.kept_ticks[s]  # a segment's blocks run kept
        out = []
        for r, q in enumerate(starts.tolist()):
            at = np.flatnonzero(keep[r])
            make: Callable[[int], Tree]
            if trees is not None:
                make = trees[r].__getitem__
            else:
                assert kinds is not None
                make = functools.partial(_family_tree, q, end[r], kinds[r], self._singles)
            out.append(SegmentMoves(need[r, at], total[r, at], end[r, at], kept[r, at], held[r, at], _Trees(make, at)))
        return out

    def _g(self, held: int) -> list[int]:
        """[j]: the gradients and side inputs live at block j's backward with ``held`` held."""
        if held not in self._grads:
            m = self.m
            self._grads[held] = [m.grads_at[j] + m.delta(held, j) + m.gather for j in range(m.n)]
        return self._grads[held]

    def replays(self, s: int, e: int, before: int) -> list[tuple[int, int, Tree]]:
        """The front of (peak above the outer level, ticks, tree) of the backward of [s..e]; each
        partial replay carries its replay peak, its backward peak before the frame lets its own
        RNG states go, and those states (NOTE [ A segment's costs from per-block numbers ])."""
        key = (s, e, before)
        if key in self._replays:
            return self._replays[key]
        m = self.m
        ge = self._g(before | m.holds(s, e))[e] + m.unpack[e] + m.snapshot(s, e)  # from e's first read
        states: dict[int, list[_State]] = {s: [_State(-m.inp[s], 0, _NONE, _NONE, 0, 0, before, ())]}
        for p in range(s, e + 1):
            for st in _front_states(states.pop(p, [])):
                level, t, temp, held = st.level, st.ticks, st.temp, st.held
                g = self._g(held | m.saves[p])[p] + level + m.kk[p] + m.bk[p]
                f = ge + level + temp + m.fork[p] + (m.fk[p] if p < e else m.fs[p])
                states.setdefault(p + 1, []).append(_State(
                    level + m.kk[p], t + m.tr[p], max(st.rp, f), max(st.bp, g + st.cs + m.extra[p]), st.cs + m.extra[p], temp,
                    held | m.saves[p], st.kids))
                for b in range(p, min(e, m.reach[p]) + 1):
                    if (p, b) == (s, e):
                        continue
                    run = b < e
                    f0 = ge + level + temp + m.fz(p, b) if run else _NONE
                    extra = sum(m.tr[p : b + 1]) if run else 0
                    more = m.forks(p, b) if run else 0
                    cs = st.cs + m.stash(p, b)
                    for cp, ct, tree in self.replays(p, b, held):
                        states.setdefault(b + 1, []).append(_State(
                            level + m.inp[p], t + extra + ct, max(st.rp, f0), max(st.bp, level + m.inp[p] + cp + cs),
                            cs, temp + more, held | m.holds(p, b), (*st.kids, tree)))
        gone = m.stash(s, e)  # by each item's backward, all the segment stashed but ``cs`` there
        final = [(max(st.rp, st.bp - gone), st.ticks, Tree((s, e), st.kids)) for st in states.get(e + 1, [])]
        self._replays[key] = result = _front2(final)
        return result


@dataclass(frozen=True)
class SegmentMoves:
    """Segments from one start: per move, its need (NOTE [ Searching segments ]), its ticks, its
    last block, the bytes it keeps, and (``trees[i]``) its structure."""

    need: np.ndarray
    ticks: np.ndarray
    """With the kept time of its blocks."""
    end: np.ndarray
    kept: np.ndarray
    held: np.ndarray
    """The side-input state after it."""
    trees: Sequence[Tree]


class _Trees(Sequence[Tree]):
    """``make(at[i])``, made when read: the search reads only its plan's trees."""

    def __init__(self, make: Callable[[int], Tree], at: np.ndarray) -> None:
        self.make, self.at = make, at

    def __len__(self) -> int:
        return len(self.at)

    @overload
    def __getitem__(self, i: int) -> Tree: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Tree]: ...
    def __getitem__(self, i: int | slice) -> Tree | Sequence[Tree]:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        return self.make(int(self.at[i]))


def _family_tree(s: int, ends: np.ndarray, kinds: np.ndarray, singles: tuple[Tree, ...], j: int) -> Tree:
    """The flat (kind 0) or two-level (kind 1) segment from ``s`` to ``ends[j]``."""
    e = int(ends[j])
    return Tree((s, e), singles[s:e] if kinds[j] else ())


class _Arrays:
    """A segment model's per-block numbers as arrays, and its side-input tables [block, state]."""

    def __init__(self, m: SegmentModel) -> None:
        def arr(x: list[int]) -> np.ndarray:
            return np.array(x, dtype=np.int64).reshape(m.n)

        self.inp, self.kk, self.fk, self.bk, self.fs = arr(m.inp), arr(m.kk), arr(m.fk), arr(m.bk), arr(m.fs)
        self.kr, self.fr, self.tr, self.rng, self.fork = arr(m.kr), arr(m.fr), arr(m.tr), arr(m.rng), arr(m.fork)
        self.extra, self.reach, self.grads_at = arr(m.extra), arr(m.reach), arr(m.grads_at)
        self.unpack = arr(m.unpack)
        self.stats_sum = np.array(m.stats_sum, dtype=np.int64)
        self.uses, self.saves = arr(m.uses), arr(m.saves)
        self.rng_sum = np.concatenate([[0], np.cumsum(self.rng)]).astype(np.int64)
        self.stashed = arr(m.freed) + self.extra  # what a call stashes: ``SegmentModel.stash``
        self.stash_sum = np.concatenate([[0], np.cumsum(self.stashed)]).astype(np.int64)
        keep = m.chain.options.index("keep")
        ms = np.array([row[keep] for row in m.chain.extra_ms], dtype=np.float64).reshape(m.n)
        self.kept_ticks = np.concatenate([[0], np.cumsum(np.rint(ms * 1e6))]).astype(np.int64)
        if m.sides is None:
            self.delta = self.fwd_delta = np.zeros((m.n, 1), dtype=np.int64)
        else:  # the chain's own tables: ``SideGroups.delta_bytes`` and ``fwd_delta_bytes``
            self.delta = np.array(m.chain.delta_bytes, dtype=np.int64).reshape(m.n, -1)
            self.fwd_delta = np.array(m.chain.fwd_delta_bytes, dtype=np.int64).reshape(m.n, -1)


class _Grid:
    """For rows of starts s (side-input state ``before`` before each) and ends e = s + d: the
    forward need (``SegmentModel.forward_need``), the base a replay peak stands on, and the flat
    and two-level segments' replay peaks and ticks, as ``SegmentModel.replay`` computes them one
    tree at a time, here for every end at once (running sums and maxima along d). The flat
    segment keeps every block in its replay; the two-level one replays each block but the last
    as a segment of one: it holds one input per block in the forward and goes down to one input
    per block only while it is replayed (NOTE [ Searching segments ])."""

    def __init__(self, fronts: Fronts, starts: np.ndarray, before: int) -> None:
        m, a = fronts.m, fronts.arrays
        d = np.arange(fronts.max_len, dtype=np.int64)
        s = starts[:, None]
        self.length = np.minimum(a.reach[starts] + 1, starts + fronts.max_len) - starts
        e = np.minimum(s + d[None, :], m.n - 1)  # cells past a row's length are never read

        def col(x: np.ndarray) -> np.ndarray:
            return x[e]

        def before_each(x: np.ndarray, first: int, how: np.ufunc) -> np.ndarray:
            """[r, d]: ``how`` accumulated over the items before d (``first`` at d = 0)."""
            acc = how.accumulate(x, axis=1)
            return np.concatenate([np.full((acc.shape[0], 1), first, dtype=np.int64), acc[:, :-1]], axis=1)

        def g(held: np.ndarray) -> np.ndarray:  # Fronts._g: gradients and side inputs at e's backward
            return col(a.grads_at) + a.delta[e, held] + m.gather

        inp, kk, bk, fk, fs, fr = col(a.inp), col(a.kk), col(a.bk), col(a.fk), col(a.fs), col(a.fr)
        fork, extra, tr, uses, saves = col(a.fork), col(a.extra), col(a.tr), col(a.uses), col(a.saves)
        stash = a.stash_sum[e + 1] - a.stash_sum[s]  # stash(s, e)
        stash_before = a.stash_sum[e] - a.stash_sum[s]  # stash(s, e - 1)
        # the forward: what the segment keeps so far, with the side inputs held so far
        fwd_level = before_each(np.where(d[None, :] == 0, a.kr[s], col(a.rng)), 0, np.add)
        fwd_held = before_each(uses, 0, np.bitwise_or) | before
        self.fwd = np.maximum.accumulate(m.lead + fwd_level + fr + m.gather + a.fwd_delta[e, fwd_held], axis=1)
        self.base = m.lead + a.inp[s] + a.rng_sum[e + 1] - a.rng_sum[s]  # lead + outer(s, e)
        for h in m.handed:
            if h.dies is not None:
                self.base -= h.size * ((s <= h.maker) & (h.maker <= e) & (e < h.dies))
        unpack = col(a.unpack)  # a replay starts at its last block's first read
        ge = g(np.bitwise_or.accumulate(uses, axis=1) | before) + unpack + a.stats_sum[e + 1] - a.stats_sum[s]
        # the flat segment: every block kept in the replay
        level = before_each(kk, 0, np.add) - a.inp[s]
        flat_g = g(before_each(saves, 0, np.bitwise_or) | before | saves)
        last_b = flat_g + level + kk + bk + np.cumsum(extra, axis=1)
        flat_f = before_each(level + fork + fk, _NONE, np.maximum)
        self.flat = np.maximum(ge + np.maximum(flat_f, level + fork + fs),
                               np.maximum.accumulate(last_b, axis=1) - stash)
        ticks = before_each(tr, 0, np.add)
        self.flat_ticks = ticks + tr
        # the two-level segment: each block but the last an inner segment of one
        level = before_each(inp, 0, np.add) - a.inp[s]
        temp = before_each(fork, 0, np.add)
        held = before_each(uses, 0, np.bitwise_or) | before
        stats = a.stats_sum[e + 1] - a.stats_sum[e]  # a segment of one snapshots its block's
        alone = np.maximum(g(held | uses) + unpack + stats - inp + fork + fs, g(held | saves) - inp + kk + bk + extra - col(a.stashed))
        two_b = before_each(level + inp + alone + stash, _NONE, np.maximum)
        two_f = before_each(level + temp + fr + fork, _NONE, np.maximum)
        self.two = np.maximum(ge + np.maximum(two_f, level + temp + fork + fs),
                              np.maximum(two_b, g(held | saves) + level + kk + bk + stash_before + extra) - stash)
        self.two_ticks = 2 * ticks + tr
        self.starts, self.before = starts, before

    def moves(self, fronts: Fronts) -> list[SegmentMoves]:
        """Per row: the front of the flat and the two-level segment of each span (NOTE [
        Searching segments ]) as ``_front2`` keeps it, by end, fastest first."""
        flat = np.maximum(self.fwd, self.base + self.flat)
        two = np.maximum(self.fwd, self.base + self.two)
        tf, tt = self.flat_ticks, self.two_ticks
        d = np.arange(flat.shape[1])[None, :]
        flat_first = (tf < tt) | ((tf == tt) & (flat <= two)) | (d == 0)  # no two-level of one block
        first, second = np.where(flat_first, flat, two), np.where(flat_first, two, flat)
        inside = d < self.length[:, None]
        # [row, d, point]: the two points of each span in ``_front2``'s order, and which it keeps
        rows = flat.shape[0]
        need = np.stack([first, second], axis=2).reshape(rows, -1)
        ticks = np.stack([np.where(flat_first, tf, tt), np.where(flat_first, tt, tf)], axis=2).reshape(rows, -1)
        kinds = np.stack([~flat_first, flat_first], axis=2).astype(np.int64).reshape(rows, -1)
        keep = np.stack([inside, inside & (d > 0) & (second < first)], axis=2).reshape(rows, -1)
        end = np.repeat(self.starts[:, None] + d, 2, axis=1)
        return fronts._finish(self.starts, self.before, need, ticks, end, keep, kinds=kinds)


@dataclass(frozen=True)
class _State:
    """A partial replay: the items of a segment so far (``Fronts.replays``)."""

    level: int
    ticks: int
    rp: int  # the replay's peak so far
    bp: int  # the items' backward peak so far, each candidate plus the RNG states of the inner
    # segments up to it: the frame's own and those of the inner segments after an item are gone
    # by the item's backward, so the peak is bp less all the segment's RNG states
    cs: int  # what the inner segments so far stash, and the code after the kept blocks before
    temp: int  # the RNG states of the inner frames the replay made so far (gone when it ends)
    held: int  # the side-input groups held at the next item's backward
    kids: tuple[Tree, ...]


def _front2(points: list[tuple[int, int, Tree]]) -> list[tuple[int, int, Tree]]:
    """The points no other beats on (value, ticks), fastest first."""
    out: list[tuple[int, int, Tree]] = []
    for p in sorted(points, key=lambda x: (x[1], x[0])):
        if not out or p[0] < out[-1][0]:
            out.append(p)
    return out


def _front_states(states: list[_State]) -> list[_State]:
    """The partial replays no other beats: no more level, ticks, replay peak or inner RNG
    states, no higher a backward peak, and no side-input group held that the other does not hold
    (each only raises what comes after)."""
    out: list[_State] = []
    for st in sorted(states, key=lambda x: (x.ticks, max(x.rp, x.bp), x.level)):
        if not any(o.level <= st.level and o.ticks <= st.ticks and o.rp <= st.rp and o.temp <= st.temp
                   and o.cs <= st.cs and o.bp <= st.bp and o.held & ~st.held == 0
                   for o in out):
            out.append(st)
    return out
