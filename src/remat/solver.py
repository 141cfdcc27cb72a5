"""Choose one option per block so that a step fits a memory budget with the least extra time.

``solve(profile, budget)`` returns a ``Plan``; ``frontier(profile)`` the memory/time trade-off of
optimal plans. The solvers see only the numbers of a ``Profile`` and judge every plan with the one
cost model, ``remat.costmodel``. Pure: no torch, no I/O, deterministic.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from remat.costmodel import ChainConstraints, chain_constraints, estimate, smallest_feasible
from remat.errors import did_you_mean
from remat.records import Plan, Profile
from remat.units import format_bytes, parse_budget

__all__ = ["METHODS", "InfeasibleBudget", "check_method", "frontier", "in_eval_mode", "solve"]

#: The solvers ``solve`` offers. ``optimal`` and ``greedy`` need a budget; the rest ignore it.
METHODS: tuple[str, ...] = ("optimal", "greedy", "none", "all", "every_k", "sqrt")

_BUDGET_METHODS = ("optimal", "greedy")
# "No budget" for the search: far above any device's memory, far below int64 overflow.
_NO_LIMIT_BYTES = 2**62
_TICKS_PER_MS = 1_000_000  # NOTE [ Time in integer ticks ]
_NO_LIMIT_TICKS = 2**62
# NOTE [ Bounding the search ]
_PLAIN_LIMIT = 512  # partial plans per block beyond which the search turns to bounds
_CELLS = 4096  # resolution of the bound on the time still to add
_ROUGH_WIDTH = 64  # partial plans per block in the search for a first, good plan
_DROPPED = 2**63 - 1  # the rank of a partial plan that is out


class InfeasibleBudget(ValueError):
    """No plan (of the method asked for) brings the step's peak under the budget."""

    def __init__(self, message: str, *, budget_bytes: int, smallest_bytes: int, dominant: str):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        """The budget asked for."""
        self.smallest_bytes = smallest_bytes
        """The lowest peak any plan reaches: the smallest budget that can be met."""
        self.dominant = dominant
        """What dominates that lowest peak, for people."""


def solve(
    profile: Profile,
    budget: int | str | None = None,
    *,
    method: str = "optimal",
    k: int | None = None,
) -> Plan:
    """One option per block for ``profile``'s step, by ``method`` (one of ``METHODS``).

    ``budget`` is the peak bytes of the whole step: an int, or a string such as ``"6GiB"``,
    ``"6.5GB"``, ``"800MiB"`` or ``"60%"`` (of the plain step's peak). ``optimal`` finds the fastest
    plan that fits it and ``greedy`` a quick approximation; both raise ``InfeasibleBudget`` when
    none fits. The baselines ``none``, ``all``, ``every_k`` (``k``, default 2) and ``sqrt`` return
    their fixed plan, with a note in ``Plan.notes`` when it exceeds a budget given.
    """
    if not isinstance(profile, Profile):
        raise TypeError(
            f"solve expects a remat Profile, got {type(profile).__name__}"
            + ("; load a saved one with Profile.load(path)" if isinstance(profile, str | Path) else
               "; make one with remat.profile(model, batch)")
        )
    check_method(method)
    if k is not None and method != "every_k":
        raise ValueError(f"k={k!r} applies to method='every_k' only, not to method={method!r}")
    budget_bytes = (
        None if budget is None else parse_budget(budget, plain_peak_bytes=profile.plain_peak_bytes)
    )
    chain = chain_constraints(profile)
    notes: list[str] = []
    if method in _BUDGET_METHODS:
        if budget_bytes is None:
            raise ValueError(
                f"method={method!r} needs a budget, e.g. solve(profile, '6GiB') or "
                "solve(profile, '60%'); the baselines 'none', 'all', 'every_k', 'sqrt' take none"
            )
        unused = sorted({o for b in profile.blocks for o in b.options} - set(chain.options))
        if unused:
            notes.append(
                f"options {unused} are not offered by every block on {profile.device!r}; "
                "the planner did not use them"
            )
        if method == "optimal":
            picks = _optimal_picks(chain, budget_bytes)
            if picks is None:
                raise _infeasible(profile, budget_bytes)
        else:
            picks = _greedy_picks(profile, chain, budget_bytes)
        names = [chain.options[o] for o in picks]
    else:
        names = _baseline(method, chain, len(profile.blocks), k)
    plan = _plan(profile, names, budget_bytes, method, notes)
    if budget_bytes is not None and plan.estimate.peak_bytes > budget_bytes:
        over = (
            f"does not fit the budget: predicted peak {format_bytes(plan.estimate.peak_bytes)} "
            f"> budget {format_bytes(budget_bytes)}"
        )
        plan = dataclasses.replace(plan, notes=[*plan.notes, over])
    return plan


def check_method(method: str) -> None:
    """Refuse a ``method`` that ``solve`` does not offer (before any work is done)."""
    if method not in METHODS:
        raise ValueError(
            f"unknown method {method!r}; expected one of {list(METHODS)}"
            + did_you_mean(str(method), METHODS)
        )


def in_eval_mode(error: InfeasibleBudget) -> InfeasibleBudget:
    """``error`` for a model that was profiled in ``eval()`` mode: say so, since the likely fix
    is ``model.train()``, not a larger budget."""
    head = str(error).rsplit("; ", 1)[0]
    return InfeasibleBudget(
        f"{head}; the model is in eval() mode, but remat plans training steps: call model.train() "
        "before planning (if it still does not fit, raise the budget or lower the batch).",
        budget_bytes=error.budget_bytes, smallest_bytes=error.smallest_bytes,
        dominant=error.dominant,
    )


def frontier(profile: Profile, *, points: int | None = 16) -> list[Plan]:
    """Optimal plans from the fastest (lowest peak among the fastest) down to the smallest feasible
    peak, by decreasing peak and increasing step time; each is on the memory/time Pareto frontier.

    ``points`` budgets are spread evenly over that range and plans that repeat are dropped;
    ``points=None`` walks every point of the frontier (slower on long, varied chains).
    """
    if points is not None and (isinstance(points, bool) or points < 2):
        raise ValueError(f"points must be an int >= 2 or None (every point), got {points!r}")
    chain = chain_constraints(profile)
    top = _optimal_picks(chain, _NO_LIMIT_BYTES)
    assert top is not None
    high = chain.peak_bytes(top)
    low, _ = smallest_feasible(profile)
    plans: dict[tuple[int, float], Plan] = {}

    def add(budget: int) -> int:
        picks = _optimal_picks(chain, budget)
        assert picks is not None, "budgets here are at least the smallest feasible"
        plan = _plan(profile, [chain.options[o] for o in picks], budget, "optimal", [])
        # Budgets between two points of the frontier give the same point: keep the first.
        plans.setdefault((plan.estimate.peak_bytes, plan.estimate.step_ms), plan)
        return plan.estimate.peak_bytes

    if points is None:
        budget = high
        while budget >= low:
            budget = add(budget) - 1
    else:
        for budget in np.linspace(high, low, points).round().tolist():
            add(max(int(budget), low))
    return sorted(plans.values(), key=lambda p: (-p.estimate.peak_bytes, p.estimate.step_ms))


# --- optimal: a Pareto dynamic program over prefix kept bytes ----------------------------------

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


def _optimal_picks(
    chain: ChainConstraints, budget_bytes: int, *, plain_limit: int = _PLAIN_LIMIT
) -> list[int] | None:
    """Option indices of the fastest plan whose peak fits ``budget_bytes`` (the lowest peak among
    those, then the fewest kept bytes); None when none fits. ``plain_limit``: NOTE [ Bounding the
    search ]; tests set it to 0 to check the bounded search."""
    floors = chain.suffix_floor_bytes()
    budget = min(budget_bytes, _NO_LIMIT_BYTES)
    if max(chain.fixed_bytes, floors[0]) > budget:
        return None
    if not chain.kept_bytes:
        return []
    table = _Table.of(chain, budget, floors)
    found = _search(table, bound_ticks=None, width=None, give_up=plain_limit)
    if found is None:  # a varied chain: bound the search (NOTE [ Bounding the search ])
        table = table.bounded()
        rough = _search(table, bound_ticks=None, width=_ROUGH_WIDTH, give_up=None)
        assert rough is not None, "the floor check above guarantees a feasible plan"
        found = _search(table, bound_ticks=rough[1], width=None, give_up=None)
        assert found is not None, "the rough plan itself is within the bound"
    return found[0]


@dataclass(frozen=True)
class _Table:
    """One search's numbers: per block, the useful options' int64 columns, and bounds."""

    columns: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
    """Per block: the option indices ``_undominated`` keeps, and their kept, need, ticks."""
    room: np.ndarray
    """[i], i = 0..n: the largest K before block i from which some finish fits the budget."""
    fixed_bytes: int
    tail_bytes: int
    budget_bytes: int
    cell_bytes: int = 1
    rest: np.ndarray | None = None
    """[i, K // cell_bytes]: a lower bound on the ticks blocks i.. add to fit the budget."""

    @classmethod
    def of(cls, chain: ChainConstraints, budget: int, floors: list[int]) -> _Table:
        n, width = len(chain.kept_bytes), len(chain.options)
        kept = np.array(chain.kept_bytes, dtype=np.int64).reshape(n, width)
        need = np.array(chain.need_bytes, dtype=np.int64).reshape(n, width)
        ms = np.array(chain.extra_ms, dtype=np.float64).reshape(n, width)
        ticks = np.rint(ms * _TICKS_PER_MS).astype(np.int64)
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
        )

    def bounded(self) -> _Table:
        """This table with ``rest`` filled in, backward from the head: from the low end of cell c
        an option's kept bytes lead exactly to the low end of cell c + kept // cell_bytes, and
        the option fits from cells c with c * cell_bytes + need <= budget."""
        n = len(self.columns)
        cell = int(self.room.max()) // _CELLS + 1
        rest = np.full((n + 1, _CELLS), _NO_LIMIT_TICKS, dtype=np.int64)
        rest[n, : max(0, min(_CELLS, int(self.room[n]) // cell + 1))] = 0
        # rest[i + 1] followed by "past the end": a window at offset s is rest[i + 1] from cell s.
        padded = np.full(2 * _CELLS, _NO_LIMIT_TICKS, dtype=np.int64)
        windows = np.lib.stride_tricks.sliding_window_view(padded, _CELLS)
        cells = np.arange(_CELLS, dtype=np.int64)
        for i in range(n - 1, -1, -1):
            _, kept, need, ticks = self.columns[i]
            padded[:_CELLS] = rest[i + 1]
            shifts = np.minimum(kept // cell, _CELLS)
            fits = cells[None, :] * cell + need[:, None] <= self.budget_bytes
            after = np.where(fits, windows[shifts] + ticks[:, None], _NO_LIMIT_TICKS).min(axis=0)
            rest[i] = np.where(after >= _NO_LIMIT_TICKS // 2, _NO_LIMIT_TICKS, after)
        return dataclasses.replace(self, cell_bytes=cell, rest=rest)


def _search(
    table: _Table, *, bound_ticks: int | None, width: int | None, give_up: int | None
) -> tuple[list[int], int] | None:
    """The DP of NOTE [ Pareto DP over prefix kept bytes ]: the option indices and ticks of the
    best plan, or None when more than ``give_up`` partial plans survive one block.

    ``bound_ticks`` drops partial plans that ``table.rest`` says cannot end within it; ``width``
    keeps only that many per block, the most promising by ``rest``: fast, not always the best."""
    K = np.zeros(1, dtype=np.int64)
    T = np.zeros(1, dtype=np.int64)
    P = np.full(1, table.fixed_bytes, dtype=np.int64)
    parents: list[np.ndarray] = []
    chosen: list[np.ndarray] = []
    for i, (cols, kept, need, ticks) in enumerate(table.columns):
        cK = (K[:, None] + kept).ravel()
        cT = (T[:, None] + ticks).ravel()
        cP = np.maximum(P[:, None], K[:, None] + need).ravel()
        drop = (cP > table.budget_bytes) | (cK > table.room[i + 1])
        hope = None
        if table.rest is not None:
            cell = np.minimum(cK // table.cell_bytes, _CELLS - 1)  # beyond room: dropped anyway
            hope = cT + table.rest[i + 1, cell]
            if bound_ticks is not None:
                drop |= hope > bound_ticks
        alive = _front(cK, cT, cP, drop)
        assert alive.size, "room and rest only drop partial plans that cannot fit or win"
        if width is not None and alive.size > width:
            assert hope is not None, "a beam needs the bounds to rank by"
            alive = alive[np.argsort(hope[alive], kind="stable")[:width]]
        if give_up is not None and alive.size > give_up:
            return None
        parents.append(alive // cols.size)
        chosen.append(cols[alive % cols.size])
        K, T, P = cK[alive], cT[alive], cP[alive]

    final = np.maximum(P, K + table.tail_bytes)
    at = int(np.lexsort((K, final, T))[0])
    ticks_total = int(T[at])
    picks = [0] * len(table.columns)
    for i in range(len(table.columns) - 1, -1, -1):
        picks[i] = int(chosen[i][at])
        at = int(parents[i][at])
    return picks, ticks_total


def _undominated(kept: np.ndarray, need: np.ndarray, ticks: np.ndarray) -> np.ndarray:
    """[block, option]: False where another option of the block is no worse in kept bytes, peak
    term and time (and better in one, or equal and earlier in ``OPTIONS``)."""
    rows = np.stack([kept, need, ticks])  # (3, n, width)
    no_worse = (rows[:, :, :, None] <= rows[:, :, None, :]).all(axis=0)  # [b, by, of]
    better = (rows[:, :, :, None] < rows[:, :, None, :]).any(axis=0)
    width = kept.shape[1]
    earlier = np.tri(width, width, -1, dtype=bool).T  # earlier[by, of]: by < of
    beaten = no_worse & (better | earlier[None])
    beaten &= ~np.eye(width, dtype=bool)[None]
    return np.logical_not(beaten.any(axis=1))


def _front(K: np.ndarray, T: np.ndarray, P: np.ndarray, drop: np.ndarray) -> np.ndarray:
    """Indices of the states that are not dropped and that no other dominates (NOTE [ Pareto DP
    over prefix kept bytes ]), ordered by K."""
    t_low, p_low = int(T.min()), int(P.min())
    p_span = int(P.max()) - p_low + 1
    if (int(T.max()) - t_low + 1) * p_span < _DROPPED:
        # (T, P) packed into one int64 that orders like the pair: one sort less.
        rank = (T - t_low) * p_span + (P - p_low)
    else:
        by_tp = np.lexsort((P, T))
        Ts, Ps = T[by_tp], P[by_tp]
        step = np.empty(by_tp.size, dtype=bool)
        step[0] = True
        step[1:] = (Ts[1:] != Ts[:-1]) | (Ps[1:] != Ps[:-1])
        rank = np.empty(by_tp.size, dtype=np.int64)
        rank[by_tp] = np.cumsum(step)
    rank[drop] = _DROPPED
    by_k = np.lexsort((rank, K))
    r = rank[by_k]
    keep = np.empty(by_k.size, dtype=bool)
    keep[0] = r[0] < _DROPPED
    keep[1:] = r[1:] < np.minimum.accumulate(r)[:-1]
    return by_k[keep]


# --- greedy ------------------------------------------------------------------------------------


def _greedy_picks(profile: Profile, chain: ChainConstraints, budget_bytes: int) -> list[int]:
    """Start from keeping every block; switch the block and option that save the most kept bytes
    per extra millisecond until the estimated peak fits. A baseline: fast, not optimal."""
    smallest, dominant = smallest_feasible(profile)
    if smallest > budget_bytes:
        raise _infeasible(profile, budget_bytes)
    n = len(chain.kept_bytes)
    kept = np.array(chain.kept_bytes, dtype=np.int64).reshape(n, len(chain.options))
    need = np.array(chain.need_bytes, dtype=np.int64).reshape(n, len(chain.options))
    picks = np.full(n, _option_index(chain, "keep"), dtype=np.int64)
    rows = np.arange(n)

    def peak() -> int:
        k = kept[rows, picks]
        before = np.cumsum(k) - k
        return max(
            chain.fixed_bytes,
            int((before + need[rows, picks]).max(initial=0)),
            int(k.sum()) + chain.tail_bytes,
        )

    heap: list[tuple[float, int, int, int, int]] = []
    version = [0] * n

    def push_moves(i: int) -> None:
        now = int(picks[i])
        for o in range(len(chain.options)):
            saved = int(kept[i, now] - kept[i, o])
            if saved <= 0:
                continue
            cost_ms = chain.extra_ms[i][o] - chain.extra_ms[i][now]
            ratio = math.inf if cost_ms <= 0 else saved / cost_ms
            heapq.heappush(heap, (-ratio, -saved, i, o, version[i]))

    for i in range(n):
        push_moves(i)
    reached = peak()
    while reached > budget_bytes and heap:
        _, _, i, o, seen = heapq.heappop(heap)
        if seen != version[i]:
            continue  # the block moved since this entry was pushed
        picks[i] = o
        version[i] += 1
        push_moves(i)
        reached = peak()
    if reached > budget_bytes:
        raise InfeasibleBudget(
            f"greedy could not bring the peak under the budget {_bytes(budget_bytes, smallest)}: "
            f"switching blocks by bytes saved per extra millisecond stops at "
            f"{format_bytes(reached)}, while the smallest feasible is "
            f"{_bytes(smallest, budget_bytes)} ({dominant}); use method='optimal' or raise the budget",
            budget_bytes=budget_bytes,
            smallest_bytes=smallest,
            dominant=dominant,
        )
    return [int(o) for o in picks]


# --- baselines ---------------------------------------------------------------------------------

# NOTE [ Baselines ]
# They are what people do by hand, kept to measure the optimal plan against.
# - none: every block kept, the plain step.
# - all: every block recomputed, what ``gradient_checkpointing_enable()`` does.
# - every_k: recompute blocks k, 2k, ... counting from 1 (indices k-1, 2k-1, ...), the reading of
#   torchtitan's ``selective_ac_option=<k>`` (checkpoint_wrapper on every k-th layer).
# - sqrt: Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost") store the inputs of
#   ~sqrt(n) segments and hold one segment's sqrt(n) blocks of activations while recomputing it.
#   Per-block options cannot drop a recomputed block's input, so the faithful per-block reading
#   spends the same sqrt(n) blocks of activations on keeping isqrt(n) evenly spaced blocks whole
#   (centres of isqrt(n) equal stretches) and recomputes every other block.


def _baseline(method: str, chain: ChainConstraints, n: int, k: int | None) -> list[str]:
    if method == "none":
        _option_index(chain, "keep")
        return ["keep"] * n
    _option_index(chain, "recompute")
    if method == "all":
        return ["recompute"] * n
    if method == "every_k":
        k = 2 if k is None else k
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1 (recompute every k-th block), got {k!r}")
        return ["recompute" if (i + 1) % k == 0 else "keep" for i in range(n)]
    assert method == "sqrt", method
    _option_index(chain, "keep")
    stretches = math.isqrt(n)
    whole = {int((j + 0.5) * n / stretches) for j in range(stretches)}
    return ["keep" if i in whole else "recompute" for i in range(n)]


# --- helpers -----------------------------------------------------------------------------------


def _option_index(chain: ChainConstraints, option: str) -> int:
    if option not in chain.options:
        raise ValueError(
            f"this plan needs option {option!r}, which not every block of the profile offers; "
            f"the blocks offer {list(chain.options)} in common; re-profile with {option!r} enabled"
        )
    return chain.options.index(option)


def _plan(
    profile: Profile,
    options: Sequence[str],
    budget_bytes: int | None,
    method: str,
    notes: list[str],
) -> Plan:
    choices = {b.name: o for b, o in zip(profile.blocks, options)}
    return Plan(
        choices=choices,
        budget_bytes=budget_bytes,
        method=method,
        estimate=estimate(profile, choices),
        model=profile.model,
        fingerprint=profile.fingerprint,
        device=profile.device,
        dtype=profile.dtype,
        batch_shape=list(profile.batch_shape),
        notes=notes,
    )


def _infeasible(profile: Profile, budget_bytes: int) -> InfeasibleBudget:
    smallest, dominant = smallest_feasible(profile)
    assert smallest > budget_bytes, (smallest, budget_bytes)
    if 2 * (profile.param_bytes + profile.optimizer_bytes) >= smallest:
        advice = (
            "raise the budget, or shard the parameters and optimizer state over more devices (FSDP)"
        )
    else:
        advice = "raise the budget or lower the batch"
    return InfeasibleBudget(
        f"budget {_bytes(budget_bytes, smallest)} is below the smallest feasible "
        f"{_bytes(smallest, budget_bytes)} ({dominant}); {advice}.",
        budget_bytes=budget_bytes,
        smallest_bytes=smallest,
        dominant=dominant,
    )


def _bytes(n: int, other: int) -> str:
    """``n`` for people, with the exact count when it would read the same as ``other``."""
    text = format_bytes(n)
    return f"{text} ({n} bytes)" if text == format_bytes(other) else text
