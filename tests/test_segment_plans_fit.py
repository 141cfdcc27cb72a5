"""Every plan ``solve`` returns, segments or not, measures within 1% of its prediction and never
over its budget, on models with long skips, pooling between blocks, stages and side inputs; and
``verify`` measures a plan of segments over blocks that all 'keep' (no plain step)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_stacks import _unet, _unet_loss

import remat
from remat.measure.profiler import profile
from remat.measure.step_memory import measure_step
from remat.models import BiasLMConfig, GPTConfig, UNetConfig, build_model, loss_fn_for, make_batch
from remat.plan.segment_estimate import estimate_segments
from remat.plan.segments import SegmentModel
from remat.plan.solver import smallest_any, solve

Case = tuple[torch.nn.Module, Any, Any]


def _built(cfg: Any, **kw: Any) -> Callable[[], Case]:
    def make() -> Case:
        torch.manual_seed(0)
        model = build_model(cfg)
        return model, make_batch(model, batch_size=4, **kw), loss_fn_for(model)
    return make


def _stacks_unet() -> Case:  # pooling and interpolation between blocks, in the user's forward
    model, batch = _unet()
    return model, batch, _unet_loss


def _convnext() -> Case:  # stages with downsampling inside, as the blocks
    _hf_zoo = pytest.importorskip("_hf_zoo")
    pytest.importorskip("transformers")
    model, batch, _ = _hf_zoo.ZOO["convnext"]()
    return model, batch, None


CASES: dict[str, Callable[[], Case]] = {
    "gpt": _built(GPTConfig(n_layer=6, n_embd=64, n_head=2, block_size=128, vocab_size=256), seq_len=128),
    "unet": _built(UNetConfig(image_size=32, channels=16)),
    "bias": _built(BiasLMConfig(n_layer=6, dim=64, n_head=2, max_seq=128, vocab_size=256), seq_len=128),
    "stacks-unet": _stacks_unet,
    "convnext": _convnext,
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_plan_solve_returns_fits_and_is_predicted(name: str) -> None:
    model, batch, loss = CASES[name]()
    prof = profile(model, batch, loss_fn=loss, repeats=1)
    low, high = smallest_any(prof)[0], prof.plain_peak_bytes
    every = solve(prof, method="all").estimate.peak_bytes  # about torch's every-block peak
    budgets = sorted({low, every, low + (high - low) // 10, low + 2 * (high - low) // 5})
    seen: dict[tuple[Any, ...], int] = {}
    for budget in budgets:
        plan = solve(prof, budget)
        key = (tuple(sorted(plan.choices.items())), tuple(map(tuple, plan.segments)))
        if key not in seen:
            remat.apply(model, plan, strict=False)
            seen[key] = measure_step(model, batch, loss_fn=loss, repeats=0).peak_bytes
            remat.remove(model)
        measured, predicted = seen[key], plan.estimate.peak_bytes
        assert measured <= budget, (budget, plan.segments, predicted, measured)
        assert abs(measured - predicted) <= 0.01 * measured, (budget, plan.segments, predicted, measured)


def test_verify_measures_a_plan_of_segments_over_kept_blocks() -> None:
    model, batch, loss = CASES["unet"]()
    prof = profile(model, batch, loss_fn=loss, repeats=1)
    names = [b.name for b in prof.blocks]
    keep, segments = solve(prof, method="none"), [[names[0], names[1]]]
    predicted = estimate_segments(prof, keep.choices, segments)
    plan = dataclasses.replace(keep, segments=segments, estimate=predicted)
    assert set(plan.choices.values()) == {"keep"}
    report = remat.verify(model, batch, plan, loss_fn=loss, repeats=1)
    remat.apply(model, plan, strict=False)
    measured = measure_step(model, batch, loss_fn=loss, repeats=0).peak_bytes
    remat.remove(model)
    assert measured < report.plain_peak_bytes  # the segment saves something: no plain step
    assert report.measured_peak_bytes == measured == predicted.peak_bytes
    assert report.grads_equal


def _laminar_spans(rng: random.Random, lo: int, hi: int, reach: list[int], depth: int = 0) -> list[tuple[int, int]]:
    """A random family of nested or disjoint spans of lo..hi that no skip crosses."""
    spans, j = [], lo
    while j <= hi:
        if rng.random() < 0.45 and depth < 3:
            last = j + rng.randint(0, min(3, hi - j, reach[j] - j))
            spans.append((j, last))
            if last > j and rng.random() < 0.6:
                spans += _laminar_spans(rng, j, last, reach, depth + 1)
            j = last + 1
        else:
            j += 1
    return sorted(set(spans))


@pytest.mark.parametrize("name", ["gpt", "unet", "bias"])
def test_random_plans_with_segments_are_predicted_to_the_byte(name: str) -> None:
    # NOTE [ A segment's costs from per-block numbers ]: a frame lets its RNG states and side
    # inputs go once its replay ends, and the replay stops inside its last block (on BiasLM the
    # model was 60 KiB over on every flat segment of 3 blocks or more before it knew both).
    model, batch, loss = CASES[name]()
    prof = profile(model, batch, loss_fn=loss, repeats=1)
    names, reach = [b.name for b in prof.blocks], SegmentModel(prof).reach
    rng = random.Random(7)
    keep = solve(prof, method="none")
    for _ in range(6):
        spans = _laminar_spans(rng, 0, len(names) - 1, reach)
        inside = {j for a, b in spans for j in range(a, b + 1)}
        choices = {n: "keep" if j in inside else rng.choice(["keep", "selective", "recompute"])
                   for j, n in enumerate(names)}
        segments = [[names[a], names[b]] for a, b in spans]
        predicted = estimate_segments(prof, choices, segments)
        remat.apply(model, dataclasses.replace(keep, choices=choices, segments=segments, estimate=predicted),
                    strict=False)
        measured = measure_step(model, batch, loss_fn=loss, repeats=0).peak_bytes
        remat.remove(model)
        assert measured == predicted.peak_bytes, (spans, choices, predicted.peak_phase)


def test_a_replay_set_off_after_the_backward_made_a_gradient_is_predicted() -> None:
    # BlockProfile.unpack_bytes: transformers' PVT layer reshapes the transposed gradient that comes
    # in (a copy) before it reads a tensor it saved, and the replay of a segment ending there runs
    # on top of that copy; the floor plan of this config measured 4,864 B over its prediction.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.PvtConfig(image_size=32, num_encoder_blocks=2, depths=[2, 2], sequence_reduction_ratios=[2, 1],
                                 hidden_sizes=[16, 32], patch_sizes=[4, 2], strides=[4, 2], num_attention_heads=[1, 2],
                                 mlp_ratios=[2, 2], num_labels=10)
    model = transformers.PvtForImageClassification(cfg).train()
    g = torch.Generator().manual_seed(1)
    batch = {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.randint(0, 10, (2,), generator=g)}
    prof = profile(model, batch, repeats=1)
    names = [b.name for b in prof.blocks]
    assert names[:2] == ["pvt.encoder.patch_embeddings.0", "pvt.encoder.block.0.0"]
    choices = {n: "recompute" if n == "pvt.encoder.block.0.1" else "keep" for n in names}
    segments = [names[:2]]
    predicted = estimate_segments(prof, choices, segments)
    remat.apply(model, dataclasses.replace(solve(prof, method="none"), choices=choices, segments=segments,
                                           estimate=predicted), strict=False)
    measured = measure_step(model, batch, repeats=0).peak_bytes
    remat.remove(model)
    assert measured == predicted.peak_bytes and predicted.peak_phase.startswith("replay of pvt.encoder.block.0.0"), (
        measured, predicted)


def test_a_block_that_saves_nothing_and_a_replay_of_batchnorms_are_predicted() -> None:
    # transformers' PatchTST: its positional encoding (an add) saves nothing, so its checkpoint
    # holds none of its inputs (BlockProfile.saves), though the encoder's code holds the one it
    # takes to the end of the forward; read as held, the recompute run's backward peaks lost that
    # input and a plan keeping the encoding measured 6,144 B over. Its layers' BatchNorms: a
    # replay snapshots their running statistics (BlockProfile.stats_bytes), 528 B over before.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.PatchTSTConfig(num_input_channels=3, context_length=64, patch_length=8, patch_stride=8,
                                      prediction_length=16, d_model=32, num_attention_heads=2, num_hidden_layers=4,
                                      ffn_dim=64, dropout=0.0, head_dropout=0.0)
    model = transformers.PatchTSTForPrediction(cfg).train()
    g = torch.Generator().manual_seed(1)
    batch = {"past_values": torch.randn(2, 64, 3, generator=g), "future_values": torch.randn(2, 16, 3, generator=g)}
    prof = profile(model, batch, repeats=1)
    names = [b.name for b in prof.blocks]
    assert names[0] == "model.encoder.positional_encoder" and not prof.blocks[0].saves
    assert [b.stats_bytes for b in prof.blocks] == [0] + [2 * (32 + 32 + 2) * 4] * 4  # two norms of 32 features
    kept_ends = {n: "keep" if n in (names[0], names[-1]) else "recompute" for n in names}
    replayed = {n: "recompute" if n in names[2:4] else "keep" for n in names}  # the floor plan
    for choices, segments in ((kept_ends, []), (replayed, [[names[1], names[1]]])):
        predicted = estimate_segments(prof, choices, segments)
        remat.apply(model, dataclasses.replace(solve(prof, method="none"), choices=choices, segments=segments,
                                               estimate=predicted), strict=False)
        measured = measure_step(model, batch, repeats=0).peak_bytes
        remat.remove(model)
        assert measured == predicted.peak_bytes, (choices, segments, measured, predicted)
    assert predicted.peak_phase == f"replay of {names[1]}"


def test_a_segment_whose_block_drops_more_than_it_stashes_lets_go_only_what_was_counted() -> None:
    # transformers' Swin: a stage drops the handover of the stage before in its forward, more than
    # its checkpoint stashes, so the segment's outer level counts none of its RNG state (rng_j is
    # clamped at 0); the frame's letting that state go at the replay's end was subtracted anyway,
    # and a one-block segment over the second stage among kept ones measured 5,056 B over.
    _hf_zoo = pytest.importorskip("_hf_zoo")
    pytest.importorskip("transformers")
    model, batch, _ = _hf_zoo.ZOO["swin"]()
    prof = profile(model, batch, repeats=1)
    names = [b.name for b in prof.blocks]
    off = []
    for name in names[1:]:
        for base in ("keep", "recompute"):
            choices, segments = dict.fromkeys(names, base) | {name: "keep"}, [[name, name]]
            predicted = estimate_segments(prof, choices, segments)
            remat.apply(model, dataclasses.replace(solve(prof, method="none"), choices=choices, segments=segments,
                                                   estimate=predicted), strict=False)
            measured = measure_step(model, batch, repeats=0).peak_bytes
            remat.remove(model)
            exact = (name, base) == ("swin.encoder.layers.1", "keep")  # the plan that was over
            if measured > predicted.peak_bytes or (exact and measured != predicted.peak_bytes):
                off.append((name, base, measured - predicted.peak_bytes, predicted.peak_phase))
    assert not off, off


class _ReturnsItsWeights(torch.nn.Module):
    """ESM-2's layer: it returns its head-averaged attention weights besides its output, which the
    model's loop holds until the next layer returns (a handover its kept forward does not save)."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.norm1(x)).chunk(3, -1))
        w = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.out((w @ v).transpose(1, 2).reshape(b, t, d))
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))
        return x, w.mean(dim=1)


class _WeightsLoop(torch.nn.Module):
    def __init__(self, depth: int = 6, dim: int = 64) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(33, dim), torch.nn.Linear(dim, 33)
        self.layers = torch.nn.ModuleList(_ReturnsItsWeights(dim) for _ in range(depth))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x, _weights = layer(x)  # held: the last layer's weights dropped here, the others when the next returns
        return self.head(x)


def test_segments_over_layers_that_hand_over_what_keep_does_not_save_are_predicted() -> None:
    """NOTE [ A segment over where a handover dies ]: ESM-2's shape, where one-block segments
    measured their prediction and more (here 93,096 B over; 263,736 B per adjacent pair on the
    helper's larger model, a two-block segment the weights' size), with verify=False."""
    torch.manual_seed(0)
    model, ids = _WeightsLoop(), torch.randint(0, 33, (4, 160))

    def loss(out: torch.Tensor, b: Any) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.transpose(1, 2), b[0])

    prof = profile(model, (ids,), loss_fn=loss, repeats=1)
    low, high = smallest_any(prof)[0], prof.plain_peak_bytes
    seen: dict[tuple[Any, ...], int] = {}
    for budget in sorted({low + (high - low) * i // 15 for i in range(16)}):
        plan = solve(prof, budget)
        key = (tuple(sorted(plan.choices.items())), tuple(map(tuple, plan.segments)))
        if key not in seen:
            remat.apply(model, plan, strict=False)
            seen[key] = measure_step(model, (ids,), loss_fn=loss, repeats=0).peak_bytes
            remat.remove(model)
        assert seen[key] <= plan.estimate.peak_bytes, (budget, plan.segments, plan.estimate.peak_bytes, seen[key])
    assert any(plan_segments for _, plan_segments in seen), "no plan with segments: the test tests nothing"
