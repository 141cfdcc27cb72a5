"""The cost model on hand-worked tables, its prefix-sum form against the simulation, and its floor
against brute force."""

from __future__ import annotations

import itertools

import pytest
from _tables import block, brute_force, chains, cost, profile, segment
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.plan.chain import chain_constraints
from remat.plan.costmodel import estimate, smallest_feasible
from remat.plan.solver import optimal_picks, solve
from remat.records import Profile


def two_blocks() -> Profile:
    # base 100 = params 60 + optimizer 30 + batch 10; the head and embeddings cost nothing.
    # keep: 10 B kept, 4 B forward transient, 6 B backward transient.
    # recompute: 2 B kept (the input), its 8 B of activations come back in the backward: 14 B.
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


@pytest.mark.parametrize(
    ("a", "b", "peak", "phase", "extra_ms"),
    [
        # live 100 | fwd a 104, +10 | fwd b 114, +10 | head 120 | bwd b 120+6 = 126 <- peak
        ("keep", "keep", 126, "backward of b", 0.0),
        # fwd a 104, +2 | fwd b 106, +10 | head 112 | bwd b 112+6 = 118 <- peak | bwd a 102+14 = 116
        ("recompute", "keep", 118, "backward of b", 5.0),
        # recomputing the last block buys nothing: its activations come back right away,
        # fwd b 114 | live 112 | bwd b 112+14 = 126 <- peak
        ("keep", "recompute", 126, "backward of b", 3.0),
        # live 104 after the forward | bwd b 104+14 = 118 <- peak | bwd a 102+14 = 116
        ("recompute", "recompute", 118, "backward of b", 8.0),
    ],
)
def test_hand_table_two_blocks(a: str, b: str, peak: int, phase: str, extra_ms: float) -> None:
    est = estimate(two_blocks(), {"a": a, "b": b})
    assert est.peak_bytes == peak
    assert est.peak_phase == phase
    assert est.step_ms == 100.0 + extra_ms
    assert est.overhead == pytest.approx(extra_ms / 100.0)


def test_hand_table_every_phase() -> None:
    # One block; every segment and the optimizer have their own numbers so each phase is visible.
    p = profile(
        [block("x", grad=7, keep=cost(20, fwd=5, bwd=9))],
        base=50,
        pre=segment(3, fwd=11, bwd=2, grad=4),
        post=segment(6, fwd=30, bwd=8, grad=1),
        optimizer_peak=40,
        gather=2,
    )
    # fwd embeddings 50+11 = 61 | live 53
    # fwd x 53+5+2 = 60 | live 73
    # fwd head 73+30 = 103 | live 79 | bwd head 79+8 = 87 | live 73+1 = 74
    # bwd x 74+9+2 = 85 | live 74+7-20 = 61
    # bwd embeddings 61+2 = 63 | live 61+4-3 = 62 | optimizer 62+40 = 102
    est = estimate(p, {"x": "keep"})
    assert (est.peak_bytes, est.peak_phase) == (103, "forward of the head")
    p2 = profile(
        [block("x", grad=7, keep=cost(20, fwd=5, bwd=9))],
        base=50,
        pre=segment(3, fwd=11, bwd=2, grad=4),
        post=segment(6, fwd=30, bwd=8, grad=1),
        optimizer_peak=45,
        gather=2,
    )
    assert (estimate(p2, {"x": "keep"}).peak_bytes, estimate(p2, {"x": "keep"}).peak_phase) == (
        107,
        "optimizer step",
    )


def test_peak_phase_is_the_first_to_reach_the_peak() -> None:
    # forward of the head and backward of the head both reach 120; the first one is named.
    p = profile([block("a", keep=cost(20))], base=100)
    est = estimate(p, {"a": "keep"})
    assert (est.peak_bytes, est.peak_phase) == (120, "forward of the head")


def test_overhead_is_zero_without_a_plain_time() -> None:
    p = profile([block("a", keep=cost(1), recompute=cost(0, ms=2.0))], plain_step_ms=0.0)
    est = estimate(p, {"a": "recompute"})
    assert (est.step_ms, est.overhead) == (2.0, 0.0)


def test_unknown_block_suggests_the_closest_name() -> None:
    with pytest.raises(ValueError, match=r"block 'c'.*expected one of its 2 blocks \('a', 'b'\)"):
        estimate(two_blocks(), {"a": "keep", "b": "keep", "c": "keep"})
    p = profile([block("layers.0", keep=cost(1)), block("layers.1", keep=cost(1))])
    with pytest.raises(ValueError, match=r"did you mean 'layers.1'\?"):
        estimate(p, {"layers.0": "keep", "layer.1": "keep"})


def test_missing_block_is_named() -> None:
    with pytest.raises(ValueError, match=r"no option for 1 of 2 blocks \('b'\).*\{'b': 'keep'\}"):
        estimate(two_blocks(), {"a": "keep"})


def test_option_not_offered_lists_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"'a' does not offer option 'offload' on device 'cuda'"):
        estimate(two_blocks(), {"a": "offload", "b": "keep"})
    with pytest.raises(ValueError, match=r"\['keep', 'recompute'\]; did you mean 'recompute'\?"):
        estimate(two_blocks(), {"a": "recompte", "b": "keep"})


def test_choices_must_be_a_mapping() -> None:
    with pytest.raises(TypeError, match="expected choices as a mapping"):
        estimate(two_blocks(), ["keep", "keep"])  # type: ignore[arg-type]


def test_smallest_feasible_hand_table() -> None:
    # Both plans with recompute on block a reach 118 (see above); nothing lower exists, and the
    # 100 B of base are mostly parameters and optimizer state.
    assert smallest_feasible(two_blocks()) == (118, "parameters and optimizer state take 90 B")


def test_smallest_feasible_names_a_block_transient() -> None:
    p = profile([block("big", keep=cost(1, bwd=500), recompute=cost(1, bwd=600, ms=1.0))], base=10)
    assert smallest_feasible(p) == (511, "block big's backward working memory takes 500 B")


def test_smallest_feasible_names_the_head() -> None:
    p = profile([block("a", keep=cost(5))], base=10, batch=10, post=segment(fwd=300))
    assert smallest_feasible(p) == (
        315,
        "the head's forward working memory (logits, loss) takes 300 B",
    )


def test_no_common_option_is_refused() -> None:
    p = profile([block("a", keep=cost(1)), block("b", recompute=cost(1))])
    with pytest.raises(ValueError, match="no option in common"):
        chain_constraints(p)


# --- properties --------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(p=chains(), data=st.data())
def test_prefix_form_equals_the_simulation(p: Profile, data: st.DataObject) -> None:
    chain = chain_constraints(p)
    picks = [data.draw(st.integers(0, len(chain.options) - 1)) for _ in p.blocks]
    choices = {b.name: chain.options[o] for b, o in zip(p.blocks, picks)}
    assert chain.peak_bytes(picks) == estimate(p, choices).peak_bytes


@settings(max_examples=200, deadline=None)
@given(p=chains(max_blocks=5))
def test_smallest_feasible_is_the_brute_force_minimum(p: Profile) -> None:
    smallest, dominant = smallest_feasible(p)
    assert smallest == int(brute_force(p).peak_bytes.min())
    assert dominant


@settings(max_examples=300, deadline=None)
@given(p=chains(max_blocks=5, sides=True) | chains(max_blocks=5, sides=True, handovers=True)
       | chains(max_blocks=6, handovers=True), data=st.data())
def test_prefix_form_with_crossings_equals_the_simulation(p: Profile, data: st.DataObject) -> None:
    # NOTE [ What crosses a block boundary, as state ] (remat.plan.crossings): with side inputs
    # and handovers, whose bits are set by their makers and dropped where they die, the
    # state-carrying form is the replay, plan by plan.
    chain = chain_constraints(p)
    picks = [data.draw(st.integers(0, len(chain.options) - 1)) for _ in p.blocks]
    choices = {b.name: chain.options[o] for b, o in zip(p.blocks, picks)}
    if chain.bound:  # a handover past HANDOVER_BITS reads as its most held (rule 5): never under
        assert chain.peak_bytes(picks) >= estimate(p, choices).peak_bytes
    else:
        assert chain.peak_bytes(picks) == estimate(p, choices).peak_bytes


@settings(max_examples=150, deadline=None)
@given(p=chains(max_blocks=4, max_blocks_3=5, sides=True) | chains(max_blocks=4, max_blocks_3=5, sides=True,
                                                                     handovers=True))
def test_smallest_feasible_with_crossings_is_the_brute_force_minimum(p: Profile) -> None:
    smallest, dominant = smallest_feasible(p)
    assert smallest == int(brute_force(p).peak_bytes.min())
    assert dominant


def test_side_input_held_by_a_checkpoint_lives_to_its_backward() -> None:
    # One side input of 100 bytes entering both blocks, saved by neither: kept blocks let it die
    # in the head's forward; a recomputed block holds it until its own backward.
    from remat.crossing import Crossing

    blocks = [block(f"b{i}", keep=cost(10, bwd=5), recompute=cost(1, bwd=20)) for i in range(2)]
    side = Crossing(size_bytes=100, consumers=["b0", "b1"])
    p = profile(blocks, base=1000, post=segment(fwd=7, bwd=3), crossings=[side], post_fwd_held=50)
    plain = profile(blocks, base=1000, post=segment(fwd=7, bwd=3))
    for b0, b1 in itertools.product(("keep", "recompute"), repeat=2):
        with_side = estimate(p, {"b0": b0, "b1": b1}).peak_bytes
        without = estimate(plain, {"b0": b0, "b1": b1}).peak_bytes
        assert (with_side > without) == ("recompute" in (b0, b1))
    # Both recomputed: the head's forward at its held peak, its backward and both blocks' with 100.
    assert estimate(p, {"b0": "recompute", "b1": "recompute"}).peak_bytes == 1000 + 2 + 100 + 20
    saved = Crossing(size_bytes=100, consumers=["b0", "b1"], saved_by={"b0": ["keep"]})
    q = profile(blocks, base=1000, post=segment(fwd=7, bwd=3), crossings=[saved], post_fwd_held=50)
    # Saved by kept b0, the plain step already holds it to b0's backward: nothing added.
    for b1 in ("keep", "recompute"):
        assert estimate(q, {"b0": "keep", "b1": b1}) == estimate(plain, {"b0": "keep", "b1": b1})


def test_brute_force_uses_the_simulation_numbers() -> None:
    # The brute force helper itself, on the hand table: every assignment against estimate().
    p = two_blocks()
    brute = brute_force(p)
    for row, peak in zip(brute.picks.tolist(), brute.peak_bytes.tolist()):
        choices = {b.name: brute.options[o] for b, o in zip(p.blocks, row)}
        assert estimate(p, choices).peak_bytes == peak
    assert len(list(itertools.product(brute.options, repeat=2))) == len(brute.picks)


def test_a_side_input_that_dies_before_the_head_is_held_through_later_forwards() -> None:
    # NOTE [ Where a side input dies ]: made for b0 and freed in its forward phase by the plain
    # step; recomputed, b0 holds it, so b2's forward (the step's peak) runs with it live too.
    from remat.crossing import Crossing

    blocks = [
        block("b0", keep=cost(60), recompute=cost(1, ms=0.5)),
        block("b1", keep=cost(10), recompute=cost(1, ms=1.0)),
        block("b2", keep=cost(10, fwd=500), recompute=cost(1, fwd=500, ms=1.0)),
    ]
    side = Crossing(size_bytes=100, consumers=["b0"], dies_after="b0")
    p = profile(blocks, base=1000, crossings=[side])
    plain = profile(blocks, base=1000)
    keep_b0 = {"b0": "keep", "b1": "recompute", "b2": "recompute"}
    held = {"b0": "recompute", "b1": "keep", "b2": "recompute"}
    assert estimate(p, keep_b0) == estimate(plain, keep_b0)
    assert estimate(p, held).peak_bytes == estimate(plain, held).peak_bytes + 100 == 1000 + 11 + 100 + 500
    assert estimate(p, held).peak_phase == "forward of b2"
    chain = chain_constraints(p)
    picks = [chain.options.index(held[b.name]) for b in p.blocks]
    assert chain.peak_bytes(picks) == estimate(p, held).peak_bytes
    # Blind to the side input, recomputing b0 alone (the cheapest) would fit this budget; it does
    # not, and the fastest plan that fits keeps b0 and recomputes b1.
    budget = 1000 + 60 + 1 + 500
    assert estimate(plain, {"b0": "recompute", "b1": "keep", "b2": "keep"}).peak_bytes <= budget
    plan = solve(p, budget)
    assert plan.choices == {"b0": "keep", "b1": "recompute", "b2": "keep"}
    assert plan.estimate.peak_bytes == budget
    for limit in (512, 0):  # enumerated, and the search over states
        picks = optimal_picks(chain, budget, plain_limit=limit)
        assert picks is not None and [chain.options[o] for o in picks] == list(plan.choices.values())
