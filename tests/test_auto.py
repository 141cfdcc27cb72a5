"""remat.auto / apply / verify on the built-in models: fits, predicted = measured, same gradients."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat import models
from remat.applier import PlanMismatch, applied_plan
from remat.measure.profiler import profile
from remat.plan.solver import InfeasibleBudget, solve
from remat.records import Plan, Profile
from remat.units import format_bytes


def build(kind: str, **kw: object) -> tuple[nn.Module, tuple[torch.Tensor, ...], object]:
    torch.manual_seed(0)
    if kind == "gpt":
        cfg = models.GPTConfig(n_layer=4, n_embd=64, n_head=2, block_size=64, vocab_size=256, dropout=0.1, **kw)
    elif kind == "llama":
        cfg = models.LlamaConfig(n_layer=4, dim=64, n_head=4, n_kv_head=2, ffn_dim=160, vocab_size=256, max_seq=64, **kw)
    else:
        cfg = models.ConvNetConfig(image_size=32, **kw)
    model = models.build_model(cfg)
    batch_kw = {"image_size": 32} if kind == "cnn" else {"seq_len": 64}
    return model, models.make_batch(model, batch_size=4, **batch_kw), models.loss_fn_for(model)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_budgets_fit_and_match_prediction(kind: str) -> None:
    model, batch, loss_fn = build(kind)
    prof = profile(model, batch, loss_fn=loss_fn, repeats=1)
    checked = 0
    for share in (0.9, 0.7, 0.5, 0.4):
        budget = int(prof.plain_peak_bytes * share)
        try:
            plan = solve(prof, budget)
        except InfeasibleBudget:
            assert share < 0.5, f"{share:.0%} of the plain peak should be feasible for {kind}"
            continue
        report = remat.verify(model, batch, plan, loss_fn=loss_fn, repeats=1)
        assert report.measured_peak_bytes <= budget, (share, report)
        assert abs(report.peak_error) <= 0.05, (share, report.peak_error)
        assert report.grads_equal, (share, report.max_grad_diff)
        assert report.passed
        checked += 1
    assert checked >= 3


def test_auto_applies_and_reapplies() -> None:
    model, batch, loss_fn = build("gpt")
    plan = remat.auto(model, batch, "60%", loss_fn=loss_fn, repeats=1)
    assert applied_plan(model) is plan
    assert any(o != "keep" for o in plan.choices.values())
    plan2, report = remat.auto(model, batch, "80%", loss_fn=loss_fn, repeats=1, verify=True)
    assert applied_plan(model) is plan2
    assert report.passed and report.budget_bytes == plan2.budget_bytes
    # the second profile saw the plain model, not the first plan
    assert plan2.estimate.peak_bytes <= plan2.budget_bytes


def test_auto_infeasible_leaves_the_model_alone() -> None:
    model, batch, loss_fn = build("gpt")
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InfeasibleBudget, match="below the smallest feasible"):
        remat.auto(model, batch, "1MiB", loss_fn=loss_fn, repeats=1)
    assert applied_plan(model) is None
    assert all(torch.equal(keys[k], v) for k, v in model.state_dict().items())
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_apply_remove_round_trip_is_invisible() -> None:
    model, batch, loss_fn = build("cnn")
    ref = copy.deepcopy(model)
    prof = profile(model, batch, loss_fn=loss_fn, repeats=1)
    plan = solve(prof, method="all", budget=None)
    names = [n for n, _ in model.named_modules()]
    params = [n for n, _ in model.named_parameters()]
    remat.apply(model, plan)
    assert [n for n, _ in model.named_modules()] == names
    assert [n for n, _ in model.named_parameters()] == params
    assert list(model.state_dict()) == list(ref.state_dict())
    # a few training steps: same loss, same BatchNorm statistics as the plain copy
    for _ in range(2):
        torch.manual_seed(1)
        loss = loss_fn(model(*batch), batch)
        loss.backward()
        torch.manual_seed(1)
        loss_ref = loss_fn(ref(*batch), batch)
        loss_ref.backward()
        assert torch.equal(loss, loss_ref)
    for (k, v), (k2, v2) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(*batch), ref.eval()(*batch))
    remat.remove(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_plan_file_applies_to_a_fresh_instance_and_refuses_another(tmp_path: Path) -> None:
    model, batch, loss_fn = build("llama")
    prof = profile(model, batch, loss_fn=loss_fn, repeats=1)
    plan = solve(prof, "70%")
    path = tmp_path / "plan.json"
    plan.save(path)
    text = path.read_text()
    loaded = Plan.load(path)
    assert loaded == plan
    fresh, _, _ = build("llama")
    remat.apply(fresh, loaded)
    assert applied_plan(fresh) == plan
    # a model of another shape: same names, other widths
    other, _, _ = build("llama", rope_theta=500000.0)  # same structure: accepted
    remat.apply(other, loaded)
    wider = models.build_model(models.LlamaConfig(n_layer=4, dim=128, n_head=4, n_kv_head=2, ffn_dim=160, vocab_size=256, max_seq=64))
    with pytest.raises(PlanMismatch, match="of another shape"):
        remat.apply(wider, loaded)
    gpt, _, _ = build("gpt")
    with pytest.raises(PlanMismatch, match="its block 'layers.0' is not in this GPT"):
        remat.apply(gpt, loaded)
    assert applied_plan(gpt) is None
    assert path.read_text() == text  # the user's plan file is never touched


# --- a verified plan fits (NOTE [ A verified plan fits ]) ----------------------------------------


class _SideBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        a = torch.softmax(h @ h.transpose(-1, -2) + bias, -1) @ h
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(a)))


class SideInput(nn.Module):
    """A position bias made in the forward and passed to every block: each checkpointed block
    holds it until its own backward, longer than the plain step does (NOTE [ Tensors that cross a block boundary ]).
    Blind to it, the 60% plan measured 512 KiB, the bias, over its prediction."""

    def __init__(self, d: int = 32, n: int = 6, seq: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.blocks = nn.ModuleList(_SideBlock(d) for _ in range(n))
        self.pos = nn.Parameter(torch.zeros(seq, seq))
        self.head = nn.Linear(d, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        bias = (self.pos * 2).expand(ids.shape[0], -1, -1).contiguous()
        for block in self.blocks:
            x = block(x, bias)
        return self.head(x)


def _side_loss(out: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), batch[0].flatten())


def test_verified_auto_solves_again_until_the_plan_measures_within_budget(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from remat.measure import marked
    from remat.measure.step_memory import measure_step

    # A profile blind to side inputs (as before they were crossings) mispredicts this model.
    monkeypatch.setattr(marked, "read_side_inputs", lambda *args: [])
    torch.manual_seed(0)
    model, batch = SideInput(), (torch.randint(0, 64, (8, 128)),)
    plain = measure_step(model, batch, loss_fn=_side_loss, repeats=0).peak_bytes
    budget = int(0.6 * plain)
    first = solve(profile(model, batch, loss_fn=_side_loss, repeats=1), budget)
    remat.apply(model, first)
    over = measure_step(model, batch, loss_fn=_side_loss, repeats=0).peak_bytes
    remat.remove(model)
    assert over > budget, "the open-loop plan no longer measures over: pick another budget"
    with caplog.at_level("WARNING", logger="remat.autoplan"):
        plan, report = remat.auto(model, batch, budget, loss_fn=_side_loss, repeats=1, verify=True)
    assert report.fits and report.measured_peak_bytes <= budget == plan.budget_bytes
    assert report.grads_equal
    assert "solving again" in caplog.text
    assert applied_plan(model) == plan
    remat.remove(model)


class _SavingBlock(_SideBlock):
    """Scales the scores by the bias: the multiply saves it, so a kept block holds it too."""

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        a = torch.softmax((h @ h.transpose(-1, -2)) * bias, -1) @ h
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(a)))


@pytest.mark.parametrize("saving", [False, True], ids=["added", "saved"])
def test_side_input_is_counted_once_and_lives_as_the_plan_makes_it(saving: bool) -> None:
    # NOTE [ Tensors that cross a block boundary ]: the bias enters every block; a checkpoint holds it to its backward.
    from remat.measure.step_memory import measure_step

    torch.manual_seed(0)
    model, batch = SideInput(), (torch.randint(0, 64, (8, 128)),)
    if saving:
        model.blocks = nn.ModuleList(_SavingBlock(32) for _ in range(6))
    prof = profile(model, batch, loss_fn=_side_loss, repeats=1)
    names = [b.name for b in prof.blocks]
    (side,) = prof.crossings
    assert side.size_bytes == 8 * 128 * 128 * 4 and side.consumers == names
    assert side.saved_by == ({n: ["keep"] for n in names} if saving else {})
    assert Profile.from_json(prof.to_json()) == prof
    plain = measure_step(model, batch, loss_fn=_side_loss, repeats=0).peak_bytes
    plans = set()
    for share in (0.4, 0.5, 0.6, 0.8):
        plan = solve(prof, int(share * plain))
        remat.apply(model, plan)
        measured = measure_step(model, batch, loss_fn=_side_loss, repeats=0).peak_bytes
        remat.remove(model)
        assert abs(plan.estimate.peak_bytes - measured) <= 0.01 * measured, (share, plan.choices)
        assert measured <= plan.budget_bytes  # type: ignore[operator]
        plans.add(tuple(plan.choices.values()))
    assert len(plans) > 2, "the budgets should give different mixes of kept and recomputed blocks"


def test_verified_auto_raises_with_the_measured_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from remat import autoplan

    model, batch, loss_fn = build("gpt")
    real = autoplan._verify

    def always_over(*args: object, **kwargs: object) -> remat.Report:
        report = real(*args, **kwargs)  # type: ignore[arg-type]
        return dataclasses.replace(report, measured_peak_bytes=(report.budget_bytes or 0) + 2**20)

    monkeypatch.setattr(autoplan, "_verify", always_over)
    with pytest.raises(InfeasibleBudget, match=r"no plan measured within the budget .* measured") as e:
        remat.auto(model, batch, "80%", loss_fn=loss_fn, repeats=1, verify=True)
    assert "raise the budget to at least" in str(e.value)
    assert applied_plan(model) is None


def test_a_plan_that_runs_out_of_memory_when_verified_is_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a process capped between torch's checkpoint on every block and the plain step, the
    verified plan of conformer's Conformer ran out of memory (the step's allocator, then the
    profiler's records: ``MemoryError: std::bad_alloc``), and ``auto`` raised that MemoryError."""
    from remat import verifier

    model, batch, loss_fn = build("gpt")
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    real = verifier.measure_step

    def ran_out(m: nn.Module, *args: object, **kwargs: Any) -> remat.StepMemory:
        if applied_plan(m) is not None:
            raise MemoryError("std::bad_alloc")
        return real(m, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(verifier, "measure_step", ran_out)
    with pytest.raises(InfeasibleBudget, match=r"no plan was verified .* ran out of memory .*MemoryError") as e:
        remat.auto(model, batch, "60%", loss_fn=loss_fn, repeats=1, verify=True)
    assert "left without a plan" in str(e.value) and "remat's profiling shares that memory" in str(e.value)
    assert applied_plan(model) is None
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(torch.equal(keys[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow  # 20-25 s
def test_a_refusal_a_few_bytes_over_names_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # In a process capped below the plain step, a diffusers UNet's plan at its floor measured 32
    # bytes over the lean profile's prediction: "raise the budget to at least 148.39 MiB" read as
    # the budget itself. The counts that read alike are given in bytes.
    import dataclasses

    from remat import autoplan

    model, batch, loss_fn = build("gpt")
    real = autoplan._verify
    measured: list[int] = []

    def over(*args: object, **kwargs: object) -> remat.Report:
        report = real(*args, **kwargs)  # type: ignore[arg-type]
        measured.append((report.budget_bytes or 0) + 32)
        return dataclasses.replace(report, measured_peak_bytes=measured[-1])

    monkeypatch.setattr(autoplan, "_verify", over)
    with pytest.raises(InfeasibleBudget) as e:
        remat.auto(model, batch, "80%", loss_fn=loss_fn, repeats=1, verify=True)
    assert f"raise the budget to at least {format_bytes(measured[-1])} ({measured[-1]} bytes)" in str(e.value)
    assert f"({measured[-1] - 32} bytes)" in str(e.value)  # the budget's


def test_a_segment_plan_that_measures_over_gives_way_to_per_block_options(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ A verified plan fits ]: a plan with segments that measures over its budget is
    replaced by the per-block optimum at the same budget before any budget is tightened."""
    import dataclasses

    from remat import autoplan
    from remat.models import UNetConfig, build_model, loss_fn_for, make_batch
    from remat.plan.costmodel import smallest_feasible

    torch.manual_seed(0)
    model = build_model(UNetConfig(image_size=32, channels=16))
    batch, loss = make_batch(model, batch_size=4), loss_fn_for(model)
    prof = profile(model, batch, loss_fn=loss, repeats=1)
    budget = smallest_feasible(prof)[0]  # the per-block floor: segments do it faster
    assert solve(prof, budget).segments, "pick a budget where the fastest plan has segments"
    real = autoplan._verify
    seen: list[Plan] = []

    def verify(model: Any, batch: Any, plan: Plan, **kw: Any) -> Any:
        seen.append(plan)
        report = real(model, batch, plan, **kw)
        if plan.segments:  # as if the segment model had under-predicted it by a byte
            report = dataclasses.replace(report, measured_peak_bytes=plan.budget_bytes + 1)
        return report

    monkeypatch.setattr(autoplan, "_verify", verify)
    with caplog.at_level("WARNING", logger="remat.autoplan"):
        plan, report = remat.auto(model, batch, budget, loss_fn=loss, repeats=1, verify=True)
    assert seen[0].segments and not plan.segments and len(seen) == 2
    assert "per-block options only" in caplog.text
    assert report.fits and report.measured_peak_bytes == plan.estimate.peak_bytes <= budget
    remat.remove(model)
