"""Named model shapes people plan for (gpt2, llama-8b, bert-large, vit-l, ...), written out here.

Nothing is downloaded: each entry is a config for one of the pure-torch models in
``remat.models``, with the source of its numbers. Memory and time depend on the shapes, not on
trained weights, so random init is all planning needs.

``build(name)`` gives a real ``(model, batch, loss_fn)``; ``spec(name)`` gives a ``ModelSpec``
whose ``make_model()`` / ``make_batch()`` build them later, e.g. inside ``FakeTensorMode`` to
estimate a 70B model on a laptop. Batches and losses follow NOTE [ Batch and loss convention ] in
``remat.models``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from remat.errors import InvalidType, InvalidValue, did_you_mean
from remat.models import (
    Batch,
    BertConfig,
    ConvNetConfig,
    GPTConfig,
    LlamaConfig,
    LossFn,
    ModelConfig,
    UNetConfig,
    ViTConfig,
    build_model,
    loss_fn_for,
    make_batch,
)

__all__ = ["ZOO", "ModelSpec", "ZooEntry", "build", "names", "spec"]


@dataclass(frozen=True, kw_only=True)
class ZooEntry:
    """One named model shape."""

    name: str
    """The name to ask for, e.g. ``"llama-8b"``."""
    config: ModelConfig
    """The config of the ``remat.models`` model with this shape."""
    source: str
    """Where the numbers come from (paper, model card, config file)."""
    nominal_params: int | None = None
    """Parameter count the source states, for checking the config; None for the built-ins."""
    seq_len: int | None = None
    """Default sequence length of a batch (token models); None for image models."""
    batch_size: int = 1
    """Default number of examples in a batch."""


def _gpt2(name: str, n_layer: int, n_embd: int, n_head: int, params: int) -> ZooEntry:
    # Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", Table 2, and the
    # openai-community/gpt2* config.json files: 1024 positions, vocab 50257, dropout 0.1, tied head.
    return ZooEntry(
        name=name, nominal_params=params, seq_len=1024,
        config=GPTConfig(vocab_size=50257, block_size=1024, n_layer=n_layer, n_head=n_head,
                         n_embd=n_embd, dropout=0.1),
        source="GPT-2 (Radford et al. 2019, Table 2; HF openai-community config.json)")


def _llama(name: str, source: str, params: int, *, llama3: bool, n_layer: int, dim: int,
           n_head: int, n_kv_head: int, ffn_dim: int, max_seq: int = 4096,
           tie_weights: bool = False) -> ZooEntry:
    # Llama 2: SentencePiece vocab 32000, rope_theta 1e4, 4096 context.
    # Llama 3: tiktoken vocab 128256, rope_theta 5e5 (config.json of each model).
    return ZooEntry(
        name=name, source=source, nominal_params=params, seq_len=min(max_seq, 8192),
        config=LlamaConfig(vocab_size=128256 if llama3 else 32000, max_seq=max_seq,
                           n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, dim=dim,
                           ffn_dim=ffn_dim, rope_theta=500000.0 if llama3 else 10000.0,
                           tie_weights=tie_weights))


def _bert(name: str, source: str, params: int, *, n_layer: int, dim: int, n_head: int) -> ZooEntry:
    # uncased WordPiece vocab 30522, 512 positions, FFN 4x, dropout 0.1 (bert-*-uncased config.json)
    return ZooEntry(name=name, source=source, nominal_params=params, seq_len=512,
                    config=BertConfig(n_layer=n_layer, n_head=n_head, dim=dim, ffn_dim=4 * dim))


def _vit(name: str, source: str, params: int, *, n_layer: int, dim: int, n_head: int) -> ZooEntry:
    # 224x224 images in 16x16 patches (196 tokens + class token), FFN 4x, ImageNet-1k head
    return ZooEntry(name=name, source=source, nominal_params=params,
                    config=ViTConfig(n_layer=n_layer, n_head=n_head, dim=dim, ffn_dim=4 * dim))


_ENTRIES = [
    # Built-in CPU demo sizes: a training step takes a fraction of a second on two cores, and
    # activations outweigh parameters + gradients + Adam state several times over.
    ZooEntry(name="gpt-tiny", config=GPTConfig(), seq_len=128, batch_size=8,
             source="remat demo size (nanoGPT-style)"),
    ZooEntry(name="llama-tiny", config=LlamaConfig(), seq_len=128, batch_size=8,
             source="remat demo size (Llama-style)"),
    ZooEntry(name="convnet", config=ConvNetConfig(), batch_size=16,
             source="remat demo size (CIFAR-style ResNet with 16-32-64 channels)"),
    _gpt2("gpt2", 12, 768, 12, 124_000_000),
    _gpt2("gpt2-medium", 24, 1024, 16, 355_000_000),
    _gpt2("gpt2-large", 36, 1280, 20, 774_000_000),
    _gpt2("gpt2-xl", 48, 1600, 25, 1_558_000_000),
    # Llama 3.2 ties the embedding and the LM head; its RoPE frequency scaling for 128K contexts
    # changes no shape and is left out.
    _llama("llama-1b", "Llama 3.2 1B (meta-llama/Llama-3.2-1B config.json, model card)",
           1_236_000_000, n_layer=16, dim=2048, n_head=32, n_kv_head=8, ffn_dim=8192,
           max_seq=131072, tie_weights=True, llama3=True),
    _llama("llama-3b", "Llama 3.2 3B (meta-llama/Llama-3.2-3B config.json, model card)",
           3_213_000_000, n_layer=28, dim=3072, n_head=24, n_kv_head=8, ffn_dim=8192,
           max_seq=131072, tie_weights=True, llama3=True),
    _llama("llama-7b", "Llama 2 7B (Touvron et al. 2023, Table 1; meta-llama/Llama-2-7b-hf config.json)",
           6_738_000_000, n_layer=32, dim=4096, n_head=32, n_kv_head=32, ffn_dim=11008, llama3=False),
    _llama("llama-8b", "Llama 3 8B (meta-llama/Meta-Llama-3-8B config.json, model card)",
           8_030_000_000, n_layer=32, dim=4096, n_head=32, n_kv_head=8, ffn_dim=14336,
           max_seq=8192, llama3=True),
    _llama("llama-13b", "Llama 2 13B (Touvron et al. 2023, Table 1; meta-llama/Llama-2-13b-hf config.json)",
           13_016_000_000, n_layer=40, dim=5120, n_head=40, n_kv_head=40, ffn_dim=13824, llama3=False),
    _llama("llama-70b", "Llama 3 70B (meta-llama/Meta-Llama-3-70B config.json, model card)",
           70_554_000_000, n_layer=80, dim=8192, n_head=64, n_kv_head=8, ffn_dim=28672,
           max_seq=8192, llama3=True),
    # BERT-Tiny: Turc et al. 2019, "Well-Read Students Learn Better" (google/bert_uncased_L-2_H-128_A-2)
    _bert("bert-tiny", "BERT-Tiny (Turc et al. 2019; google/bert_uncased_L-2_H-128_A-2)",
          4_400_000, n_layer=2, dim=128, n_head=2),
    _bert("bert-base", "BERT-Base (Devlin et al. 2019, Sec. 3; google-bert/bert-base-uncased)",
          110_000_000, n_layer=12, dim=768, n_head=12),
    _bert("bert-large", "BERT-Large (Devlin et al. 2019, Sec. 3; google-bert/bert-large-uncased)",
          336_000_000, n_layer=24, dim=1024, n_head=16),
    _vit("vit-tiny", "DeiT-Ti/16 (Touvron et al. 2021, Table 1)", 5_700_000,
         n_layer=12, dim=192, n_head=3),
    _vit("vit-b", "ViT-B/16 (Dosovitskiy et al. 2021, Table 1)", 86_000_000,
         n_layer=12, dim=768, n_head=12),
    _vit("vit-l", "ViT-L/16 (Dosovitskiy et al. 2021, Table 1)", 307_000_000,
         n_layer=24, dim=1024, n_head=16),
]

#: Every named shape, by name, in the order above (demo sizes, GPT-2, Llama, BERT, ViT).
ZOO: dict[str, ZooEntry] = {e.name: e for e in _ENTRIES}


def names() -> list[str]:
    """The names ``build`` and ``spec`` accept."""
    return list(ZOO)


def _lookup(name: str) -> ZooEntry:
    if name in ZOO:
        return ZOO[name]
    hint = did_you_mean(str(name), ZOO)
    raise InvalidValue(f"unknown model {name!r}{hint} Known models: {', '.join(ZOO)}")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """How to build one model and one batch, later and as often as needed.

    ``make_model`` and ``make_batch`` are deterministic (they seed from ``seed``, leaving the
    global RNG as it was) and work inside ``FakeTensorMode``.
    """

    name: str
    """The zoo name, or the config's class name for a config given directly."""
    config: ModelConfig
    """The model's config (for ViT and ConvNet, with ``image_size`` set to the batch's)."""
    batch_size: int
    """Examples per batch."""
    seq_len: int | None
    """Tokens per example (token models); None for image models."""
    dtype: torch.dtype
    """Parameter dtype, and the dtype of the images."""
    device: str
    """Device the model and the batch are created on."""
    seed: int
    """Seed of the parameter init and of the batch."""

    def make_model(self) -> nn.Module:
        """A freshly initialised model (in training mode)."""
        dev = torch.device(self.device)
        # Fork only this device's RNG; forking every CUDA device warns on multi-GPU machines.
        rng_devices = [dev.index if dev.index is not None else torch.cuda.current_device()] \
            if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices):
            torch.manual_seed(self.seed)
            return build_model(self.config, dtype=self.dtype, device=self.device)

    def make_batch(self) -> Batch:
        """A random example batch; see NOTE [ Batch and loss convention ] in ``remat.models``."""
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        return make_batch(self.config, batch_size=self.batch_size, seq_len=self.seq_len,
                          generator=generator, dtype=self.dtype, device=self.device)

    @property
    def loss_fn(self) -> LossFn:
        """``loss_fn(output, batch) -> scalar``."""
        return loss_fn_for(self.config)


def spec(model: str | ModelConfig, *, batch_size: int | None = None, seq_len: int | None = None,
         image_size: int | None = None, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", seed: int = 0) -> ModelSpec:
    """A ``ModelSpec`` for a zoo name (see ``names()``) or a ``remat.models`` config.

    ``batch_size`` and ``seq_len`` default to the entry's (a config's own context for a config);
    ``seq_len`` may exceed the trained context for rotary (Llama) models but not for models with
    learned positions (GPT, BERT). ``image_size`` (image models) resizes the input, and for ViT the
    token count with it.
    """
    if isinstance(model, str):
        entry = _lookup(model)
        name, config = entry.name, entry.config
        batch_size = entry.batch_size if batch_size is None else batch_size
        seq_len = entry.seq_len if seq_len is None else seq_len
    elif isinstance(model, GPTConfig | LlamaConfig | ConvNetConfig | BertConfig | ViTConfig):
        name, config = type(model).__name__, model
        batch_size = 1 if batch_size is None else batch_size
    else:
        raise InvalidType(f"expected a zoo name ({', '.join(ZOO)}) or a remat.models config, "
                        f"got {type(model).__name__}")
    if batch_size < 1:
        raise InvalidValue(f"batch_size must be at least 1, got {batch_size}")
    if not dtype.is_floating_point:
        raise InvalidValue(f"dtype must be a floating point type (torch.float32, torch.bfloat16, "
                         f"...), got {dtype}")
    if isinstance(config, ConvNetConfig | ViTConfig | UNetConfig):
        if seq_len is not None:
            raise InvalidValue(f"{name} is an image model: give image_size, not seq_len")
        if image_size is not None:
            config = dataclasses.replace(config, image_size=image_size)  # ViT checks divisibility
    else:
        if image_size is not None:
            raise InvalidValue(f"{name} takes token ids: give seq_len, not image_size")
        context = config.block_size if isinstance(config, GPTConfig) else config.max_seq
        seq_len = context if seq_len is None else seq_len
        if seq_len < 2:
            raise InvalidValue(f"seq_len must be at least 2 (next-token targets), got {seq_len}")
        if seq_len > context and not isinstance(config, LlamaConfig):
            raise InvalidValue(f"{name} has learned position embeddings for {context} positions; "
                             f"seq_len={seq_len} is longer. Use seq_len <= {context}, or a "
                             "rotary-position model (llama-*) for longer sequences")
    return ModelSpec(name=name, config=config, batch_size=batch_size, seq_len=seq_len,
                     dtype=dtype, device=str(device), seed=seed)


def build(model: str | ModelConfig, *, batch_size: int | None = None, seq_len: int | None = None,
          image_size: int | None = None, dtype: torch.dtype = torch.float32,
          device: str | torch.device = "cpu", seed: int = 0) -> tuple[nn.Module, Batch, LossFn]:
    """``(model, batch, loss_fn)`` for a zoo name or a config; the options are those of ``spec``."""
    s = spec(model, batch_size=batch_size, seq_len=seq_len, image_size=image_size, dtype=dtype,
             device=device, seed=seed)
    return s.make_model(), s.make_batch(), s.loss_fn
