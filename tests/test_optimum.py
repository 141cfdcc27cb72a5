"""NOTE [ The optimum, defined ] (remat.plan.optimum): ``fastest``, which ``solve`` runs, finds the
plan ``defined`` finds, on random chains with and without side inputs, on varied chains long
enough for the bounded search, and on chains whose segments win. The definition itself is pinned
by brute force: tests/test_solver.py (per-block plans) and tests/test_segments_plan.py (every plan
with segments)."""

from __future__ import annotations

import pytest
from _tables import brute_force, budget_near, chains, varied_chain
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.plan.bounds import PerBlock
from remat.plan.chain import chain_constraints
from remat.plan.fastest import fastest
from remat.plan.optimum import Found, defined
from remat.plan.segment_estimate import estimate_segments
from remat.plan.segment_search import EXACT_BLOCKS
from remat.plan.segments import SegmentModel
from remat.plan.solver import smallest_any
from remat.records import Estimate, Profile


def _estimate(p: Profile, found: Found | None) -> tuple[Estimate, bool] | None:
    """What a found plan costs, and whether it has segments."""
    if found is None:
        return None
    chain = chain_constraints(p)
    names = [b.name for b in p.blocks]
    choices = {n: chain.options[o] for n, o in zip(names, found.picks)}
    spans = [[names[a], names[b]] for t in found.trees for a, b in t.spans()]
    return estimate_segments(p, choices, spans), bool(found.trees)


def _model(p: Profile) -> SegmentModel | None:
    chain = chain_constraints(p)
    return SegmentModel(p, chain) if {"keep", "recompute"} <= set(chain.options) and p.blocks else None


def _same(p: Profile, budget: int) -> tuple[Estimate, bool] | None:
    chain, model = chain_constraints(p), _model(p)
    for with_model in (None, model):
        got = _estimate(p, fastest(chain, with_model, budget))
        want = _estimate(p, defined(chain, with_model, budget))
        assert got == want, (with_model is not None, budget)
    return want


@settings(max_examples=150, deadline=None)
@given(p=chains(max_blocks=5, max_blocks_3=7, sides=False), data=st.data())
def test_fastest_finds_the_defined_optimum(p: Profile, data: st.DataObject) -> None:
    _same(p, budget_near(data, brute_force(p)))


@settings(max_examples=80, deadline=None)
@given(p=chains(max_blocks=4, max_blocks_3=6, sides=True), data=st.data())
def test_fastest_finds_the_defined_optimum_with_side_inputs(p: Profile, data: st.DataObject) -> None:
    _same(p, budget_near(data, brute_force(p)))


@settings(max_examples=80, deadline=None)
@given(p=chains(max_blocks=4, max_blocks_3=6, sides=True, handovers=True), data=st.data())
def test_fastest_finds_the_defined_optimum_with_handovers(p: Profile, data: st.DataObject) -> None:
    # Segments search on the chain without the handovers' state (``SegmentModel.chain``).
    _same(p, budget_near(data, brute_force(p)))


def test_a_relaxation_nothing_fits_rules_segments_out() -> None:
    # Found by the property above: a per-block plan fits, but the relaxation of the chain without
    # the handover's state (the segment search's) has no room at all; bounding it divided by zero.
    from _tables import block, cost, profile, segment

    from remat.crossing import Crossing

    blocks = [block("layers.0", grad=18, keep=cost(14, fwd=58, bwd=34, ms=9.0), recompute=cost(1, fwd=13, bwd=19, ms=10.0)),
              block("layers.1", grad=58, keep=cost(1, fwd=12, bwd=21, ms=9.25), recompute=cost(64, fwd=31, bwd=56, ms=7.0))]
    p = profile(blocks, base=23, pre=segment(50, fwd=4, bwd=23, grad=12), post=segment(55, fwd=25, bwd=58, grad=6),
                optimizer_peak=13, gather=6, post_fwd_held=32,
                crossings=[Crossing(size_bytes=19, made_by="layers.0", saved_by={"layers.0": ["keep", "selective"]})])
    assert _same(p, 180) is not None


@pytest.mark.parametrize("seed", range(3))
def test_fastest_finds_the_defined_optimum_where_segments_win(seed: int) -> None:
    p = varied_chain(EXACT_BLOCKS, seed)
    low = smallest_any(p)[0]
    high = _top_peak(p)
    kinds = set()
    for share in (0.0, 0.02, 0.1, 0.3, 0.6, 1.0):
        found = _same(p, low + int(share * (high - low)))
        assert found is not None
        kinds.add(found[1])
    assert kinds == {True, False}  # the comparison met plans with segments and without


def test_fastest_finds_the_defined_per_block_optimum_on_a_long_varied_chain() -> None:
    p = varied_chain(48, seed=1)
    chain = chain_constraints(p)
    floor, high = chain.suffix_floor_bytes()[0], _top_peak(p)
    bounded = 0
    for share in (0.05, 0.3, 0.7):
        budget = floor + int(share * (high - floor))
        assert _estimate(p, fastest(chain, None, budget)) == _estimate(p, defined(chain, None, budget))
        search = PerBlock.start(chain, budget)
        assert search is not None
        bounded += not search.exact
    assert bounded  # fastest took the bounded search at least once


def _top_peak(p: Profile) -> int:
    """The peak of the fastest per-block plan with no budget (every block kept, or faster)."""
    chain = chain_constraints(p)
    top = defined(chain, None, 2**62)
    assert top is not None
    return chain.peak_bytes(top.picks)
