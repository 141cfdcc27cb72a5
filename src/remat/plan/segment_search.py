"""The search over per-block options and segments together: the fastest plan that fits a budget,
or the lowest peak any plan reaches. Pure: numpy, no torch.

# NOTE [ Searching segments ]
By NOTE [ A segment's costs from per-block numbers ] (``remat.plan.segments``) a top-level
segment [s..e] is, for the prefix-sum search, one more option that spans blocks s..e: it adds its
kept bytes to the prefix, its side-input groups to the state, and one peak candidate (prefix +
its need) and its replay ticks. So the search is the Pareto DP of ``remat.plan.search`` (NOTE [
Pareto DP over prefix kept bytes ]: a partial plan is dropped when another with the same side-
input state keeps no more bytes and is no slower, or as fast with a peak no higher), over
positions 0..n, where the moves out of position q are block q's options (to q + 1) and the
segments that start at q (to e + 1; a segment of block q alone too). The same DP with the peak alone as the objective gives the
lowest peak of any plan.
A segment's own structure (which inner segments its replay uses, nested how deep) only changes
its need and its ticks, which depend on the blocks inside it and the side-input state alone, not
on the rest of the plan. So each (span, state) contributes the Pareto front of (need, ticks) over
its structures, found by the same DP one level down, over the span's items (a block kept in the
replay, or an inner segment, whose own front is found the same way), memoised per span: the rotor
recursion, in Pareto form, with no memory discretised.
What is exact and what is not:
- chains of at most ``EXACT_BLOCKS`` blocks: every top-level segment length, every nesting, so
  the plan is the fastest of all plans of per-block options and laminar families of segments
  (checked against brute force in tests/test_segments_plan.py, and against Revolve's closed form
  on uniform chains);
- longer chains: top-level segments of at most ``max_len`` blocks (16, 8 beyond 128 blocks), each either flat (every block
  kept in its replay) or two-level (its replay recomputes each block but the last as a segment of
  one: it holds one input in the forward and goes down to one input per block only while it is
  replayed); no deeper nesting, so the plan is the fastest of that family (and never slower than
  the per-block optimum, which the solver also computes), not of all schedules;
- on longer chains, a position whose undominated partial plans exceed ``MAX_STATES`` keeps that
  many, spread evenly over the front from the fewest kept bytes to the fastest (so that both
  tight and loose budgets keep candidates); varied chains of 128 blocks and more reach it. The
  solver uses a segment plan only when it is strictly faster than the exact per-block optimum,
  so this makes segments help less, never a plan worse.
A relaxation makes ``solve`` fast without changing what is exact. Give each block one more
option, ``SegmentModel.free_option``: it keeps no more bytes than the block keeps inside any
segment (min(0, Kr_j): a segment keeps at least min(0, Kr_s) and never negative stash bytes), its
candidate is no higher than the lowest one the block meets inside any segment (its backward:
lead + gradients + min(Kk_j + Bk_j, in_j + Br_j), less whatever negative kept bytes and stashes
could lower the levels under it), and it costs one recompute's ticks (every replay recomputes
the block, at least once). Side inputs count as never held (they only add). Any plan with
segments then maps to a relaxed per-block plan (its segments' blocks on the extra option) that
is no slower and no higher anywhere, so the relaxed chain's fastest plan (the exact per-block
search of ``remat.plan.bounds``, on the relaxed table) is no slower than any plan. Without side
inputs its plan, when it uses no extra option, is a real per-block plan: the optimum, and
``solve`` is done with that one search (a GPU's options: offload keeps nothing for less than a
recompute, and segments rarely win). Otherwise ``solve`` searches per-block options alone, and
runs the segment search only if the relaxed optimum is faster than that (with side inputs, only
if the relaxed search with the per-block optimum as its bound keeps a partial plan to the end,
or keeps too many to finish quickly).
The segment search drops every partial plan (and every segment move) whose ticks plus the
relaxed table's bound from where it stands (``Table.bound``) cannot beat the per-block optimum.
With that floor in place the search's memory floors are only the head's (the exact per-position
ones need every span's front, most of the search's cost on long chains); what they no longer cut
the time floor does, or the plan is over the budget and dropped at its end. Both cuts only drop
partial plans that cannot end strictly faster than the per-block optimum, so results the solver
uses are those of the search without them, up to which states the ``MAX_STATES`` cap keeps on
long chains (fewer compete for it).
On a varied chain (one whose exact searches need their bounds, NOTE [ Bounding the search ] in
``remat.plan.bounds``) two exact searches are put off: where the relaxed chain's beam plan uses
the extra option, the exact relaxed search (which could only end the solve with a per-block plan)
is skipped and its bounded table is the floor; and the per-block optimum is bounded from above
by its beam's plan, which the segment search is to beat (a looser time floor than the optimum
itself, so on chains that reach ``MAX_STATES`` other states compete for the cap). When it does,
the exact per-block search runs under the segment plan's ticks (where it is quick), and a
per-block plan that fast wins; when it does not, the exact per-block search runs in full.
For the solve time, every position's moves are arrays: block q's options and the segments from
q against the partial plans there, sorted by K (and by falling time, the time objective): a
move is made only from the prefix it fits and the suffix fast enough, and a later point of one
span's front (as many bytes kept, more ticks, less need) only from the states where the point
before it does not fit (from the others that point beats it: the same plans from 22-33% fewer
partial plans on the 128-block solve-time chains); and the flat and two-level segments of every
span computed for every start at once (``remat.plan.segment_fronts``: the arithmetic of
``SegmentModel.replay``, as running sums and maxima along the span; tests/test_segment_fronts.py
checks it equal, tree by tree). A segment's tree is made only for the plan found.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from remat.plan.chain import ChainConstraints
from remat.plan.pareto import pair_rank, undominated
from remat.plan.search import Table
from remat.plan.segment_fronts import Fronts
from remat.plan.segments import SegmentModel, Tree

__all__ = ["EXACT_BLOCKS", "MAX_STATES", "SegmentResult", "segment_search"]

EXACT_BLOCKS = 10
MAX_STATES = 256
_NO_TICKS = 2**62


@dataclass(frozen=True)
class SegmentResult:
    picks: list[int]
    """Per block: the option index (into ``chain.options``); ``keep`` for blocks in segments."""
    trees: list[Tree]
    """The top-level segments with their nested ones."""
    ticks: int
    peak_bytes: int


def segment_search(
    chain: ChainConstraints, model: SegmentModel, budget_bytes: int, *, objective: str = "time",
    max_len: int | None = None, below_ticks: int | None = None, floor: Table | None = None,
) -> SegmentResult | None:
    """The fastest plan (``objective="time"``) of per-block options and segments whose peak fits
    ``budget_bytes``, or the one with the lowest peak (``"peak"``); None when none fits.
    ``below_ticks``: only plans faster than that are of interest (the per-block optimum's);
    ``floor``: a bounded relaxed table (``Table.bound``: a lower bound on the ticks still to add),
    to drop partial plans that cannot be."""
    n, width = len(chain.kept_bytes), len(chain.options)
    if n == 0 or "keep" not in chain.options or "recompute" not in chain.options:
        return None
    exact = n <= EXACT_BLOCKS
    if max_len is None:  # long chains: shorter top-level segments, for the solve time
        max_len = 16 if n <= 128 else 8
    longest = n if exact else min(n, max_len)
    fronts = Fronts(model, exact, longest)
    keep = chain.options.index("keep")
    ticks = np.rint(np.array(chain.extra_ms, dtype=np.float64).reshape(n, width) * 1e6).astype(np.int64)
    tails = np.array(chain.tail_held_bytes if chain.holds else [chain.tail_bytes], dtype=np.int64)
    states = len(tails)
    if below_ticks is None:
        floor = None  # the time floor prunes against a bound only
    if floor is not None:
        # The time floor prunes; these floors (which would need every span's front) are only
        # the head's, a weaker bound that holds for every state (NOTE [ Searching segments ]).
        floors = np.full((n + 1, states), int(tails.min()), dtype=np.int64)
    else:
        floors = _floors(chain, fronts, states)  # [position, state]
    limit = _NO_TICKS if below_ticks is None else below_ticks
    recompute = np.concatenate([[0], np.cumsum([max(0, t) for t in model.tr])]).astype(np.int64)
    # Per position, the partial plans that reach it, in chunks [7, m]: kept bytes, ticks, peak,
    # side-input state, and where each came from (position, index there, move).
    pending: list[list[np.ndarray]] = [[] for _ in range(n + 1)]
    pending[0].append(np.array([[0], [0], [chain.fixed_bytes], [0], [-1], [0], [0]], dtype=np.int64))
    saved: list[tuple[np.ndarray, ...]] = []
    moves: list[list[tuple[int, _MoveSet]]] = []  # per position: (first move's index, its set)
    for q in range(n + 1):
        if not pending[q]:
            if q == n:
                return None  # every partial plan is over the budget
            saved.append((np.zeros(0, dtype=np.int64),) * 3)
            moves.append([])
            continue  # no plan stops here (segments jump over it)
        K, T, P, H, src, idx, mv = pending[q][0] if len(pending[q]) == 1 else np.concatenate(pending[q], axis=1)
        pending[q] = []
        if q == n:
            break
        # Some finish fits and could win: checked for every move as it is made (below), so here
        # only for the first state.
        hope = None
        if q == 0:
            hope = (K + floors[q, H] <= budget_bytes) & (limit > T) & (budget_bytes >= P)
            if floor is not None:
                hope &= limit > T + floor.bound(q, K)
        alive = _front(K, T, P, H, objective, hope, None if exact else MAX_STATES)
        K, T, P, H = K[alive], T[alive], P[alive], H[alive]
        saved.append((src[alive], idx[alive], mv[alive]))
        table: list[tuple[int, _MoveSet]] = []
        moves.append(table)
        for h in (np.unique(H).tolist() if chain.holds else [0]):  # every move from q, all at once
            sel = np.flatnonzero(h == H) if chain.holds else np.arange(K.size, dtype=np.int64)
            if not sel.size:
                continue
            live = None
            if exact and floor is not None:
                # Replays cost at least their recomputes: a span through which no state here can
                # end faster needs no front (the moves' own check below would drop its moves).
                ends = np.arange(q, min(model.reach[q] + 1, q + longest), dtype=np.int64)
                spans = np.array([model.kept(q, int(e)) for e in ends.tolist()], dtype=np.int64)
                ahead = (int(T[sel].min()) + recompute[ends + 1] - recompute[q]
                         + floor.bound(ends + 1, int(K[sel].min()) + spans))
                live = (ahead < limit).tolist()
            move_set, m_need, m_kept, m_ticks, m_target, m_held = _moves(
                chain, fronts, q, int(h), ticks[q].tolist(), live)
            first_move = sum(m.width + len(m.trees) for _, m in table)
            table.append((first_move, move_set))
            found = _made(K[sel], T[sel], P[sel], (m_need, m_kept, m_ticks, m_target, m_held),
                          budget_bytes - floors[m_target, m_held], budget_bytes, limit,
                          move_set.width if objective == "time" else None, floor)
            if found is None:
                continue
            c, r, cK, cT, cP = found
            goes = m_target[c]
            made = np.stack([cK, cT, cP, m_held[c], np.full(c.size, q), sel[r], first_move + c])
            cuts = [0, *(np.flatnonzero(goes[1:] != goes[:-1]) + 1).tolist(), r.size]
            for lo, hi in itertools.pairwise(cuts):
                pending[int(goes[lo])].append(made[:, lo:hi])
    final = np.maximum(P, K + tails[H] if chain.holds else K + tails[0])
    fits = np.flatnonzero(final <= budget_bytes)
    if not fits.size:
        return None
    order = np.lexsort((K[fits], final[fits], T[fits])) if objective == "time" else np.lexsort((K[fits], T[fits], final[fits]))
    at = int(fits[order[0]])
    best_ticks, best_peak = int(T[at]), int(final[at])
    picks, trees = [keep] * n, list[Tree]()
    q, i, move = int(src[at]), int(idx[at]), int(mv[at])
    while q >= 0:
        first, move_set = next((f, m) for f, m in reversed(moves[q]) if f <= move)
        o, step = move_set.entry(move - first)
        if step is None:
            picks[q] = o
        else:
            trees.append(step)
        q, i, move = int(saved[q][0][i]), int(saved[q][1][i]), int(saved[q][2][i])
    return SegmentResult(picks=picks, trees=sorted(trees, key=lambda t: t.span), ticks=best_ticks, peak_bytes=best_peak)


@dataclass(frozen=True)
class _MoveSet:
    """The moves out of one position in one side-input state: the block's ``width`` options,
    then segments (``trees``)."""

    width: int
    trees: Sequence[Tree]

    def entry(self, i: int) -> tuple[int, Tree | None]:
        """(option, None) for an option's move, (-1, tree) for a segment's."""
        return (i, None) if i < self.width else (-1, self.trees[i - self.width])


def _moves(chain: ChainConstraints, fronts: Fronts, q: int, h: int, ticks: list[int], live: list[bool] | None
           ) -> tuple[_MoveSet, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every move out of position q in side-input state h: block q's options, then the segments
    from q (the points of each span's front; only spans ``live`` says may win), and arrays of
    their need, kept bytes, ticks, target and the state after them."""
    width = len(chain.options)
    rows = []
    for o in range(width):
        held = h | (chain.holds[q][o] if chain.holds else 0)
        rows.append((chain.need_at(q, o, held), chain.kept_bytes[q][o], ticks[o], q + 1, held))
    need, kept, tick, target, after = np.array(rows, dtype=np.int64).T
    seg = fronts.moves(q, h, live)
    columns = (np.concatenate([need, seg.need]), np.concatenate([kept, seg.kept]), np.concatenate([tick, seg.ticks]),
               np.concatenate([target, seg.end + 1]), np.concatenate([after, seg.held]))
    return (_MoveSet(width, seg.trees), *columns)


def _made(K: np.ndarray, T: np.ndarray, P: np.ndarray, move: tuple[np.ndarray, ...], room: np.ndarray,
          budget: int, limit: int, segments_from: int | None, floor: Table | None
          ) -> tuple[np.ndarray, ...] | None:
    """The partial plans made from the states (K, T, P) of one position and side-input state,
    sorted by K, by ``move``'s columns (need, kept, ticks, target, state after): those that fit
    (their peak, and the least a finish adds, ``room`` per move: the budget less it) and could
    still end below ``limit``. Per plan, by move, then state: its move and state indices, kept
    bytes, ticks and peak; None when none. The states' peaks fit already, so a move
    fits from a prefix of them. ``segments_from`` (the time objective: the states' T falls along
    K, as on a front by time; the index of the first segment move): only a suffix of those is
    fast enough, and a later point of one span's front (the same end: the same bytes kept, more
    ticks, less need) is made only from the states where the point before it does not fit, for
    from the others that point beats it. Only those cells are made."""
    need, kept, ticks, target, _ = move
    hi = np.searchsorted(K, np.minimum(budget - need, room - kept), side="right")
    if segments_from is None:
        lo = np.zeros_like(hi)
    else:
        lo = np.searchsorted(-T, ticks - limit, side="right")
        later = np.zeros(need.size, dtype=bool)
        later[segments_from + 1 :] = target[segments_from + 1 :] == target[segments_from:-1]
        if later.any():
            at = np.flatnonzero(later)
            lo[at] = np.maximum(lo[at], np.searchsorted(K, budget - need[at - 1], side="right"))
    counts = np.maximum(hi - lo, 0)
    total = int(counts.sum())
    if not total:
        return None
    c = np.repeat(np.arange(counts.size), counts)
    r = np.arange(total) - np.repeat(np.cumsum(counts) - counts - lo, counts)
    Kr = K[r]
    cK, cT = Kr + kept[c], T[r] + ticks[c]
    ok = None if segments_from is not None else cT < limit
    if floor is not None:
        fast = cT + floor.bound(target[c], cK) < limit
        ok = fast if ok is None else ok & fast
    if ok is not None:
        at = np.flatnonzero(ok)
        if not at.size:
            return None
        if at.size < total:
            c, r, Kr, cK, cT = c[at], r[at], Kr[at], cK[at], cT[at]
    return c, r, cK, cT, np.maximum(P[r], Kr + need[c])


def _floors(chain: ChainConstraints, fronts: Fronts, states: int) -> np.ndarray:
    """[q][state]: the lowest peak blocks q.. and the head reach with nothing kept before q, with
    segments (as ``ChainConstraints.suffix_floors`` without them): a partial plan keeping K before
    q can still fit budget B only if K + floors[q, H] <= B."""
    n = len(chain.kept_bytes)
    floors = np.zeros((n + 1, states), dtype=np.int64)
    floors[n] = [chain.tail_at(h) for h in range(states)]
    for q in range(n - 1, -1, -1):
        for h in range(states):
            best = min(max(chain.need_at(q, o, now := h | (chain.holds[q][o] if chain.holds else 0)),
                           k + int(floors[q + 1, now]))
                       for o, k in enumerate(chain.kept_bytes[q]))
            seg = fronts.moves(q, h)
            if seg.need.size:
                best = min(best, int(np.maximum(seg.need, seg.kept + floors[seg.end + 1, seg.held]).min()))
            floors[q, h] = best
    return floors


def _front(K: np.ndarray, T: np.ndarray, P: np.ndarray, H: np.ndarray, objective: str, hope: np.ndarray | None,
           cap: int | None) -> np.ndarray:
    """Indices of the hopeful partial plans (``hope``; None: all) no other with the same state H
    dominates (NOTE [ Searching segments ]), by state, then K; at most ``cap`` per state, spread
    over the front."""
    if hope is not None and not hope.all():
        part = np.flatnonzero(hope)
        return part[_front(K[part], T[part], P[part], H[part], objective, None, cap)] if part.size else part
    if H.size and int(H.min()) != int(H.max()):
        parts = [np.flatnonzero(h == H) for h in np.unique(H).tolist()]
        return np.concatenate([p[_front(K[p], T[p], P[p], H[p], objective, None, cap)] for p in parts])
    first, second = (T, P) if objective == "time" else (P, T)
    chosen = undominated(K, pair_rank(first, second))
    if cap is not None and chosen.size > cap:  # sorted by K: a spread from both ends
        chosen = chosen[_spread(chosen.size, cap)]
    return chosen


def _spread(size: int, cap: int) -> np.ndarray:
    """``cap`` (> 1) indices spread evenly over 0..size-1 (size > cap), both ends included: steps
    over 1, so no two the same."""
    return np.rint(np.arange(cap) * ((size - 1) / (cap - 1))).astype(np.int64)
