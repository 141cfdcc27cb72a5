"""What ``solve(method="optimal")`` finds, defined apart from how it is found fast. Pure: no torch.

# NOTE [ The optimum, defined ]
The plan ``solve`` returns is, by definition:
1. among per-block plans (one option per block) whose predicted peak fits the budget, the fastest;
   among those the lowest peak; among those the fewest kept bytes (NOTE [ Pareto DP over prefix
   kept bytes ] in ``remat.plan.search``: that search, run plain, with no bounds);
2. among every plan with segments (NOTE [ Searching segments ] in ``remat.plan.segment_search``:
   that search, run with no floor and no time to beat), the fastest that fits; it replaces 1 only
   when strictly faster, or when no per-block plan fits.
``defined`` is that rule written as it reads: two searches and a comparison. It is the one the
brute-force tests pin (tests/test_solver.py, tests/test_segments_plan.py).
``remat.plan.fastest.fastest`` finds the same plan sooner, with bounds, a relaxation and a beam that
each drop only what cannot win; tests/test_optimum.py checks the two equal. Everything that makes
the solve fast lives there: a change to what is optimal is a change here first.
On chains of more than ``EXACT_BLOCKS`` blocks the segment search is exact only over its family of
segments, and keeps at most ``MAX_STATES`` partial plans per position; which ones depends on what
else competes, so there the two may differ in the segment plan they find, and so in whether
segments win at all (never in the per-block optimum, which both find exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from remat.plan.chain import ChainConstraints
from remat.plan.search import plain_optimum
from remat.plan.segment_search import segment_search
from remat.plan.segments import SegmentModel, Tree

__all__ = ["Found", "Optimum", "defined"]


@dataclass(frozen=True)
class Found:
    """The plan a search found: per block the option index (into ``chain.options``; ``keep`` for
    blocks in segments), and the top-level segments with their nested ones (none: per-block)."""

    picks: list[int]
    trees: list[Tree]


Optimum = Callable[[ChainConstraints, SegmentModel | None, int], Found | None]
"""A search for NOTE [ The optimum, defined ]: the chain, its segment model (None: per-block plans
only) and the budget in bytes; None when no plan fits."""


def defined(chain: ChainConstraints, model: SegmentModel | None, budget_bytes: int) -> Found | None:
    """NOTE [ The optimum, defined ], as it reads."""
    per_block = plain_optimum(chain, budget_bytes)
    with_segments = None if model is None else segment_search(model.chain, model, budget_bytes, objective="time")
    if with_segments is not None and with_segments.trees and (
        per_block is None or with_segments.ticks < per_block[1]
    ):
        return Found(with_segments.picks, with_segments.trees)
    return None if per_block is None else Found(per_block[0], [])
