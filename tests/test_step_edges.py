"""The edges every stage shares: the two forms of ``loss_fn``, the step clock, factories that convert
their model's dtype in estimated mode, and ``verify_many``'s plain baseline and in-turn timing."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import models
from remat.measure.clock import step_clock_ms
from remat.measure.step import resolve_loss_fn
from remat.measure.step_memory import measure_step
from remat.verifier import verify_many

CFG = models.GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=64, dropout=0.0)


def gpt() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = models.build_model(CFG)
    return model, models.make_batch(model, batch_size=2, seq_len=32)


def output_only(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().pow(2).mean()


# --- loss_fn(output) or loss_fn(output, batch) --------------------------------------------------


def test_both_loss_forms_give_the_same_step() -> None:
    model, batch = gpt()
    one = measure_step(model, batch, loss_fn=output_only, repeats=0)
    two = measure_step(model, batch, loss_fn=lambda out, b: output_only(out), repeats=0)
    lam = measure_step(model, batch, loss_fn=lambda out: output_only(out), repeats=0)
    assert one.peak_bytes == two.peak_bytes == lam.peak_bytes
    prof = remat.profile(model, batch, loss_fn=lambda out: out.float().pow(2).mean(), repeats=1)
    plan = remat.solve(prof, "90%")
    (report,) = verify_many(model, batch, [plan], loss_fn=output_only, repeats=1)
    assert report.grads_equal and report.fits


def test_one_argument_loss_through_auto() -> None:
    model, batch = gpt()
    plan, report = remat.auto(model, batch, "90%", loss_fn=lambda out: out.float().mean(),
                              repeats=1, verify=True)  # fmt: skip
    assert report.passed, report
    assert any(option != "keep" for option in plan.choices.values()), plan.choices
    remat.remove(model)


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize(
    "bad",
    [lambda: 0.0, lambda out, batch, extra: 0.0, "mse"],
    ids=["no-argument", "three-arguments", "a-string"],
)
def test_a_loss_of_neither_form_is_refused_before_any_work(bad: Any) -> None:
    model, batch = Counting(), torch.randn(2, 4)
    for call in (
        lambda: remat.profile(model, batch, loss_fn=bad),
        lambda: remat.auto(model, batch, "70%", loss_fn=bad),
        lambda: measure_step(model, batch, loss_fn=bad),
        lambda: verify_many(model, batch, [], loss_fn=bad),
    ):
        with pytest.raises(TypeError, match=r"loss_fn\(output\) or loss_fn\(output, batch\)"):
            call()
    assert model.calls == 0


def test_resolving_is_idempotent_and_keeps_defaults() -> None:
    assert resolve_loss_fn(None) is None
    once = resolve_loss_fn(output_only)
    assert resolve_loss_fn(once) is once
    with_default = resolve_loss_fn(lambda out, batch=None: out.sum())
    assert with_default is not None and with_default(torch.ones(2), None).item() == 2.0
    assert resolve_loss_fn(F.mse_loss) is F.mse_loss  # (input, target): the two-argument form


# --- the step clock -----------------------------------------------------------------------------


def test_cpu_step_clock_counts_work_not_waiting() -> None:
    t0 = step_clock_ms("cpu")
    time.sleep(0.3)  # another process holding the core looks like this to us
    slept = step_clock_ms("cpu") - t0
    t0 = step_clock_ms("cpu")
    x = torch.randn(256, 256)
    for _ in range(50):
        x = torch.tanh(x @ x)
    worked = step_clock_ms("cpu") - t0
    assert slept < 100.0, slept
    assert worked > 0.0


# --- estimated-mode factories that convert the dtype --------------------------------------------


@functools.cache
def _fp32_estimate() -> remat.Profile:
    def batch() -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, CFG.vocab_size, (2, 32)),)

    return remat.profile(lambda: models.build_model(CFG), batch, loss_fn=models.lm_loss, device="h100")


@pytest.mark.parametrize(
    "convert", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.bfloat16()],
    ids=["to-bfloat16", "half", "bfloat16"],
)
def test_estimated_factory_may_convert_the_dtype(convert: Any) -> None:
    def factory() -> nn.Module:
        return convert(models.build_model(CFG))

    def batch() -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, CFG.vocab_size, (2, 32)),)

    fp32 = _fp32_estimate()
    half = remat.profile(factory, batch, loss_fn=models.lm_loss, device="h100")
    assert half.dtype in ("bfloat16", "float16")
    assert half.param_bytes * 2 == fp32.param_bytes
    assert 0 < half.plain_peak_bytes < fp32.plain_peak_bytes


def test_estimated_conversion_keeps_tied_weights() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.measure.fake import convertible_parameters

    mode = FakeTensorMode()
    with mode, convertible_parameters(mode):
        model = models.build_model(CFG).to(torch.bfloat16)
        head, emb = model.lm_head.weight, model.wte.weight  # the GPT ties them
        assert head is emb and head.dtype == torch.bfloat16


# --- verify_many --------------------------------------------------------------------------------


def test_verify_many_measures_plain_once_and_each_distinct_plan_once() -> None:
    model, batch = gpt()
    loss_fn = models.lm_loss
    prof = remat.profile(model, batch, loss_fn=loss_fn, repeats=1)
    none, every = remat.solve(prof, method="none"), remat.solve(prof, method="all")
    twin = dataclasses.replace(every, budget_bytes=every.estimate.peak_bytes, method="optimal")
    reports = verify_many(model, batch, [none, every, twin], loss_fn=loss_fn, repeats=3)
    plain, r_every, r_twin = reports
    # A plan that keeps every block is the plain step: its baseline by construction.
    assert plain.measured_overhead == 0.0 and plain.step_ms == plain.plain_step_ms
    assert plain.measured_peak_bytes == plain.plain_peak_bytes == none.estimate.peak_bytes
    # The same choices are measured once; each report is judged against its own budget.
    assert r_every.measured_peak_bytes == r_twin.measured_peak_bytes == every.estimate.peak_bytes
    assert r_every.step_ms == r_twin.step_ms
    assert r_every.budget_bytes is None and r_twin.budget_bytes == every.estimate.peak_bytes
    assert r_twin.fits and r_every.grads_equal and r_twin.grads_equal
    for r in reports:
        assert r.plain_self_overhead is not None and r.step_ms_spread is not None
        assert r.step_ms_spread >= 0.0
    assert remat.applier.applied_plan(model) is None


def test_verify_keeps_the_users_plan() -> None:
    model, batch = gpt()
    prof = remat.profile(model, batch, loss_fn=models.lm_loss, repeats=1)
    plan = remat.solve(prof, method="all")
    remat.apply(model, plan)
    report = remat.verify(model, batch, plan, loss_fn=models.lm_loss, repeats=1)
    assert report.passed
    assert remat.applier.applied_plan(model) == plan
