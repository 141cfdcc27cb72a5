"""Built-in encoders and a CNN: ``ConvNet`` (residual, BatchNorm), ``Bert`` and ``ViT``
(bidirectional ``Encoder`` stacks). NOTE [ Batch and loss convention ] is in ``remat.models.decoders``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from remat.models.decoders import check_config, init_normal

__all__ = [
    "Bert",
    "BertConfig",
    "ConvNet",
    "ConvNetConfig",
    "Encoder",
    "EncoderLayer",
    "ResBlock",
    "ViT",
    "ViTConfig",
]


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
        check_config(dim % n_head == 0, f"EncoderLayer: dim={dim} is not divisible by n_head={n_head}")
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
        init_normal(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq_len = ids.shape[1]
        check_config(seq_len <= self.config.max_seq,
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
        check_config(self.image_size % self.patch_size == 0,
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
        init_normal(self)
        nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        size = self.config.image_size
        check_config(tuple(images.shape[-2:]) == (size, size),
               f"ViT: images are {tuple(images.shape[-2:])} but the position embeddings are for "
               f"{size}x{size}; build a ViTConfig with image_size={images.shape[-1]}")
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.drop(x + self.pos_embed)
        return self.head(self.norm(self.encoder(x))[:, 0])
