"""Copies of tensors that measuring keeps while steps run (the weights ``preserved`` puts back, the
gradients ``verify`` compares), kept off the memory those steps are measured in.

# NOTE [ Copies off the budget's memory ]
1. A CUDA device's copies are host memory, which no budget counts. The CPU's host memory is the
   budget's memory: there a copy of the weights takes the room of the very steps remat plans, in
   the process that cannot hold the plain step (hf-llama's weights are 26.9 MiB; ``verify`` held
   the reference's gradients and ``preserved`` the weights, two copies, beside its step).
2. So a CPU tensor's copy is written to an unnamed temporary file (``Copies``) and read back, in
   pieces of at most ``_PIECE`` bytes, into its place or into a new tensor when it is used: the
   file's pages are the kernel's cache, not the process's memory. A tensor the file cannot take
   bit for bit (not dense and strided, a subclass, a quantized or conjugate view) is copied in
   memory as before.
3. Copies are read back with ``Tensor.copy_``, so a tensor put back counts a new version, as any
   in-place write does.
4. Reading a copy back into a new tensor allocates it: ``preserved`` frees the steps' gradients and
   optimizer state first, so putting back needs no more than the user's own had, and puts the
   weights back first, in place (the capped ``embedding`` case of tests/test_does_not_fit.py ran
   out of memory reading its 32 MiB embedding gradient beside the last step's).
5. Where the temporary file cannot be made or written (no space left), copies stay in memory, as
   before, with a warning: measuring goes on, only with less room.
"""

from __future__ import annotations

import io
import logging
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast, overload

import torch
from torch.utils._pytree import tree_map

__all__ = ["Copies", "copy_tree", "read_tree"]

log = logging.getLogger(__name__)

_PIECE = 4 * 2**20
"""The most bytes read back at once (NOTE [ Copies off the budget's memory ], rule 2)."""


@dataclass(frozen=True)
class _Written:
    """Where a copy lies in the file, and what tensor it was."""

    offset: int
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


def _to_file(t: torch.Tensor) -> bool:
    """Whether ``t``'s copy goes to the file (NOTE [ Copies off the budget's memory ], rule 2)."""
    return (t.device.type == "cpu" and type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
            and not t.is_quantized and not t.is_conj() and not t.is_neg() and t.numel() > 0)


class Copies(Sequence[torch.Tensor]):
    """Copies of tensors, in the order added: a CPU tensor's in a temporary file, any other's in
    host memory (NOTE [ Copies off the budget's memory ]). Indexing reads a copy back as a new CPU
    tensor; ``put`` writes one back into a tensor of its shape."""

    def __init__(self, tensors: Sequence[torch.Tensor] = ()) -> None:
        self._copies: list[torch.Tensor | _Written] = []
        self._file: io.BufferedRandom | None = None
        self._unwritable = False
        for t in tensors:
            self.add(t)

    def add(self, t: torch.Tensor) -> int:
        """Copy ``t`` (its values as they are now); its index."""
        t = t.detach()
        written = self._write(t) if _to_file(t) and not self._unwritable else None
        self._copies.append(written if written is not None else t.to("cpu", copy=True))
        return len(self._copies) - 1

    def _write(self, t: torch.Tensor) -> _Written | None:
        """``t``'s copy in the file; None where the file cannot take it (rule 5 of NOTE [ Copies off
        the budget's memory ]), and from then on."""
        try:
            if self._file is None:
                self._file = cast(io.BufferedRandom, tempfile.TemporaryFile())  # noqa: SIM115  # closed by close()
            src = t.contiguous()
            offset = self._file.seek(0, 2)
            self._file.write(src.reshape(-1).view(torch.uint8).numpy().data)
            self._file.flush()
        except OSError as e:
            log.warning("remat: keeping copies in memory: the temporary file for them failed (%s)", e)
            self._unwritable = True
            return None
        return _Written(offset, t.shape, t.stride(), t.dtype)

    def __len__(self) -> int:
        return len(self._copies)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...
    def __getitem__(self, i: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        copy = self._copies[i]
        if isinstance(copy, torch.Tensor):
            return copy
        out = torch.empty(copy.shape, dtype=copy.dtype)
        self._read(copy, out)
        if out.stride() != copy.stride and _dense(copy):  # the layout it had (a gradient's follows its weight's)
            out = torch.empty_strided(copy.shape, copy.stride, dtype=copy.dtype).copy_(out)
        return out

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))

    def put(self, i: int, into: torch.Tensor) -> None:
        """Write copy ``i`` back into ``into`` (its shape and dtype; in place, bit for bit)."""
        copy = self._copies[i]
        if isinstance(copy, _Written) and into.is_contiguous() and into.device.type == "cpu" and into.dtype == copy.dtype:
            self._read(copy, into)
        else:
            into.copy_(self[i])

    def shape(self, i: int) -> torch.Size:
        copy = self._copies[i]
        return copy.shape

    def pieces(self, i: int) -> Iterator[torch.Tensor]:
        """Copy ``i``'s values in order, flat, in new tensors of at most ``_PIECE`` bytes each."""
        copy = self._copies[i]
        if isinstance(copy, torch.Tensor):
            flat = (copy if copy.layout == torch.strided else copy.to_dense()).reshape(-1)
            step = max(1, _PIECE // flat.element_size())
            yield from (flat[start:start + step] for start in range(0, flat.numel(), step))
            return
        for _, piece in self._raw(copy):
            yield piece.view(copy.dtype)

    def _read(self, copy: _Written, into: torch.Tensor) -> None:
        """Read ``copy`` into the contiguous CPU tensor ``into``, a piece at a time."""
        flat = into.detach().reshape(-1).view(torch.uint8)
        for start, piece in self._raw(copy):
            flat[start:start + piece.numel()].copy_(piece)

    def _raw(self, copy: _Written) -> Iterator[tuple[int, torch.Tensor]]:
        """(offset in the copy, its bytes from there) a piece at a time, each read as it is asked for."""
        assert self._file is not None
        for start in range(0, copy.nbytes, _PIECE):
            piece = torch.empty(min(_PIECE, copy.nbytes - start), dtype=torch.uint8)
            self._file.seek(copy.offset + start)
            got = self._file.readinto(piece.numpy().data)
            if got != piece.numel():
                raise OSError(f"remat's copy file gave {got} of {piece.numel()} bytes at {copy.offset + start}")
            yield start, piece

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __del__(self) -> None:
        self.close()


def _dense(copy: _Written) -> bool:
    """Whether a tensor of ``copy``'s shape and strides covers its storage once (a permuted layout)."""
    expected = 1
    for size, stride in sorted((d for d in zip(copy.shape, copy.stride) if d[0] > 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def copy_tree(obj: Any, copies: Copies) -> Any:
    """``obj`` (dicts and lists of tensors, as an optimizer's ``state_dict``) with each tensor
    replaced by its index in ``copies``, as ``_Index``."""
    return tree_map(lambda v: _Index(copies.add(v)) if isinstance(v, torch.Tensor) else v, obj)


def read_tree(obj: Any, copies: Copies) -> Any:
    """``copy_tree``'s ``obj`` with each tensor read back."""
    return tree_map(lambda v: copies[v.i] if isinstance(v, _Index) else v, obj)


@dataclass(frozen=True)
class _Index:
    i: int
