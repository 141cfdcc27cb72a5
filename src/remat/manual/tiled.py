"""The ``tiled`` option: a block kept, its MLP run over the sequence in tiles, each recomputed.

# NOTE [ The tiled MLP ]
At long sequences a transformer block's largest activations are its MLP's: the [batch, seq,
4 x hidden] intermediates (two of them and their product for a SwiGLU), saved for the backward and
made again as gradients there. The MLP works token by token, so it can run on a tile of the
sequence at a time: ``tiled`` keeps the block as it is except its MLP, which runs as
``tiles(seq, hidden)`` tiles along the sequence (dim -2), each under torch's non-reentrant
checkpoint: the forward keeps only each tile's input (a view of the MLP's input, which the plain
MLP keeps too), and the backward recomputes one tile's intermediates at a time. The block keeps
its attention's activations and loses the MLP's; the price is one more forward of the MLP. The
tile count follows ALST's tiled MLP: ``ceil(seq / hidden)``, at least 2. Outputs and gradients
are the plain MLP's to round-off (the same per-token arithmetic). An MLP with active dropout is
not tiled: its random numbers would be drawn tile by tile, not as the plain step draws them, so
the gradients could not equal plain ones; ``find_mlp`` does not offer it. The MLP is found as
the block's ``mlp`` child (transformers' decoder layers, remat's models) or a child whose class
name ends in ``MLP`` or is ``SwiGLU``; a mixture of experts is not tiled (its router's statistics,
such as a load-balancing loss, are the whole batch's). Each tile is one sequence's run of tokens,
a contiguous view of a contiguous input (MLPs may ``.view()`` their input).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from remat.errors import BlockError
from remat.manual.contexts import stop_passes_through

__all__ = ["find_mlp", "is_tiled", "tile_block", "tiles", "untile_block"]

_RECORD = "_remat_tiled"
_NAMES = ("SwiGLU", "FeedForward")
_ROUTED = ("Moe", "MoE", "Sparse", "Expert", "Router")


def tiles(seq: int, hidden: int) -> int:
    """The number of tiles for a sequence of ``seq`` tokens of ``hidden`` features."""
    return max(2, math.ceil(seq / max(hidden, 1)))


def find_mlp(block: nn.Module) -> nn.Module | None:
    """The MLP of ``block`` that ``tiled`` runs in tiles, or None (NOTE [ The tiled MLP ])."""
    mlp = getattr(block, "mlp", None)
    if not isinstance(mlp, nn.Module):
        mlp = next(
            (m for m in block.children()
             if type(m).__name__.endswith("MLP") or type(m).__name__ in _NAMES),
            None,
        )  # fmt: skip
    if mlp is None or not any(True for _ in mlp.parameters()):
        return None
    if any(any(k in type(m).__name__ for k in _ROUTED) or hasattr(m, "experts") for m in mlp.modules()):
        return None  # a mixture of experts: its router's statistics are the whole batch's
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in mlp.modules()):
        return None
    rates = [getattr(mlp, k, None) for k in ("dropout", "dropout_p")]  # a functional dropout's rate
    if any(isinstance(r, int | float) and not isinstance(r, bool) and r > 0 for r in rates):
        return None
    return mlp


class TiledForward:
    """The ``forward`` of a tiled MLP (data, not a closure: NOTE [ The module form is data ])."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def _original(self) -> Any:
        original = self.module.__dict__[_RECORD]
        return original if original is not None else type(self.module).forward.__get__(self.module)

    @property
    def __wrapped__(self) -> Any:
        return self._original()

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        original = self._original()
        if (not self.module.training or not torch.is_grad_enabled() or args or kwargs
                or not isinstance(x, torch.Tensor) or x.dim() not in (2, 3)):  # fmt: skip
            return original(x, *args, **kwargs)
        seq, hidden = x.shape[-2], x.shape[-1]
        n = min(tiles(seq, hidden), seq)
        if n < 2:
            return original(x)
        size = math.ceil(seq / n)
        # Tiles of one sequence each, so that every tile is a contiguous view (an MLP may .view()).
        rows = x.unsqueeze(0) if x.dim() == 2 else x
        out = []
        for row in range(rows.shape[0]):
            parts = [
                _torch_checkpoint(_tile_forward, original, _tile(rows, row, start, min(size, seq - start), x.dim()),
                                  use_reentrant=False)
                for start in range(0, seq, size)
            ]  # fmt: skip
            out.append(torch.cat(parts, dim=-2))
        return out[0] if x.dim() == 2 else torch.cat(out, dim=0)


def _tile(rows: torch.Tensor, row: int, start: int, length: int, dim: int) -> torch.Tensor:
    """Tokens ``start:start+length`` of sequence ``row``: [length, hidden] for a 2-D input,
    [1, length, hidden] for a 3-D one."""
    tile = rows[row : row + 1, start : start + length]
    return tile[0] if dim == 2 else tile


def tile_block(block: nn.Module) -> nn.Module:
    """Run ``block``'s MLP in tiles (NOTE [ The tiled MLP ]), in place; returns the MLP."""
    mlp = find_mlp(block)
    if mlp is None:
        raise BlockError(
            f"option 'tiled' needs an MLP without dropout in the block ({type(block).__name__}): "
            "a child named 'mlp' or of a class named '*MLP' or 'SwiGLU'; this block has none, so "
            "the profiler does not offer 'tiled' for it"
        )
    if _RECORD not in mlp.__dict__:
        object.__setattr__(mlp, _RECORD, mlp.__dict__.get("forward"))
        object.__setattr__(mlp, "forward", TiledForward(mlp))
    return mlp


def untile_block(block: nn.Module) -> None:
    """Undo ``tile_block``: the MLP's own forward again. A no-op otherwise. The MLP is looked for
    among all the block's modules: ``find_mlp`` reaches it through a wrapper's attributes too
    (torch's ``checkpoint_wrapper`` hands ``block.mlp`` on to the module it wraps), and a fake copy
    left tiled by the profiler had its lean profile 40,448 B a block low (torchtune's layers)."""
    for module in block.modules():
        if _RECORD in module.__dict__:
            original = module.__dict__.pop(_RECORD)
            module.__dict__.pop("forward", None)
            if original is not None:
                object.__setattr__(module, "forward", original)


def is_tiled(block: nn.Module) -> bool:
    """Whether ``block``'s MLP runs in tiles."""
    return any(_RECORD in m.__dict__ for m in block.modules())


def _tile_forward(mlp: Any, tile: torch.Tensor) -> Any:
    with stop_passes_through():  # NOTE [ A recompute stopped early ] in remat.manual.contexts
        return mlp(tile)
