"""remat on a zoo of tiny transformers models of many families (tests/_hf_zoo.py): blocks found in
every stack, verified plans at 60% and 40% of the plain peak and at the smallest feasible peak that
fit their budget, measure within 1% of their prediction and give the plain model's gradients bit
for bit, and ``remove`` that gives back the model as it was.

Predicted against measured peaks go into a table (``zoo_table.md`` in pytest's temporary
directory, and printed with ``-s``). The side inputs every block receives (masks, rotary tables,
position biases, an encoder's output) are in the cost model (NOTE [ Tensors that cross a block boundary ] in remat.crossing);
``auto(verify=True)`` re-solves when a plan measures over (NOTE [ A verified plan fits ]), and the
table counts how often it had to.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import _hf_zoo
from _tiers import breadth

import remat
from remat.manual.blocks import find_blocks
from remat.units import format_bytes

SHARES = (0.6, 0.4, 0.0)
"""Budgets as shares of the plain peak; 0 stands for the smallest feasible peak."""


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    yield rows
    lines = ["| architecture | budget | predicted | measured | error % | re-solves |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (list(_hf_zoo.ZOO).index(r["name"]), -r["share"])):
        share = f"{r['share']:.0%}" if r["share"] else "smallest"
        head = f"| {r['name']} | {share} = {format_bytes(r['budget'])} |"
        if r["measured"] is None:
            lines.append(f"{head} infeasible: smallest {format_bytes(r['smallest'])} | | | |")
            continue
        error = 100 * (r["measured"] / r["predicted"] - 1)
        lines.append(f"{head} {format_bytes(r['predicted'])} | {format_bytes(r['measured'])} | "
                     f"{error:+.1f} | {r['resolves']} |")
    resolved = sum(1 for r in rows if r["resolves"])
    lines.append(f"\n{len(rows)} cases, {resolved} needed a re-solve, "
                 f"{sum(1 for r in rows if r['measured'] is None)} infeasible.")
    text = "\n".join(lines) + "\n"
    (tmp_path_factory.mktemp("hf_zoo") / "zoo_table.md").write_text(text)
    print("\n" + text)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _outputs(model: nn.Module, batch: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of an evaluation forward and the loss of a training forward on one seed."""
    model.eval()
    with torch.no_grad():
        out = _tensors(dict(model(**batch)))
    model.train()
    torch.manual_seed(0)
    with torch.no_grad():
        out.append(model(**batch).loss)
    return out


def _hook_counts(model: nn.Module) -> list[int]:
    return [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]


@pytest.mark.parametrize("name", list(_hf_zoo.ZOO))
def test_blocks_in_every_stack(name: str) -> None:
    model, _, stacks = _hf_zoo.ZOO[name]()
    found = [n for n, _ in find_blocks(model)]
    expected = [f"{s}.{c}" for s in stacks for c, _ in model.get_submodule(s).named_children()]
    assert found == expected
    assert len(found) == sum(len(model.get_submodule(s)) for s in stacks) >= 2 * len(stacks)


@contextlib.contextmanager
def _without_plan(model: Any, plan: Any) -> Iterator[None]:
    remat.remove(model)
    try:
        yield
    finally:
        remat.apply(model, plan)


@pytest.mark.parametrize("share", SHARES, ids=lambda s: f"{s:.0%}" if s else "smallest")
@pytest.mark.parametrize("name", breadth(_hf_zoo.ZOO, quick=["llama"]))  # 15-75 s a case; the quick tier: llama
def test_verified_plan_fits_and_is_exact(
    name: str, share: float, table: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    model, batch, _ = _hf_zoo.ZOO[name]()
    before = copy.deepcopy(model)
    hooks = _hook_counts(model)
    caplog.set_level(logging.WARNING, logger="remat.autoplan")
    row: dict[str, Any] = {"name": name, "share": share, "measured": None, "resolves": 0}
    budget: int | str = f"{share:.0%}"
    if not share:  # the floor remat names when asked for less, as a user finds it
        with pytest.raises(remat.InfeasibleBudget) as floor:
            remat.auto(model, batch, 1, repeats=1)
        budget = floor.value.smallest_bytes or 0
    try:
        try:
            plan, report = remat.auto(model, batch, budget, verify=True, repeats=1)
        except remat.InfeasibleBudget as e:
            # the floor named before any step ran is the fake tensors'; the lean steps then measure
            # what kernels allocate besides and name it with that (NOTE [ What no tensor holds ])
            # (on the ConvNeXt, whose kernels' scratch no fake step sees, the refined floor is 2.7x:
            # every option no lean step ran is charged the largest scratch)
            if share or not e.smallest_bytes or e.smallest_bytes <= int(budget):
                raise
            budget = e.smallest_bytes
            plan, report = remat.auto(model, batch, budget, verify=True, repeats=1)
    except remat.InfeasibleBudget as e:
        assert share, f"the plan for the smallest feasible peak measured over it: {e}"
        assert e.smallest_bytes > e.budget_bytes
        assert format_bytes(e.smallest_bytes) in str(e), str(e)
        assert remat.applied_plan(model) is None  # left without a plan
        table.append(row | {"budget": e.budget_bytes, "smallest": e.smallest_bytes})
    else:
        assert plan.budget_bytes is not None
        assert report.measured_peak_bytes <= plan.budget_bytes, report
        if report.plain_ran:
            assert abs(report.measured_peak_bytes / report.predicted_peak_bytes - 1) <= 0.01, report
        else:  # a lean profile: bytes from fake tensors, which take transformers' tracing branches
            assert report.measured_peak_bytes <= 1.01 * report.predicted_peak_bytes, report
        if report.reference.startswith("none"):  # no reference fits the budget: this process holds plain
            from remat.models.hf import without_cache
            from remat.verify_steps import compare as _compare
            from remat.verify_steps import loss_and_grads as _grads

            with without_cache(model):  # as verify runs its steps (NOTE [ No K/V cache in a planned ... ])
                planned = _grads(model, batch, None, None, 0)
                with _without_plan(model, plan):
                    plain = _grads(model, batch, None, None, 0)
            diff, equal = _compare(plain, planned, exact=plan.head == "keep" and "tiled" not in plan.choices.values())
            assert equal, (diff, plan.choices, plan.head)
        else:
            assert report.grads_equal, report.max_grad_diff
        assert set(plan.choices) >= {n for n, _ in find_blocks(model)}  # the stacks' layers, and what else runs
        resolves = sum("solving again" in r.getMessage() for r in caplog.records)
        table.append(row | {"budget": plan.budget_bytes, "predicted": report.predicted_peak_bytes,
                            "measured": report.measured_peak_bytes, "resolves": resolves})
    remat.remove(model)
    assert _hook_counts(model) == hooks
    state, ref = model.state_dict(), before.state_dict()
    assert list(state) == list(ref)
    assert all(torch.equal(state[k], ref[k]) for k in ref)
    for got, want in zip(_outputs(model, batch), _outputs(before, batch), strict=True):
        assert torch.equal(got, want)


# --- no K/V cache in a planned training step (NOTE [ No K/V cache in a planned training step ]) ----


@pytest.mark.parametrize("name", ["mistral", "falcon", "gemma", "gpt_bigcode"])
def test_training_steps_build_no_cache_while_planned_and_remove_gives_it_back(name: str) -> None:
    model, batch, _ = _hf_zoo.ZOO[name]()
    assert model.config.use_cache
    twin, _, _ = _hf_zoo.ZOO[name]()
    twin.config.use_cache = False
    # The profile of the user's model is the profile of the same model without a cache, byte for byte.
    got, want = remat.profile(model, batch, repeats=1), remat.profile(twin, batch, repeats=1)
    assert got.plain_peak_bytes == want.plain_peak_bytes
    for a, b in zip(got.blocks, want.blocks, strict=True):
        assert {o: c.kept_bytes for o, c in a.options.items()} == {o: c.kept_bytes for o, c in b.options.items()}
    assert model(**batch).past_key_values is not None  # the user's setting, before a plan
    hooks = _hook_counts(model)
    remat.apply(model, remat.solve(got, "60%"))
    assert model(**batch).past_key_values is None  # training with the plan: no cache
    model.eval()
    with torch.no_grad():
        assert model(**batch).past_key_values is not None  # evaluation keeps its cache
    model.train()
    assert model.config.use_cache  # the config is never touched
    remat.remove(model)
    assert _hook_counts(model) == hooks
    assert model(**batch).past_key_values is not None


# --- layerdrop (NOTE [ layerdrop ]) ----------------------------------------------------------------


class _Runs:
    """Which encoder layers ran in which forward of the encoder (a recompute adds nothing)."""

    def __init__(self, encoder: nn.Module) -> None:
        self.forwards = 0
        self.ran: set[tuple[int, int]] = set()
        self.layers = len(encoder.layers)
        encoder.register_forward_pre_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))
        for i, layer in enumerate(encoder.layers):
            layer.register_forward_pre_hook(lambda *_, i=i: self.ran.add((self.forwards, i)))

    def all_ran(self, since: int = 0) -> bool:
        steps = range(since + 1, self.forwards + 1)
        return len(steps) > 0 and self.ran >= {(s, i) for s in steps for i in range(self.layers)}


def test_layerdrop_is_planned_with_every_layer_running_and_left_on(caplog: pytest.LogCaptureFixture) -> None:
    model, batch, _ = _hf_zoo.wav2vec2(layerdrop=0.5)
    cfg = model.config
    runs = _Runs(model.wav2vec2.encoder)
    with caplog.at_level(logging.INFO, logger="remat.models.hf"):
        plan, report = remat.auto(model, batch, "80%", verify=True, repeats=1)
    assert runs.all_ran()  # every step that profiled and verified ran every layer
    assert report.fits and report.grads_equal
    assert {n for n in plan.choices if ".encoder.layers." in n} == {f"wav2vec2.encoder.layers.{i}" for i in range(runs.layers)}
    assert "every layer running" in caplog.text and "(model.config.layerdrop = 0.5)" in caplog.text
    assert model.config is cfg and model.wav2vec2.encoder.config is cfg and cfg.layerdrop == 0.5
    before = runs.forwards
    torch.manual_seed(0)
    for _ in range(4):  # training with the plan: the user's layerdrop skips layers again
        model(**batch).loss.backward()
    assert not runs.all_ran(since=before)


def test_the_floor_solve_names_for_a_model_with_layerdrop_is_a_plan_apply_takes() -> None:
    # Profile.layerdrop: the floor InfeasibleBudget named needed a segment over layers layerdrop
    # may skip, which apply refuses (transformers' Autoformer and Informer, layerdrop 0.1 by default).
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoformerConfig(prediction_length=16, context_length=32, input_size=1, lags_sequence=[1, 2, 3],
                                        num_time_features=1, d_model=32, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                        decoder_ffn_dim=32)
    torch.manual_seed(0)
    model = transformers.AutoformerForPrediction(cfg).train()
    g = torch.Generator().manual_seed(1)
    batch = {"past_values": torch.randn(2, 35, generator=g), "past_time_features": torch.randn(2, 35, 1, generator=g),
             "past_observed_mask": torch.ones(2, 35), "future_values": torch.randn(2, 16, generator=g),
             "future_time_features": torch.randn(2, 16, 1, generator=g)}
    prof = remat.profile(model, batch, repeats=1)
    layers = [b.name for b in prof.blocks if ".layers." in b.name]  # and each stack's embedding norm (rule 7)
    assert len(layers) == 4 and len(prof.blocks) == 6 and prof.layerdrop == layers
    assert remat.Profile.from_json(prof.to_json()) == prof
    with pytest.raises(remat.InfeasibleBudget) as refused:
        remat.solve(prof, 1)
    assert refused.value.smallest_bytes is not None
    plan = remat.solve(prof, refused.value.smallest_bytes)
    remat.apply(model, plan)
    remat.remove(model)
    assert not plan.segments


def test_verify_runs_every_layer_of_a_model_with_layerdrop() -> None:
    model, batch, _ = _hf_zoo.wav2vec2(layerdrop=0.0)
    plan = remat.solve(remat.profile(model, batch, repeats=1), "80%")
    model.config.layerdrop = 0.5
    runs = _Runs(model.wav2vec2.encoder)
    report = remat.verify(model, batch, plan, repeats=2)
    assert runs.all_ran()  # the plain and the planned steps alike: peaks of the step the plan is for
    assert report.grads_equal and abs(report.peak_error) < 0.01
    assert model.config.layerdrop == 0.5


@pytest.mark.parametrize("name", ["wav2vec2", "bart"])
def test_layerdrop_is_put_back_when_profiling_fails(name: str) -> None:
    # Wav2Vec2 reads config.layerdrop at each step; BART copies it to its encoder and decoder.
    model, batch, _ = getattr(_hf_zoo, name)()
    cfg = model.config
    holders = [m for m in model.modules() if "layerdrop" in m.__dict__]
    cfg.layerdrop, cfg.encoder_layerdrop, cfg.decoder_layerdrop = 0.1, 0.2, 0.3
    for m in holders:
        m.layerdrop = 0.4

    def failing(output: Any, batch: Any) -> torch.Tensor:
        raise RuntimeError("a loss that fails")

    with pytest.raises(RuntimeError, match="a loss that fails"):
        remat.profile(model, batch, loss_fn=failing, repeats=1)
    assert all(m.config is cfg for m in model.modules() if "config" in m.__dict__)
    assert (cfg.layerdrop, cfg.encoder_layerdrop, cfg.decoder_layerdrop) == (0.1, 0.2, 0.3)
    assert [m.layerdrop for m in holders] == [0.4] * len(holders) and (holders or name == "wav2vec2")


def test_an_estimate_runs_every_layer_and_leaves_the_shared_config_alone() -> None:
    # Under fake tensors a layer skip is a data-dependent branch: the estimate would fail on it.
    transformers = pytest.importorskip("transformers")
    model, batch, _ = _hf_zoo.bart()
    cfg = model.config
    cfg.encoder_layerdrop, cfg.decoder_layerdrop = 0.3, 0.2
    estimate = remat.profile(lambda: transformers.BartForConditionalGeneration(cfg), batch, device="h100")
    layers = [b.name for b in estimate.blocks if ".layers." in b.name]  # and each stack's embedding norm (rule 7)
    assert len(layers) == 4 and len(estimate.blocks) == 6 and estimate.layerdrop == layers
    assert (cfg.encoder_layerdrop, cfg.decoder_layerdrop) == (0.3, 0.2)


def test_auto_plans_a_model_with_layerdrop_without_segments() -> None:
    model, batch, _ = _hf_zoo.wav2vec2(layerdrop=0.5, layers=6)
    layers = ["wav2vec2.encoder.layers.*"]  # the layers alone: the feature extractor's blocks take 60% without segments
    prof = remat.profile(model, batch, blocks=layers, repeats=1)
    assert not remat.solve(prof, "60%").segments  # Profile.layerdrop
    with_segments = remat.solve(dataclasses.replace(prof, layerdrop=[]), "60%")
    assert any(".encoder.layers." in a and a != b for a, b in with_segments.segments)  # what it avoids
    plan = remat.auto(model, batch, "60%", blocks=layers, repeats=1)
    assert not plan.segments and remat.applied_plan(model) == plan
    torch.manual_seed(0)
    for _ in range(4):  # layerdrop skips layers; per-block options do not mind
        model(**batch).loss.backward()


def test_a_segment_over_layers_layerdrop_skips_is_refused() -> None:
    model, batch, _ = _hf_zoo.wav2vec2(layerdrop=0.5)
    plan = remat.solve(remat.profile(model, batch, repeats=1), method="all")
    layers = [n for n in plan.choices if ".encoder.layers." in n]
    choices = {n: "keep" if n in layers else o for n, o in plan.choices.items()}
    over = dataclasses.replace(plan, choices=choices, segments=[[layers[0], layers[-1]]])
    with pytest.raises(remat.RematError, match=r"segment .*layers.0..*layers.1 holds .*layers.0, a layer that "
                                               r"layerdrop \(wav2vec2.encoder.config.layerdrop = 0.5\).*segments=False"):
        remat.apply(model, over)
    one = dataclasses.replace(plan, choices=choices, segments=[[layers[0], layers[0]]])
    remat.apply(model, one)  # a segment of one layer opens and closes in its call: skipped, it never opens
    torch.manual_seed(0)
    for _ in range(4):
        model(**batch).loss.backward()
