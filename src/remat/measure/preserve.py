"""Leaving the user's objects as they were: ``preserved(model, optimizer)`` puts back everything a
measuring run changes (weights, buffers such as BatchNorm statistics, the modules' own attributes,
gradients, optimizer state, RNG state), so that profiling or verifying a model never alters what
the user gave.

# NOTE [ A module's state is its buffers and its attributes ]
1. A module's code may keep state between calls in buffers and in plain attributes at once
   (rotary-embedding-torch: a cache buffer, and an int that says how much of it is filled), so
   ``preserved`` puts back both: each buffer's values, the entries of each module's containers
   (parameters, buffers, submodules and hooks: a layer built on the first call, transformers'
   first-forward hooks) and its attributes by value (those set since are deleted). An object an
   attribute holds and a forward changed in place (a list it appended to) is not copied, so not
   put back.
2. A fake copy made between real steps (the lean profile's, once a real step measured the
   kernels' scratch) is a copy of the modules as given (``as_given``): a real step may leave a
   tensor where the model kept a number (transformers' dynamic RoPE), which a fake copy fakes and
   then compares with.
3. remat's own state on the modules (an applied plan's records, wrappers, hooks and held flags) is
   put back with the rest, so a run that applies plans in turn starts and ends with none applied
   (``times_in_turns``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.measure.copies import Copies, copy_tree, read_tree
from remat.measure.step import batch_leaves

__all__ = ["as_given", "batch_grads", "module_states", "preserved"]


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
    tensors = dict(_named_state(model))
    copies = Copies()  # NOTE [ Copies off the budget's memory ] in remat.measure.copies
    saved = {name: copies.add(t) for name, t in tensors.items()}
    grads = {name: copies.add(p.grad) if p.grad is not None else None for name, p in model.named_parameters()}
    opt_state = copy_tree(optimizer.state_dict(), copies) if optimizer is not None else None
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    modules = module_states(model)
    try:
        with batch_grads(batch):
            yield
    finally:
        for state in modules:
            state.put_back()
        # the steps' gradients and optimizer state freed before the copies are read back (rule 4 of
        # NOTE [ Copies off the budget's memory ]); the weights first, in place
        model.zero_grad(set_to_none=True)
        if optimizer is not None:
            optimizer.state.clear()
        with torch.no_grad():
            for name, t in tensors.items():
                copies.put(saved[name], t)
            for name, p in model.named_parameters():
                g = grads.get(name)
                p.grad = copies[g].to(p.device) if g is not None else None
        if optimizer is not None and opt_state is not None:
            optimizer.load_state_dict(read_tree(opt_state, copies))
        copies.close()
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def module_states(model: nn.Module) -> list[_ModuleState]:
    """Each module's attributes and the entries of its containers, as they are now."""
    return [_ModuleState.of(m) for m in model.modules()]


@contextlib.contextmanager
def as_given(given: list[_ModuleState]) -> Iterator[None]:
    """The modules' attributes and containers as ``given`` while the body runs, then as they were
    (a copy made between real steps is a copy of the model as given: NOTE [ A module's state is its
    buffers and its attributes ])."""
    now = [_ModuleState.of(state.module) for state in given]
    for state in given:
        state.put_back()
    try:
        yield
    finally:
        for state in now:
            state.put_back()


# What ``nn.Module.__init__`` sets: the containers of a module's parameters, buffers, submodules and
# hooks are put back by their entries, the rest of its ``__dict__`` (its own attributes) by value.
_OWN = frozenset(vars(nn.Module()))


@dataclass(frozen=True)
class _ModuleState:
    """A module's attributes and the entries of its containers (NOTE [ A module's state is its
    buffers and its attributes ])."""

    module: nn.Module
    attributes: dict[str, Any]
    containers: dict[str, dict[str, Any] | set[Any]]

    @classmethod
    def of(cls, module: nn.Module) -> _ModuleState:
        attributes, containers = {}, {}
        for name, value in vars(module).items():
            if name in _OWN and isinstance(value, (dict, set)):
                containers[name] = value.copy()
            else:
                attributes[name] = value
        return cls(module, attributes, containers)

    def put_back(self) -> None:
        own = vars(self.module)
        for name in [k for k in own if k not in self.attributes and k not in self.containers]:
            del own[name]
        own.update(self.attributes)
        for name, entries in self.containers.items():
            now = own[name]
            if isinstance(entries, dict) and now.keys() == entries.keys() and all(now[k] is v for k, v in entries.items()):
                continue
            now.clear()
            now.update(entries)


def _named_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        yield name, t
