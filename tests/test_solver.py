"""The solvers on hand-worked tables, against brute force on random chains, and at the edges."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import unittest.mock

import pytest
from _tables import (
    Brute,
    block,
    brute_force,
    budget_near,
    chains,
    cost,
    profile,
    segment,
    varied_chain,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.plan import bounds as solver
from remat.plan import crossings
from remat.plan.chain import chain_constraints
from remat.plan.costmodel import estimate, priced_picks, smallest_feasible
from remat.plan.optimum import defined
from remat.plan.segment_estimate import estimate_segments
from remat.plan.solver import METHODS, InfeasibleBudget, frontier, smallest_any, solve
from remat.records import Plan, Profile, RecordError

# --- hand tables -------------------------------------------------------------------------------


def two_blocks() -> Profile:
    # The table of test_costmodel.py: keep,keep peaks at 126; recompute on a brings it to 118
    # (5 ms); recompute on b alone buys nothing (126, 3 ms); both reach 118 too (8 ms).
    return profile(
        [
            block("a", keep=cost(10, fwd=4, bwd=6), recompute=cost(2, fwd=4, bwd=14, ms=5.0)),
            block("b", keep=cost(10, fwd=4, bwd=6), recompute=cost(2, fwd=4, bwd=14, ms=3.0)),
        ],
        base=100,
        params=60,
        optimizer=30,
        batch=10,
    )


def tie() -> Profile:
    # Numbers chosen for a tie, not for realism. Nothing but the two blocks holds memory.
    # keep,keep:      K = 10, 20; head 20, backward of b 20           -> 20 B, 0 ms
    # recompute a:    K = 2, 12;  head 12, backward of a 2+8 = 10     -> 12 B, 1 ms
    # recompute b:    K = 10, 10; head 10, backward of b 10+1 = 11    -> 11 B, 1 ms
    # both:           K = 2, 2;   backward of b 3, of a 2+8 = 10      -> 10 B, 2 ms
    return profile(
        [
            block("a", keep=cost(10), recompute=cost(2, bwd=8, ms=1.0)),
            block("b", keep=cost(10), recompute=cost(0, bwd=1, ms=1.0)),
        ]
    )


def four_blocks() -> Profile:
    # base 50; the head needs 5 B above the kept activations, forward and backward; no grads.
    # keep 8 B kept (backward +3), selective 4 B (+5, 1 ms), recompute 1 B (+10, 3 ms).
    # With K_i the bytes kept by blocks 1..i: peak = 50 + max(K_4 + 5, K_i + bwd_i).
    opts = {
        "keep": cost(8, fwd=2, bwd=3),
        "selective": cost(4, fwd=2, bwd=5, ms=1.0),
        "recompute": cost(1, fwd=2, bwd=10, ms=3.0),
    }
    return profile(
        [block(f"layers.{i}", **opts) for i in range(4)],
        base=50,
        params=30,
        optimizer=20,
        post=segment(fwd=5, bwd=5),
    )


def _extra_ms(p: Profile, plan: Plan) -> float:
    if plan.segments:  # a segment's replays cost more than its blocks' choices say
        return estimate_segments(p, plan.choices, plan.segments).step_ms - p.plain_step_ms
    return sum(b.options[plan.choices[b.name]].extra_ms for b in p.blocks)


def test_two_blocks() -> None:
    p = two_blocks()
    assert solve(p, 126).choices == {"a": "keep", "b": "keep"}
    # 120 B: only plans with recompute on a fit; alone it costs 5 ms, with b 8 ms.
    for budget in (125, 120, 118):
        plan = solve(p, budget)
        assert plan.choices == {"a": "recompute", "b": "keep"}
        assert (plan.estimate.peak_bytes, plan.estimate.step_ms) == (118, 105.0)
        assert plan.budget_bytes == budget and plan.method == "optimal"


def test_two_blocks_greedy_is_worse() -> None:
    # Greedy switches b first (8 B saved for 3 ms beats 8 B for 5 ms), which does not lower the
    # peak, then a: both recomputed, 8 ms where 5 ms suffice.
    plan = solve(two_blocks(), 120, method="greedy")
    assert plan.choices == {"a": "recompute", "b": "recompute"}
    assert plan.estimate.step_ms == 108.0


def test_equal_time_prefers_the_lower_peak() -> None:
    plan = solve(tie(), 15)
    assert plan.choices == {"a": "keep", "b": "recompute"}
    assert plan.estimate.peak_bytes == 11
    assert solve(tie(), 10).choices == {"a": "recompute", "b": "recompute"}


def test_frontier_of_the_tie_table() -> None:
    points = [(p.estimate.peak_bytes, p.estimate.step_ms) for p in frontier(tie(), points=None)]
    assert points == [(20, 100.0), (11, 101.0), (10, 102.0)]
    assert [p.method for p in frontier(tie(), points=None)] == ["optimal"] * 3


def test_four_blocks() -> None:
    p = four_blocks()
    # keep everything: 50 + 32 + 5 = 87 B.
    assert solve(p, 87).estimate.peak_bytes == 87
    # 80 B: K_4 <= 25, so save 7 B; two selective (8 B, 2 ms) beat one recompute (7 B, 3 ms);
    # peak 50 + 24 + 5 = 79 wherever they go.
    plan = solve(p, 80)
    assert sorted(plan.choices.values()) == ["keep", "keep", "selective", "selective"]
    assert (plan.estimate.peak_bytes, _extra_ms(p, plan)) == (79, 2.0)
    # 75 B: save 12 B: three selective (3 ms); 50 + 20 + 5 = 75.
    plan = solve(p, 75)
    assert sorted(plan.choices.values()) == ["keep", "selective", "selective", "selective"]
    assert (plan.estimate.peak_bytes, _extra_ms(p, plan)) == (75, 3.0)
    # 70 B: K_4 <= 15, save 17 B: four selective save only 16; three selective and one
    # recompute (6 ms) save 19, and the recompute block needs K_i + 10 <= 20: first or second
    # place (peak 50 + 13 + 5 = 68; in third place its backward reaches 69).
    plan = solve(p, 70)
    assert sorted(plan.choices.values()) == ["recompute", "selective", "selective", "selective"]
    assert (plan.estimate.peak_bytes, _extra_ms(p, plan)) == (68, 6.0)
    assert plan.choices["layers.0"] == "recompute" or plan.choices["layers.1"] == "recompute"


def test_four_blocks_floor() -> None:
    # recompute, recompute, recompute, selective: K = 1, 2, 3, 7; backward of the third block
    # 3 + 10 = 13 is the highest; the last block selective (7 + 5 = 12) beats recompute (14).
    assert smallest_feasible(four_blocks()) == (63, "parameters and optimizer state take 50 B")
    plan = solve(four_blocks(), 63)
    assert plan.estimate.peak_bytes == 63
    assert plan.estimate.peak_phase == "backward of layers.2"


def test_frontier_runs_from_the_plain_peak_to_the_floor() -> None:
    plans = frontier(four_blocks())
    assert plans[0].choices == {f"layers.{i}": "keep" for i in range(4)}
    # With segments it reaches below every per-block plan (63): the lowest peak of any plan.
    assert (plans[0].estimate.peak_bytes, plans[-1].estimate.peak_bytes) == (87, 62)
    assert plans[-1].segments and smallest_any(four_blocks())[0] == 62
    per_block = frontier(four_blocks(), segments=False)
    assert per_block[-1].estimate.peak_bytes == 63 and not any(p.segments for p in per_block)
    peaks = [p.estimate.peak_bytes for p in plans]
    times = [p.estimate.step_ms for p in plans]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)
    assert times == sorted(times) and len(set(times)) == len(times)
    assert all(p.estimate.peak_bytes <= (p.budget_bytes or 0) for p in plans)


def test_infeasible_budget_says_what_to_do() -> None:
    with pytest.raises(InfeasibleBudget) as info:
        solve(two_blocks(), 117)
    e = info.value
    assert isinstance(e, ValueError)
    assert (e.budget_bytes, e.smallest_bytes) == (117, 118)
    assert e.dominant == "parameters and optimizer state take 90 B"
    assert str(e) == (
        "budget 117 B is below the smallest feasible 118 B (parameters and optimizer state take "
        "90 B); raise the budget, or shard the parameters and optimizer state over more devices "
        "(FSDP)."
    )


def test_infeasible_budget_dominated_by_activations_says_lower_the_batch() -> None:
    p = profile([block("a", keep=cost(5 * 2**30))], base=2**30, params=2**29, batch=2**29)
    with pytest.raises(InfeasibleBudget) as info:
        solve(p, "4GiB")
    assert str(info.value) == (
        "budget 4.00 GiB is below the smallest feasible 6.00 GiB (activations kept for the "
        "backward take 5.00 GiB); raise the budget or lower the batch."
    )


def test_close_budgets_show_exact_bytes() -> None:
    p = profile([block("a", keep=cost(2**30))], base=2**30, params=2**30)
    with pytest.raises(InfeasibleBudget, match=r"budget 2.00 GiB \(2147483647 bytes\) is below"):
        solve(p, 2**31 - 1)


def test_greedy_can_miss_a_feasible_budget() -> None:
    # recompute saves the most per ms (8 B / 1.5 ms) but brings its 20 B back in the backward;
    # from there greedy has no move left, while selective (6 B) fits.
    p = profile(
        [
            block(
                "a",
                keep=cost(10),
                selective=cost(6, ms=1.0),
                recompute=cost(2, bwd=20, ms=1.5),
            )
        ]
    )
    with pytest.raises(InfeasibleBudget, match=r"greedy could not.*method='optimal'") as info:
        solve(p, 7, method="greedy")
    assert info.value.smallest_bytes == 6
    assert solve(p, 7).choices == {"a": "selective"}


# --- baselines ---------------------------------------------------------------------------------


def _uniform(n: int) -> Profile:
    opts = {"keep": cost(10, bwd=2), "recompute": cost(1, bwd=12, ms=2.0)}
    return profile([block(f"layers.{i}", **opts) for i in range(n)], base=100)


def _recomputed(plan: Plan) -> list[int]:
    return [i for i, o in enumerate(plan.choices.values()) if o == "recompute"]


def test_baselines() -> None:
    p = _uniform(9)
    assert set(solve(p, method="none").choices.values()) == {"keep"}
    assert set(solve(p, method="all").choices.values()) == {"recompute"}
    assert _recomputed(solve(p, method="every_k")) == [1, 3, 5, 7]
    assert _recomputed(solve(p, method="every_k", k=3)) == [2, 5, 8]
    # isqrt(16) = 4 blocks kept whole, at the centres of four stretches of four.
    kept = [i for i in range(16) if i not in _recomputed(solve(_uniform(16), method="sqrt"))]
    assert kept == [2, 6, 10, 14]
    assert _recomputed(solve(_uniform(1), method="sqrt")) == []
    plan = solve(p, method="all")
    assert (plan.budget_bytes, plan.notes, plan.method) == (None, [], "all")


def test_baseline_over_budget_is_returned_with_a_note() -> None:
    plan = solve(_uniform(4), 120, method="none")
    assert plan.estimate.peak_bytes == 142  # 100 + 4 x 10 + the last backward's 2
    assert plan.notes == ["does not fit the budget: predicted peak 142 B > budget 120 B"]
    assert solve(_uniform(4), 142, method="none").notes == []


def test_baselines_need_their_options() -> None:
    p = profile([block("a", keep=cost(1), selective=cost(0, ms=1.0))])
    with pytest.raises(ValueError, match=r"needs option 'recompute'.*\['keep', 'selective'\]"):
        solve(p, method="all")


# --- the public edge ---------------------------------------------------------------------------


def test_budget_strings() -> None:
    p = profile([block("a", keep=cost(2**30), recompute=cost(2**20, ms=1.0))], plain_peak=2**31)
    assert solve(p, "1.5GiB").budget_bytes == 3 * 2**29
    assert solve(p, "1GB").budget_bytes == 10**9
    assert solve(p, "60%").budget_bytes == int(2**31 * 0.6)
    assert solve(p, "60%").choices == {"a": "keep"}
    assert solve(p, "40%").choices == {"a": "recompute"}


def test_unknown_method() -> None:
    with pytest.raises(ValueError, match=r"unknown method 'optimum'.*did you mean 'optimal'\?"):
        solve(two_blocks(), 120, method="optimum")
    assert METHODS == ("optimal", "greedy", "none", "all", "every_k", "sqrt")


def test_budget_and_k_are_checked() -> None:
    with pytest.raises(ValueError, match="method='optimal' needs a budget"):
        solve(two_blocks())
    with pytest.raises(ValueError, match="method='greedy' needs a budget"):
        solve(two_blocks(), method="greedy")
    with pytest.raises(ValueError, match=r"k=3 applies to method='every_k' only"):
        solve(two_blocks(), 120, k=3)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        solve(two_blocks(), method="every_k", k=0)
    with pytest.raises(ValueError, match="a budget must be positive"):
        solve(two_blocks(), 0)
    with pytest.raises(ValueError, match="points must be an int >= 2"):
        frontier(two_blocks(), points=1)


def test_options_not_offered_everywhere_are_left_out() -> None:
    p = profile(
        [
            block("a", keep=cost(10), recompute=cost(2, ms=5.0), offload=cost(0, ms=0.5)),
            block("b", keep=cost(10), recompute=cost(2, ms=5.0)),
        ]
    )
    plan = solve(p, 12)
    assert "offload" not in plan.choices.values()
    assert plan.notes == [
        "options ['offload'] are not offered by every block on 'cuda'; the planner did not use them"
    ]


def test_plan_carries_the_profile() -> None:
    p = four_blocks()
    plan = solve(p, 75)
    assert list(plan.choices) == [b.name for b in p.blocks]
    assert (plan.model, plan.fingerprint, plan.device, plan.dtype, plan.batch_shape) == (
        p.model,
        p.fingerprint,
        p.device,
        p.dtype,
        p.batch_shape,
    )


def test_plan_json_round_trip() -> None:
    plan = solve(_uniform(4), 120, method="none")
    assert plan.notes
    assert Plan.from_json(plan.to_json()) == plan
    plan = solve(four_blocks(), 70)
    assert Plan.from_json(plan.to_json()) == plan


def test_plan_of_another_schema_is_refused() -> None:
    data = json.loads(solve(four_blocks(), 70).to_json())
    for old in (1, 2):  # 1: before the head's option; 2: before Plan.tied
        data["schema_version"] = old
        with pytest.raises(RecordError, match=f"schema version {old}, but this remat reads version 3"):
            Plan.from_json(json.dumps(data))


def test_solver_imports_no_torch() -> None:
    code = (
        "import sys, remat.plan.costmodel, remat.plan.solver; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_many_identical_blocks() -> None:
    # 128 identical decoder layers with all five options: the common case must stay cheap (the
    # benchmark times it) and deterministic.
    mib = 2**20
    opts = {
        "keep": cost(400 * mib, fwd=200 * mib, bwd=300 * mib),
        "selective": cost(150 * mib, fwd=200 * mib, bwd=350 * mib, ms=1.25),
        "recompute": cost(32 * mib, fwd=200 * mib, bwd=650 * mib, ms=6.0),
        "offload": cost(0, fwd=220 * mib, bwd=700 * mib, ms=2.5),
        "recompute_offload": cost(0, fwd=200 * mib, bwd=690 * mib, ms=7.0),
    }
    p = profile(
        [block(f"layers.{i}", grad=50 * mib, **opts) for i in range(128)],
        base=4000 * mib,
        post=segment(200 * mib, fwd=800 * mib, bwd=900 * mib),
    )
    plain = solve(p, method="none").estimate.peak_bytes
    low, _ = smallest_feasible(p)
    budget = (plain + low) // 2
    plan = solve(p, budget)
    assert plan.estimate.peak_bytes <= budget
    assert solve(p, budget) == plan
    assert plan.estimate.step_ms <= solve(p, budget, method="greedy").estimate.step_ms


# --- properties against brute force ------------------------------------------------------------

_PROPERTY = settings(max_examples=200, deadline=None)
_CHAINS = chains(max_blocks=6, max_blocks_3=8)


@_PROPERTY
@given(p=_CHAINS, data=st.data())
def test_optimal_equals_brute_force(p: Profile, data: st.DataObject) -> None:
    brute = brute_force(p)
    budget = budget_near(data, brute)
    best = brute.fastest_within(budget)
    if best is None:
        try:  # segments (tests/test_segments_plan.py) can go below every per-block plan
            plan = solve(p, budget)
        except InfeasibleBudget as info:
            assert info.smallest_bytes <= int(brute.peak_bytes.min())
            assert info.budget_bytes == budget
            return
        assert plan.segments and plan.estimate.peak_bytes <= budget
        return
    plan = solve(p, budget)
    assert plan.estimate.peak_bytes <= budget
    # NOTE [ The optimum, defined ] (remat.plan.optimum): its per-block part is this optimum.
    chain = chain_constraints(p)
    picks = defined(chain, None, budget)
    assert picks is not None and not picks.trees
    assert (sum(row[o] for row, o in zip(chain.extra_ms, picks.picks)), chain.peak_bytes(picks.picks)) == best
    if plan.segments:  # faster than every per-block plan
        assert plan.estimate.step_ms - p.plain_step_ms < best[0]
        return
    # The fastest, and among the fastest the lowest peak.
    assert (_extra_ms(p, plan), plan.estimate.peak_bytes) == best


@_PROPERTY
@given(p=_CHAINS, data=st.data())
def test_bounded_search_equals_brute_force(p: Profile, data: st.DataObject) -> None:
    # NOTE [ Bounding the search ]: the path long varied chains take, forced on small ones.
    brute = brute_force(p)
    budget = budget_near(data, brute)
    best = brute.fastest_within(budget)
    chain = chain_constraints(p)
    picks = solver.optimal_picks(chain, budget, plain_limit=0)
    if best is None:
        assert picks is None
        return
    assert picks is not None
    ms = sum(row[o] for row, o in zip(chain.extra_ms, picks))
    assert (ms, chain.peak_bytes(picks)) == best


_SIDE_CHAINS = chains(max_blocks=4, max_blocks_3=6, sides=True)


def _per_block_search_is_brute_force(p: Profile, data: st.DataObject) -> tuple[Brute, int, tuple[float, int] | None]:
    """The per-block search, plain and bounded, finds brute force's plan at a budget drawn near
    the peaks; brute force, the budget and the best plan's (time, peak) there."""
    brute = brute_force(p)
    budget = budget_near(data, brute)
    best = brute.fastest_within(budget)
    chain = chain_constraints(p)
    for limit in (512, 0):
        picks = solver.optimal_picks(chain, budget, plain_limit=limit)
        if best is None:
            assert picks is None
            continue
        assert picks is not None
        ms = sum(row[o] for row, o in zip(chain.extra_ms, picks))
        assert (ms, chain.peak_bytes(picks)) == best
    return brute, budget, best


@settings(max_examples=100, deadline=None)
@given(p=_SIDE_CHAINS, data=st.data())
def test_optimal_with_side_inputs_equals_brute_force(p: Profile, data: st.DataObject) -> None:
    # NOTE [ A side input's extra life ]: the search carries the held state, plain and bounded.
    _per_block_search_is_brute_force(p, data)


_HANDED_CHAINS = chains(max_blocks=4, max_blocks_3=6, sides=True, handovers=True) | chains(
    max_blocks=5, max_blocks_3=7, handovers=True)


@settings(max_examples=150, deadline=None)
@given(p=_HANDED_CHAINS, data=st.data())
def test_optimal_with_handovers_equals_brute_force(p: Profile, data: st.DataObject) -> None:
    # NOTE [ What crosses a block boundary, as state ] (remat.plan.crossings): the search carries
    # the handovers' bits, plain and bounded, and ``solve`` needs no search after it.
    brute, budget, best = _per_block_search_is_brute_force(p, data)
    if best is None:
        with pytest.raises(InfeasibleBudget) as refused:
            solve(p, budget, segments=False)
        assert refused.value.smallest_bytes == int(brute.peak_bytes.min())
        return
    plan = solve(p, budget)
    assert plan.estimate.peak_bytes <= budget
    if not plan.segments and chain_constraints(p).bound:  # its peak read as the most held (rule 5)
        assert _extra_ms(p, plan) == best[0] and plan.estimate.peak_bytes <= best[1]
    elif not plan.segments:
        assert (_extra_ms(p, plan), plan.estimate.peak_bytes) == best
    else:  # segments only where they beat every per-block plan
        assert plan.estimate.step_ms - p.plain_step_ms < best[0]


@settings(max_examples=100, deadline=None)
@given(p=_HANDED_CHAINS)
def test_the_smallest_peak_with_handovers_is_a_budget_solve_meets(p: Profile) -> None:
    # A plan with segments is judged by ``estimate_segments`` (remat.plan.solver._counted): the
    # floor it names, with segments or without, is one ``solve`` finds a plan for, and no lower.
    low = smallest_any(p)[0]
    plan = solve(p, low)
    if chain_constraints(p).bound:  # a handover past HANDOVER_BITS reads as its most held (rule 5)
        assert plan.estimate.peak_bytes <= low
        return
    assert low <= int(brute_force(p).peak_bytes.min())
    assert plan.estimate.peak_bytes == low
    with pytest.raises(InfeasibleBudget):
        solve(p, low - 1, segments=False)


@settings(max_examples=100, deadline=None)
@given(p=_HANDED_CHAINS)
def test_pinned_handovers_name_no_floor_above_a_plan_priced_exactly(p: Profile) -> None:
    # Rule 5 of NOTE [ What crosses a block boundary, as state ]: with one bit for all handovers,
    # most are pinned, and the searches read plans above their cost; the floor named is still at or
    # below every block on one option (every block recomputed: torch's checkpoint on each), and
    # ``solve`` meets it.
    with unittest.mock.patch.object(crossings, "HANDOVER_BITS", 1):
        if not chain_constraints(p).bound:
            return
        low = smallest_any(p)[0]
        chain, names = chain_constraints(p), [b.name for b in p.blocks]
        assert all(low <= estimate(p, dict(zip(names, chain.chosen(picks)))).peak_bytes for picks in priced_picks(chain))
        assert solve(p, low).estimate.peak_bytes <= low


@pytest.mark.parametrize("inputs", [2, 4])
def test_plans_with_segments_are_judged_with_the_handovers_counted(inputs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The segment search sees handovers as each option's own run did; with ones that keep and
    # recompute save and selective does not (``inputs`` blocks' inputs of bytes each), some plans
    # it finds are over by ``estimate_segments``, and the per-block optimum or the lowest plan with
    # segments replaces them.
    from remat.crossing import Crossing
    from remat.plan import solver as planner

    replaced, with_segments = [], 0
    counted = planner._counted

    def noting(*args: object) -> object:
        out = counted(*args)  # type: ignore[arg-type]
        replaced.append(out is not args[-1])
        return out

    monkeypatch.setattr(planner, "_counted", noting)
    for seed in range(3):
        p = varied_chain(10, seed)
        names, size = [b.name for b in p.blocks], inputs * p.blocks[0].input_bytes
        handed = [Crossing(size_bytes=size, made_by=names[i], dies_after=names[i + 2] if i < 8 else None,
                           saved_by={names[i]: ["keep", "recompute"]}) for i in range(0, 10, 2)]
        p = dataclasses.replace(p, crossings=handed)
        low = smallest_any(p)[0]
        for k in range(21):
            budget = low + (p.plain_peak_bytes - low) * k // 20
            plan = solve(p, budget)
            assert plan.estimate.peak_bytes <= budget, (seed, k)
            with_segments += bool(plan.segments)
    assert with_segments and any(replaced)


def test_partial_plans_holding_different_side_inputs_are_not_compared() -> None:
    # Selective b0 keeps less than keep b0, at the same time and peak so far, but holds the
    # 1000-byte side input to its backward; only keep b0 then lets b1 be kept within the budget.
    from remat.crossing import Crossing

    p = profile(
        [block("b0", keep=cost(10, bwd=995), selective=cost(5), recompute=cost(5, ms=5.0)),
         block("b1", keep=cost(10), selective=cost(10, ms=5.0), recompute=cost(1, ms=1.0))],
        crossings=[Crossing(size_bytes=1000, consumers=["b0"])],
    )  # fmt: skip
    plan = solve(p, 1010)
    assert plan.choices == {"b0": "keep", "b1": "keep"} and plan.estimate.peak_bytes == 1005
    assert chain_constraints(p).peak_bytes([1, 2]) == 1006  # selective, recompute: slower


@_PROPERTY
@given(p=_CHAINS, data=st.data())
def test_a_larger_budget_is_never_slower(p: Profile, data: st.DataObject) -> None:
    low, _ = smallest_feasible(p)
    small = data.draw(st.integers(low, low + 200 * 2**20))
    large = data.draw(st.integers(small, small + 200 * 2**20))
    assert _extra_ms(p, solve(p, large)) <= _extra_ms(p, solve(p, small))


@_PROPERTY
@given(p=_CHAINS, data=st.data())
def test_optimal_is_never_slower_than_a_baseline_that_fits(p: Profile, data: st.DataObject) -> None:
    budget = budget_near(data, brute_force(p))
    low, _ = smallest_feasible(p)
    if budget < low:
        return
    fastest = _extra_ms(p, solve(p, budget))
    for method in ("none", "all", "every_k", "sqrt", "greedy"):
        try:
            plan = solve(p, budget, method=method)
        except InfeasibleBudget:
            assert method == "greedy"
            continue
        if plan.estimate.peak_bytes <= budget:
            assert fastest <= _extra_ms(p, plan), method


@_PROPERTY
@given(p=_CHAINS)
def test_frontier_is_the_brute_force_pareto_front(p: Profile) -> None:
    plans = frontier(p, points=None, segments=False)  # with segments: tests/test_segments_plan.py
    points = [(plan.estimate.peak_bytes, _extra_ms(p, plan)) for plan in plans]
    assert set(points) == brute_force(p).pareto()
    assert points == sorted(points, key=lambda x: (-x[0], x[1]))
    for plan in frontier(p, points=5, segments=False):
        assert (plan.estimate.peak_bytes, _extra_ms(p, plan)) in set(points)


def test_greedy_counts_side_inputs() -> None:
    # Recomputing b0 (the best bytes per millisecond) holds the 5-byte side input through the
    # head's backward: greedy's peak sees that (16 > 15) and recomputes b1 too.
    from remat.crossing import Crossing

    p = profile(
        [block("b0", keep=cost(10), selective=cost(10, ms=9.0), recompute=cost(1, ms=1.0)),
         block("b1", keep=cost(10), selective=cost(10, ms=9.0), recompute=cost(1, ms=2.0))],
        crossings=[Crossing(size_bytes=5, consumers=["b0"])],
    )  # fmt: skip
    plan = solve(p, 15, method="greedy")
    assert plan.choices == {"b0": "recompute", "b1": "recompute"} and plan.estimate.peak_bytes == 7
    assert solve(p, 15).choices == {"b0": "keep", "b1": "recompute"}
