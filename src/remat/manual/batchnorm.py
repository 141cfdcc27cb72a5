"""BatchNorm running statistics moved once per step, by the modules of the call being recomputed.

# NOTE [ BatchNorm in recompute ]
A BatchNorm in training mode updates its running statistics as a side effect of its forward.
Plain torch checkpointing runs that forward twice (once in the forward pass, once when the
backward recomputes it), so running_mean/var move twice and num_batches_tracked counts twice
(pytorch issue 96136). The normalisation uses the batch's statistics in training mode, never the
running ones, so undoing the second update changes no output. When a recompute starts, the running
statistics of every training-mode _NormBase module the checkpointed call can reach are
snapshotted; when it ends (even when torch stops it early after the last needed tensor), they are
written back. (Switching track_running_stats off instead would change which tensors batch_norm
saves, and torch's checkpoint rightly refuses a recompute that saves a different set.)

The modules are found from the call itself (``module_roots``): a module, a bound method's
``self``, a ``functools.partial``'s function and arguments, a function's closure cells and the
globals its code names, and the call's own arguments, a few levels deep. Nothing process-wide is
touched (no global module hook), so another thread's BatchNorm, checkpointed or not, is never
snapshotted or restored. A BatchNorm reachable by none of these routes (say, through an attribute
of a global object) moves twice, as with plain torch.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["RUNNING_STATS", "RestoreRunningStats", "module_roots", "running_stats", "snapshot_bytes"]

_DEPTH = 4

RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")
"""The buffers a training norm moves in its forward, which a recompute puts back."""


def module_roots(*objs: Any) -> tuple[nn.Module, ...]:
    """The modules ``objs`` (a callable, its arguments) reach (NOTE [ BatchNorm in recompute ])."""
    found: dict[int, nn.Module] = {}
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > _DEPTH:
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            found[id(obj)] = obj
            return
        children: Any = ()
        if isinstance(obj, (list, tuple)):
            children = obj
        elif isinstance(obj, dict):
            children = obj.values()
        elif isinstance(obj, functools.partial):
            children = (obj.func, obj.args, obj.keywords)
        elif isinstance(obj, types.MethodType):
            children = (obj.__self__, obj.__func__)
        elif isinstance(obj, types.FunctionType):
            cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            names = [obj.__globals__[n] for n in obj.__code__.co_names if n in obj.__globals__]
            children = cells + [g for g in names if isinstance(g, (nn.Module, types.FunctionType))]
        elif callable(obj) and not isinstance(obj, type) and hasattr(obj, "__dict__"):
            children = tuple(vars(obj).values())  # a callable object: what it holds
        for child in children:
            visit(child, depth + 1)

    for obj in objs:
        visit(obj, 0)
    return tuple(found.values())


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def running_stats(roots: tuple[nn.Module, ...]) -> list[torch.Tensor]:
    """The running statistics of the training BatchNorms under ``roots``, each once: what a
    recompute of them snapshots until it ends (``BlockProfile.stats_bytes``)."""
    seen: set[int] = set()
    found = []
    for root in roots:
        for module in root.modules():
            if id(module) in seen or not isinstance(module, nn.modules.batchnorm._NormBase):
                continue
            seen.add(id(module))
            if module.training:
                found += [b for n in RUNNING_STATS
                          if isinstance(b := getattr(module, n, None), torch.Tensor)]
    return found


def snapshot_bytes(roots: tuple[nn.Module, ...]) -> int:
    """The bytes a recompute's snapshot of ``running_stats(roots)`` takes on their device (CUDA's
    allocator rounds each copy to 512-byte blocks)."""
    sizes = [(b.numel() * b.element_size(), b.is_cuda) for b in running_stats(roots)]
    return sum(-(-n // 512) * 512 if cuda else n for n, cuda in sizes)


class RestoreRunningStats:
    """Snapshot, on enter, the running statistics of the training BatchNorms under ``roots``;
    write them back on exit."""

    def __init__(self, roots: tuple[nn.Module, ...]) -> None:
        self._roots = roots
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        # Outside any dispatch mode: selective checkpointing's recompute mode would take these
        # clones for ops of the block and refuse them.
        with _disable_current_modes():
            self._saved = [(buf, buf.detach().clone()) for buf in running_stats(self._roots)]

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad(), _disable_current_modes():
            for buf, value in self._saved:
                buf.copy_(value)
        self._saved.clear()
