"""Pareto fronts of partial plans, for the searches of ``remat.plan.search`` and
``remat.plan.segment_search``: a pair of criteria packed into one rank, and the points no other
beats on (bytes kept, rank). Pure: numpy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DROPPED", "pair_rank", "undominated"]

DROPPED = 2**63 - 1
"""The rank of a partial plan that is out."""
_SMALL = 200  # points below which the two-key sort is the faster front (timed on 50..2000)


def pair_rank(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Per element, an int64 below ``DROPPED`` that orders like the pair (first, second), equal
    pairs equal: the pair packed into one number when its ranges allow (one sort less), else its
    dense rank."""
    f_low, s_low = int(first.min()), int(second.min())
    s_span = int(second.max()) - s_low + 1
    if (int(first.max()) - f_low + 1) * s_span < DROPPED:
        return (first - f_low) * s_span + (second - s_low)
    by = np.lexsort((second, first))
    fs, ss = first[by], second[by]
    step = np.empty(by.size, dtype=bool)
    step[0] = True
    step[1:] = (fs[1:] != fs[:-1]) | (ss[1:] != ss[:-1])
    rank = np.empty(by.size, dtype=np.int64)
    rank[by] = np.cumsum(step)
    return rank


def undominated(k: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Indices, by increasing k, of the points no other beats: no more k and a lower rank, or the
    same k and rank and earlier; ranks ``DROPPED`` never stay. What ``np.lexsort((rank, k))``
    and a running minimum give, with one stable sort by k: a point below every rank before it
    (smaller k, or the same k and earlier) stays unless a later point of its k does too (that
    one is lower still). Partial plans often come in runs sorted by k (a front moved by one
    move's bytes), which the stable sort merges quickly."""
    if k.size < _SMALL:  # fewer numpy calls: the sort by both, then a running minimum
        by = np.lexsort((rank, k))
        r = rank[by]
        keep = np.empty(by.size, dtype=bool)
        keep[0] = r[0] < DROPPED
        keep[1:] = r[1:] < np.minimum.accumulate(r)[:-1]
        return by[keep]
    order = np.argsort(k, kind="stable")
    rs = rank[order]
    below = np.empty(rs.size, dtype=bool)
    below[0] = rs[0] < DROPPED
    np.less(rs[1:], np.minimum.accumulate(rs)[:-1], out=below[1:])
    at = np.flatnonzero(below)
    ks = k[order[at]]
    last = np.ones(at.size, dtype=bool)  # the last of its k among those below
    np.not_equal(ks[1:], ks[:-1], out=last[:-1])
    return order[at[last]]
