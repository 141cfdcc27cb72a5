"""The models and the configurations that ``frontier.py`` compares: PyTorch's own options and remat's.

A ``Case`` is one training step to measure: a model, its batch, its loss and its blocks (the
modules remat plans over: ``find_blocks``). A ``Config`` is one way of running that step: the
plain step, a PyTorch checkpointing option, ``torch.compile`` under an activation memory budget, or
a remat plan. ``Config.active()`` switches the model into that configuration and back, cheaply, so
that configurations can take turns step by step (NOTE [ Interleaved timing ] in frontier.py).

# NOTE [ The peers ]
- "every block" / "every k-th block": ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
  around blocks 0, k, 2k, ... (k = 1: every block), the convention of transformers'
  ``activation_checkpointing_enable(every_n_layers=k)``. On transformers models that method itself
  is called, so the peer is exactly what its users run (``gradient_checkpointing_enable()`` is its
  k = 1 case). On remat's built-in models the same torch call is put on each block's ``forward``.
- "checkpoint_sequential": ``torch.utils.checkpoint.checkpoint_sequential`` over the blocks with
  round(sqrt(n)) segments; torch keeps the last segment's activations (it is not checkpointed). It
  needs the blocks as a chain of one-argument callables: the ConvNet *is* an ``nn.Sequential``; for
  the built-in GPT and Llama a wrapper module runs the model's own embedding and head around
  ``checkpoint_sequential`` over its blocks (Llama's blocks take the rotary tables and return a
  tuple, so each is called through a small adapter). The wrapper is checked against the model's
  own forward (eval mode, equal outputs) before it is measured. transformers' decoder layers take
  masks, caches and position tensors that the model's own forward loop builds, so this peer is not
  run for them.
- "torch.compile budget b": each block compiled with ``torch.compile`` (per block, the way
  torchtitan compiles; one graph serves every identical block; ``dynamic=False``) while
  ``torch._functorch.config.activation_memory_budget = b``: the min-cut partitioner then solves a
  knapsack for the least recomputation (by a FLOP-based runtime estimate) that saves at most b of
  the activations its default partition (1.0) saves; 0.0 is checkpointing the whole compiled
  block. Each budget gets a function with its own code object, so dynamo compiles it afresh
  instead of reusing another budget's graph, and the budget stays set while that configuration
  runs, so a recompile (if a guard ever failed) would use it too.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from remat.applier import apply, remove
from remat.manual.blocks import find_blocks
from remat.models import (
    BiasLMConfig,
    ConvNetConfig,
    GPTConfig,
    LlamaConfig,
    UNetConfig,
    build_model,
    loss_fn_for,
    make_batch,
    rope_cos_sin,
)
from remat.records import Plan

__all__ = ["MODELS", "Case", "Config", "build_case", "compiled", "every_k", "plain", "remat_plan", "sequential"]

#: Models the benchmark knows, in the order of its default run.
MODELS = ("gpt", "llama", "cnn", "unet", "bias-lm", "hf-gpt2", "hf-llama")
HF_MODELS = ("hf-gpt2", "hf-llama")


@dataclass(kw_only=True)
class Case:
    """One training step to measure."""

    name: str
    """The model's name in this benchmark, e.g. ``"gpt"``."""
    title: str
    """Its shape for people, e.g. ``"GPT 8 x 128, batch 4 x 128"``."""
    model: nn.Module
    batch: Any
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    optimizer: torch.optim.Optimizer
    blocks: list[tuple[str, nn.Module]]
    """The blocks remat plans over (``find_blocks``); the peers checkpoint the same ones."""
    sequential: nn.Module | None = None
    """A module that runs the step's forward with ``checkpoint_sequential`` over the blocks."""
    no_sequential: str = ""
    """Why there is no ``sequential`` runner."""
    hf: bool = False
    """A transformers model (its own checkpointing method is the peer)."""


@dataclass(kw_only=True)
class Config:
    """One way of running the step; ``active()`` switches the model into it and back."""

    name: str
    """Its label in tables and plots."""
    kind: str
    """``plain``, ``peer`` (per-block torch checkpointing), ``sequential``, ``compile`` or
    ``remat``."""
    runner: nn.Module
    """What the step calls: the model itself or a wrapper around it."""
    enter: Callable[[], object] = lambda: None
    exit: Callable[[], object] = lambda: None
    error: str = ""
    """Why it could not be run (set up, compiled), or empty."""
    plan: Plan | None = None
    """remat's plan, for ``kind == "remat"``."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Numbers for the JSON file (budget, compile seconds, ...)."""

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        self.enter()
        try:
            yield self.runner
        finally:
            self.exit()


# --- models ---------------------------------------------------------------------------------------

# NOTE [ Sizes ]
# "cpu": a step of roughly 0.1-0.6 s of CPU time on one core, eight blocks (so that every 2nd/3rd block
# and sqrt(n) segments differ), and activations, not the parameters' gradients and AdamW's state,
# dominate the lowest peak: the language models train on 8 x 128 tokens (at 2 x 128 every schedule
# ends at the same floor, the optimizer step, and no plan can go below every peer), and hf-gpt2 has
# GPT-2's ratio of vocabulary to width (50257 / 768 ~ 8192 / 128). "quick": the test's tiny GPT.
# "gpu": what benchmarks/gpu.sh runs on one large GPU: GPT-2 medium and large shapes and a
# Llama-3.2-1B shape at sequence 2048, bf16 parameters.
_GPT = {
    "quick": (GPTConfig(n_layer=4, n_embd=64, n_head=2, block_size=64, vocab_size=512), 2, 64),
    "cpu": (GPTConfig(n_layer=8, n_embd=128, n_head=4, block_size=128, vocab_size=2048), 8, 128),
    "gpu": (GPTConfig(n_layer=24, n_embd=1024, n_head=16, block_size=2048, vocab_size=50304), 4, 2048),
}
_LLAMA = {
    "quick": (LlamaConfig(n_layer=4, dim=64, n_head=2, n_kv_head=1, ffn_dim=172, vocab_size=512), 2, 64),
    "cpu": (LlamaConfig(n_layer=8, dim=128, n_head=4, n_kv_head=2, ffn_dim=344, vocab_size=2048), 8, 128),
    "gpu": (LlamaConfig(n_layer=16, dim=2048, n_head=32, n_kv_head=8, ffn_dim=8192, vocab_size=128256,
                        max_seq=2048, rope_theta=500000.0, tie_weights=True), 4, 2048),
}
_CNN = {
    "quick": (ConvNetConfig(image_size=16, channels=(8, 16), blocks_per_stage=2), 4),
    "cpu": (ConvNetConfig(image_size=32, channels=(16, 32, 64), blocks_per_stage=2), 8),
    "gpu": (ConvNetConfig(image_size=224, channels=(64, 128, 256, 512), blocks_per_stage=2), 64),
}
# The two models that are not one chain: a UNet with long skips (two blocks per level) and a
# decoder passing one attention bias to every block, at a long sequence (activations, not the
# parameters' gradients, dominate the backward: where segments can go below every block).
_UNET = {
    "quick": (UNetConfig(image_size=16, channels=8, depth=2), 2),
    "cpu": (UNetConfig(image_size=32, channels=16, depth=3), 8),
    "gpu": (UNetConfig(image_size=256, channels=64, depth=4), 16),
}
_BIAS = {
    "quick": (BiasLMConfig(n_layer=4, dim=32, n_head=2, max_seq=64, vocab_size=256), 2, 64),
    "cpu": (BiasLMConfig(n_layer=8, dim=64, n_head=4, max_seq=256, vocab_size=512), 4, 256),
    "gpu": (BiasLMConfig(n_layer=16, dim=1024, n_head=16, max_seq=2048, vocab_size=32000), 4, 2048),
}
# transformers configs: (layers, hidden, heads, kv heads, intermediate, vocab, batch, seq)
_HF_GPT2 = {"quick": (4, 64, 2, 2, 256, 512, 2, 64), "cpu": (8, 128, 4, 4, 512, 8192, 4, 128),
            "gpu": (36, 1280, 20, 20, 5120, 50257, 4, 2048)}
_HF_LLAMA = {"quick": (4, 64, 2, 1, 172, 512, 2, 64), "cpu": (8, 128, 4, 2, 344, 2048, 8, 128),
             "gpu": (16, 2048, 32, 8, 8192, 128256, 4, 2048)}


def transformers_missing() -> str:
    """Why transformers models cannot be built here, or empty."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install 'remat[hf]')"
    return ""


def build_case(name: str, *, size: str, device: torch.device, dtype: torch.dtype) -> Case:
    """Model, batch, loss, optimizer (AdamW) and blocks for ``name``, seeded."""
    torch.manual_seed(0)
    if name in HF_MODELS:
        case = _hf_case(name, size, device, dtype)
    elif name == "cnn":
        cfg, batch_size = _CNN[size]
        model = build_model(cfg, dtype=dtype, device=device)
        batch = make_batch(model, batch_size=batch_size, dtype=dtype, device=device)
        case = Case(name=name, title=f"ConvNet (BatchNorm) {'-'.join(map(str, cfg.channels))} x "
                    f"{cfg.blocks_per_stage}/stage, batch {batch_size} x {cfg.image_size}²",
                    model=model, batch=batch, loss_fn=loss_fn_for(model),
                    optimizer=_adamw(model), blocks=[])
    elif name == "unet":
        ucfg, batch_size = _UNET[size]
        model = build_model(ucfg, dtype=dtype, device=device)
        batch = make_batch(model, batch_size=batch_size, dtype=dtype, device=device)
        case = Case(name=name, title=f"UNet {ucfg.depth} levels x {ucfg.blocks_per_level} blocks, "
                    f"{ucfg.channels} channels, long skips, batch {batch_size} x {ucfg.image_size}²",
                    model=model, batch=batch, loss_fn=loss_fn_for(model), optimizer=_adamw(model),
                    blocks=[], no_sequential="its up blocks take the down path's outputs (long "
                    "skips): not a chain of one-argument blocks")
    elif name == "bias-lm":
        bcfg, batch_size, seq = _BIAS[size]
        model = build_model(bcfg, dtype=dtype, device=device)
        batch = make_batch(model, batch_size=batch_size, seq_len=seq, device=device)
        case = Case(name=name, title=f"BiasLM {bcfg.n_layer} x {bcfg.dim}, one attention bias "
                    f"into every block, batch {batch_size} x {seq}", model=model, batch=batch,
                    loss_fn=loss_fn_for(model), optimizer=_adamw(model), blocks=[])
    elif name in ("gpt", "llama"):
        lm: Any = _GPT if name == "gpt" else _LLAMA
        cfg, batch_size, seq = lm[size]
        model = build_model(cfg, dtype=dtype, device=device)
        batch = make_batch(model, batch_size=batch_size, seq_len=seq, device=device)
        width = cfg.n_embd if isinstance(cfg, GPTConfig) else cfg.dim
        case = Case(name=name, title=f"{type(model).__name__} {cfg.n_layer} x {width}, "
                    f"batch {batch_size} x {seq}", model=model, batch=batch,
                    loss_fn=loss_fn_for(model), optimizer=_adamw(model), blocks=[])
    else:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    case.blocks = find_blocks(case.model)
    _add_sequential(case)
    return case


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def _hf_case(name: str, size: str, device: torch.device, dtype: torch.dtype) -> Case:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers as _transformers

    transformers: Any = _transformers  # its config classes take **kwargs that stubs do not list
    transformers.logging.set_verbosity_error()
    layers, hidden, heads, kv, inter, vocab, batch_size, seq = (
        _HF_GPT2 if name == "hf-gpt2" else _HF_LLAMA)[size]
    # use_cache=False: a training step has no use for a KV cache (and would keep one alive).
    if name == "hf-gpt2":
        cfg: Any = transformers.GPT2Config(
            n_layer=layers, n_embd=hidden, n_head=heads, n_inner=inter, vocab_size=vocab,
            n_positions=seq, use_cache=False, attn_implementation="sdpa")
        cls: Any = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.LlamaConfig(
            hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
            max_position_embeddings=seq, use_cache=False, tie_word_embeddings=size == "gpu",
            attn_implementation="sdpa")
        cls = transformers.LlamaForCausalLM
    # Created in place, in its dtype on its device: a 1B model initialised on the CPU in float32
    # and then moved would take longer than the GPU benchmark itself.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg).train()
    finally:
        torch.set_default_dtype(old)
    title = f"transformers {cls.__name__} {layers} x {hidden}"
    ids = torch.randint(vocab, (batch_size, seq), device=device)
    return Case(name=name, title=f"{title}, batch {batch_size} x {seq}", model=model,
                batch={"input_ids": ids, "labels": ids}, loss_fn=None, optimizer=_adamw(model),
                blocks=[], hf=True,
                no_sequential="its decoder layers take masks and position tensors that the "
                "model's own forward loop builds")


def sqrt_segments(n: int) -> int:
    return max(1, min(n, round(math.sqrt(n))))


def _add_sequential(case: Case) -> None:
    model, n = case.model, len(case.blocks)
    segments = sqrt_segments(n)
    if case.hf or case.no_sequential:
        return
    if isinstance(model, nn.Sequential):
        if [m for _, m in case.blocks] != list(model.children()):
            case.no_sequential = "its blocks are not the Sequential's children"
            return
        case.sequential = _SequentialRunner(model, segments)
    elif type(model).__name__ == "GPT":
        case.sequential = _GPTSequential(model, segments)
    elif type(model).__name__ == "Llama":
        case.sequential = _LlamaSequential(model, segments)
    elif type(model).__name__ == "BiasLM":
        case.sequential = _BiasSequential(model, segments)
    else:
        case.no_sequential = f"no chain form for {type(model).__name__}"
        return
    _check_same_forward(case)


class _SequentialRunner(nn.Module):
    def __init__(self, seq: nn.Sequential, segments: int) -> None:
        super().__init__()
        self.seq, self.segments = seq, segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.seq, self.segments, x, use_reentrant=False)


class _GPTSequential(nn.Module):
    """remat.models.GPT.forward with its block loop run by checkpoint_sequential."""

    def __init__(self, gpt: nn.Module, segments: int) -> None:
        super().__init__()
        self.gpt: Any = gpt
        self.segments = segments

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = g.drop(g.wte(idx) + g.wpe(pos))
        x = checkpoint_sequential(list(g.blocks), self.segments, x, use_reentrant=False)
        return g.lm_head(g.ln_f(x))


class _LlamaSequential(nn.Module):
    """remat.models.Llama.forward (no attention mask) with its layer loop run by
    checkpoint_sequential; each layer through an adapter that passes the rotary tables."""

    def __init__(self, llama: nn.Module, segments: int) -> None:
        super().__init__()
        self.llama: Any = llama
        self.segments = segments

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        m, cfg = self.llama, self.llama.config
        hidden = m.embed_tokens(idx)
        cos, sin = rope_cos_sin(idx.shape[1], cfg.dim // cfg.n_head, cfg.rope_theta,
                                device=idx.device, dtype=hidden.dtype)

        def adapter(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda h: layer(h, position_embeddings=(cos, sin), attention_mask=None)[0]

        hidden = checkpoint_sequential([adapter(layer) for layer in m.layers], self.segments,
                                       hidden, use_reentrant=False)
        return m.lm_head(m.norm(hidden))


class _BiasSequential(nn.Module):
    """remat.models.BiasLM.forward with its block loop run by checkpoint_sequential; each block
    through an adapter that passes the bias."""

    def __init__(self, model: nn.Module, segments: int) -> None:
        super().__init__()
        self.model: Any = model
        self.segments = segments

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        m, t = self.model, ids.shape[1]
        x = m.embed(ids)
        pos = torch.arange(t, device=ids.device)
        dist = (pos[None, :] - pos[:, None]).clamp(max=0).to(x.dtype)
        causal = torch.full((t, t), -math.inf, device=ids.device, dtype=x.dtype).triu(1)
        bias = m.slopes[:, None, None] * dist + causal

        def adapter(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda h: block(h, bias)

        x = checkpoint_sequential([adapter(b) for b in m.blocks], self.segments, x, use_reentrant=False)
        return m.lm_head(m.norm(x))


def _check_same_forward(case: Case) -> None:
    """The chain wrapper must compute what the model computes (eval mode: no dropout)."""
    assert case.sequential is not None
    case.model.eval()
    try:
        with torch.no_grad():
            ours = case.sequential(*case.batch)
            theirs = case.model(*case.batch)
    finally:
        case.model.train()
    if not torch.equal(ours, theirs):
        raise AssertionError(
            f"{case.name}: the checkpoint_sequential wrapper's output differs from the model's "
            f"(max diff {float((ours - theirs).abs().max()):.3g}); the model's forward changed?"
        )


# --- configurations -----------------------------------------------------------------------------


def plain(case: Case) -> Config:
    return Config(name="no checkpointing", kind="plain", runner=case.model,
                  extra={"as_plan": {name: "keep" for name, _ in case.blocks}})


def every_k(case: Case, k: int) -> Config:
    """torch checkpointing on blocks 0, k, 2k, ... (NOTE [ The peers ])."""
    name = "every block" if k == 1 else f"every {_ordinal(k)} block"
    # The same choice as a remat plan, for remat's cost model to estimate (frontier.py's bar).
    as_plan = {b: "recompute" if i % k == 0 else "keep" for i, (b, _) in enumerate(case.blocks)}
    if case.hf:
        model: Any = case.model

        def enter() -> None:
            model.activation_checkpointing_enable(every_n_layers=k)

        def exit_() -> None:
            model.activation_checkpointing_disable()
            # Enabling also hooked the embedding to make its output require grad (for PEFT); the
            # plain model has no such hook, so take it off again (a no-op when there is none).
            model.disable_input_require_grads()

        return Config(name=name, kind="peer", runner=case.model, enter=enter, exit=exit_,
                      extra={"how": f"model.activation_checkpointing_enable(every_n_layers={k})",
                             "as_plan": as_plan})
    chosen = [m for i, (_, m) in enumerate(case.blocks) if i % k == 0]

    def on() -> None:
        for m in chosen:
            # ``forward`` on the instance shadows the class's; the class's is what it calls.
            m.forward = functools.partial(_torch_checkpointed, m)

    def off() -> None:
        for m in chosen:
            del m.forward

    return Config(name=name, kind="peer", runner=case.model, enter=on, exit=off,
                  extra={"how": f"torch.utils.checkpoint.checkpoint on blocks 0, {k}, ..."
                         if k > 1 else "torch.utils.checkpoint.checkpoint on every block",
                         "as_plan": as_plan})


def _torch_checkpointed(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(module).forward
    if not module.training:
        return forward(module, *args, **kwargs)
    return checkpoint(forward, module, *args, use_reentrant=False, **kwargs)


def _ordinal(k: int) -> str:
    return {2: "2nd", 3: "3rd"}.get(k, f"{k}th")


def sequential(case: Case) -> Config:
    n = len(case.blocks)
    name = f"checkpoint_sequential ({sqrt_segments(n)} segments)"
    if case.sequential is None:
        return Config(name=name, kind="sequential", runner=case.model,
                      error=f"not run: {case.no_sequential}")
    return Config(name=name, kind="sequential", runner=case.sequential,
                  extra={"segments": sqrt_segments(n)})


def _block_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The template of every budget's compiled function: a block's own (class) forward.
    return type(module).forward(module, *args, **kwargs)


def compiled(case: Case, budget: float) -> Config:
    """Blocks compiled under ``activation_memory_budget = budget`` (NOTE [ The peers ]).

    Nothing is compiled here: the first step under ``active()`` compiles (see ``compile_now``)."""
    import torch._functorch.config as functorch_config

    tag = f"{budget:g}".replace(".", "_")
    code = _block_call.__code__.replace(co_name=f"block_budget_{tag}")
    fn = torch.compile(types.FunctionType(code, _block_call.__globals__, code.co_name), dynamic=False)
    modules = [m for _, m in case.blocks]
    saved: list[float] = []

    def on() -> None:
        saved.append(functorch_config.activation_memory_budget)
        functorch_config.activation_memory_budget = budget
        for m in modules:
            m.forward = functools.partial(fn, m)

    def off() -> None:
        for m in modules:
            del m.forward
        functorch_config.activation_memory_budget = saved.pop()

    return Config(name=f"torch.compile budget {budget:g}", kind="compile", runner=case.model,
                  enter=on, exit=off, extra={"activation_memory_budget": budget})


class CompileTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``CompileTimeout`` in the main thread after ``seconds`` (POSIX; no limit elsewhere)."""
    if seconds <= 0 or not hasattr(signal, "setitimer"):
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise CompileTimeout(f"compiling took longer than the {seconds:g} s limit")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def remat_plan(case: Case, plan: Plan, name: str) -> Config:
    return Config(name=name, kind="remat", runner=case.model, plan=plan,
                  enter=lambda: apply(case.model, plan), exit=lambda: remove(case.model))
