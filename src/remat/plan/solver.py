"""Choose one option per block so that a step fits a memory budget with the least extra time.

``solve(profile, budget)`` returns a ``Plan``; ``frontier(profile)`` the memory/time trade-off of
optimal plans. The solvers see only the numbers of a ``Profile`` and judge every plan with the one
cost model, ``remat.plan.costmodel``. Pure: no torch, no I/O, deterministic.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from remat.errors import InfeasibleBudget, InvalidType, InvalidValue, did_you_mean
from remat.plan.baselines import baseline, option_index
from remat.plan.bounds import optimal_picks
from remat.plan.chain import ChainConstraints, chain_constraints
from remat.plan.costmodel import estimate, priced_picks, smallest_feasible
from remat.plan.fastest import fastest
from remat.plan.handovers import handovers
from remat.plan.head import HEAD_KEEP, best_of_heads, frontier_of_heads, head_names, with_head
from remat.plan.optimum import Found
from remat.plan.refusals import exact_bytes, in_eval_mode, infeasible, tied_note
from remat.plan.search import NO_LIMIT_BYTES
from remat.plan.segment_estimate import estimate_segments
from remat.plan.segment_search import segment_search
from remat.plan.segments import SegmentModel, Tree
from remat.records import Estimate, Plan, Profile
from remat.units import format_bytes, parse_budget

__all__ = [
    "METHODS", "InfeasibleBudget", "check_method", "frontier", "in_eval_mode", "smallest_any", "solve",
]

#: The solvers ``solve`` offers. ``optimal`` and ``greedy`` need a budget; the rest ignore it.
METHODS: tuple[str, ...] = ("optimal", "greedy", "none", "all", "every_k", "sqrt")

_BUDGET_METHODS = ("optimal", "greedy")

def solve(
    profile: Profile,
    budget: int | str | None = None,
    *,
    method: str = "optimal",
    k: int | None = None,
    segments: bool = True,
) -> Plan:
    """One option per block for ``profile``'s step, by ``method`` (one of ``METHODS``).

    ``budget`` is the peak bytes of the whole step: an int, or a string such as ``"6GiB"``,
    ``"6.5GB"``, ``"800MiB"`` or ``"60%"`` (of the plain step's peak). ``optimal`` finds the fastest
    plan that fits it and ``greedy`` a quick approximation; both raise ``InfeasibleBudget`` when
    none fits. The baselines ``none``, ``all``, ``every_k`` (``k``, default 2) and ``sqrt`` return
    their fixed plan, with a note in ``Plan.notes`` when it exceeds a budget given.
    ``segments=False``: ``optimal`` chooses per-block options only (no multi-block segments).
    """
    if not isinstance(profile, Profile):
        raise InvalidType(
            f"solve expects a remat Profile, got {type(profile).__name__}"
            + ("; load a saved one with Profile.load(path)" if isinstance(profile, str | Path) else
               "; make one with remat.profile(model, batch)")
        )
    check_method(method)
    if k is not None and method != "every_k":
        raise InvalidValue(f"k={k!r} applies to method='every_k' only, not to method={method!r}")
    budget_bytes = (
        None if budget is None else parse_budget(budget, plain_peak_bytes=profile.plain_peak_bytes,
                                                 device_memory_bytes=profile.device_memory_bytes)
    )
    if profile.head_options and method in _BUDGET_METHODS and budget_bytes is not None:
        # NOTE [ The head's options ] in remat.records: the blocks solved once per head option.
        return best_of_heads(
            profile, lambda one: solve(one, budget_bytes, method=method, segments=segments)
        )
    chain = chain_constraints(profile)
    notes: list[str] = []
    if method in _BUDGET_METHODS:
        if budget_bytes is None:
            raise InvalidValue(
                f"method={method!r} needs a budget, e.g. solve(profile, '6GiB') or "
                "solve(profile, '60%'); the baselines 'none', 'all', 'every_k', 'sqrt' take none"
            )
        unused = sorted({o for b in profile.blocks for o in b.options} - set(chain.options))
        if unused:
            notes.append(
                f"options {unused} are not offered by every block on {profile.device!r}; "
                "the planner did not use them"
            )
        plan = _searched(profile, chain, budget_bytes, method, notes, segments)
    else:
        plan = _plan(profile, baseline(method, chain, len(profile.blocks), k), budget_bytes, method, notes)
    if budget_bytes is not None and plan.estimate.peak_bytes > budget_bytes:
        over = (
            f"does not fit the budget: predicted peak {format_bytes(plan.estimate.peak_bytes)} "
            f"> budget {format_bytes(budget_bytes)}"
        )
        plan = dataclasses.replace(plan, notes=[*plan.notes, over])
    return plan


def _searched(profile: Profile, chain: ChainConstraints, budget_bytes: int, method: str, notes: list[str],
              segments: bool) -> Plan:
    """The plan ``method`` (``optimal`` or ``greedy``) finds under ``budget_bytes``."""
    spans: list[list[str]] = []
    if method == "optimal":
        picks, spans = _optimal(profile, chain, budget_bytes, segments)
    else:
        picks = _greedy_picks(profile, chain, budget_bytes)
    return _plan(profile, chain.chosen(picks), budget_bytes, method, notes, spans)


def check_method(method: str) -> None:
    """Refuse a ``method`` that ``solve`` does not offer (before any work is done)."""
    if method not in METHODS:
        raise InvalidValue(
            f"unknown method {method!r}; expected one of {list(METHODS)}"
            + did_you_mean(str(method), METHODS)
        )


def frontier(profile: Profile, *, points: int | None = 16, segments: bool = True) -> list[Plan]:
    """Optimal plans from the fastest (lowest peak among the fastest) down to the smallest feasible
    peak (``smallest_any``: with segments), by decreasing peak and increasing step time; each is on
    the memory/time Pareto frontier.

    ``points`` budgets are spread evenly over that range and plans that repeat are dropped;
    ``points=None`` walks every point of the frontier (slower on long, varied chains).
    ``segments=False``: per-block options only, as ``solve(..., segments=False)``.
    """
    if points is not None and (isinstance(points, bool) or points < 2):
        raise InvalidValue(f"points must be an int >= 2 or None (every point), got {points!r}")
    if profile.head_options:  # NOTE [ The head's options ] in remat.records
        return frontier_of_heads(profile, lambda one: frontier(one, points=points, segments=segments))
    chain = chain_constraints(profile)
    top = optimal_picks(chain, NO_LIMIT_BYTES)
    assert top is not None
    high = chain.peak_bytes(top)
    low = smallest_any(profile)[0] if segments else smallest_feasible(profile)[0]
    plans: dict[tuple[int, float], Plan] = {}

    def add(budget: int) -> int:
        plan = _searched(profile, chain, budget, "optimal", [], segments)
        # Budgets between two points of the frontier give the same point: keep the first.
        plans.setdefault((plan.estimate.peak_bytes, plan.estimate.step_ms), plan)
        return min(budget, plan.estimate.peak_bytes)

    if points is None:
        budget = high
        while budget >= low:
            budget = add(budget) - 1
    else:
        for budget in np.linspace(high, low, points).round().tolist():
            add(max(int(budget), low))
    out: list[Plan] = []  # a point some lower one is as fast as is not on the frontier (the
    # segment search is not exhaustive on long chains: NOTE [ Searching segments ])
    for plan in sorted(plans.values(), key=lambda p: (p.estimate.peak_bytes, p.estimate.step_ms)):
        if not out or plan.estimate.step_ms < out[-1].estimate.step_ms:
            out.append(plan)
    return out[::-1]


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
    picks = np.full(n, option_index(chain, "keep"), dtype=np.int64)
    rows = np.arange(n)

    def peak() -> int:
        if chain.holds:  # side inputs: the state-carrying form (NOTE [ A side input's extra life ])
            return chain.peak_bytes([int(o) for o in picks])
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
            f"greedy could not bring the peak under the budget {exact_bytes(budget_bytes, smallest)}: "
            f"switching blocks by bytes saved per extra millisecond stops at "
            f"{format_bytes(reached)}, while the smallest feasible is "
            f"{exact_bytes(smallest, budget_bytes)} ({dominant}); use method='optimal' or raise the budget",
            budget_bytes=budget_bytes,
            smallest_bytes=smallest,
            dominant=dominant,
        )
    return [int(o) for o in picks]


def _optimal(
    profile: Profile, chain: ChainConstraints, budget: int, segments: bool
) -> tuple[list[int], list[list[str]]]:
    """The picks and segments of NOTE [ The optimum, defined ] (``remat.plan.optimum``), found by
    ``remat.plan.fastest``; segments only where ``_segments_run`` allows them."""
    model = SegmentModel(profile, chain) if segments and _segments_run(profile, chain) else None
    found = fastest(chain, model, budget)
    if model is not None and handovers(profile):
        found = _counted(profile, chain, model, budget, found)
    if found is None and chain.bound:
        found = _priced(profile, chain, budget)
    if found is None:
        raise _infeasible(profile, budget, segments)
    return found.picks, _segment_names(profile, found.trees)


def _priced(profile: Profile, chain: ChainConstraints, budget: int) -> Found | None:
    """The fastest of ``priced_picks`` that ``estimate`` fits in ``budget``, where pinned handovers
    left the searches none: ``smallest_feasible`` names their floor too."""
    names = [b.name for b in profile.blocks]
    fits = [(e.step_ms, picks) for picks in priced_picks(chain)
            if (e := estimate(profile, dict(zip(names, chain.chosen(picks))))).peak_bytes <= budget]
    return Found(picks=min(fits)[1], trees=[]) if fits else None


def _counted(profile: Profile, chain: ChainConstraints, model: SegmentModel, budget: int,
             found: Found | None) -> Found | None:
    """``found`` with the handovers counted. The segment search sees them as each option's own
    run did (``SegmentModel.chain``), so a plan with segments is judged by ``estimate_segments``:
    over the budget, the per-block optimum (exact with handovers) takes its place, or, where no
    per-block plan fits, the plan of the lowest peak with segments, if that fits
    (``smallest_any``'s floor)."""
    if found is not None and (not found.trees or _estimated(profile, chain, found).peak_bytes <= budget):
        return found
    per_block = fastest(chain, None, budget)
    if per_block is not None:
        return per_block
    low = _lowest_with_segments(model)
    return low if low is not None and _estimated(profile, chain, low).peak_bytes <= budget else None


def _lowest_with_segments(model: SegmentModel) -> Found | None:
    """The plan with segments of the lowest peak by the segment model; None if it has none."""
    seg = segment_search(model.chain, model, NO_LIMIT_BYTES, objective="peak")
    return None if seg is None or not seg.trees else Found(seg.picks, seg.trees)


def _estimated(profile: Profile, chain: ChainConstraints, found: Found) -> Estimate:
    """``found``'s estimate, with segments and handovers counted."""
    choices = dict(zip((b.name for b in profile.blocks), chain.chosen(found.picks)))
    return estimate_segments(profile, choices, _segment_names(profile, found.trees))


def _segment_names(profile: Profile, trees: Sequence[Tree]) -> list[list[str]]:
    names = [b.name for b in profile.blocks]
    spans = sorted((s for t in trees for s in t.spans()), key=lambda s: (s[0], -s[1]))
    return [[names[a], names[b]] for a, b in spans]


def smallest_any(profile: Profile) -> tuple[int, str]:
    """``smallest_feasible`` over plans with segments too: the lowest peak any plan reaches, and
    what dominates it (or where it falls, when segments reach below every per-block plan); with
    head options, the lowest over them (NOTE [ The head's options ] in remat.records)."""
    if profile.head_options:
        low, why, head = min(((*smallest_any(with_head(profile, h)), h) for h in head_names(profile)),
                             key=lambda t: t[0])
        return low, why if head == HEAD_KEEP else f"{why} (head: {head})"
    chain = chain_constraints(profile)
    low, why = smallest_feasible(profile)
    if not _segments_run(profile, chain):
        return low, why
    seg = _lowest_with_segments(SegmentModel(profile, chain))
    if seg is None:
        return low, why
    reached = _estimated(profile, chain, seg)  # with handovers, counted (``_counted``)
    if reached.peak_bytes >= low:
        return low, why
    return reached.peak_bytes, f"with segments; the peak falls at the {reached.peak_phase}"


def _plan(
    profile: Profile,
    options: Sequence[str],
    budget_bytes: int | None,
    method: str,
    notes: list[str],
    segments: list[list[str]] | None = None,
) -> Plan:
    choices = {b.name: o for b, o in zip(profile.blocks, options)}
    return Plan(
        choices=choices,
        segments=list(segments or []),
        budget_bytes=budget_bytes,
        method=method,
        estimate=estimate_segments(profile, choices, segments or []),
        model=profile.model,
        fingerprint=profile.fingerprint,
        device=profile.device,
        dtype=profile.dtype,
        batch_shape=list(profile.batch_shape),
        plain_ran=profile.plain_ran,
        notes=notes + tied_note(profile),
        tied=list(profile.tied),
    )


def _segments_run(profile: Profile, chain: ChainConstraints) -> bool:
    """Whether plans with segments can run for ``profile``: blocks that keep and recompute, no
    FSDP2 (``remat.distributed.apply_distributed`` refuses them there) and no layerdrop
    (``Profile.layerdrop``: ``remat.apply`` refuses a segment over a layer it may skip)."""
    return {"keep", "recompute"} <= set(chain.options) and not profile.fsdp and not profile.layerdrop


def _infeasible(profile: Profile, budget_bytes: int, segments: bool = True) -> InfeasibleBudget:
    return infeasible(profile, budget_bytes, *(smallest_any if segments else smallest_feasible)(profile))
