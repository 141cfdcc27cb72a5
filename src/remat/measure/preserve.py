"""Leaving the user's objects as they were: ``preserved(model, optimizer)`` puts back everything a
measuring run changes (weights, buffers such as BatchNorm statistics, gradients, optimizer state,
RNG state), so that profiling or verifying a model never alters what the user gave."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from remat.measure.step import batch_leaves

__all__ = ["batch_grads", "preserved"]


@contextlib.contextmanager
def batch_grads(batch: Any) -> Iterator[None]:
    """Put back the gradients of the batch's tensors that require grad (a step sets them; on fake
    tensors, to a fake tensor)."""
    leaves = batch_leaves(batch)
    grads = [t.grad for t in leaves]
    try:
        yield
    finally:
        for t, g in zip(leaves, grads):
            t.grad = g


@contextlib.contextmanager
def preserved(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, batch: Any = None) -> Iterator[None]:
    """Run measuring steps, then put back weights, buffers, grads (the batch's too), optimizer
    state and RNG state."""
    tensors = {name: t for name, t in _named_state(model)}
    saved = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
    grads = {
        name: (p.grad.detach().to("cpu", copy=True) if p.grad is not None else None)
        for name, p in model.named_parameters()
    }
    opt_state = _copy_to_cpu(optimizer.state_dict()) if optimizer is not None else None
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    training = {m: m.training for m in model.modules()}
    try:
        with batch_grads(batch):
            yield
    finally:
        with torch.no_grad():
            for name, t in tensors.items():
                t.copy_(saved[name])
            for name, p in model.named_parameters():
                g = grads.get(name)
                p.grad = g.to(p.device) if g is not None else None
        if optimizer is not None and opt_state is not None:
            optimizer.load_state_dict(opt_state)
            if not opt_state["state"]:
                optimizer.state.clear()
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for m, flag in training.items():
            m.training = flag


def _named_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        yield name, t


def _copy_to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _copy_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_to_cpu(v) for v in obj]
    return obj
