"""One training step, the way every stage runs it: forward, loss, backward, optimizer step.

The calling convention for a user's model and batch:
- ``batch`` a tensor: ``model(batch)``; a tuple or list: ``model(*batch)``; a dict: ``model(**batch)``;
  any other object (a dataclass, torch_geometric's ``Data``): ``model(batch)``.
- ``loss_fn(output, batch) -> scalar`` or ``loss_fn(output) -> scalar``, told apart by its
  signature (``resolve_loss_fn``, called at every public edge). Without one: the output itself
  when it is a scalar, its ``.loss`` when it has one (transformers models given labels), else the
  mean of the output.

Steps are timed by ``remat.measure.clock``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from remat.errors import InvalidType, InvalidValue
from remat.manual.own_checkpointing import own_checkpointing_off
from remat.measure.storages import batch_tensors
from remat.models.hf import cache_off, every_layer

__all__ = [
    "Batch",
    "LossFn",
    "batch_leaves",
    "check_compiled",
    "check_grad_mode",
    "check_trainable",
    "forward_loss",
    "resolve_loss_fn",
    "train_step",
]

Batch = Any
LossFn = Callable[[Any, Any], torch.Tensor]


def check_grad_mode(verb: str) -> None:
    """Refuse to run a training step where autograd is off: under ``torch.no_grad()`` or
    ``torch.inference_mode()`` there is no backward to plan or measure."""
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        where = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
        raise InvalidValue(
            f"{verb} runs a training step (forward and backward), but it was called under {where}, "
            f"where autograd records nothing; call {verb} outside that block"
        )


def check_compiled(model: Any, verb: str) -> None:
    """Refuse a ``torch.compile``d module: its blocks run inside a compiled graph that remat's
    hooks cannot see (nothing is compiled here; the wrapper is recognised by its ``_orig_mod``)."""
    if isinstance(model, nn.Module) and type(model).__name__ == "OptimizedModule" and hasattr(
        model, "_orig_mod"
    ):
        raise InvalidType(
            f"{verb} was given a torch.compile'd model; apply remat to the model before compiling "
            f"it: plan = remat.auto(model, batch, budget) (or remat.apply(model, plan)), then "
            f"model = torch.compile(model); or pass model._orig_mod here"
        )


def check_trainable(model: Any, verb: str) -> None:
    """What every stage that runs a training step needs of the model, checked before it runs:
    an ``nn.Module`` (not compiled) with data and shapes in its parameters and at least one that
    trains, and autograd on."""
    if not isinstance(model, nn.Module):
        raise InvalidType(f"{verb} expects the model, an nn.Module; got {type(model).__name__}")
    check_compiled(model, verb)
    check_grad_mode(verb)
    params = list(model.parameters())
    if any(p.is_meta for p in params):
        raise InvalidValue(
            f"{verb}: the {type(model).__name__}'s parameters are on the meta device (shapes "
            "without data), so no step can run; materialise it first (model.to_empty(device=...) "
            "and load its weights), or estimate for a device from a factory (device='h100')"
        )
    if any(nn.parameter.is_lazy(p) for p in params):
        raise InvalidValue(
            f"{verb}: the {type(model).__name__} has lazy parameters (nn.LazyLinear, nn.LazyConv2d, ...) "
            "that have no shape yet, so no step can be measured; run one forward first (model(batch), "
            "under torch.no_grad()), which gives them their shapes"
        )
    if not any(p.requires_grad for p in params):
        raise InvalidValue(
            f"{verb}: the {type(model).__name__} has no parameter that requires grad"
            f"{' (it has none at all)' if not params else ''}, so a training step has no backward "
            "to checkpoint; unfreeze what should train (p.requires_grad_(True))"
        )


# NOTE [ A batch the model writes into ]
# A model may write into the dict it is given: sentence-transformers' forward adds its
# ``token_embeddings`` and ``sentence_embedding`` to its features. remat runs one batch for many
# steps, so the next step found the last one's outputs, graph and all, among its inputs, and two
# plain steps of a profile disagreed (a ProfileError). Each call gets the batch in new containers
# (dicts, lists and tuples copied shallowly, the tensors the batch's own), as a data loader gives a
# new batch each step.


def call_model(model: Callable[..., Any], batch: Batch) -> Any:
    """``model`` called with ``batch``: its keywords if a mapping, its items if a sequence, else
    itself, in new containers (NOTE [ A batch the model writes into ])."""
    batch = _fresh(batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _fresh(obj: Any) -> Any:
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _fresh(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_fresh(v) for v in obj)
    return obj


def default_loss(output: Any, batch: Batch) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    if isinstance(output, Mapping):
        output = next(iter(output.values()))
    if not isinstance(output, torch.Tensor):
        raise InvalidType(
            f"cannot make a loss from a model output of type {type(output).__name__}; "
            "pass loss_fn=lambda output, batch: ... that returns a scalar tensor"
        )
    return output if output.dim() == 0 else output.float().mean()


class _OutputOnly:
    """A one-argument ``loss_fn(output)`` in the two-argument form every stage calls."""

    def __init__(self, fn: Callable[[Any], torch.Tensor]) -> None:
        self.fn = fn

    def __call__(self, output: Any, batch: Batch) -> torch.Tensor:
        return self.fn(output)

    def __repr__(self) -> str:
        return f"{self.fn!r} (called as loss_fn(output))"


def _takes(signature: inspect.Signature, n: int) -> bool:
    try:
        signature.bind(*range(n))
    except TypeError:
        return False
    return True


def resolve_loss_fn(loss_fn: Any) -> LossFn | None:
    """``loss_fn`` as ``loss_fn(output, batch)``: a one-argument ``loss_fn(output)`` is wrapped.

    Which form it is is decided by its signature, here at the public edge, so that a function of
    neither form is refused before any work, with both forms named.
    """
    if loss_fn is None or isinstance(loss_fn, _OutputOnly):
        return loss_fn
    if not callable(loss_fn):
        raise InvalidType(
            f"loss_fn must be a function, loss_fn(output) or loss_fn(output, batch) returning a "
            f"scalar tensor; got a {type(loss_fn).__name__}"
        )
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin without a signature: the documented form
        return loss_fn
    if _takes(signature, 2):
        return loss_fn
    if _takes(signature, 1):
        return _OutputOnly(loss_fn)
    name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
    raise InvalidType(
        f"loss_fn must take loss_fn(output) or loss_fn(output, batch) and return a scalar "
        f"tensor; {name}{signature} takes neither"
    )


def forward_loss(model: Callable[..., Any], batch: Batch, loss_fn: LossFn | None) -> torch.Tensor:
    output = call_model(model, batch)
    loss = (loss_fn or default_loss)(output, batch)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise InvalidType(
            f"loss_fn must return a scalar tensor, got "
            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
        )
    return loss


def train_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    mark: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """One step; ``mark(phase)`` is called at each phase boundary. Returns the loss, detached."""
    mark = mark or (lambda _: None)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    _drop_batch_grads(batch)
    mark("forward")
    loss = forward_loss(model, batch, loss_fn)
    mark("backward")
    loss.backward()
    value = loss.detach()
    del loss
    mark("optimizer")
    if optimizer is not None:
        optimizer.step()
    mark("end")
    _drop_batch_grads(batch)
    return value


def batch_leaves(batch: Batch) -> list[torch.Tensor]:
    """The batch's tensors that require grad (a physics-informed loss's coordinates), whose
    gradients a step makes."""
    return [t for t in batch_tensors(batch) if t.requires_grad and t.is_leaf]


def _drop_batch_grads(batch: Batch) -> None:
    """The batch's gradients set to none: a measuring step makes its own and drops it when it ends,
    as a loop that takes a fresh batch each step does (``remat.measure.preserve`` puts back the
    user's)."""
    for t in batch_leaves(batch):
        t.grad = None


def batch_device(model: nn.Module, batch: Batch) -> torch.device:
    first = next(batch_tensors(batch), None)
    if first is not None:
        return first.device
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def switched_off(model: nn.Module) -> list[Any]:
    """Turn off what a planned training step runs without: transformers' K/V cache (NOTE [ No K/V
    cache in a planned training step ] in remat.models.hf) and the model's own checkpointing (NOTE
    [ A model's own checkpointing ] in remat.manual.own_checkpointing); each of the returned
    handles' ``remove()`` undoes its part. ``remat.apply`` keeps them until ``remat.remove``."""
    return [*cache_off(model), *own_checkpointing_off(model)]


@contextlib.contextmanager
def as_planned(model: nn.Module) -> Iterator[None]:
    """Steps of ``model`` inside this context run as remat plans them: every layer (NOTE
    [ layerdrop ] in remat.models.hf) and what ``switched_off`` turns off; all back as it was
    on exit, error or not."""
    with every_layer(model):
        handles = switched_off(model)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
