"""The optimum of NOTE [ The optimum, defined ] (``remat.plan.optimum``), found fast. Pure: no torch.

``fastest`` returns the plan ``defined`` returns (tests/test_optimum.py checks them equal), and
does less to find it; each device below drops only partial plans that cannot win:
- the relaxation (NOTE [ Searching segments ] in ``remat.plan.segment_search``): one more option
  per block that bounds every segment from below; when its fastest plan uses none, that plan is
  the optimum and no segment search runs;
- bounds and a beam on long varied chains (NOTE [ Bounding the search ] in
  ``remat.plan.bounds``), with the exact per-block search put off until the segment search is
  known to lose (``PerBlock.within``: under a tighter bound it costs far less);
- the segment search told the per-block optimum's ticks to beat and given the relaxation's
  bounded table as a floor on the time still to add.
"""

from __future__ import annotations

from remat.plan.bounds import (
    PerBlock,
    bounded,
    relaxed_beats,
    relaxed_fits,
    relaxed_search,
    relaxed_table,
)
from remat.plan.chain import ChainConstraints
from remat.plan.optimum import Found
from remat.plan.search import Table
from remat.plan.segment_search import segment_search
from remat.plan.segments import SegmentModel

__all__ = ["fastest"]


def fastest(chain: ChainConstraints, model: SegmentModel | None, budget: int) -> Found | None:
    """NOTE [ The optimum, defined ]'s plan for ``chain`` (with segments when ``model`` is given;
    their search, and the relaxation that bounds it, on ``model.chain``) under ``budget`` bytes;
    None when no plan fits."""
    relaxed: Table | None = None
    floor_ticks = beam_ticks = None
    plain = True  # whether the per-block search begins without bounds (NOTE [ Bounding the search ])
    if model is not None and not chain.holds and model.chain == chain:
        relaxed = relaxed_table(model.chain, budget, model.free_option())
        # A block in a segment is bounded by one more per-block option: the relaxation's fastest
        # plan is no slower than any plan, and (without side inputs) when it is a per-block plan,
        # it is the optimum.
        search = relaxed_search(relaxed)
        if search is None:
            return None  # nothing fits even the relaxation
        if -1 in search.picks and not search.exact:
            # A varied chain whose beam plan uses segments: the bounded table is the floor, and
            # the exact relaxed search (which would not end the solve) is skipped; the beam's
            # plan is a relaxed plan that fast.
            relaxed, beam_ticks = search.table, search.ticks
        else:
            picks, floor_ticks = search.optimum()
            if -1 not in picks:
                return Found(picks, [])
            relaxed = search.table
        plain = search.exact  # a chain whose relaxed search needs bounds likely needs them too
    per_block = PerBlock.start(chain, budget) if plain else PerBlock.start(chain, budget, plain_limit=0)
    # ``upper``: the per-block optimum's ticks, or on a varied chain an upper bound on them.
    upper = None if per_block is None else per_block.ticks
    if model is not None and upper != 0:
        relaxed = relaxed or relaxed_table(model.chain, budget, model.free_option())
        floor = None
        if upper is not None and relaxed_fits(relaxed):  # else no plan with segments fits
            floor = relaxed if relaxed.rest is not None else bounded(relaxed)
            if floor_ticks is not None:
                hopeful = floor_ticks < upper
            else:
                hopeful = (beam_ticks is not None and beam_ticks < upper) or relaxed_beats(floor, upper)
            if not hopeful:
                floor = None  # no plan of any kind fits and is strictly faster than ``upper``
        if floor is not None or upper is None:
            seg = segment_search(model.chain, model, budget, objective="time", below_ticks=upper, floor=floor)
            if seg is not None and seg.trees and (upper is None or seg.ticks < upper):
                # Segments win only when strictly faster than the per-block optimum: its exact
                # search under the segments' ticks (quick) finds it if it is as fast.
                found = None if per_block is None else per_block.within(seg.ticks)
                if found is None:
                    return Found(seg.picks, seg.trees)
                return Found(found[0], [])
    return None if per_block is None else Found(per_block.optimum()[0], [])
