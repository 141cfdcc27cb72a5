"""The exact search behind ``solve(method="optimal")``: a Pareto dynamic program over prefix kept
bytes, bounded when the chain is long and varied. Pure: numpy, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from remat.plan.costmodel import ChainConstraints
from remat.plan.pareto import DROPPED, pair_rank, undominated

__all__ = [
    "NO_LIMIT_BYTES", "FreeOption", "PerBlock", "Table", "optimal_picks", "relaxed_beats",
    "relaxed_optimum", "relaxed_search", "relaxed_table",
]

# NOTE [ Pareto DP over prefix kept bytes ]
# By NOTE [ Every peak candidate is a prefix sum ] (costmodel.py), what the blocks before block i
# leave behind for the rest of the step is summed up by K (the bytes they keep), T (their extra
# time) and P (the highest peak candidate so far). A partial plan (K, T, P) can be dropped when
# another one has K' <= K and (T', P') <= (T, P) in lexicographic order: every way of finishing
# the first is as feasible for the second (future candidates grow with K) and ends faster, or as
# fast with a peak no higher. So after each block we keep only the partial plans that no other
# dominates in that sense: sort by K, rank (T, P), keep the ones whose rank beats every rank at
# smaller K. Two more cuts keep the sets small: options of a block that another option of the same
# block beats on kept bytes, peak term and time are never tried, and a partial plan is dropped as
# soon as K + floors[i] exceeds the budget (no finish fits; ``suffix_floor_bytes``). The plan kept
# at the end is the fastest, then the lowest peak, then the fewest kept bytes: exact and
# deterministic (stable sorts, options in ``OPTIONS`` order). Identical repeated blocks are the
# cheap case: arrangements reaching the same (K, T, P) collapse into one state, so the sets grow
# with the number of distinct totals, not with the number of arrangements.

# With side inputs (NOTE [ A side input's extra life ], sides.py) a partial plan also carries H,
# the side-input groups held so far (a mask): a block's backward candidate and the head's depend on
# it, so only partial plans with the same H are compared, and options of a block are compared
# only when they hold the same groups (on their forward and backward candidates apart). The floors
# used to drop partial plans are those of the partial plan's own H (``suffix_floors``).

# NOTE [ Time in integer ticks ]
# Extra times are summed as integer nanoseconds. Float sums depend on their order, so two
# arrangements of the same options (the common case with repeated blocks) would differ in the last
# bit, and "as fast" would turn into an arbitrary choice; integers make ties exact. Options closer
# than half a nanosecond per block count as equally fast.

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

# "No budget" for the search: far above any device's memory, far below int64 overflow.
NO_LIMIT_BYTES = 2**62
_TICKS_PER_MS = 1_000_000  # NOTE [ Time in integer ticks ]
_NO_LIMIT_TICKS = 2**62
# NOTE [ Bounding the search ]
_PLAIN_LIMIT = 512  # partial plans per block beyond which the search turns to bounds
_CELLS = 32768  # most cells of the bound on the time still to add
_MIN_CELLS = 4096  # fewest cells
_CELLS_PER_BLOCK = 64  # cells per block in between: rounding errs by up to one cell per block
_ROUGH_WIDTH = 64  # partial plans per block in the search for a first, good plan
_UNSET32 = 2**30  # "nothing fits" in the int32 bound (and above it)
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
        floors = chain.suffix_floors()  # [i][side-input state]; one state without side inputs
        budget = min(budget_bytes, NO_LIMIT_BYTES)
        if max(chain.fixed_bytes, floors[0][0]) > budget:
            return None
        return cls.of(Table.of(chain, budget, floors), plain_limit)

    @classmethod
    def of(cls, table: Table, plain_limit: int = _PLAIN_LIMIT) -> PerBlock:
        """The search over ``table`` (which the caller checked some plan fits)."""
        if not table.columns:
            return cls(table, [], 0, True)
        found = _search(table, bound_ticks=None, width=None, give_up=plain_limit)
        if found is not None:
            return cls(table, found[0], found[1], True)
        bounded = table if table.rest is not None else table.bounded()  # a varied chain
        rough = _search(bounded, bound_ticks=None, width=_ROUGH_WIDTH, give_up=None)
        assert rough is not None, "the floor check guarantees a feasible plan"
        return cls(bounded, rough[0], rough[1], False)

    def within(self, ticks: int) -> tuple[list[int], int] | None:
        """The optimum's picks and ticks if it takes at most ``ticks``, else None."""
        if self.exact:
            return (self.picks, self.ticks) if self.ticks <= ticks else None
        try:
            return _search(self.table, bound_ticks=ticks, width=None, give_up=None, none_left=True)
        except _NoneLeft:
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
    if relaxed.fixed_bytes > relaxed.budget_bytes or int(relaxed.room[0, 0]) < 0:
        return None
    return PerBlock.of(relaxed)


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
        _search(relaxed, bound_ticks=below_ticks - 1, width=None, give_up=give_up, none_left=True)
    except _NoneLeft:
        return False
    return True  # a relaxed plan is faster, or the search gave up


class _NoneLeft(Exception):
    """No partial plan is left at some block (``_search`` with ``none_left``)."""


@dataclass(frozen=True)
class Table:
    """One search's numbers: per block, the useful options' int64 columns, and bounds."""

    columns: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
    """Per block: the option indices ``_undominated`` keeps, and their kept, need, ticks."""
    room: np.ndarray
    """[i, state], i = 0..n: the largest K before block i, in that side-input state, from which
    some finish fits the budget."""
    fixed_bytes: int
    tail_bytes: int
    budget_bytes: int
    cell_bytes: int = 1
    rest: np.ndarray | None = None
    """[i, K // cell_bytes]: a lower bound on the ticks blocks i.. add to fit the budget, in
    units of ``rest_unit`` ticks (int32; ``_UNSET32`` where nothing fits)."""
    rest_unit: int = 1
    sides: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] | None = None
    """With side inputs: per block, the useful options' holds, forward and backward candidates,
    and [state] the bytes held side inputs add to its backward and to its forward."""
    tails: np.ndarray | None = None
    """With side inputs: [state] the head's candidate."""

    @classmethod
    def of(cls, chain: ChainConstraints, budget: int, floors: list[list[int]]) -> Table:
        n, width = len(chain.kept_bytes), len(chain.options)
        kept = np.array(chain.kept_bytes, dtype=np.int64).reshape(n, width)
        need = np.array(chain.need_bytes, dtype=np.int64).reshape(n, width)
        ms = np.array(chain.extra_ms, dtype=np.float64).reshape(n, width)
        ticks = np.rint(ms * _TICKS_PER_MS).astype(np.int64)
        sides = tails = None
        if chain.holds:
            holds = np.array(chain.holds, dtype=np.int64).reshape(n, width)
            fwd = np.array(chain.fwd_need_bytes, dtype=np.int64).reshape(n, width)
            bwd = np.array(chain.bwd_need_bytes, dtype=np.int64).reshape(n, width)
            delta = np.array(chain.delta_bytes, dtype=np.int64).reshape(n, -1)
            fwd_delta = np.array(chain.fwd_delta_bytes, dtype=np.int64).reshape(n, -1)
            useful = _undominated(kept, fwd, ticks, bwd, holds)
            sides = [
                (holds[i, c], fwd[i, c], bwd[i, c], delta[i], fwd_delta[i])
                for i, c in enumerate(np.flatnonzero(r) for r in useful)
            ]
            tails = np.array(chain.tail_held_bytes, dtype=np.int64)
        else:
            useful = _undominated(kept, need, ticks)
        columns = []
        for i in range(n):
            cols = np.flatnonzero(useful[i])
            columns.append((cols, kept[i, cols], need[i, cols], ticks[i, cols]))
        return cls(
            columns=columns,
            room=budget - np.array(floors, dtype=np.int64),
            fixed_bytes=chain.fixed_bytes,
            tail_bytes=chain.tail_bytes,
            budget_bytes=budget,
            sides=sides,
            tails=tails,
        )

    def bound(self, i: int | np.ndarray, kept: np.ndarray) -> np.ndarray:
        """``rest`` read as ticks: a lower bound on what blocks i.. add from a prefix keeping
        ``kept`` bytes (``i`` an int, or an array broadcast with ``kept``). Cells below 0 (a prefix
        that freed a side input, NOTE [ Where a side input dies ]) read 0; past the end, the last
        cell (monotone in K; such a prefix is over the room anyway)."""
        assert self.rest is not None
        at = np.maximum(np.minimum(cell := kept // self.cell_bytes, (cells := self.rest.shape[1]) - 1), 0)
        low = self.rest[i][at] if isinstance(i, int) else self.rest.ravel()[np.asarray(i) * cells + at]
        out = np.where(low >= _UNSET32, _NO_LIMIT_TICKS, low.astype(np.int64) * self.rest_unit)
        return np.where(cell < 0, 0, out) if cell.size and int(cell.min()) < 0 else out

    def bounded(self, cells: int | None = None) -> Table:
        """This table with ``rest`` filled in, backward from the head: from the low end of cell c
        an option's kept bytes lead exactly to the low end of cell c + kept // cell_bytes, and
        the option fits from cells c with c * cell_bytes + need <= budget."""
        n = len(self.columns)
        cells_n = min(_CELLS, max(_MIN_CELLS, _CELLS_PER_BLOCK * n)) if cells is None else cells
        cell = int(self.room.max()) // cells_n + 1
        # In int32 units of ``unit`` ticks, each option's ticks rounded down (a sum of floors is
        # no more than the floor of the sum: still a lower bound): a quarter of int64's memory
        # traffic, which is what the many cells of long chains cost. Totals stay below _UNIT_SPAN,
        # and _UNSET32 (nothing fits) plus any option's ticks below int32's top.
        unit = max(1, sum(max(0, int(c[3].max())) for c in self.columns) // _UNIT_SPAN + 1)
        rest = np.empty((n + 1, cells_n), dtype=np.int32)
        # Each row lies in the middle third of a buffer of three: a slice at offset s of the
        # buffer is the row from cell s on, with cells below 0 (a block that keeps negative bytes:
        # one that frees a side input, NOTE [ Where a side input dies ]) reading 0 ticks (a lower
        # bound whatever the state there) and cells past the end reading "nothing fits".
        after = np.full(3 * cells_n, _UNSET32, dtype=np.int32)
        after[:cells_n] = 0
        row = after.copy()
        after[cells_n : cells_n + max(0, min(cells_n, int(self.room[n].max()) // cell + 1))] = 0
        rest[n] = after[cells_n : 2 * cells_n]
        spare = np.empty(cells_n, dtype=np.int32)
        for i in range(n - 1, -1, -1):
            _, kept, need, ticks = self.columns[i]
            out = row[cells_n : 2 * cells_n]
            out.fill(_UNSET32)
            for k, nd, t in zip(kept.tolist(), need.tolist(), (ticks // unit).tolist()):
                # The option fits from cells c with c * cell + need <= budget: a prefix.
                fits = min(cells_n, max(0, (self.budget_bytes - nd) // cell + 1))
                if not fits:
                    continue
                shift = cells_n + max(-cells_n, min(k // cell, cells_n))
                np.add(after[shift : shift + fits], t, out=spare[:fits])
                np.minimum(out[:fits], spare[:fits], out=out[:fits])
            np.minimum(out, _UNSET32, out=out)  # "nothing fits" plus ticks is still nothing
            rest[i] = out
            after, row = row, after
        return dataclasses.replace(self, cell_bytes=cell, rest=rest, rest_unit=unit)


def _search(
    table: Table, *, bound_ticks: int | None, width: int | None, give_up: int | None,
    none_left: bool = False,
) -> tuple[list[int], int] | None:
    """The DP of NOTE [ Pareto DP over prefix kept bytes ]: the option indices and ticks of the
    best plan, or None when more than ``give_up`` partial plans survive one block. ``none_left``:
    raise ``_NoneLeft`` when the bound leaves none (else that is a bug: the bound is a plan's).

    ``bound_ticks`` drops partial plans that ``table.rest`` says cannot end within it; ``width``
    keeps only that many per block, the most promising by ``rest``: fast, not always the best."""
    K, T = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    P = np.full(1, table.fixed_bytes, dtype=np.int64)
    H = None if table.sides is None else np.zeros(1, dtype=np.int64)  # side-input groups held so far
    parents: list[np.ndarray] = []
    chosen: list[np.ndarray] = []
    for i, (cols, kept, need, ticks) in enumerate(table.columns):
        cK = (K[:, None] + kept).ravel()
        cT = (T[:, None] + ticks).ravel()
        if table.sides is None or H is None:  # one side-input state: no H
            cH = None
            cP = np.maximum(P[:, None], K[:, None] + need).ravel()
            drop = (cP > table.budget_bytes) | (cK > table.room[i + 1, 0])
        else:
            holds, fwd, bwd, delta, fwd_delta = table.sides[i]
            now = H[:, None] | holds
            term = np.maximum(fwd + fwd_delta[now], bwd + delta[now])
            cH, cP = now.ravel(), np.maximum(P[:, None], K[:, None] + term).ravel()
            drop = (cP > table.budget_bytes) | (cK > table.room[i + 1, cH])
        hope = None if table.rest is None else cT + table.bound(i + 1, cK)
        if hope is not None and bound_ticks is not None:
            drop |= hope > bound_ticks
        live = np.flatnonzero(~drop)  # the front of the rest is the same; fewer to sort
        lH = None if cH is None else cH[live]
        alive = live[_front(cK[live], cT[live], cP[live], drop[live], lH)] if live.size else live
        if none_left and not alive.size:
            raise _NoneLeft
        assert alive.size, "room and rest only drop partial plans that cannot fit or win"
        if width is not None and alive.size > width:
            assert hope is not None, "a beam needs the bounds to rank by"
            alive = alive[np.argsort(hope[alive], kind="stable")[:width]]
        if give_up is not None and alive.size > give_up:
            return None
        parents.append(alive // cols.size)
        chosen.append(cols[alive % cols.size])
        K, T, P, H = cK[alive], cT[alive], cP[alive], None if cH is None else cH[alive]

    tail = table.tail_bytes if table.tails is None or H is None else table.tails[H]
    final = np.maximum(P, K + tail)
    at = int(np.lexsort((K, final, T))[0])
    ticks_total = int(T[at])
    picks = [0] * len(table.columns)
    for i in range(len(table.columns) - 1, -1, -1):
        picks[i] = int(chosen[i][at])
        at = int(parents[i][at])
    return picks, ticks_total


def _undominated(
    kept: np.ndarray, need: np.ndarray, ticks: np.ndarray, *more: np.ndarray
) -> np.ndarray:
    """[block, option]: False where another option of the block is no worse in kept bytes, peak
    term and time (and better in one, or equal and earlier in ``OPTIONS``). With side inputs,
    ``more`` is the backward term and the holds: an option beats only one that holds the same."""
    holds = more[-1] if more else None
    rows = np.stack([kept, need, ticks, *more[:-1]])  # (k, n, width)
    no_worse = (rows[:, :, :, None] <= rows[:, :, None, :]).all(axis=0)  # [b, by, of]
    if holds is not None:
        no_worse &= holds[:, :, None] == holds[:, None, :]
    better = (rows[:, :, :, None] < rows[:, :, None, :]).any(axis=0)
    width = kept.shape[1]
    earlier = np.tri(width, width, -1, dtype=bool).T  # earlier[by, of]: by < of
    beaten = no_worse & (better | earlier[None])
    beaten &= ~np.eye(width, dtype=bool)[None]
    return np.logical_not(beaten.any(axis=1))


def _front(K: np.ndarray, T: np.ndarray, P: np.ndarray, drop: np.ndarray, H: np.ndarray | None) -> np.ndarray:
    """Indices of the states not dropped that none with the same side-input state H (None: one)
    dominates (NOTE [ Pareto DP over prefix kept bytes ]), ordered by H, then K."""
    if H is not None and H.size and int(H.min()) != int(H.max()):
        parts = [np.flatnonzero(h == H) for h in np.unique(H)]
        return np.concatenate([p[_front(K[p], T[p], P[p], drop[p], H[p])] for p in parts])
    rank = pair_rank(T, P)
    rank[drop] = DROPPED
    return undominated(K, rank)
