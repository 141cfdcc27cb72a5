"""A checkpointed forward that writes its module's buffers in place.

# NOTE [ A buffer the forward writes ]
1. A recompute runs the forward again on the module as the forward left it. Where that forward
   changed a buffer in place, the replay reads the changed values and changes them again: a
   vector-quantize-pytorch EMA codebook, updated in its forward, quantized the replay with the
   updated codebook and moved twice, and the encoder's gradients differed from the plain step's,
   silently (torch's checkpoint does the same). A training norm's running statistics are not
   counted here: its forward normalises with the batch's statistics, and the recompute puts them
   back (NOTE [ BatchNorm in recompute ]).
2. So the forward notes the buffers it wrote (each one's version counter, read before and after),
   and the recompute puts them back as the forward left them when it ends. Where the recompute
   wrote one of them again, the write is one every call makes (an EMA, a step counter), not a
   cache the first call fills (rotary-embedding-torch's table of frequencies, which the replay
   reads as it is): the backward stops with an error that names the buffer, before an optimizer
   step can take those gradients, and the buffer is as the forward left it.
3. ``remat.auto`` and ``remat.profile`` never take such a module for a block and refuse a named
   one (rule 1 of NOTE [ Blocks by what runs ] in ``remat.manual.settle``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import _StopRecomputationError

from remat.errors import BlockError
from remat.manual.batchnorm import RUNNING_STATS

__all__ = ["ForwardWrites", "ReplayWrites"]


def _buffers(roots: tuple[nn.Module, ...]) -> list[tuple[nn.Module, str, torch.Tensor, int]]:
    """The buffers under ``roots``, each once, with its module, its name there and its version, but
    a training norm's running statistics. A walk of the modules once (it runs at every checkpointed
    call: the names are made only for an error)."""
    seen: set[int] = set()
    found = []
    for root in roots:
        for module in root.modules():
            if not module._buffers:
                continue
            norm = module.training and isinstance(module, nn.modules.batchnorm._NormBase)
            for key, b in module._buffers.items():
                if b is not None and not (norm and key in RUNNING_STATS) and id(b) not in seen:
                    seen.add(id(b))
                    found.append((module, key, b, b._version))
    return found


class ForwardWrites:
    """Around a checkpointed call's forward: the buffers under ``roots`` it wrote in place
    (``written``; NOTE [ A buffer the forward writes ], rule 2)."""

    def __init__(self, roots: tuple[nn.Module, ...]) -> None:
        self.roots = roots
        self.written: list[tuple[str, torch.Tensor]] = []
        self._before: list[tuple[nn.Module, str, torch.Tensor, int]] = []

    def __enter__(self) -> ForwardWrites:
        self._before = _buffers(self.roots)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.written = [(f"{type(m).__name__}.{key}", b) for m, key, b, v in self._before if b._version != v]
        self._before = []


class ReplayWrites:
    """Around a recompute: the buffers its forward wrote put back as the forward left them, and an
    error where the recompute wrote one again (NOTE [ A buffer the forward writes ], rule 2)."""

    def __init__(self, written: list[tuple[str, torch.Tensor]], what: str) -> None:
        self.written, self.what = written, what
        self._saved: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []

    def __enter__(self) -> None:
        with _disable_current_modes():  # as RestoreRunningStats: not ops of the block's
            self._saved = [(n, b, b.detach().clone(), b._version) for n, b in self.written]

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        again = [(n, b, value) for n, b, value, v in self._saved if b._version != v]
        with torch.no_grad(), _disable_current_modes():
            for _, b, value in again:
                b.copy_(value)
        self._saved.clear()
        if again and (kind is None or issubclass(kind, _StopRecomputationError)):  # or torch's early stop
            raise BlockError(
                f"{self.what} changed the buffer {again[0][0]} in place in its forward and again in its "
                "recompute (an EMA, a step counter): the recompute ran on the changed values, so the "
                "gradients are not the plain step's, and this backward stops here, before any optimizer "
                "step takes them (the buffer is as the forward left it). Checkpoint the modules around "
                "it instead, or make the update outside the forward (NOTE [ A buffer the forward "
                "writes ] in remat.manual.buffer_writes)"
            )
