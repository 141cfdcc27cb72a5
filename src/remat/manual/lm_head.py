"""The head option of a model: ``keep`` or ``chunked:<tokens>`` (NOTE [ A planned head ]).

``set_head(model, head_name, option)`` is what the profiler and ``remat.apply`` call. For a model
whose loss comes from ``remat.chunked_cross_entropy`` in the user's own code it sets the chunk size
on the head module. For a transformers causal LM it also routes the model's own loss through the
chunked head (NOTE [ The chunked head of a transformers causal LM ]).

# NOTE [ The chunked head of a transformers causal LM ]
A ``*ForCausalLM`` given ``labels`` computes ``logits = lm_head(hidden)`` for every token and then
its loss from them with ``self.loss_function``. With the chunked head applied, the model's
``forward`` is replaced on the instance (as ``remat.manual.module_form`` does, a data object, not a
closure): while it trains with gradients and is given ``labels``, the model's own forward runs,
``lm_head`` answers with a placeholder (one element, expanded to [batch, seq, vocab]) instead of
the logits, and its ``loss_function`` is ``chunked_cross_entropy`` of the hidden states that
reached ``lm_head``, with transformers' own conventions (labels shifted by one, ``ignore_index``,
``shift_labels`` and ``num_items_in_batch`` honoured). So the model adds to that loss what it adds
to its own (a mixture of experts' router balancing loss: run with ``labels=None``, Mixtral's and
Jamba's left it out, and their routers' gradients differed by up to a fifth). The output's
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
        self.logits: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        self.logits = hidden.new_zeros(()).expand(*hidden.shape[:-1], self.out_features)
        return self.logits


class _ChunkedLoss:
    """The model's ``loss_function`` while the chunked loss runs: transformers' causal LM loss of
    the hidden states the placeholder noted, one chunk of logits at a time."""

    def __init__(self, head: nn.Module, stand_in: _Placeholder) -> None:
        self.head, self.stand_in, self.calls = head, stand_in, 0

    def __call__(self, logits: Any, labels: torch.Tensor, vocab_size: Any = None, num_items_in_batch: Any = None,
                 ignore_index: int = -100, shift_labels: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        hidden = self.stand_in.hidden
        if hidden is None or logits is not self.stand_in.logits:
            raise InvalidValue("the model's loss is not of the logits its lm_head returned; remove the head "
                               "option from the plan")  # fmt: skip
        self.calls += 1
        targets = shift_labels if shift_labels is not None else labels
        loss = chunked_cross_entropy(
            hidden, self.head, targets.to(hidden.device), ignore_index=ignore_index,
            reduction="sum" if num_items_in_batch is not None else "mean", shift=shift_labels is None,
        )  # fmt: skip
        if num_items_in_batch is not None:
            n = num_items_in_batch
            loss = loss / (n.to(loss.device) if torch.is_tensor(n) else n)
        return loss


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
        labels = inspect.signature(original).bind_partial(*args, **kwargs).arguments.get("labels")
        if labels is None or not model.training or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        head = model.get_submodule(model.__dict__[_FORWARD_ATTR][0])
        stand_in, own = _Placeholder(head), head.__dict__.get("forward")
        loss_fn, own_loss = _ChunkedLoss(head, stand_in), model.__dict__.get("_loss_function")
        object.__setattr__(head, "forward", stand_in)
        model.__dict__["_loss_function"] = loss_fn  # transformers' ``loss_function`` reads it first
        try:
            output = original(*args, **kwargs)
        finally:
            head.__dict__.pop("forward", None)
            if own is not None:
                object.__setattr__(head, "forward", own)
            model.__dict__.pop("_loss_function", None)
            if own_loss is not None:
                model.__dict__["_loss_function"] = own_loss
        if loss_fn.calls != 1:
            raise InvalidValue(f"{type(model).__name__}'s forward computed its loss {loss_fn.calls} times with its "
                               "loss_function, where remat's chunked head expects once; remove the head option from "
                               "the plan")  # fmt: skip
        if isinstance(output, tuple):  # return_dict=False
            return tuple(None if v is stand_in.logits else v for v in output)
        output["logits"] = None
        return output
