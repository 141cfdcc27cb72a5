"""Handovers (shape 2 of NOTE [ Tensors that cross a block boundary ] in remat.crossing): a tensor
a block returns besides its hidden output, held by the model's loop until the next block returns.
Every plan, per block or with a segment, is predicted to the byte, ``solve``'s plans fit when
applied and are as fast as the best per-block plan found by brute force, and the detection leaves
out what is not a handover; on a pure-torch loop and on BLOOM."""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Any

import pytest
import torch
from _tiers import breadth
from torch import nn

import remat
from remat.manual.options import clear_option, set_option
from remat.measure.profiler import profile
from remat.measure.step_memory import measure_step
from remat.plan.costmodel import estimate
from remat.plan.handovers import handovers
from remat.plan.segment_estimate import estimate_segments
from remat.plan.solver import frontier, smallest_any, solve
from remat.records import Profile


class _Attention(nn.Module):
    """Returns its output and its attention probabilities (as BLOOM's layers do)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        probs = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        h = x + self.proj(probs @ v)
        return h + self.mlp(h), probs


class _Loop(nn.Module):
    """``hold``: "next" holds each block's return value until the next block returns (BLOOM's
    loop), "none" drops the probabilities at once, "all" keeps every block's to the head."""

    def __init__(self, hold: str = "next", n: int = 4, dim: int = 32) -> None:
        super().__init__()
        self.hold = hold
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(_Attention(dim) for _ in range(n))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, every = self.embed(x), []
        for block in self.blocks:
            if self.hold == "none":  # (``h, _ = block(h)`` would hold them in ``_``: a handover)
                h = block(h)[0]
                continue
            out = block(h)  # held until the next block returns
            h = out[0]
            if self.hold == "all":
                every.append(out[1])
        loss = self.head(h).pow(2).mean()
        return loss + sum(p.sum() for p in every) * 0.0 if every else loss


def _case(hold: str = "next") -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Loop(hold).train(), torch.randn(4, 48, 8)


def _measured(model: nn.Module, batch: Any, choices: dict[str, str], loss_fn: Any = None) -> int:
    modules = dict(model.named_modules())
    try:
        for name, option in choices.items():
            set_option(modules[name], option)
        return measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    finally:
        for name in choices:
            clear_option(modules[name])


def _plan(prof: Profile, choices: dict[str, str], segments: list[list[str]]) -> remat.Plan:
    return remat.Plan(choices=choices, budget_bytes=None, method="manual", model=prof.model,
                      estimate=estimate_segments(prof, choices, segments), fingerprint=prof.fingerprint,
                      device=prof.device, dtype=prof.dtype, batch_shape=prof.batch_shape, segments=segments)


def _measured_plan(model: nn.Module, batch: Any, plan: remat.Plan) -> int:
    remat.apply(model, plan)
    try:
        return measure_step(model, batch, repeats=0).peak_bytes
    finally:
        remat.remove(model)


def _every_plan() -> tuple[nn.Module, torch.Tensor, Profile, list[Any]]:
    """The loop, its profile, and the estimate of every per-block plan."""
    model, batch = _case()
    prof = profile(model, batch, repeats=1)
    names = [b.name for b in prof.blocks]
    return model, batch, prof, [estimate(prof, dict(zip(names, c)))
                                for c in itertools.product(prof.options, repeat=len(names))]


def test_the_loop_holds_four_handovers_saved_by_keep_and_the_record_round_trips() -> None:
    model, batch = _case()
    prof = profile(model, batch, repeats=1)
    probs = 4 * 48 * 48 * 4
    made = [(h.made_by, h.dies_after, h.size_bytes) for h in handovers(prof)]
    # the third's is dropped when the last block returns and the last's when the model does: in
    # the head's forward phase, both
    assert made == [("blocks.0", "blocks.1", probs), ("blocks.1", "blocks.2", probs),
                    ("blocks.2", None, probs), ("blocks.3", None, probs)], made
    assert all(h.saved_by == {h.made_by: ["keep"]} for h in handovers(prof))  # selective recomputes the softmax
    assert Profile.from_json(prof.to_json()) == prof


@pytest.mark.parametrize("hold", ["none", "all"])
def test_tensors_dropped_at_once_are_none_and_ones_held_to_the_head_die_there(hold: str) -> None:
    model, batch = _case(hold)
    prof = profile(model, batch, repeats=1)
    # "all": each freed in the head's forward; "none": only the last block's, which its return
    # frees in the head's forward phase (which starts where the last block ends)
    made = ["blocks.3"] if hold == "none" else [b.name for b in prof.blocks]
    assert [h.made_by for h in handovers(prof)] == made
    assert all(h.dies_after is None for h in handovers(prof))
    names = [b.name for b in prof.blocks]
    for combo in [("keep", "recompute") * 2, ("recompute", "keep") * 2, ("keep",) * 3 + ("recompute",)]:
        choices = dict(zip(names, combo))
        assert _measured(model, batch, choices) == estimate(prof, choices).peak_bytes


def test_every_plan_is_predicted_to_the_byte() -> None:
    model, batch = _case()
    prof = profile(model, batch, repeats=1)
    names = [b.name for b in prof.blocks]
    plans = [dict(zip(names, c)) for c in itertools.product(["keep", "recompute"], repeat=len(names))]
    rng = random.Random(0)
    plans += [{n: rng.choice(prof.options) for n in names} for _ in range(8)]
    off = {}
    for choices in plans:
        if (d := _measured(model, batch, choices) - estimate(prof, choices).peak_bytes) != 0:
            off["".join(o[0] for o in choices.values())] = d
    assert off == {}


@pytest.mark.parametrize("hold", ["next", "all"])
def test_plans_with_segments_are_predicted_to_the_byte(hold: str) -> None:
    # NOTE [ Handovers in a segment ] in remat.plan.segment_estimate: a block inside a segment is
    # recomputed in the forward and kept in the replay. Read as kept in both, no plan here was
    # exact (up to 149 KiB under); read as recomputed in both, 19 of 24 were over.
    model, batch = _case(hold)
    prof = profile(model, batch, repeats=1)
    names = [b.name for b in prof.blocks]
    rng = random.Random(0)
    off = {}
    for a, b in itertools.combinations(range(len(names)), 2):
        for _ in range(2):
            choices = {n: "keep" if a <= i <= b else rng.choice(prof.options) for i, n in enumerate(names)}
            plan = _plan(prof, choices, [[names[a], names[b]]])
            if (d := _measured_plan(model, batch, plan) - plan.estimate.peak_bytes) != 0:
                off[f"{''.join(o[0] for o in choices.values())} {a}..{b}"] = d
    assert off == {}


@pytest.mark.parametrize("hold", ["next", "all", "none"])
def test_no_plan_of_nested_segments_measures_over_its_prediction(hold: str) -> None:
    # Several segments, nested ones among them, on six blocks: the replay of an inner segment
    # inside an outer one is on the safe side (NOTE [ Handovers in a segment ]).
    torch.manual_seed(0)
    model, batch = _Loop(hold, n=6).train(), torch.randn(4, 48, 8)
    prof = profile(model, batch, repeats=1)
    names, rng = [b.name for b in prof.blocks], random.Random(1)
    over, exact = {}, 0
    for _ in range(10):
        spans, i = [], rng.randrange(2)
        while i < len(names):
            e = rng.randrange(i, len(names))
            spans.append((i, e))
            if e - i >= 2:
                a = rng.randrange(i + 1, e)
                spans.append((a, rng.randrange(a, e + 1)))
            i = e + 1 + rng.randrange(2)
        inside = {j for a, b in spans for j in range(a, b + 1)}
        choices = {n: "keep" if j in inside else rng.choice(prof.options) for j, n in enumerate(names)}
        plan = _plan(prof, choices, [[names[a], names[b]] for a, b in spans])
        d = _measured_plan(model, batch, plan) - plan.estimate.peak_bytes
        exact += d == 0
        if d > 0:
            over[str(spans)] = d
    assert over == {} and exact >= 5, (over, exact)


def test_solve_fits_and_is_the_fastest_per_block_plan() -> None:
    model, batch, prof, every = _every_plan()
    low, high = smallest_any(prof)[0], prof.plain_peak_bytes
    per_block_low = min(e.peak_bytes for e in every)
    assert low < per_block_low, "segments reach below every per-block plan"
    segmented = 0
    for k in range(11):
        budget = low + (high - low) * k // 10
        planned = solve(prof, budget)  # with segments: within its prediction
        assert _measured_plan(model, batch, planned) <= planned.estimate.peak_bytes <= budget, (k, planned.segments)
        segmented += bool(planned.segments)
        if budget < per_block_low:
            continue
        fastest = min(e.step_ms for e in every if e.peak_bytes <= budget)
        plan = solve(prof, budget, segments=False)
        assert plan.estimate.peak_bytes <= budget and plan.estimate.step_ms == pytest.approx(fastest), (k, plan.choices)
        assert _measured(model, batch, plan.choices) <= budget, (k, plan.choices)
        assert planned.estimate.step_ms <= plan.estimate.step_ms
    assert segmented


def test_bloom_every_plan_is_predicted_and_solve_fits() -> None:
    pytest.importorskip("transformers")
    from _hf_zoo import ZOO

    from remat.plan.costmodel import smallest_feasible

    model, batch, _ = ZOO["bloom"]()
    prof = profile(model, batch, repeats=1)
    assert handovers(prof), "BLOOM's loop holds each layer's attention probabilities"
    names = [b.name for b in prof.blocks]
    for combo in itertools.product(["keep", "recompute"], repeat=len(names)):
        choices = dict(zip(names, combo))
        assert _measured(model, batch, choices) == estimate(prof, choices).peak_bytes, combo
    low, high = smallest_any(prof)[0], prof.plain_peak_bytes
    for budget in (low + (high - low) * k // 6 for k in range(6)):
        planned = solve(prof, budget)  # with segments (NOTE [ Handovers in a segment ]) at the floor too
        assert _measured_plan(model, batch, planned) <= planned.estimate.peak_bytes <= budget, planned.segments
        if budget >= smallest_feasible(prof)[0]:
            plan = solve(prof, budget, segments=False)
            assert _measured(model, batch, plan.choices) == plan.estimate.peak_bytes <= budget


@pytest.mark.parametrize("hold", breadth(["next", "all"], quick=["next"]))
def test_no_phase_of_any_plan_measures_over_its_prediction(hold: str) -> None:
    # Phase by phase, not only the peak: the head's forward, where the loop lets handovers go
    # (maybe after the head's own peak), and the backward up to each maker's, where every run has
    # let them go (NOTE [ Tensors that cross a block boundary ]).
    from remat.measure import marked as measure
    from remat.measure.phases import span
    from remat.measure.runner import every_block
    from remat.measure.tracer import MemoryTracer
    from remat.plan import costmodel
    from remat.plan.handovers import handed_over
    from remat.plan.schedule import step_phases

    model, batch = _case(hold)
    prof = profile(model, batch, repeats=1)
    modules = dict(model.named_modules())
    named = [(b.name, modules[b.name]) for b in prof.blocks]
    keys = measure.base_keys(model, None, batch)
    over = {}
    for combo in itertools.product(["keep", "recompute", "selective"], repeat=len(named)):
        with every_block(named, list(combo)):
            model.zero_grad(set_to_none=True)
            with MemoryTracer(torch.device("cpu")) as tracer:
                hooks = measure.marked_step(model, named, batch, None, None, tracer.mark, keys)
        live = {m.label: m.live_bytes for m in tracer.trace.marks}
        fixed = handed_over(prof, combo)
        costs = costmodel._chosen_costs(fixed, {b.name: o for b, o in zip(prof.blocks, combo)})
        phases = costmodel._phases(fixed, costs, list(combo))
        for phase, predicted in zip(step_phases(len(named)), phases):
            start, end = ("optimizer", "end") if phase.part == "optimizer" else span(phase, hooks.order, live)
            if (d := prof.base_bytes + tracer.trace.peak_between(start, end) - predicted.peak_bytes) > 0:
                over["".join(o[0] for o in combo) + " " + predicted.name] = d
    assert over == {}


def test_smallest_frontier_and_refusals_count_the_handovers() -> None:
    from remat.plan.costmodel import smallest_feasible

    model, batch, prof, every = _every_plan()
    lowest = min(e.peak_bytes for e in every)
    assert smallest_feasible(prof)[0] == lowest
    with pytest.raises(remat.InfeasibleBudget) as refused:
        solve(prof, lowest - 1, segments=False)
    assert refused.value.smallest_bytes == lowest
    # with segments, lower: a floor solve meets, and that the plan measures
    low = smallest_any(prof)[0]
    assert low < lowest
    plan = solve(prof, low)
    assert plan.segments and _measured_plan(model, batch, plan) <= plan.estimate.peak_bytes == low
    with pytest.raises(remat.InfeasibleBudget) as refused:
        solve(prof, low - 1)
    assert refused.value.smallest_bytes == low
    front = frontier(prof, points=None, segments=False)  # walks every point (it once never ended)
    assert [p.estimate.peak_bytes for p in front] == sorted((p.estimate.peak_bytes for p in front), reverse=True)
    assert all(p.estimate.peak_bytes <= p.budget_bytes and not p.segments for p in front)
    fastest = {}
    for e in every:  # the brute-force frontier: the fastest plan at each peak, then undominated
        fastest[e.peak_bytes] = min(fastest.get(e.peak_bytes, e.step_ms), e.step_ms)
    points, best = [], float("inf")
    for peak in sorted(fastest):
        if fastest[peak] < best - 1e-9:
            points.append(peak)
            best = fastest[peak]
    assert [p.estimate.peak_bytes for p in front][::-1] == points


def test_the_plan_table_shows_the_bytes_the_plan_keeps() -> None:
    from remat.report.tables import plan_table, render_text
    from remat.units import format_bytes

    _, _, prof, _ = _every_plan()
    names = [b.name for b in prof.blocks]
    plan = dataclasses.replace(solve(prof, method="none"), choices=dict(zip(names, ["recompute", "keep"] * 2)))
    text = render_text(plan_table(plan, prof))
    after = prof.blocks[1].options["keep"].kept_bytes - handovers(prof)[0].size_bytes  # freed at its return
    row = next(line for line in text.splitlines() if line.strip().startswith("blocks.1 "))
    assert format_bytes(after) in row, row


def test_an_offloaded_maker_leaves_the_device_tensor_to_the_loop_until_it_drops_it() -> None:
    # Derived (no GPU here): the offload's numbers keep nothing on the device, but the loop holds
    # the device tensor until the next block returns: one more transient in that block's forward.
    from remat.plan.chain import chain_constraints
    from remat.plan.handovers import handed_over

    _, _, prof, _ = _every_plan()
    blocks = [dataclasses.replace(b, options={**b.options, "offload": dataclasses.replace(
        b.options["keep"], kept_bytes=0)}) for b in prof.blocks]
    prof = dataclasses.replace(prof, blocks=blocks)
    first = handovers(prof)[0]
    assert (first.made_by, first.dies_after) == ("blocks.0", "blocks.1")

    def fwd(p: Profile) -> int:
        return p.blocks[1].options["keep"].fwd_peak_bytes

    kept_first = handed_over(prof, ["keep"] * 4)
    offloaded = handed_over(prof, ["offload", "keep", "keep", "keep"])
    assert fwd(offloaded) == fwd(kept_first) + first.size_bytes == fwd(prof) + first.size_bytes
    # The searches' form carries whether each maker offloads (NOTE [ What crosses a block boundary,
    # as state ] in remat.plan.crossings) and predicts every plan as ``estimate`` does.
    chain = chain_constraints(prof, ["keep", "recompute", "offload"])
    names = [b.name for b in prof.blocks]
    for combo in itertools.product(range(3), repeat=4):
        choices = {n: chain.options[o] for n, o in zip(names, combo)}
        assert chain.peak_bytes(list(combo)) == estimate(prof, choices).peak_bytes, choices


class _Cached(nn.Module):
    """Returns its output and a cache cut from its keys by a ``gather``, which saves its int64
    index (twice the cache's bytes) for a backward the cache never gets (Griffin's, NSA's)."""

    def __init__(self, dim: int, window: int = 16) -> None:
        super().__init__()
        self.k = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.window = window

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k(x)
        index = (torch.arange(self.window) + x.shape[1] - self.window).roll(3)
        cache = torch.gather(k, 1, index[None, :, None].repeat(x.shape[0], 1, x.shape[2]))
        return x + self.mlp(k), cache


class _CacheLoop(nn.Module):
    """``hold``: "all" keeps every block's cache in a dict until the forward returns, "next" until
    the next block returns."""

    def __init__(self, hold: str, n: int = 4, dim: int = 32) -> None:
        super().__init__()
        self.hold = hold
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(_Cached(dim) for _ in range(n))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, caches = self.embed(x), {}
        for i, block in enumerate(self.blocks):
            h, caches[i if self.hold == "all" else 0] = block(h)
        return self.head(h).pow(2).mean()


@pytest.mark.parametrize("hold", breadth(["all", "next"], quick=["next"]))  # 20-30 s each
def test_a_handover_whose_graph_saves_more_than_itself_is_predicted_to_the_byte(hold: str) -> None:
    # NOTE [ A handover's graph ] in remat.measure.handovers: counted as its storage alone, every
    # plan mixing keep and recompute here missed by the index of each maker (RKKK 64 KiB under
    # its measured peak, KKKR 192 KiB over; Griffin's plan at 60% 33,104 B over its budget).
    torch.manual_seed(0)
    model, batch = _CacheLoop(hold).train(), torch.randn(4, 64, 8)
    prof = profile(model, batch, repeats=1)
    cache, index = 4 * 16 * 32 * 4, 4 * 16 * 32 * 8
    assert [(h.size_bytes, h.graph_bytes) for h in handovers(prof)] == [(cache, index)] * 4
    assert profile(model, batch, repeats=1, budget=prof.plain_peak_bytes * 7 // 10).crossings == prof.crossings  # fake steps
    names = [b.name for b in prof.blocks]
    off = {}
    for combo in itertools.product(["keep", "recompute", "selective"], repeat=len(names)):
        choices = dict(zip(names, combo))
        if (d := _measured(model, batch, choices) - estimate(prof, choices).peak_bytes) != 0:
            off["".join(o[0] for o in combo)] = d
    # "all": the caches die as the forward returns, after the head's peak, but the cost model
    # cannot tell (plan.handovers): there plans whose makers checkpoint are over-predicted, 20 of 81
    # by 1,936 to 18,320 B.
    assert (off == {}) if hold == "next" else (all(d < 0 for d in off.values()) and len(off) <= 20), off
    plan = solve(prof, (prof.plain_peak_bytes + smallest_any(prof)[0]) // 2)
    assert _measured_plan(model, batch, plan) <= plan.estimate.peak_bytes <= plan.budget_bytes


@pytest.mark.parametrize("hold", ["all", "next"])
def test_no_segment_over_a_handover_with_a_graph_measures_over_its_prediction(hold: str) -> None:
    # NOTE [ Handovers in a segment ] in remat.plan.segment_estimate: a replay counts the graph in
    # the kept numbers it reads, on the safe side. Counted as the cache's storage alone, four of
    # these 18 plans measured over their prediction by 8 or 16 KiB.
    torch.manual_seed(0)
    model, batch = _CacheLoop(hold).train(), torch.randn(4, 64, 8)
    prof = profile(model, batch, repeats=1)
    names, rng = [b.name for b in prof.blocks], random.Random(0)
    over = {}
    for a, b in itertools.combinations(range(len(names)), 2):
        for _ in range(3):
            choices = {n: "keep" if a <= i <= b else rng.choice(prof.options) for i, n in enumerate(names)}
            plan = _plan(prof, choices, [[names[a], names[b]]])
            if (d := _measured_plan(model, batch, plan) - plan.estimate.peak_bytes) > 0:
                over[f"{''.join(o[0] for o in choices.values())} {a}..{b}"] = d
    assert over == {}
