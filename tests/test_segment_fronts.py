"""The segment search's fast paths against the cost model's own arithmetic: the flat and
two-level segments of every span, computed for every start at once (``remat.plan.segment_fronts``),
equal ``SegmentModel.need`` of the same trees one by one, in every side-input state; and the
Pareto front of ``remat.plan.pareto`` equals the sort-and-scan it replaced."""

from __future__ import annotations

import numpy as np
from _tables import chains
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.plan.pareto import DROPPED, undominated
from remat.plan.segment_fronts import Fronts, _front2
from remat.plan.segments import SegmentModel, Tree
from remat.records import Profile


def _segment_ticks(p: Profile, tree: Tree, replay_ticks: int) -> int:
    """A segment's ticks as the search counts them: its replays and its blocks run kept."""
    s, e = tree.span
    return replay_ticks + sum(int(np.rint(p.blocks[j].options["keep"].extra_ms * 1e6)) for j in range(s, e + 1))


@settings(max_examples=60, deadline=None)
@given(chains(max_blocks=14, max_blocks_3=18, sides=True) | chains(max_blocks=10, max_blocks_3=12, handovers=True),
       st.integers(2, 16))
def test_every_start_at_once_is_the_cost_model_one_by_one(p: Profile, max_len: int) -> None:
    """Each span's flat segment (every block kept in its replay) and two-level one (each block
    but the last a segment of one), as the search's moves from every start and state, against
    ``SegmentModel.need`` of those trees: the same need, ticks, kept bytes and state after, and
    exactly the points ``_front2`` keeps of the two, less a one-block segment whose peak is no
    lower than recompute's."""
    if not p.blocks or not {"keep", "recompute"} <= set(p.blocks[0].options):
        return
    m = SegmentModel(p)
    fronts = Fronts(m, exact=False, max_len=max_len)
    rec = m.chain.options.index("recompute")
    states = range(m.sides.masks) if m.sides is not None else [0]
    for h in states:
        for s in range(m.n):
            got = fronts.moves(s, h)
            found = [(int(got.end[i]), int(got.need[i]), int(got.ticks[i]), int(got.kept[i]), int(got.held[i]),
                      got.trees[i]) for i in range(len(got.trees))]
            want = []
            for e in range(s, min(m.reach[s] + 1, s + max_len)):
                trees = [Tree((s, e))] + ([Tree((s, e), tuple(Tree((j, j)) for j in range(s, e)))] if e > s else [])
                points = []
                for tree in trees:
                    need, ticks, _ = m.need(tree, h)
                    points.append((need, _segment_ticks(p, tree, ticks), tree))
                for need, ticks, tree in _front2(points):
                    if e == s and need >= m.chain.need_at(s, rec, h | m.holds(s, s)):
                        continue
                    want.append((e, need, ticks, m.kept(s, e), h | m.holds(s, e), tree))
            assert found == want


@settings(max_examples=40, deadline=None)
@given(chains(max_blocks=5, max_blocks_3=6, sides=True) | chains(max_blocks=5, max_blocks_3=6, handovers=True))
def test_every_replay_of_the_exact_search_is_the_cost_model_one(p: Profile) -> None:
    """The exact search's partial replays (``Fronts.replays``, every tree of a span) against
    ``SegmentModel.replay`` of the same tree: the same peak and ticks."""
    if not p.blocks or not {"keep", "recompute"} <= set(p.blocks[0].options):
        return
    m = SegmentModel(p)
    fronts = Fronts(m, exact=True, max_len=m.n)
    states = range(m.sides.masks) if m.sides is not None else [0]
    for h in states:
        for s in range(m.n):
            for e in range(s, m.reach[s] + 1):
                for peak, ticks, tree in fronts.replays(s, e, h):
                    assert (peak, ticks) == m.replay(tree, h)[:2], tree


def _sort_and_scan(k: np.ndarray, rank: np.ndarray) -> list[int]:
    order = np.lexsort((rank, k))
    r = rank[order]
    keep = np.empty(order.size, dtype=bool)
    keep[0] = r[0] < DROPPED
    keep[1:] = r[1:] < np.minimum.accumulate(r)[:-1]
    return order[keep].tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.booleans()), min_size=1, max_size=40))
def test_the_front_is_the_sort_and_scan(points: list[tuple[int, int, bool]]) -> None:
    """Sorted by (k, rank, position), a point stays when its rank is below every rank before it;
    dropped points never stay; ties in both go to the first."""
    k = np.array([p[0] for p in points], dtype=np.int64)
    rank = np.array([DROPPED if p[2] else p[1] for p in points], dtype=np.int64)
    assert undominated(k, rank).tolist() == _sort_and_scan(k, rank)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([3, 40, 10**6]), st.integers(200, 5000), st.booleans())
def test_the_front_of_many_points_is_the_sort_and_scan(seed: int, spread: int, size: int, low_out: bool) -> None:
    """Past the size where ``undominated`` turns to one stable sort: runs sorted by k (as the
    search's pending plans come), many ties, some dropped (``low_out``: every point of the
    smallest k)."""
    rng = np.random.default_rng(seed)
    runs = [np.sort(rng.integers(0, spread, size // 4)) + rng.integers(0, spread) for _ in range(4)]
    k = np.concatenate(runs).astype(np.int64)
    rank = rng.integers(0, spread, k.size).astype(np.int64)
    rank[rng.random(k.size) < 0.1] = DROPPED
    if low_out:
        rank[k == k.min()] = DROPPED
    assert undominated(k, rank).tolist() == _sort_and_scan(k, rank)
