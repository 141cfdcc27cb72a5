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

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import InvalidValue

__all__ = [
    "GPT",
    "Block",
    "DecoderLayer",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "check_config",
    "init_normal",
    "rope_cos_sin",
]



def check_config(ok: bool, message: str) -> None:
    """Raise ``InvalidValue(message)`` unless ``ok``: a config or input the models cannot take."""
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
        check_config(self.n_embd % self.n_head == 0,
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
        init_normal(self)
        # GPT-2 scales the init of the projections that write into the residual stream.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq_len = idx.shape[1]
        check_config(seq_len <= self.config.block_size,
               f"GPT: sequence length {seq_len} is longer than block_size="
               f"{self.config.block_size} (learned position embeddings); use a shorter sequence "
               "or a larger block_size")
        pos = torch.arange(seq_len, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def init_normal(model: nn.Module) -> None:
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
        check_config(self.dim % self.n_head == 0,
               f"LlamaConfig: dim={self.dim} is not divisible by n_head={self.n_head}")
        check_config(self.n_head % self.n_kv_head == 0,
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
        init_normal(self)

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
