"""Built-in models for the demo, the tests and the benchmarks: pure torch, nothing downloaded.

- ``GPT``: a nanoGPT-style decoder; blocks in ``self.blocks`` (a ModuleList called in a loop).
- ``Llama``: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU; layers in ``self.layers``
  take extra arguments (``position_embeddings=(cos, sin)``, ``attention_mask=``) and return a tuple.
- ``ConvNet``: a residual CNN with BatchNorm whose blocks shrink stage by stage; it *is* an
  ``nn.Sequential`` (stem, blocks..., head).
- ``Bert`` and ``ViT``: bidirectional ``Encoder`` stacks (post-LN with a masked-LM head; pre-LN with
  a patch embedding, a class token and a classifier head).

Every model is deterministic given ``torch.manual_seed``, runs in bf16 parameters and under
``torch.autocast``, and can be built and run inside ``FakeTensorMode`` (no ``.item()``, no
data-dependent Python control flow). Named sizes (gpt2, llama-8b, ...) live in ``remat.models.zoo``.

# NOTE [ Batch and loss convention ]
A *batch* is a tuple of tensors, the forward is ``output = model(*batch)`` and the loss is
``loss_fn(output, batch) -> scalar``, which derives its targets from the batch itself. So one
``(model, batch, loss_fn)`` triple describes a whole training step and nothing else has to travel
with it. Every batch built here holds one tensor, so ``model(*batch) == model(batch[0])``:

- language models (GPT, Llama): ``(ids,)``; next-token cross-entropy (targets = ids shifted left);
  a Llama batch may also be ``(ids, attention_mask)``, which ``model(*batch)`` passes through;
- Bert: ``(ids,)``; masked-LM cross-entropy on every 7th position (~15%, as in BERT);
- image models (ConvNet, ViT): ``(images,)``; the label of image ``i`` is ``i % num_classes``, a
  synthetic task with the shapes and costs of real classification, which is what planning needs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import InvalidType, InvalidValue

__all__ = [
    "GPT",
    "Batch",
    "Bert",
    "BertConfig",
    "Block",
    "ConvNet",
    "ConvNetConfig",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "LossFn",
    "ModelConfig",
    "ResBlock",
    "ViT",
    "ViTConfig",
    "build_model",
    "classification_loss",
    "lm_loss",
    "loss_fn_for",
    "make_batch",
    "mlm_loss",
    "rope_cos_sin",
]

Batch: TypeAlias = tuple[torch.Tensor, ...]
LossFn: TypeAlias = Callable[[Any, Batch], torch.Tensor]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidValue(message)


# ---------------------------------------------------------------------------------------- GPT


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A nanoGPT-style decoder. The defaults are the CPU demo size (~2M parameters)."""

    vocab_size: int = 2048
    """Number of token ids."""
    block_size: int = 128
    """Longest sequence: the number of learned position embeddings."""
    n_layer: int = 8
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Hidden size."""
    dropout: float = 0.1
    """Dropout on embeddings, attention probabilities and residual branches (training only)."""
    bias: bool = True
    """Biases in the linear layers and LayerNorms (GPT-2 has them)."""
    tie_weights: bool = True
    """Share the token embedding with ``lm_head`` (GPT-2 does)."""

    def __post_init__(self) -> None:
        _check(self.n_embd % self.n_head == 0,
               f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``forward(idx: (B, T) long) -> logits (B, T, vocab_size)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = cfg = config
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        _init_normal(self)
        # GPT-2 scales the init of the projections that write into the residual stream.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq_len = idx.shape[1]
        _check(seq_len <= self.config.block_size,
               f"GPT: sequence length {seq_len} is longer than block_size="
               f"{self.config.block_size} (learned position embeddings); use a shorter sequence "
               "or a larger block_size")
        pos = torch.arange(seq_len, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _init_normal(model: nn.Module) -> None:
    """N(0, 0.02) weights and zero biases for linears and embeddings (GPT-2, BERT, Llama)."""
    for m in model.modules():
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


# -------------------------------------------------------------------------------------- Llama


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """A Llama-style decoder. The defaults are the CPU demo size (~2M parameters)."""

    vocab_size: int = 2048
    """Number of token ids."""
    max_seq: int = 128
    """Context length the model was trained for; longer sequences still run (rotary positions)."""
    n_layer: int = 8
    """Number of decoder layers."""
    n_head: int = 4
    """Query heads; must divide ``dim``."""
    n_kv_head: int = 2
    """Key/value heads (grouped-query attention); must divide ``n_head``."""
    dim: int = 128
    """Hidden size."""
    ffn_dim: int = 344
    """Intermediate size of the SwiGLU MLP."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    dropout: float = 0.0
    """Dropout on attention probabilities (training only)."""
    tie_weights: bool = False
    """Share the token embedding with ``lm_head`` (Llama 3.2 1B/3B do)."""

    def __post_init__(self) -> None:
        _check(self.dim % self.n_head == 0,
               f"LlamaConfig: dim={self.dim} is not divisible by n_head={self.n_head}")
        _check(self.n_head % self.n_kv_head == 0,
               f"LlamaConfig: n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, *, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables of shape (seq_len, head_dim), computed in float32 and then cast.

    Computed per forward rather than kept in a buffer: a buffer would follow ``model.to(bf16)``,
    and bf16 frequencies give visibly wrong angles at long positions.
    """
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Cast to x's dtype: under autocast q/k come out of a linear in bf16 while cos/sin are float32,
    # and a float32 q next to a bf16 v would make attention fail on mixed dtypes.
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.dropout = cfg.n_head, cfg.n_kv_head, cfg.dropout
        self.head_dim = hd = cfg.dim // cfg.n_head
        self.q_proj = nn.Linear(cfg.dim, cfg.n_head * hd, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_head * hd, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_head * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        # enable_gqa shares each k/v head across its query group without materialising copies.
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=attention_mask is None, enable_gqa=self.n_kv_head != self.n_head)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer. Returns a 1-tuple, like transformers' decoder layers."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        cos, sin = position_embeddings
        h = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attention_mask)
        return (h + self.mlp(self.post_attention_layernorm(h)),)


class Llama(nn.Module):
    """``forward(idx: (B, T) long, attention_mask=None) -> logits (B, T, vocab_size)``.

    ``attention_mask`` is None (causal), a (B, T) padding mask (True/1 = a real token; combined
    with the causal mask here) or a 4-D mask broadcastable to (B, heads, T, T) that is passed to
    attention as is (boolean: True = attend; float: added to the scores).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg = config
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.n_layer)])
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.embed_tokens.weight
        _init_normal(self)

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        hidden = self.embed_tokens(idx)
        cos, sin = rope_cos_sin(T, self.config.dim // self.config.n_head, self.config.rope_theta,
                                device=idx.device, dtype=hidden.dtype)
        mask = attention_mask
        if mask is not None and mask.dim() == 2:
            causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
            mask = mask.bool()[:, None, None, :] & causal
            # A padded query row would have nothing to attend to (NaN); let it see itself.
            mask = mask | torch.eye(T, dtype=torch.bool, device=idx.device)
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=(cos, sin), attention_mask=mask)[0]
        return self.lm_head(self.norm(hidden))


# ------------------------------------------------------------------------------------ ConvNet


@dataclass(frozen=True, kw_only=True)
class ConvNetConfig:
    """A residual CNN classifier; each stage halves the resolution and doubles the channels."""

    image_size: int = 64
    """Height and width of the input images (any size works; the head pools globally)."""
    in_channels: int = 3
    """Channels of the input images."""
    channels: tuple[int, ...] = (16, 32, 64)
    """Channels per stage; every stage after the first starts with a stride-2 block."""
    blocks_per_stage: int = 2
    """Residual blocks per stage."""
    num_classes: int = 10
    """Number of classes."""
    dropout: float = 0.1
    """Dropout before the classifier (training only)."""


class ResBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus a shortcut (1x1 conv-BN when the shape changes), then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ConvNet(nn.Sequential):
    """``nn.Sequential(stem, ResBlock..., head)``: images (B, C, H, W) -> logits (B, classes)."""

    config: ConvNetConfig

    def __init__(self, config: ConvNetConfig) -> None:
        c0 = config.channels[0]
        stem = nn.Sequential(nn.Conv2d(config.in_channels, c0, 3, padding=1, bias=False),
                             nn.BatchNorm2d(c0), nn.ReLU())
        blocks, c_in = [], c0
        for stage, c_out in enumerate(config.channels):
            for i in range(config.blocks_per_stage):
                blocks.append(ResBlock(c_in, c_out, stride=2 if stage > 0 and i == 0 else 1))
                c_in = c_out
        head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(config.dropout),
                             nn.Linear(c_in, config.num_classes))
        super().__init__(stem, *blocks, head)
        self.config = config


# ------------------------------------------------------------------------------ Encoders


class EncoderLayer(nn.Module):
    """Bidirectional transformer layer: post-LN (BERT) or pre-LN (ViT, ``norm_first=True``)."""

    def __init__(self, dim: int, n_head: int, ffn_dim: int, *, dropout: float, norm_first: bool,
                 eps: float) -> None:
        super().__init__()
        _check(dim % n_head == 0, f"EncoderLayer: dim={dim} is not divisible by n_head={n_head}")
        self.n_head, self.dropout, self.norm_first = n_head, dropout, norm_first
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.drop = nn.Dropout(dropout)

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_first:
            x = x + self._attn(self.norm1(x))
            return x + self._mlp(self.norm2(x))
        x = self.norm1(x + self._attn(x))
        return self.norm2(x + self._mlp(x))


class Encoder(nn.Module):
    """``n_layer`` ``EncoderLayer``s in ``self.layers``, called in a loop."""

    def __init__(self, n_layer: int, dim: int, n_head: int, ffn_dim: int, *, dropout: float,
                 norm_first: bool, eps: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList([
            EncoderLayer(dim, n_head, ffn_dim, dropout=dropout, norm_first=norm_first, eps=eps)
            for _ in range(n_layer)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass(frozen=True, kw_only=True)
class BertConfig:
    """A BERT encoder with its masked-LM head. The defaults are BERT-Tiny (2 layers, 128 wide)."""

    vocab_size: int = 30522
    """Number of token ids."""
    max_seq: int = 512
    """Number of learned position embeddings (the longest sequence)."""
    n_layer: int = 2
    """Number of encoder layers."""
    n_head: int = 2
    """Attention heads; must divide ``dim``."""
    dim: int = 128
    """Hidden size."""
    ffn_dim: int = 512
    """Intermediate size of the MLP."""
    type_vocab_size: int = 2
    """Number of segment (token type) ids."""
    dropout: float = 0.1
    """Dropout on embeddings, attention probabilities and residual branches (training only)."""
    norm_eps: float = 1e-12
    """LayerNorm epsilon."""


class Bert(nn.Module):
    """``forward(ids: (B, T) long) -> masked-LM logits (B, T, vocab_size)``; segment 0 throughout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = cfg = config
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.position_embeddings = nn.Embedding(cfg.max_seq, cfg.dim)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.dim)
        self.emb_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.encoder = Encoder(cfg.n_layer, cfg.dim, cfg.n_head, cfg.ffn_dim, dropout=cfg.dropout,
                               norm_first=False, eps=cfg.norm_eps)
        self.mlm_dense = nn.Linear(cfg.dim, cfg.dim)
        self.mlm_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlm_decoder = nn.Linear(cfg.dim, cfg.vocab_size)
        self.mlm_decoder.weight = self.word_embeddings.weight
        _init_normal(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq_len = ids.shape[1]
        _check(seq_len <= self.config.max_seq,
               f"Bert: sequence length {seq_len} is longer than max_seq={self.config.max_seq} "
               "(learned position embeddings); use a shorter sequence")
        pos = torch.arange(seq_len, device=ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(pos)
        x = self.drop(self.emb_norm(x + self.token_type_embeddings.weight[0]))
        x = self.encoder(x)
        return self.mlm_decoder(self.mlm_norm(F.gelu(self.mlm_dense(x))))


@dataclass(frozen=True, kw_only=True)
class ViTConfig:
    """A Vision Transformer classifier. The defaults are ViT-Ti/16 (DeiT-Tiny) at 224 pixels."""

    image_size: int = 224
    """Height and width of the input images; fixed by the learned position embeddings."""
    patch_size: int = 16
    """Side of a square patch; must divide ``image_size``."""
    in_channels: int = 3
    """Channels of the input images."""
    n_layer: int = 12
    """Number of encoder layers."""
    n_head: int = 3
    """Attention heads; must divide ``dim``."""
    dim: int = 192
    """Hidden size."""
    ffn_dim: int = 768
    """Intermediate size of the MLP."""
    num_classes: int = 1000
    """Number of classes."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches (training only)."""
    norm_eps: float = 1e-6
    """LayerNorm epsilon."""

    def __post_init__(self) -> None:
        _check(self.image_size % self.patch_size == 0,
               f"ViTConfig: patch_size={self.patch_size} does not divide image_size={self.image_size}")


class ViT(nn.Module):
    """``forward(images: (B, C, H, W)) -> logits (B, num_classes)``, from the class token."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = cfg = config
        n_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embed = nn.Conv2d(cfg.in_channels, cfg.dim, cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos_embed = nn.Parameter(torch.empty(1, n_patches + 1, cfg.dim))
        self.drop = nn.Dropout(cfg.dropout)
        self.encoder = Encoder(cfg.n_layer, cfg.dim, cfg.n_head, cfg.ffn_dim, dropout=cfg.dropout,
                               norm_first=True, eps=cfg.norm_eps)
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)
        _init_normal(self)
        nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        size = self.config.image_size
        _check(tuple(images.shape[-2:]) == (size, size),
               f"ViT: images are {tuple(images.shape[-2:])} but the position embeddings are for "
               f"{size}x{size}; build a ViTConfig with image_size={images.shape[-1]}")
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.drop(x + self.pos_embed)
        return self.head(self.norm(self.encoder(x))[:, 0])


# ------------------------------------------------------------------- building, batches, losses

ModelConfig: TypeAlias = GPTConfig | LlamaConfig | ConvNetConfig | BertConfig | ViTConfig
_MODELS: dict[type, Callable[[Any], nn.Module]] = {
    GPTConfig: GPT, LlamaConfig: Llama, ConvNetConfig: ConvNet, BertConfig: Bert, ViTConfig: ViT}


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
    _check(dtype.is_floating_point, f"dtype must be a floating point type, got {dtype}")
    with _default_dtype(dtype), torch.device(device):
        return cls(config)


def _config_of(model_or_config: nn.Module | ModelConfig) -> ModelConfig:
    if isinstance(model_or_config, nn.Module):
        config = getattr(model_or_config, "config", None)
        if not isinstance(config, GPTConfig | LlamaConfig | ConvNetConfig | BertConfig | ViTConfig):
            raise InvalidType(f"{type(model_or_config).__name__} is not one of remat's built-in "
                            "models (GPT, Llama, ConvNet, Bert, ViT)")
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
    _check(batch_size >= 1, f"batch_size must be at least 1, got {batch_size}")
    if isinstance(cfg, ConvNetConfig | ViTConfig):
        _check(seq_len is None, f"{type(cfg).__name__} takes images: give image_size, not seq_len")
        size = cfg.image_size if image_size is None else image_size
        shape = (batch_size, cfg.in_channels, size, size)
        return (torch.randn(shape, generator=generator, device=device).to(dtype),)
    _check(image_size is None, f"{type(cfg).__name__} takes token ids: give seq_len, not image_size")
    if seq_len is None:
        seq_len = cfg.block_size if isinstance(cfg, GPTConfig) else cfg.max_seq
    _check(seq_len >= 2, f"seq_len must be at least 2 (next-token targets), got {seq_len}")
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
    if isinstance(cfg, GPTConfig | LlamaConfig):
        return lm_loss
    if isinstance(cfg, BertConfig):
        return mlm_loss
    return classification_loss
