"""Bounds that make the per-block search fast on long varied chains (NOTE [ Bounding the search ]),
and the relaxation that bounds every plan with segments from below (NOTE [ Searching segments ] in
``remat.plan.segment_search``). Each only drops partial plans that cannot win: the plan found is
the plain search's (``remat.plan.search.plain_optimum``; tests/test_solver.py forces the bounded
path on small chains). Pure: numpy, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from remat.plan.chain import ChainConstraints
from remat.plan.search import NO_LIMIT_BYTES, NOTHING_FITS_32, NoneLeft, Table, pareto_search

__all__ = [
    "FreeOption",
    "PerBlock",
    "bounded",
    "optimal_picks",
    "relaxed_beats",
    "relaxed_fits",
    "relaxed_optimum",
    "relaxed_search",
    "relaxed_table",
]

# NOTE [ Bounding the search ]
# On a varied chain (every block's bytes different) the partial plans that no other dominates
# grow with the number of distinct kept-byte totals, into the tens of thousands. When one block
# leaves more than _PLAIN_LIMIT of them, the search starts over with bounds, and stays exact:
# - rest[i, c]: a lower bound on the time blocks i.. must add from any K in cell c (cells of
#   cell_bytes over the range of K), computed backward from the head like ``suffix_floor_bytes``
#   but with times. From a cell's low end an option's kept bytes lead exactly to a cell's low end,
#   and finishing from a lower K never costs more, so the bound holds for the whole cell;
# - an upper bound: the time of a plan found by a beam search that keeps, per block, the
#   _ROUGH_WIDTH partial plans with the lowest time + rest;
# - the full search then drops every partial plan whose time + rest exceeds the upper bound.
#   Partial plans of every plan as fast as the best survive, so ties are broken as before.
# Repeated identical blocks rarely need the bounds: their partial plans stay in the hundreds.
# Each block's kept bytes are rounded down to whole cells in ``rest``, so the bound loosens by up
# to a cell per block: long chains get more cells (64 per block, 4096..32768; at 512 varied blocks
# this cut the partial plans the full search visits from 12-14 million to 3-4 million), stored as
# int32 in units of a few ticks (rounded down: still a lower bound) to keep the table small.

_PLAIN_LIMIT = 512  # partial plans per block beyond which the search turns to bounds
_CELLS = 32768  # most cells of the bound on the time still to add
_MIN_CELLS = 4096  # fewest cells
_CELLS_PER_BLOCK = 64  # cells per block in between: rounding errs by up to one cell per block
_ROUGH_WIDTH = 64  # partial plans per block in the search for a first, good plan
_UNIT_SPAN = 2**29  # the most units of ticks a whole chain adds


def optimal_picks(
    chain: ChainConstraints, budget_bytes: int, *, plain_limit: int = _PLAIN_LIMIT
) -> list[int] | None:
    """Option indices of the fastest plan whose peak fits ``budget_bytes`` (the lowest peak among
    those, then the fewest kept bytes); None when none fits. ``plain_limit``: NOTE [ Bounding the
    search ]; tests set it to 0 to check the bounded search."""
    search = PerBlock.start(chain, budget_bytes, plain_limit=plain_limit)
    return None if search is None else search.optimum()[0]


@dataclass(frozen=True)
class PerBlock:
    """The per-block optimum's search, begun: the optimum itself when the plain search found it,
    else (a long varied chain, NOTE [ Bounding the search ]) the bounded table and a beam's plan,
    whose ticks bound the optimum's from above, with the exact search left for when it is asked
    for: under a tighter bound (``within``) it costs far less."""

    table: Table
    picks: list[int]
    ticks: int
    """The optimum's ticks when ``exact``, else an upper bound on them (the beam's plan's)."""
    exact: bool

    @classmethod
    def start(cls, chain: ChainConstraints, budget_bytes: int, *, plain_limit: int = _PLAIN_LIMIT
              ) -> PerBlock | None:
        """The search over ``chain``'s options; None when no per-block plan fits."""
        table = Table.fitting(chain, budget_bytes)
        return None if table is None else cls.of(table, plain_limit)

    @classmethod
    def of(cls, table: Table, plain_limit: int = _PLAIN_LIMIT) -> PerBlock:
        """The search over ``table`` (which the caller checked some plan fits)."""
        if not table.columns:
            return cls(table, [], 0, True)
        found = pareto_search(table, bound_ticks=None, width=None, give_up=plain_limit)
        if found is not None:
            return cls(table, found[0], found[1], True)
        with_bounds = table if table.rest is not None else bounded(table)  # a varied chain
        rough = pareto_search(with_bounds, bound_ticks=None, width=_ROUGH_WIDTH, give_up=None)
        assert rough is not None, "the floor check guarantees a feasible plan"
        return cls(with_bounds, rough[0], rough[1], False)

    def within(self, ticks: int) -> tuple[list[int], int] | None:
        """The optimum's picks and ticks if it takes at most ``ticks``, else None."""
        if self.exact:
            return (self.picks, self.ticks) if self.ticks <= ticks else None
        try:
            return pareto_search(self.table, bound_ticks=ticks, width=None, give_up=None, none_left=True)
        except NoneLeft:
            return None

    def optimum(self) -> tuple[list[int], int]:
        """The optimum's picks and ticks (an exact search under the beam's bound, if not done)."""
        found = self.within(self.ticks)
        assert found is not None, "the beam's plan itself is within the bound"
        return found


def relaxed_table(chain: ChainConstraints, budget_bytes: int, free: FreeOption) -> Table:
    """The per-block table relaxed by one more option per block, ``free`` (column -1), with side
    inputs as if never held: every plan of other moves whose blocks each cost at least that option
    is no faster than the relaxed table's fastest plan (NOTE [ Searching segments ])."""
    budget = min(budget_bytes, NO_LIMIT_BYTES)
    table = Table.of(chain, budget, chain.suffix_floors())
    columns = [
        (np.append(cols, -1), np.append(kept, fk), np.append(need, fn), np.append(ticks, max(0, ft)))
        for (cols, kept, need, ticks), fk, fn, ft in zip(table.columns, free.kept, free.need, free.ticks)
    ]
    low = [chain.tail_bytes]  # the relaxed chain's suffix floors (``suffix_floor_bytes``)
    for _, kept, need, _ in reversed(columns):
        low.append(int(np.maximum(need, kept + low[-1]).min()))
    room = budget - np.array(low[::-1], dtype=np.int64)[:, None]
    return dataclasses.replace(table, columns=columns, sides=None, tails=None, room=room)


def relaxed_optimum(relaxed: Table) -> tuple[list[int], int, Table | None] | None:
    """``relaxed``'s fastest plan (picks, -1 for the extra option), its ticks and the table bounded
    if the search needed it; None when nothing fits even there."""
    search = relaxed_search(relaxed)
    if search is None:
        return None
    picks, ticks = search.optimum()
    return picks, ticks, None if search.exact else search.table


def relaxed_search(relaxed: Table) -> PerBlock | None:
    """The search for ``relaxed``'s fastest plan, begun (``PerBlock``); None when nothing fits
    even there."""
    return PerBlock.of(relaxed) if relaxed_fits(relaxed) else None


def relaxed_fits(relaxed: Table) -> bool:
    """Whether some plan fits ``relaxed`` (else no plan of the moves it bounds fits either)."""
    return relaxed.fixed_bytes <= relaxed.budget_bytes and int(relaxed.room[0, 0]) >= 0


@dataclass(frozen=True)
class FreeOption:
    """Per block: the kept bytes, need and ticks of the relaxation's extra option."""

    kept: list[int]
    need: list[int]
    ticks: list[int]


def relaxed_beats(relaxed: Table, below_ticks: int, *, give_up: int = 4 * _PLAIN_LIMIT) -> bool:
    """Whether some plan of the relaxed table (``relaxed_table``'s, bounded) takes fewer than
    ``below_ticks``: its exact search with that bound. True too when it would keep more than
    ``give_up`` partial plans at a block (not known, so not ruled out)."""
    assert relaxed.rest is not None
    if int(relaxed.rest[0, 0]) * relaxed.rest_unit >= below_ticks:
        return False
    try:
        pareto_search(relaxed, bound_ticks=below_ticks - 1, width=None, give_up=give_up, none_left=True)
    except NoneLeft:
        return False
    return True  # a relaxed plan is faster, or the search gave up


def bounded(table: Table, cells: int | None = None) -> Table:
    """``table`` with ``rest`` filled in, backward from the head: from the low end of cell c
    an option's kept bytes lead exactly to the low end of cell c + kept // cell_bytes, and
    the option fits from cells c with c * cell_bytes + need <= budget."""
    n = len(table.columns)
    cells_n = min(_CELLS, max(_MIN_CELLS, _CELLS_PER_BLOCK * n)) if cells is None else cells
    cell = int(table.room.max()) // cells_n + 1
    # In int32 units of ``unit`` ticks, each option's ticks rounded down (a sum of floors is
    # no more than the floor of the sum: still a lower bound): a quarter of int64's memory
    # traffic, which is what the many cells of long chains cost. Totals stay below _UNIT_SPAN,
    # and NOTHING_FITS_32 (nothing fits) plus any option's ticks below int32's top.
    unit = max(1, sum(max(0, int(c[3].max())) for c in table.columns) // _UNIT_SPAN + 1)
    rest = np.empty((n + 1, cells_n), dtype=np.int32)
    # Each row lies in the middle third of a buffer of three: a slice at offset s of the
    # buffer is the row from cell s on, with cells below 0 (a block that keeps negative bytes:
    # one that frees a side input, NOTE [ Where a side input dies ]) reading 0 ticks (a lower
    # bound whatever the state there) and cells past the end reading "nothing fits".
    after = np.full(3 * cells_n, NOTHING_FITS_32, dtype=np.int32)
    after[:cells_n] = 0
    row = after.copy()
    after[cells_n : cells_n + max(0, min(cells_n, int(table.room[n].max()) // cell + 1))] = 0
    rest[n] = after[cells_n : 2 * cells_n]
    spare = np.empty(cells_n, dtype=np.int32)
    for i in range(n - 1, -1, -1):
        _, kept, need, ticks = table.columns[i]
        out = row[cells_n : 2 * cells_n]
        out.fill(NOTHING_FITS_32)
        for k, nd, t in zip(kept.tolist(), need.tolist(), (ticks // unit).tolist()):
            # The option fits from cells c with c * cell + need <= budget: a prefix.
            fits = min(cells_n, max(0, (table.budget_bytes - nd) // cell + 1))
            if not fits:
                continue
            shift = cells_n + max(-cells_n, min(k // cell, cells_n))
            np.add(after[shift : shift + fits], t, out=spare[:fits])
            np.minimum(out[:fits], spare[:fits], out=out[:fits])
        np.minimum(out, NOTHING_FITS_32, out=out)  # "nothing fits" plus ticks is still nothing
        rest[i] = out
        after, row = row, after
    return dataclasses.replace(table, cell_bytes=cell, rest=rest, rest_unit=unit)
