"""Segments in the cost model and the solver (NOTE [ A segment's costs from per-block numbers ],
NOTE [ Searching segments ]): against brute force over every plan of small chains, against
Revolve's closed form on uniform chains, and the plain per-block model unchanged."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest
from _tables import block, chains, cost, profile, varied_chain
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.errors import InfeasibleBudget
from remat.plan.bounds import relaxed_optimum, relaxed_table
from remat.plan.chain import chain_constraints
from remat.plan.costmodel import estimate
from remat.plan.head import estimate_with_head, head_extra_ms, head_names, with_head
from remat.plan.optimum import defined
from remat.plan.segment_estimate import estimate_segments
from remat.plan.segments import SegmentModel
from remat.plan.solver import frontier, smallest_any, solve
from remat.records import Plan, Profile


def _laminar(n: int) -> list[list[tuple[int, int]]]:
    spans = [(a, b) for a in range(n) for b in range(a, n)]
    out = []
    for r in range(len(spans) + 1):
        for family in itertools.combinations(spans, r):
            if all(not (a < c <= b < d) and not (c < a <= d < b) for (a, b), (c, d) in itertools.combinations(family, 2)):
                out.append(list(family))
    return out


def _every_plan(p: Profile) -> list[tuple[int, float]]:
    """(peak, extra ms) of every plan: per-block options and laminar families of segments."""
    chain = chain_constraints(p)
    names = [b.name for b in p.blocks]
    out = []
    for family in _laminar(len(names)):
        inside = {j for a, b in family for j in range(a, b + 1)}
        free = [j for j in range(len(names)) if j not in inside]
        segs = [[names[a], names[b]] for a, b in family]
        for opts in itertools.product(chain.options, repeat=len(free)):
            choices = {n: "keep" for n in names}
            choices.update({names[j]: o for j, o in zip(free, opts)})
            est = estimate_segments(p, choices, segs)
            out.append((est.peak_bytes, est.step_ms - p.plain_step_ms))
    return out


@settings(max_examples=25, deadline=None)
@given(chains(max_blocks=3, max_blocks_3=4, sides=False), st.floats(0, 1))
def test_solve_is_the_fastest_of_every_plan_with_segments(p: Profile, share: float) -> None:
    _check_against_brute_force(p, share)


@settings(max_examples=20, deadline=None)
@given(chains(max_blocks=3, max_blocks_3=3, sides=True), st.floats(0, 1))
def test_solve_is_the_fastest_of_every_plan_with_side_inputs(p: Profile, share: float) -> None:
    _check_against_brute_force(p, share)


def _check_against_brute_force(p: Profile, share: float) -> None:
    if not p.blocks:
        return
    plans = _every_plan(p)
    low, high = min(pk for pk, _ in plans), max(pk for pk, _ in plans)
    assert smallest_any(p)[0] == low
    budget = low + int(share * (high - low))
    best = min(ms for pk, ms in plans if pk <= budget)
    plan = solve(p, budget)
    assert plan.estimate.peak_bytes <= budget
    assert plan.estimate.step_ms - p.plain_step_ms == pytest.approx(best, abs=1e-9)
    assert estimate_segments(p, plan.choices, plan.segments) == plan.estimate
    assert Plan.from_json(plan.to_json()) == plan
    # NOTE [ The optimum, defined ] (remat.plan.optimum): the definition is this optimum too.
    chain = chain_constraints(p)
    found = defined(chain, SegmentModel(p, chain), budget)
    assert found is not None
    names = [b.name for b in p.blocks]
    mine = estimate_segments(p, {n: chain.options[o] for n, o in zip(names, found.picks)},
                             [[names[a], names[b]] for t in found.trees for a, b in t.spans()])
    assert mine.peak_bytes <= budget
    assert mine.step_ms - p.plain_step_ms == pytest.approx(best, abs=1e-9)


@settings(max_examples=20, deadline=None)
@given(chains(max_blocks=3, max_blocks_3=3, sides=True))
def test_frontier_is_the_brute_force_pareto_front_of_every_plan_with_segments(p: Profile) -> None:
    if not p.blocks:
        return
    front: list[tuple[int, float]] = []
    for pk, ms in sorted(_every_plan(p)):
        if not front or ms < front[-1][1] - 1e-9:
            front.append((pk, ms))
    plans = frontier(p, points=None)
    got = [(plan.estimate.peak_bytes, plan.estimate.step_ms - p.plain_step_ms) for plan in plans][::-1]
    assert [g[0] for g in got] == [f[0] for f in front]
    assert [g[1] for g in got] == pytest.approx([f[1] for f in front], abs=1e-9)
    assert all(estimate_segments(p, plan.choices, plan.segments) == plan.estimate for plan in plans)


@settings(max_examples=20, deadline=None)
@given(chains(max_blocks=3, max_blocks_3=3, sides=False), st.floats(0, 1), st.integers(0, 2**31))
def test_solve_with_head_options_is_the_fastest_of_every_plan_and_head(p: Profile, share: float, seed: int) -> None:
    """Head options (NOTE [ The head's options ]) and segments together: the solver's plan is the
    fastest of every plan under every head, and its estimate is that of its segments with its
    head (a plan's estimate once left its segments out when the profile offered head options)."""
    if not p.blocks:
        return
    rng = random.Random(seed)
    peak = max(p.post.bwd_peak_bytes, 1)
    p = dataclasses.replace(p, head_module="head", head_options={
        "chunked:64": dataclasses.replace(p.post, fwd_peak_bytes=rng.randint(0, peak), bwd_peak_bytes=rng.randint(0, peak),
                                          fwd_ms=p.post.fwd_ms + rng.choice([0.0, 0.25, 2.0]), bwd_ms=p.post.bwd_ms),
    })
    plans = [(pk, ms + head_extra_ms(p, h)) for h in head_names(p) for pk, ms in _every_plan(with_head(p, h))]
    low, high = min(pk for pk, _ in plans), max(pk for pk, _ in plans)
    budget = low + int(share * (high - low))
    plan = solve(p, budget)
    assert plan.estimate.peak_bytes <= budget
    assert plan.estimate.step_ms - p.plain_step_ms == pytest.approx(min(ms for pk, ms in plans if pk <= budget), abs=1e-9)
    assert plan.estimate == estimate_with_head(p, plan.choices, plan.head or "keep", plan.segments)
    assert plan.estimate.peak_bytes == estimate_segments(with_head(p, plan.head or "keep"), plan.choices, plan.segments).peak_bytes


# NOTE [ Revolve's closed form ]
# Griewank & Walther ("Algorithm 799: Revolve", ACM TOMS 26(1), 2000): reversing l steps with s
# checkpoints (the initial state one of them) takes at least t(l, s) = r*l - beta(s+1, r-1)
# forward steps besides the reverse sweep's own, where beta(s, r) = C(s+r, s) and r is the repetition
# number, the least r with l <= beta(s, r). On a chain of identical blocks whose activations take
# A >> one input, a budget of s inputs + A allows one block taped (kept) at a time and s kept
# inputs: exactly Revolve's setting, with a recomputed block's re-forward as one forward step.


def _beta(s: int, r: int) -> int:
    return math.comb(s + r, s) if r >= 0 else 0


def revolve_steps(steps: int, s: int) -> int:
    r = 0
    while steps > _beta(s, r):
        r += 1
    return r * steps - _beta(s + 1, r - 1)


def test_the_closed_form_itself() -> None:
    assert [revolve_steps(k, 1) for k in range(1, 6)] == [0, 1, 3, 6, 10]  # l(l-1)/2 with one
    assert [revolve_steps(k, 2) for k in range(1, 7)] == [0, 1, 2, 4, 6, 8]
    assert revolve_steps(10, 9) == 9  # enough checkpoints: every step but the last once


def _uniform_chain(n: int, a: int = 1000) -> Profile:
    blocks = [
        block(f"layers.{i}", keep=cost(a, fwd=1, bwd=0), recompute=cost(1, fwd=1, bwd=a - 1, ms=1.0))
        for i in range(n)
    ]
    return profile(blocks, plain_step_ms=10.0)


@pytest.mark.parametrize("s", [1, 2, 3, 4])
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
def test_uniform_chains_take_revolves_least_number_of_forward_steps(steps: int, s: int) -> None:
    p, a = _uniform_chain(steps), 1000
    plan = solve(p, s + a)
    assert plan.estimate.peak_bytes <= s + a
    assert round(plan.estimate.step_ms - p.plain_step_ms) == revolve_steps(steps, s)


def test_segments_go_below_every_per_block_plan() -> None:
    p = _uniform_chain(8)
    low, why = smallest_any(p)
    per_block = estimate(p, {b.name: "recompute" for b in p.blocks}).peak_bytes
    assert low < per_block and "segments" in why
    plan = solve(p, low)
    assert plan.segments and plan.estimate.peak_bytes == low


def test_no_segments_is_the_per_block_estimate() -> None:
    p = _uniform_chain(4)
    choices = {"layers.0": "recompute", "layers.1": "keep", "layers.2": "recompute", "layers.3": "keep"}
    assert estimate_segments(p, choices, []) == estimate(p, choices)
    # A segment of one block is a recomputed block.
    single = dict(choices, **{"layers.0": "keep"})
    one, per_block = estimate_segments(p, single, [["layers.0", "layers.0"]]), estimate(p, choices)
    assert (one.peak_bytes, one.step_ms) == (per_block.peak_bytes, per_block.step_ms)


def test_plan_json_keeps_segments_and_blocks_inside_must_keep() -> None:
    p = _uniform_chain(6)
    plan = solve(p, 3 + 1000)
    assert plan.segments
    assert json.loads(plan.to_json())["segments"] == plan.segments
    bad = dict(plan.choices, **{plan.segments[0][0]: "recompute"})
    with pytest.raises(ValueError, match="inside a segment"):
        estimate_segments(p, bad, plan.segments)


def test_the_plan_table_shows_segments() -> None:
    from remat.report.tables import plan_table, render_text

    p = _uniform_chain(6)
    plan = solve(p, 2 + 1000)
    text = render_text(plan_table(plan, p), width=140)
    assert f"{len(plan.segments)} segments" in text and "keep (segment" in text


@pytest.mark.parametrize("offload", [True, False], ids=["gpu-options", "cpu-options"])
@pytest.mark.parametrize("n", [24, 64])
def test_long_chains_relaxation_bounds_every_plan_and_its_per_block_optimum_is_exact(n: int, offload: bool) -> None:
    """NOTE [ Searching segments ] on chains too long for brute force: the relaxed chain's fastest
    plan is no slower than the plan ``solve`` returns; a plan without segments is as fast as the
    per-block optimum (``segments=False``: the shortcut through the relaxation returns that very
    optimum), one with segments strictly faster; every plan fits."""
    p = varied_chain(n, seed=n, offload=offload)
    chain = chain_constraints(p)
    low = smallest_any(p)[0]
    high = estimate(p, {b.name: "keep" for b in p.blocks}).peak_bytes
    with_segments = 0
    for share in (0.02, 0.1, 0.3, 0.6, 0.9):
        budget = low + int(share * (high - low))
        plan = solve(p, budget)
        assert plan.estimate.peak_bytes <= budget
        assert estimate_segments(p, plan.choices, plan.segments) == plan.estimate
        relaxed = relaxed_optimum(relaxed_table(chain, budget, SegmentModel(p, chain).free_option()))
        assert relaxed is not None
        extra = plan.estimate.step_ms - p.plain_step_ms
        assert relaxed[1] <= round(extra * 1e6) + len(p.blocks)  # ticks; rounding of ms per block
        try:
            per_block = solve(p, budget, segments=False).estimate.step_ms - p.plain_step_ms
        except InfeasibleBudget:
            assert plan.segments  # only segments fit
            with_segments += 1
            continue
        if plan.segments:
            with_segments += 1
            assert extra < per_block
        else:
            assert extra == pytest.approx(per_block, abs=1e-9)
    assert offload or with_segments  # a CPU's options: segments win at the tight budgets
