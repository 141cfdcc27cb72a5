"""Built-in models that are not one chain: a UNet with long skips, and a decoder that passes one
bias tensor to every block (NOTE [ The step as a graph ] in the design notes).

Both call their blocks in a loop from their own ``forward``, as users write models, so that remat
plans and applies to them unmodified. The UNet's blocks do their own resampling (a down block
pools its input, an up block upsamples its input and concatenates the skip), so that each block
receives the previous block's output itself, and the skips (the down blocks' outputs, held by the
forward in a list) enter the up blocks as second arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from remat.models.decoders import check_config

__all__ = ["BiasLM", "BiasLMConfig", "UNet", "UNetConfig"]


@dataclass(frozen=True, kw_only=True)
class UNetConfig:
    """A small image UNet classifier: a down path, a middle block, an up path with long skips."""

    image_size: int = 32
    """Height and width of the input images; divisible by ``2 ** (depth - 1)``."""
    in_channels: int = 3
    channels: int = 16
    """Channels of every block."""
    depth: int = 3
    """Resolution levels of the down path (and of the up path)."""
    blocks_per_level: int = 2
    """Blocks at each level of each path; the last down block of a level hands its output to the
    up path (a long skip), the first up block of a level takes it."""
    num_classes: int = 10

    def __post_init__(self) -> None:
        check_config(self.depth >= 1 and self.blocks_per_level >= 1,
                     f"UNetConfig: depth and blocks_per_level must be at least 1, got {self}")
        check_config(self.image_size % 2 ** (self.depth - 1) == 0,
                     f"UNetConfig: image_size={self.image_size} is not divisible by 2**(depth-1)")


class ConvUnit(nn.Module):
    """Conv, GroupNorm, SiLU, twice, with a residual path."""

    def __init__(self, c_in: int, c: int) -> None:
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(c_in, c, 3, padding=1), nn.GroupNorm(4, c)
        self.conv2, self.norm2 = nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c)
        self.skip = nn.Conv2d(c_in, c, 1) if c_in != c else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.norm1(self.conv1(x)))
        return self.skip(x) + F.silu(self.norm2(self.conv2(h)))


class DownBlock(nn.Module):
    def __init__(self, c: int, *, pool: bool, skip: bool) -> None:
        super().__init__()
        self.pool, self.skip, self.unit = pool, skip, ConvUnit(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unit(F.avg_pool2d(x, 2) if self.pool else x)


class UpBlock(nn.Module):
    def __init__(self, c: int, *, upsample: bool, skip: bool) -> None:
        super().__init__()
        self.upsample, self.skip = upsample, skip
        self.unit = ConvUnit(2 * c if skip else c, c)

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        if self.upsample:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return self.unit(x if skip is None else torch.cat([x, skip], dim=1))


class UNet(nn.Module):
    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        self.config = c = config
        n = c.blocks_per_level
        self.stem = nn.Conv2d(c.in_channels, c.channels, 3, padding=1)
        self.down = nn.ModuleList(
            DownBlock(c.channels, pool=level > 0 and k == 0, skip=k == n - 1)
            for level in range(c.depth) for k in range(n)
        )
        self.mid = DownBlock(c.channels, pool=False, skip=False)
        self.up = nn.ModuleList(
            UpBlock(c.channels, upsample=level > 0 and k == 0, skip=k == 0)
            for level in range(c.depth) for k in range(n)
        )
        self.head = nn.Linear(c.channels, c.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.stem(images)
        skips = []
        for block in self.down:
            h = block(h)
            if block.skip:
                skips.append(h)
        h = self.mid(h)
        for block in self.up:
            h = block(h, skips.pop()) if block.skip else block(h)
        return self.head(h.mean(dim=(2, 3)))


@dataclass(frozen=True, kw_only=True)
class BiasLMConfig:
    """A decoder whose attention takes one additive position bias, made once in the forward and
    passed to every block (a side input, NOTE [ Tensors that cross a block boundary ] in ``remat.crossing``)."""

    vocab_size: int = 2048
    max_seq: int = 128
    n_layer: int = 8
    n_head: int = 4
    dim: int = 128

    def __post_init__(self) -> None:
        check_config(self.dim % self.n_head == 0,
                     f"BiasLMConfig: dim={self.dim} is not divisible by n_head={self.n_head}")


class BiasBlock(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class BiasLM(nn.Module):
    def __init__(self, config: BiasLMConfig) -> None:
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.slopes = nn.Parameter(torch.linspace(-1.0, -1.0 / c.n_head, c.n_head))
        self.blocks = nn.ModuleList(BiasBlock(c.dim, c.n_head) for _ in range(c.n_layer))
        self.norm, self.lm_head = nn.LayerNorm(c.dim), nn.Linear(c.dim, c.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.embed(ids)
        pos = torch.arange(t, device=ids.device)
        dist = (pos[None, :] - pos[:, None]).clamp(max=0).to(x.dtype)  # ALiBi-like, causal below
        causal = torch.full((t, t), -math.inf, device=ids.device, dtype=x.dtype).triu(1)
        bias = self.slopes[:, None, None] * dist + causal  # (heads, t, t): one tensor, every block
        for block in self.blocks:
            x = block(x, bias)
        return self.lm_head(self.norm(x))
