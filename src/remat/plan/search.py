"""The exact search behind ``solve(method="optimal")``: a Pareto dynamic program over prefix kept
bytes, the per-block part of NOTE [ The optimum, defined ] (``remat.plan.optimum``). Its bounds
for long varied chains, and the relaxation that bounds segments, are ``remat.plan.bounds``.
Pure: numpy, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat.plan.chain import ChainConstraints
from remat.plan.pareto import DROPPED, pair_rank, undominated

__all__ = ["NOTHING_FITS_32", "NO_LIMIT_BYTES", "NoneLeft", "Table", "pareto_search", "plain_optimum"]

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

# With tensors that cross a block boundary (NOTE [ What crosses a block boundary, as state ] in
# crossings.py) a partial plan also carries H, the state's bits (a mask): a block's candidates, its
# kept bytes and the head's candidate depend on it, so only partial plans with the same H are
# compared, and options of a block are compared only when they set the same bits (on their forward
# and backward candidates apart). The floors used to drop partial plans are those of the partial
# plan's own H (``suffix_floors``).

# NOTE [ Time in integer ticks ]
# Extra times are summed as integer nanoseconds. Float sums depend on their order, so two
# arrangements of the same options (the common case with repeated blocks) would differ in the last
# bit, and "as fast" would turn into an arbitrary choice; integers make ties exact. Options closer
# than half a nanosecond per block count as equally fast.

# "No budget" for the search: far above any device's memory, far below int64 overflow.
NO_LIMIT_BYTES = 2**62
_TICKS_PER_MS = 1_000_000  # NOTE [ Time in integer ticks ]
_NO_LIMIT_TICKS = 2**62
NOTHING_FITS_32 = 2**30
""""Nothing fits" in ``Table.rest`` (and above it): NOTE [ Bounding the search ] in remat.plan.bounds."""


def plain_optimum(chain: ChainConstraints, budget_bytes: int) -> tuple[list[int], int] | None:
    """The per-block optimum (as ``optimal_picks``) and its ticks, by the DP of NOTE [ Pareto DP
    over prefix kept bytes ] run plain, however many partial plans it keeps: no bounds, no beam;
    None when no plan fits."""
    table = Table.fitting(chain, budget_bytes)
    if table is None:
        return None
    found = pareto_search(table, bound_ticks=None, width=None, give_up=None) if table.columns else ([], 0)
    assert found is not None, "a search that never gives up finds the plan the floors promise"
    return found


class NoneLeft(Exception):
    """No partial plan is left at some block (``pareto_search`` with ``none_left``)."""


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
    units of ``rest_unit`` ticks (int32; ``NOTHING_FITS_32`` where nothing fits)."""
    rest_unit: int = 1
    sides: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]] | None = None
    """With a state (NOTE [ What crosses a block boundary, as state ] in remat.plan.crossings): per
    block, the useful options' bits, forward and backward candidates, [state] the bytes the state
    adds to its backward, its forward and its kept bytes, and the bits dropped after it."""
    tails: np.ndarray | None = None
    """With side inputs: [state] the head's candidate."""

    @classmethod
    def fitting(cls, chain: ChainConstraints, budget_bytes: int) -> Table | None:
        """``chain``'s table under ``budget_bytes`` (at most ``NO_LIMIT_BYTES``); None when its
        suffix floors say no per-block plan fits."""
        floors = chain.suffix_floors()  # [i][side-input state]; one state without side inputs
        budget = min(budget_bytes, NO_LIMIT_BYTES)
        if max(chain.fixed_bytes, floors[0][0]) > budget:
            return None
        return cls.of(chain, budget, floors)

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
            kept_delta = (np.array(chain.kept_delta_bytes, dtype=np.int64).reshape(n, -1) if chain.kept_delta_bytes
                          else np.zeros_like(delta))
            useful = _undominated(kept, fwd, ticks, bwd, holds)
            sides = [
                (holds[i, c], fwd[i, c], bwd[i, c], delta[i], fwd_delta[i], kept_delta[i],
                 chain.clears[i] if chain.clears else 0)
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
        out = np.where(low >= NOTHING_FITS_32, _NO_LIMIT_TICKS, low.astype(np.int64) * self.rest_unit)
        return np.where(cell < 0, 0, out) if cell.size and int(cell.min()) < 0 else out


def pareto_search(
    table: Table, *, bound_ticks: int | None, width: int | None, give_up: int | None,
    none_left: bool = False,
) -> tuple[list[int], int] | None:
    """The DP of NOTE [ Pareto DP over prefix kept bytes ]: the option indices and ticks of the
    best plan, or None when more than ``give_up`` partial plans survive one block. ``none_left``:
    raise ``NoneLeft`` when the bound leaves none (else that is a bug: the bound is a plan's).

    ``bound_ticks`` drops partial plans that ``table.rest`` says cannot end within it; ``width``
    keeps only that many per block, the most promising by ``rest``: fast, not always the best."""
    K, T = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    P = np.full(1, table.fixed_bytes, dtype=np.int64)
    H = None if table.sides is None else np.zeros(1, dtype=np.int64)  # side-input groups held so far
    parents: list[np.ndarray] = []
    chosen: list[np.ndarray] = []
    for i, (cols, kept, need, ticks) in enumerate(table.columns):
        cT = (T[:, None] + ticks).ravel()
        if table.sides is None or H is None:  # one state: no H
            cH = None
            cK = (K[:, None] + kept).ravel()
            cP = np.maximum(P[:, None], K[:, None] + need).ravel()
            drop = (cP > table.budget_bytes) | (cK > table.room[i + 1, 0])
        else:
            holds, fwd, bwd, delta, fwd_delta, kept_delta, clear = table.sides[i]
            now = H[:, None] | holds
            term = np.maximum(fwd + fwd_delta[now], bwd + delta[now])
            cK = (K[:, None] + kept + kept_delta[now]).ravel()
            cH, cP = (now & ~clear).ravel(), np.maximum(P[:, None], K[:, None] + term).ravel()
            drop = (cP > table.budget_bytes) | (cK > table.room[i + 1, cH])
        hope = None if table.rest is None else cT + table.bound(i + 1, cK)
        if hope is not None and bound_ticks is not None:
            drop |= hope > bound_ticks
        live = np.flatnonzero(~drop)  # the front of the rest is the same; fewer to sort
        lH = None if cH is None else cH[live]
        alive = live[_front(cK[live], cT[live], cP[live], drop[live], lH)] if live.size else live
        if none_left and not alive.size:
            raise NoneLeft
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
