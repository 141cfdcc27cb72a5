"""The head option of a model: ``keep`` or ``chunked:<tokens>`` (NOTE [ A planned head ]).

``set_head(model, head_name, option)`` is what the profiler and ``remat.apply`` call. For a model
whose loss comes from ``remat.chunked_cross_entropy`` in the user's own code it sets the chunk size
on the head module. For a transformers causal LM it also routes the model's own loss through the
chunked head (NOTE [ The chunked head of a transformers causal LM ]).

# NOTE [ The chunked head of a transformers causal LM ]
A ``*ForCausalLM`` given ``labels`` computes ``logits = lm_head(hidden)`` for every token and then
its loss from them. With the chunked head applied, the model's ``forward`` is replaced on the
instance (as ``remat.manual.module_form`` does, a data object, not a closure): while it trains
with gradients and is given ``labels``, the model's own forward runs with ``labels=None`` and
``lm_head`` answers with a placeholder (one element, expanded to [batch, seq, vocab]) instead of
the logits; the loss is then ``chunked_cross_entropy`` of the hidden states that reached
``lm_head``, with transformers' own conventions (labels shifted by one, ``ignore_index=-100``,
``shift_labels`` and ``num_items_in_batch`` honoured). The output's ``loss`` is that loss and its
``logits`` is None: computing them is what the chunked head avoids. Without labels, in ``eval()``
or under ``no_grad`` the model runs its own forward unchanged. Models that transform the logits
after ``lm_head`` (final-logit soft-capping, a logit scale), or that compute their loss with their
own code instead of transformers' causal LM loss (XLNet, BART's decoder), are not offered the option.
``remove`` restores the instance exactly (``clear_head``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from remat.errors import InvalidValue
from remat.manual.head import chunked_cross_entropy, head_chunk_of, set_head_chunk

__all__ = [
    "HEAD_KEEP",
    "causal_lm_head",
    "chunk_of_option",
    "clear_head",
    "head_option_name",
    "head_option_of",
    "set_head",
]

HEAD_KEEP = "keep"
_PREFIX = "chunked:"
_FORWARD_ATTR = "_remat_head_forward"
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


def head_option_name(chunk_size: int) -> str:
    """``"chunked:1024"``: the head option for chunks of ``chunk_size`` tokens."""
    return f"{_PREFIX}{int(chunk_size)}"


def chunk_of_option(option: str) -> int | None:
    """The chunk size of a head option, None for ``keep``; refuses anything else."""
    if option == HEAD_KEEP:
        return None
    if isinstance(option, str) and option.startswith(_PREFIX) and option[len(_PREFIX):].isdigit():
        size = int(option[len(_PREFIX):])
        if size >= 1:
            return size
    raise InvalidValue(
        f"unknown head option {option!r}; expected 'keep' or 'chunked:<tokens>', e.g. 'chunked:1024'"
    )


def causal_lm_head(model: nn.Module) -> str | None:
    """The qualified name of a transformers causal LM's ``lm_head`` when the chunked head applies to
    it (NOTE [ The chunked head of a transformers causal LM ]), else None."""
    names = [c.__name__ for c in type(model).__mro__]
    if "PreTrainedModel" not in names or not names[0].endswith(("ForCausalLM", "LMHeadModel")):
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, key, None) not in (None, 1, 1.0) for key in _LOGIT_TRANSFORMS):
        return None
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear) or not _causal_loss(model):
        return None
    return next((name for name, m in model.named_modules() if m is head), None)


def _causal_loss(model: nn.Module) -> bool:
    """Whether ``model``'s forward computes its loss with transformers' causal LM loss (labels
    shifted by one), the loss the chunked head computes. Some ``*ForCausalLM`` and
    ``*LMHeadModel`` classes compute their own without the shift (XLNet's, BART's decoder's: a
    chunked head gave XLNet another loss)."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING  # the model is transformers'

        source = inspect.getsource(type(model).forward)
    except (ImportError, OSError, TypeError):
        return False
    return "self.loss_function(" in source and getattr(model, "loss_function", None) is LOSS_MAPPING.get("ForCausalLM")


def set_head(model: nn.Module, head_name: str, option: str, *, causal_lm: bool) -> None:
    """Run ``model``'s head (the module named ``head_name``) with ``option``, in place."""
    chunk = chunk_of_option(option)
    head = model.get_submodule(head_name)
    clear_head(model, head_name)
    if chunk is None:
        return
    set_head_chunk(head, chunk)
    if causal_lm:
        original = model.__dict__.get("forward")
        object.__setattr__(model, _FORWARD_ATTR, (head_name, original))
        object.__setattr__(model, "forward", ChunkedHeadForward(model))


def head_option_of(model: nn.Module, head_name: str) -> tuple[str, bool]:
    """The head option ``model`` runs its head ``head_name`` with, and whether its loss is routed
    (``set_head``'s ``causal_lm``): what to restore after measuring another."""
    chunk = head_chunk_of(model.get_submodule(head_name))
    option = HEAD_KEEP if chunk is None else head_option_name(chunk)
    return option, _FORWARD_ATTR in model.__dict__


def clear_head(model: nn.Module, head_name: str | None = None) -> None:
    """Undo ``set_head``: the model's own forward, the call's own chunk size. A no-op otherwise."""
    record = model.__dict__.pop(_FORWARD_ATTR, None)
    if record is not None:
        head_name = head_name or record[0]
        model.__dict__.pop("forward", None)
        if record[1] is not None:
            object.__setattr__(model, "forward", record[1])
    if head_name:
        set_head_chunk(model.get_submodule(head_name), None)


class _Placeholder:
    """``lm_head``'s stand-in while the chunked loss runs: notes its input, returns no logits."""

    def __init__(self, head: nn.Module) -> None:
        self.out_features: int = head.out_features  # type: ignore[assignment]
        self.hidden: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        return hidden.new_zeros(()).expand(*hidden.shape[:-1], self.out_features)


class ChunkedHeadForward:
    """The ``forward`` of a causal LM with the chunked head (NOTE [ The chunked head of a
    transformers causal LM ])."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def _original(self) -> Any:
        model = self.model
        original = model.__dict__[_FORWARD_ATTR][1]
        return original if original is not None else type(model).forward.__get__(model, type(model))

    @property
    def __wrapped__(self) -> Any:
        return self._original()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model, original = self.model, self._original()
        bound = inspect.signature(original).bind_partial(*args, **kwargs)
        labels = bound.arguments.get("labels")
        if labels is None or not model.training or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        extra = bound.arguments.get("kwargs", {})
        shift_labels = extra.pop("shift_labels", None)
        num_items = extra.pop("num_items_in_batch", None)
        bound.arguments["labels"] = None
        head = model.get_submodule(model.__dict__[_FORWARD_ATTR][0])
        stand_in, own = _Placeholder(head), head.__dict__.get("forward")
        object.__setattr__(head, "forward", stand_in)
        try:
            output = original(*bound.args, **bound.kwargs)
        finally:
            head.__dict__.pop("forward", None)
            if own is not None:
                object.__setattr__(head, "forward", own)
        if stand_in.hidden is None:
            raise InvalidValue(f"{type(model).__name__}'s forward did not call its lm_head; "
                               "remove the head option from the plan")  # fmt: skip
        targets = shift_labels if shift_labels is not None else labels
        reduction = "sum" if num_items is not None else "mean"
        loss = chunked_cross_entropy(
            stand_in.hidden, head, targets.to(stand_in.hidden.device), reduction=reduction,
            shift=shift_labels is None,
        )  # fmt: skip
        if num_items is not None:
            loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
        if isinstance(output, tuple):  # return_dict=False: (logits, ...) without labels
            return (loss, *output[1:])
        output["loss"] = loss
        output["logits"] = None
        return output
