"""The bytes tensors hold: a tensor's storages (a sparse tensor's are its indices' and values'),
the tensors inside any object a step is given or returns, and what the parameters, the optimizer
state and the batch take. ``remat.measure.step`` runs the step these are read from."""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from remat.manual.frames import is_data

__all__ = [
    "batch_bytes",
    "batch_shape",
    "batch_tensors",
    "carried_tensors",
    "optimizer_bytes",
    "param_bytes",
    "storage_bytes",
    "storage_key",
    "strided_parts",
    "tensors_in",
    "trainable_bytes",
]


def strided_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors whose storages hold ``t``: ``t``, or a sparse tensor's indices and values
    (a sparse tensor has no storage of its own: openai-whisper keeps one as a buffer); none for a
    layout remat cannot read (mkldnn's)."""
    if t.layout == torch.strided:
        return (t,)
    if t.layout == torch.sparse_coo:
        return (t._indices(), t._values())
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices(), t.values())
    return ()


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (views share it; a sparse tensor's is its values'), for real
    and fake tensors alike: the StorageImpl's address, valid while the storage lives."""
    parts = strided_parts(t)
    return int(parts[-1].untyped_storage()._cdata) if parts else id(t)


def storage_bytes(tensors: Any, *, seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (any nesting); each storage counted once."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors_in(tensors):
        for part in strided_parts(t):
            if (key := storage_key(part)) not in seen:
                seen.add(key)
                total += part.untyped_storage().nbytes()
    return total


def tensors_in(obj: Any, _seen: set[int] | None = None, *, attributes: bool = False) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj`` (a tensor, or mappings, tuples, lists and dataclasses of them), depth
    first; each container walked once (one may hold itself). ``attributes``: also in the attributes
    of other objects (``batch_tensors``). A dataclass is data wherever it is met (``is_data``):
    blocks that hand each other a ``@dataclass`` state were refused (no gradient seemed to reach
    their outputs)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if id(obj) in (seen := set() if _seen is None else _seen):
        return
    if isinstance(obj, Mapping):
        values: Any = obj.values()
    elif isinstance(obj, (tuple, list)):
        values = obj
    elif is_data(obj):
        values = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif attributes and hasattr(obj, "__dict__") and not isinstance(obj, _NOT_DATA):
        values = vars(obj).values()
    else:
        return
    seen.add(id(obj))
    for v in values:
        yield from tensors_in(v, seen, attributes=attributes)


# What holds no batch's tensors however it is reached: code, and a model's modules.
_NOT_DATA = (nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType, functools.partial)


def batch_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The batch's tensors: in any object it is made of, a dataclass or torch_geometric's ``Data``
    (its tensors in a mapping it holds) as well as mappings and sequences. Each is on the device
    before the step starts: the step's peak counts it (a ``Data`` batch's 384,000 B were left out,
    and every plan's peak with them)."""
    return tensors_in(batch, attributes=True)


_MODULE_STATE = ("_parameters", "_buffers", "_modules")


def carried_tensors(model: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(module name, attribute, tensor) for the tensors ``model``'s modules hold in plain attributes
    (tensors, and lists, tuples and dicts of them; not parameters or buffers): what a module may
    carry from one step into the next (NOTE [ A tensor carried from one step into the next ] in
    remat.measure.marked)."""
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr not in _MODULE_STATE:
                for t in tensors_in(value):
                    yield name, attr, t


def param_bytes(model: nn.Module) -> int:
    return storage_bytes(list(model.parameters()))


def trainable_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def optimizer_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return storage_bytes([dict(s) for s in optimizer.state.values()])


def batch_bytes(batch: Any) -> int:
    return storage_bytes(list(batch_tensors(batch)))


def batch_shape(batch: Any) -> list[int]:
    first = next(batch_tensors(batch), None)
    return list(first.shape) if first is not None else []
