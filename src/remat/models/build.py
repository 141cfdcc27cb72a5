"""Building a built-in model, its batch and its loss (NOTE [ Batch and loss convention ] in
``remat.models.decoders``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import InvalidType
from remat.models.decoders import GPT, GPTConfig, Llama, LlamaConfig, check_config
from remat.models.encoders import Bert, BertConfig, ConvNet, ConvNetConfig, ViT, ViTConfig
from remat.models.graphs import BiasLM, BiasLMConfig, UNet, UNetConfig

__all__ = [
    "Batch",
    "LossFn",
    "ModelConfig",
    "build_model",
    "classification_loss",
    "lm_loss",
    "loss_fn_for",
    "make_batch",
    "mlm_loss",
]

Batch: TypeAlias = tuple[torch.Tensor, ...]
LossFn: TypeAlias = Callable[[Any, Batch], torch.Tensor]


# ------------------------------------------------------------------- building, batches, losses

ModelConfig: TypeAlias = (
    GPTConfig | LlamaConfig | ConvNetConfig | BertConfig | ViTConfig | UNetConfig | BiasLMConfig
)
_MODELS: dict[type, Callable[[Any], nn.Module]] = {
    GPTConfig: GPT, LlamaConfig: Llama, ConvNetConfig: ConvNet, BertConfig: Bert, ViTConfig: ViT,
    UNetConfig: UNet, BiasLMConfig: BiasLM}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> nn.Module:
    """The model for ``config``, created directly in ``dtype`` on ``device``.

    Created in place rather than converted with ``.to()``: ``Module.to`` cannot swap parameters
    that are fake tensors, and estimated mode builds models inside ``FakeTensorMode``.
    """
    cls = _MODELS.get(type(config))
    if cls is None:
        raise InvalidType(f"expected one of {sorted(c.__name__ for c in _MODELS)}, "
                        f"got {type(config).__name__}")
    check_config(dtype.is_floating_point, f"dtype must be a floating point type, got {dtype}")
    with _default_dtype(dtype), torch.device(device):
        return cls(config)


def _config_of(model_or_config: nn.Module | ModelConfig) -> ModelConfig:
    if isinstance(model_or_config, nn.Module):
        config = getattr(model_or_config, "config", None)
        if not isinstance(config, GPTConfig | LlamaConfig | ConvNetConfig | BertConfig | ViTConfig
                          | UNetConfig | BiasLMConfig):
            raise InvalidType(f"{type(model_or_config).__name__} is not one of remat's built-in "
                            "models (GPT, Llama, ConvNet, Bert, ViT, UNet, BiasLM)")
        return config
    return model_or_config


def make_batch(model_or_config: nn.Module | ModelConfig, *, batch_size: int,
               seq_len: int | None = None, image_size: int | None = None,
               generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> Batch:
    """A random example batch, ``(ids,)`` or ``(images,)``; see NOTE [ Batch and loss convention ].

    ``seq_len`` defaults to the model's context (``block_size`` / ``max_seq``), ``image_size`` to
    the config's; ``dtype`` is that of the images (token ids are always int64).
    """
    cfg = _config_of(model_or_config)
    check_config(batch_size >= 1, f"batch_size must be at least 1, got {batch_size}")
    if isinstance(cfg, ConvNetConfig | ViTConfig | UNetConfig):
        check_config(seq_len is None, f"{type(cfg).__name__} takes images: give image_size, not seq_len")
        size = cfg.image_size if image_size is None else image_size
        shape = (batch_size, cfg.in_channels, size, size)
        return (torch.randn(shape, generator=generator, device=device).to(dtype),)
    check_config(image_size is None, f"{type(cfg).__name__} takes token ids: give seq_len, not image_size")
    if seq_len is None:
        seq_len = cfg.block_size if isinstance(cfg, GPTConfig) else cfg.max_seq
    check_config(seq_len >= 2, f"seq_len must be at least 2 (next-token targets), got {seq_len}")
    return (torch.randint(cfg.vocab_size, (batch_size, seq_len), generator=generator,
                          device=device),)


def lm_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Mean next-token cross-entropy: position t predicts ``ids[t + 1]``."""
    ids = batch[0]
    # Pad the targets instead of slicing the logits: logits[:, :-1] would be copied to flatten it.
    targets = F.pad(ids[:, 1:], (0, 1), value=-100)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def mlm_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Masked-LM cross-entropy on every 7th position (~15% of tokens, as in BERT)."""
    ids = batch[0]
    keep = torch.arange(ids.shape[1], device=ids.device) % 7 == 0
    targets = ids.masked_fill(~keep, -100)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def classification_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Cross-entropy with the synthetic labels ``i % num_classes`` for image ``i``."""
    labels = torch.arange(logits.shape[0], device=logits.device) % logits.shape[1]
    return F.cross_entropy(logits, labels)


def loss_fn_for(model_or_config: nn.Module | ModelConfig) -> LossFn:
    """The standard ``loss_fn(output, batch)`` for a built-in model or config."""
    cfg = _config_of(model_or_config)
    if isinstance(cfg, GPTConfig | LlamaConfig | BiasLMConfig):
        return lm_loss
    if isinstance(cfg, BertConfig):
        return mlm_loss
    return classification_loss
