"""What the warm-up step sees of the module calls (``Calls``, NOTE [ Blocks by what runs ] in
``remat.manual.settle``): one observer whose state is declared here, fed by forward hooks, the
saving hooks and a dispatch mode that sees writes into buffers."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from remat.errors import ProfileError
from remat.manual.settle import Calls
from remat.measure import step as _step
from remat.measure import storages as _storages
from remat.measure.sides import first_tensor
from remat.measure.storages import storage_key

__all__ = ["CallsSeen", "seen_calls"]


@dataclass
class CallsSeen:
    """The observer of one training step's module calls; ``calls`` is what it saw."""

    model: nn.Module
    batch_ids: set[int]
    """The batch's tensors, by id: a module whose first call takes one is fed the batch (rule 3)."""
    calls: Calls = field(default_factory=lambda: Calls(count={}, start={}, end={}, grads=set(), inputs={},
                                                       made=set()))
    late: set[str] = field(default_factory=set)
    """The modules called with gradients only after the model's forward returned (rule 1)."""
    clock: int = 0
    """How many calls' starts and ends have been seen: where a call starts or ends, or work is done."""
    done: bool = False
    """Whether the model's forward has returned."""
    first: list[str] = field(default_factory=list)
    """The modules in their first call, innermost last."""
    saved: set[str] = field(default_factory=set)
    """The modules whose first call saved a tensor for the backward (rule 1)."""
    read: set[str] = field(default_factory=set)
    """Of those, the ones whose saved tensor the backward read."""
    returned: dict[str, list[weakref.ref[torch.Tensor]]] = field(default_factory=dict)
    """Per module in its first call: what its modules returned (rule 8)."""
    outputs: dict[int, weakref.ref[torch.Tensor]] = field(default_factory=dict)
    """What modules holding parameters returned, by id (rule 9)."""
    inputs: dict[str, set[int]] = field(default_factory=dict)
    """What modules holding parameters were called with, by id, while they run (rule 9)."""
    handles: list[RemovableHandle] = field(default_factory=list)
    """The hooks on modules and on the tensors they returned, removed after the step (a tensor of
    the batch a module returns as it is outlives the step)."""
    mark: Callable[[str], None] = lambda _: None
    """Called at each module call and each saved tensor the backward reads: where the warm-up's
    memory record may be cut (``remat.measure.tracer.sized``)."""

    def __post_init__(self) -> None:
        self.names = {id(m): n for n, m in self.model.named_modules()}
        self.holding = {n for n, m in self.model.named_modules() if any(True for _ in m.parameters())}

    def holder(self) -> str | None:
        """The innermost module in its first call that holds parameters: whose code runs now."""
        return next((n for n in reversed(self.first) if n in self.holding), None)

    def worked(self) -> None:
        """The code running now saved a tensor or made a module's input (rule 9)."""
        if (name := self.holder()) is not None:
            self.calls.work.setdefault(name, []).append(self.clock)

    def tick(self) -> int:
        self.clock += 1
        return self.clock - 1

    def _made_by_caller(self, x: torch.Tensor) -> bool:
        """Whether ``x`` was made by the code running now: neither what a module holding parameters
        returned nor what that code was called with (rule 9)."""
        if (h := self.holder()) is None or id(x) in self.inputs.get(h, ()):
            return False
        return not ((r := self.outputs.get(id(x))) is not None and r() is x)

    def pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.mark("call")
        if not torch.is_grad_enabled():
            return
        calls, name = self.calls, self.names[id(module)]
        if self.done:
            self.late.add(name)
            return
        calls.count[name] = calls.count.get(name, 0) + 1
        if name in calls.start:
            return
        calls.start[name] = self.tick()
        x = first_tensor((args, kwargs))
        if x is not None and x.requires_grad and self._made_by_caller(x):
            self.worked()
        self.first.append(name)
        if name in self.holding:
            self.inputs[name] = {id(t) for t in _storages.tensors_in((args, kwargs))}
        if x is not None:
            calls.inputs[name] = "grad" if x.requires_grad else "batch" if id(x) in self.batch_ids else "made"

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        calls, name = self.calls, self.names[id(module)]
        if torch.is_grad_enabled() and not self.done and name not in calls.end:
            calls.end[name] = self.tick()
            if name in self.first:
                self.first.remove(name)
            self.inputs.pop(name, None)
            y = first_tensor(output)
            if y is not None and name in self.holding:
                self.outputs[id(y)] = weakref.ref(y)
            if y is not None and not any(r() is y for r in self.returned.pop(name, [])):
                calls.made.add(name)  # rule 8
            if y is not None and (parent := name.rpartition(".")[0]) in calls.start and parent not in calls.end:
                self.returned.setdefault(parent, []).append(weakref.ref(y))
            for t in _storages.tensors_in(output):
                if t.requires_grad:  # a backward runs through it only where a gradient reaches it
                    self.handles.append(t.register_hook(lambda _, name=name: calls.grads.add(name)))
        self.done = self.done or module is self.model

    def pack(self, t: torch.Tensor) -> tuple[tuple[str, ...], torch.Tensor]:
        self.saved.update(self.first)
        self.worked()
        return tuple(self.first), t.detach()  # NOTE [ What the saving hook holds ] in remat.measure.saved

    def unpack(self, packed: tuple[tuple[str, ...], torch.Tensor]) -> torch.Tensor:
        self.mark("read")
        self.read.update(packed[0])
        return packed[1]

    def written(self, buffer: str) -> None:
        """An op wrote into ``buffer``: a replay would change it again (rule 1)."""
        for name in self.first:
            self.calls.mutates.setdefault(name, buffer)


def seen_calls(model: nn.Module, batch: Any, loss_fn: Any, optimizer: Any,
               mark: Callable[[str], None] = lambda _: None) -> CallsSeen:
    """One training step of ``model`` on ``batch``, its module calls watched; where it wrote into
    buffers, the next step too, whose writes are the ones a step makes (the first alone fills a
    cache: rule 1). ``mark``: ``CallsSeen.mark``."""
    seen = _watched(model, batch, loss_fn, optimizer, mark)
    if seen.calls.mutates:
        again = _watched(model, batch, loss_fn, optimizer, mark).calls.mutates
        for name in [n for n in seen.calls.mutates if n not in again]:
            del seen.calls.mutates[name]
    return seen


def _watched(model: nn.Module, batch: Any, loss_fn: Any, optimizer: Any, mark: Callable[[str], None]) -> CallsSeen:
    seen = CallsSeen(model, batch_ids={id(t) for t in _storages.batch_tensors(batch)}, mark=mark)
    seen.handles += [h for m in model.modules()
                     for h in (m.register_forward_pre_hook(seen.pre, with_kwargs=True), m.register_forward_hook(seen.post))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(seen.pack, seen.unpack), _BufferWrites(model, seen.written):
            _step.train_step(model, batch, loss_fn, optimizer)
    except RuntimeError as e:
        if "support saved tensor hooks" not in str(e):
            raise
        raise ProfileError(
            f"{type(model).__name__}'s step calls torch.func's transforms (grad, vjp: a memory that learns in "
            "its forward, as titans-pytorch's), which torch does not run under saved-tensor hooks, and remat "
            "reads every tensor a step saves through them: it cannot profile this model. Checkpoint its "
            "modules that do not call torch.func with remat.checkpoint in the model's code") from None
    finally:
        for h in seen.handles:
            h.remove()
    seen.calls.idle.update(seen.saved - seen.read)
    return seen


class _BufferWrites(TorchDispatchMode):
    """Calls ``written(name)`` for each op that writes into one of ``model``'s buffers, however it
    is reached (``buffer.data.lerp_``, which no version counter sees), on real or fake tensors; not
    for a training norm's running statistics, which a replay puts back (NOTE [ BatchNorm in
    recompute ] in remat.manual.batchnorm)."""

    def __init__(self, model: nn.Module, written: Callable[[str], None]) -> None:
        super().__init__()
        self.written = written
        self.buffers = {storage_key(t): name for name, t in model.named_buffers(remove_duplicate=False)
                        if not _replayed(model.get_submodule(name.rpartition(".")[0]))}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.buffers:
            for k, arg in enumerate(func._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    t = args[k] if k < len(args) else kwargs.get(arg.name)
                    if isinstance(t, torch.Tensor) and (name := self.buffers.get(storage_key(t))) is not None:
                        self.written(name)
        return func(*args, **kwargs)


def _replayed(module: nn.Module) -> bool:
    """Whether a replay puts back what ``module``'s forward changes in its buffers: a training norm's
    running statistics."""
    return isinstance(module, nn.modules.batchnorm._NormBase) and module.training
