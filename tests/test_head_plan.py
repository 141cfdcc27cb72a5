"""The head as a planned segment: the solver on hand tables, the profiler and apply on real models."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch
from torch import nn

import remat
from remat.errors import InfeasibleBudget, InvalidValue, PlanMismatch
from remat.measure.heads import chunk_sizes
from remat.measure.step_memory import measure_step
from remat.plan.head import estimate_with_head, head_names, with_head
from remat.plan.solver import frontier, smallest_any, solve
from remat.records import Plan, Profile
from tests._tables import block, cost, profile, segment

MIB = 2**20


def _headed() -> Profile:
    """Two blocks (keep 100, recompute 10, 5 ms) and a head whose plain backward peaks at 500;
    chunked:64 peaks at 50 for 3 ms more, chunked:32 at 30 for 6 ms more."""
    blocks = [block(f"b{i}", keep=cost(100), recompute=cost(10, fwd=20, bwd=20, ms=5.0)) for i in range(2)]
    base = profile(blocks, post=segment(200, fwd=300, bwd=500), plain_peak=1000)
    chunked = {
        "chunked:64": dataclasses.replace(segment(5, fwd=50, bwd=50), fwd_ms=2.0, bwd_ms=3.0),
        "chunked:32": dataclasses.replace(segment(5, fwd=30, bwd=30), fwd_ms=3.0, bwd_ms=5.0),
    }
    return dataclasses.replace(base, head_module="head", head_options=chunked)


def test_with_head_is_the_profile_with_that_post() -> None:
    prof = _headed()
    assert head_names(prof) == ["keep", "chunked:64", "chunked:32"]
    one = with_head(prof, "chunked:32")
    assert one.post == prof.head_options["chunked:32"] and not one.head_options
    assert one.plain_step_ms == prof.plain_step_ms + 6.0
    keep = {"b0": "keep", "b1": "keep"}
    est = estimate_with_head(prof, keep, "chunked:32")
    assert est.peak_bytes == 200 + 5 + 30  # both blocks kept, the chunked head's backward
    assert est.overhead == pytest.approx(0.06)
    assert estimate_with_head(prof, keep).peak_bytes == 200 + 200 + 500
    with pytest.raises(InvalidValue, match="offers no head option 'chunked:16'"):
        with_head(prof, "chunked:16")


def test_the_solver_chooses_head_and_blocks_under_one_budget() -> None:
    prof = _headed()
    assert solve(prof, 900).head == "keep"  # fits as written: the fastest
    plan = solve(prof, 300)  # only a chunked head fits; the cheaper one, every block kept
    assert plan.head == "chunked:64" and set(plan.choices.values()) == {"keep"}
    assert plan.head_module == "head" and plan.estimate.peak_bytes == 255
    assert any("chunked:64" in n for n in plan.notes)
    plan = solve(prof, 150)  # the blocks give way too: chunked:32 + one recompute beats chunked:64 + two
    assert plan.head == "chunked:32" and sorted(plan.choices.values()) == ["keep", "recompute"]
    assert plan.estimate.peak_bytes == 100 + 10 + 5 + 30
    # without head options the smallest feasible peak is the plain head's
    with pytest.raises(InfeasibleBudget, match="smallest feasible"):
        solve(dataclasses.replace(prof, head_options={}), 300)
    with pytest.raises(InfeasibleBudget) as info:
        solve(prof, 40)
    # the floor is the lowest over head options, segments included (NOTE [ Searching segments ])
    lowest = min(smallest_any(with_head(prof, h))[0] for h in head_names(prof))
    assert info.value.smallest_bytes == lowest == smallest_any(with_head(prof, "chunked:32"))[0]
    assert smallest_any(prof)[0] == lowest and "chunked:32" in smallest_any(prof)[1]  # over the heads
    assert solve(prof, method="all").head == "keep"  # baselines leave the head as written


def test_the_frontier_spans_head_options_and_is_pareto() -> None:
    prof = _headed()
    points = frontier(prof, points=None)
    peaks = [p.estimate.peak_bytes for p in points]
    times = [p.estimate.step_ms for p in points]
    assert peaks == sorted(peaks, reverse=True) and times == sorted(times)
    assert len(set(peaks)) == len(peaks) and len(set(times)) == len(times)
    assert {p.head for p in points} >= {"keep", "chunked:32"}
    plain_points = frontier(dataclasses.replace(prof, head_options={}), points=None)
    assert min(peaks) < min(p.estimate.peak_bytes for p in plain_points)


def test_records_round_trip_with_head_options() -> None:
    prof = _headed()
    assert Profile.from_json(prof.to_json()) == prof
    plan = solve(prof, 300)
    assert Plan.from_json(plan.to_json()) == plan


def test_chunk_sizes() -> None:
    assert chunk_sizes(768) == [384, 192, 96]
    assert chunk_sizes(8192) == [4096, 2048, 1024]
    assert chunk_sizes(100) == [56, 32, 16] and chunk_sizes(63) == []


# --- measured: a user model that calls remat.chunked_cross_entropy ---------------------------------


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 4096, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_a_user_models_chunked_call_is_planned_and_applied() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    ids = torch.randint(0, 4096, (2, 256))

    def loss_fn(hidden: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return remat.chunked_cross_entropy(hidden, model.head, batch, chunk_size=4096, shift=True)

    prof = remat.profile(model, ids, loss_fn=loss_fn, repeats=1)
    assert prof.head_module == "head" and not prof.head_causal_lm
    assert sorted(prof.head_options) == ["chunked:128", "chunked:256", "chunked:64"]
    assert prof.head_options["chunked:64"].bwd_peak_bytes < prof.post.bwd_peak_bytes / 2
    with pytest.raises(InfeasibleBudget):  # the head as written (4096 tokens a chunk) cannot
        solve(dataclasses.replace(prof, head_options={}), "60%")
    plan = solve(prof, "60%")
    assert plan.head != "keep"
    plain = measure_step(model, ids, loss_fn=loss_fn, repeats=0)
    torch.manual_seed(1)
    want = _grads(model, ids, loss_fn)
    remat.apply(model, plan)
    assert model.head.__dict__["_remat_head_chunk"] == int(plan.head.split(":")[1])
    planned = measure_step(model, ids, loss_fn=loss_fn, repeats=0)
    assert planned.peak_bytes == plan.estimate.peak_bytes < plain.peak_bytes
    got = _grads(model, ids, loss_fn)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    again = remat.profile(model, ids, loss_fn=loss_fn, repeats=1)  # a plan applied stays applied
    assert model.head.__dict__["_remat_head_chunk"] == int(plan.head.split(":")[1])
    assert again.head_options.keys() == prof.head_options.keys()
    remat.remove(model)
    assert "_remat_head_chunk" not in model.head.__dict__


class _ScaleFirst(nn.Module):
    """Its first op saves nothing of its input: the last block's input dies in the head's forward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x * 0.5)))


class _Chain(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_ScaleFirst(32) for _ in range(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x


def test_every_head_option_measures_its_prediction_where_the_head_frees_the_last_blocks_input() -> None:
    """NOTE [ The last block's input ]: the kept step's head carries that input's bytes, and so
    must each head option's. Zamba (transformers), whose last layer starts with a concatenation,
    measured every chunked plan one hidden state (65,536 B) over its prediction."""
    torch.manual_seed(0)
    model = _Chain()
    ids = torch.randint(0, 4096, (2, 256))

    def loss_fn(hidden: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return remat.chunked_cross_entropy(hidden, model.head, batch, shift=True)

    prof = remat.profile(model, ids, loss_fn=loss_fn, repeats=1)
    names = [b.name for b in prof.blocks]
    assert len(names) == 3 and len(prof.head_options) == 3
    base = solve(prof, prof.plain_peak_bytes)
    off = {}
    for head in prof.head_options:
        for combo in itertools.product(["keep", "recompute"], repeat=3):
            choices = dict(zip(names, combo))
            est = estimate_with_head(prof, choices, head)
            remat.apply(model, dataclasses.replace(base, choices=choices, head=head, estimate=est, segments=[]))
            measured = measure_step(model, ids, loss_fn=loss_fn, repeats=0).peak_bytes
            remat.remove(model)
            if measured != est.peak_bytes:
                off[head, combo] = measured - est.peak_bytes
    assert off == {}


def _grads(model: nn.Module, batch, loss_fn) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    model.zero_grad(set_to_none=True)
    loss_fn(model(batch), batch).backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def test_apply_refuses_a_head_the_model_lacks() -> None:
    prof = _headed()
    plan = dataclasses.replace(solve(prof, 300), choices={}, head_module="nohead")
    with pytest.raises(PlanMismatch, match="chunks the head 'nohead'"):
        remat.apply(nn.Linear(2, 2), plan, strict=False)


# --- measured: a transformers Llama with a 32k vocabulary ---------------------------------------


def llama_32k():  # type: ignore[no-untyped-def]
    from remat.models.hf import build

    return build("llama", batch_size=2, seq_len=384, vocab_size=32000, max_position_embeddings=512,
                 attention_dropout=0.0)  # fmt: skip


@pytest.mark.slow  # a profile of a 32k-vocabulary Llama: ~20-50 s on a shared 2-core CPU
def test_llama_32k_below_45_percent_of_plain_with_equal_loss_and_grads() -> None:
    model, batch, loss_fn = llama_32k()
    before = copy.deepcopy(model.state_dict())
    plain = measure_step(model, batch, loss_fn=loss_fn, repeats=0)
    prof = remat.profile(model, batch, loss_fn=loss_fn, repeats=1)
    assert prof.head_causal_lm and prof.head_module == "lm_head"
    assert prof.plain_peak_bytes == plain.peak_bytes
    budget = int(0.45 * plain.peak_bytes)
    with pytest.raises(InfeasibleBudget):  # the blocks alone cannot: the head's logits dominate
        solve(dataclasses.replace(prof, head_options={}), budget)
    plan = solve(prof, budget)
    assert plan.head.startswith("chunked:")
    torch.manual_seed(0)
    out = model(**batch)
    out.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    remat.apply(model, plan)
    planned = measure_step(model, batch, loss_fn=loss_fn, repeats=0)
    assert planned.peak_bytes < budget
    assert planned.peak_bytes == plan.estimate.peak_bytes  # the cost model, exactly
    torch.manual_seed(0)
    got = model(**batch)
    got.loss.backward()
    torch.testing.assert_close(got.loss, out.loss.detach())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n)
    remat.remove(model)
    assert "forward" not in model.__dict__
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_tables_show_the_head_option() -> None:
    from rich.console import Console

    from remat.report.tables import plan_table, profile_table

    prof = _headed()
    console = Console(width=200, record=True)
    console.print(plan_table(solve(prof, 300), prof))
    console.print(profile_table(prof))
    text = console.export_text()
    assert "(head) head" in text and "chunked:64" in text and "(after blocks, head chunked:32)" in text


# --- estimated: the Llama-3-8B shape on an H100, two layers (the head does not depend on depth) -----


def test_llama3_8b_head_option_lowers_the_floor_in_estimated_mode() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "benchmarks/head.py", "--part", "estimated", "--layers", "2", "--out", "/dev/null"],
        cwd=root, capture_output=True, text=True, timeout=300, check=True,
    )
    text = out.stdout
    assert "head options ['chunked:4096', 'chunked:2048', 'chunked:1024']" in text, text
    lines = [line for line in text.splitlines() if line.startswith("| 8 (FSDP)")]
    floors = [float(line.split("|")[5].split()[0]) for line in lines]  # GiB, as written then chunked
    assert len(floors) == 2 and floors[0] - floors[1] > 2.0, text  # the 128k-vocabulary head's logits


@pytest.mark.slow  # 25-35 s
def test_verify_and_auto_pass_a_plan_with_a_chunked_head() -> None:
    from remat.models.hf import build

    model, batch, loss_fn = build("llama", batch_size=2, seq_len=128, vocab_size=4096, attention_dropout=0.0)
    # profiled with the plain step (no budget given to the profile): verified against it
    plan = remat.solve(remat.profile(model, batch, loss_fn=loss_fn, repeats=1), "40%")
    remat.apply(model, plan)
    report = remat.verify(model, batch, plan, loss_fn=loss_fn, repeats=1)
    remat.remove(model)
    assert plan.head.startswith("chunked:") and report.plain_ran
    assert report.passed and report.grads_equal and 0 < report.max_grad_diff < 1e-6
    assert report.measured_peak_bytes == report.predicted_peak_bytes
    # auto at 40% runs no step above it: verified against every block recomputed with the same
    # chunked head (NOTE [ Verifying without the plain step ]); the fake step takes transformers'
    # tracing branch (an explicit causal mask), so the lean profile predicts a little over
    plan, report = remat.auto(model, batch, budget="40%", loss_fn=loss_fn, verify=True, repeats=1)
    assert plan.head.startswith("chunked:") and not report.plain_ran
    assert report.reference == f"every block recomputed, the head {plan.head}"
    assert report.passed and report.grads_equal and report.max_grad_diff == 0
    assert report.measured_peak_bytes <= report.predicted_peak_bytes <= 1.1 * report.measured_peak_bytes
    assert remat.applied_plan(model) is plan and "forward" in model.__dict__
    remat.remove(model)
    assert "forward" not in model.__dict__


def test_a_head_option_measured_faster_than_the_plain_head_is_not_predicted_faster() -> None:
    """A chunked head makes its logits twice; a profile that timed it faster (noise, on a small
    head) must not make the plain step's own budget choose it."""
    prof = _headed()
    quick = dataclasses.replace(prof.head_options["chunked:64"], fwd_ms=0.5, bwd_ms=0.5)  # 1 ms < 2 ms
    prof = dataclasses.replace(prof, head_options={**prof.head_options, "chunked:64": quick})
    plan = solve(prof, 1000)
    assert plan.head == "keep" and set(plan.choices.values()) == {"keep"}
    assert plan.estimate.overhead == 0.0
    assert solve(prof, 300).head == "chunked:64"  # where it is needed it still serves, at no extra time
