"""The loss head in chunks: ``remat.chunked_cross_entropy(hidden, head, targets)``.

A language model's head turns every token's hidden state into ``vocab`` logits and the loss reads
them once: plain PyTorch keeps the [tokens, vocab] logits (and their fp32 copy) from the forward to
the backward and makes a gradient of the same size there. At a 32k-128k vocabulary that is the
step's peak. ``chunked_cross_entropy`` gives the same loss and gradients with one chunk's logits
live at a time (NOTE [ The chunked head ]).

# NOTE [ The chunked head ]
The forward runs the head chunk by chunk of ``chunk_size`` tokens: logits of the chunk (in the
head's dtype, or autocast's), then in fp32 their log-sum-exp and the target's logit; it keeps only
the hidden states (a view of the caller's), the targets and one fp32 log-sum-exp per token. The
backward recomputes each chunk's logits, turns them into softmax - onehot in place, scales each row
by the incoming gradient of that token's loss, and accumulates the hidden state's, the weight's and
the bias's gradients. So the head's memory is one chunk's logits (about three [chunk, vocab]
buffers in the backward) instead of the [tokens, vocab] logits, their fp32 copy and their gradient;
the price is one more head matmul per step. The per-token losses come out of the custom function
and the reduction (mean over the tokens whose target is not ``ignore_index``, or sum) is plain
autograd after it, so ``reduction="none"`` and any later use of the losses work too. Under autocast
the matmuls run in autocast's dtype in both passes, as the plain ``head(hidden).float()`` does; the
order of the weight gradient's sums differs, so gradients agree to round-off, not bit for bit. The
weight's gradient is summed over the chunks in the weight's own dtype (fp32 for fp32 weights, with
or without autocast; a bf16 weight's is rounded once per chunk, as gradient accumulation over
micro-batches rounds it), never in an fp32 copy of a bf16 weight: at a 128k vocabulary that copy
would outweigh the chunks.

# NOTE [ A planned head ]
The planner treats the head as a part of the step with options (``keep``, ``chunked:<tokens>``).
``chunked_cross_entropy`` is the documented call it recognises: while the profiler runs a step it
notes every head module the call receives (``noting_heads``), and measures the step again with each
chunk size set on that module (``set_head_chunk``); ``remat.apply`` sets the chunk size the plan
chose the same way, and the call reads it in place of its own ``chunk_size``. ``keep`` on a call
the user wrote means the call's own ``chunk_size``. transformers causal LMs get the call without
user code through ``remat.manual.lm_head``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from remat.errors import InvalidType, InvalidValue

__all__ = [
    "chunked_cross_entropy",
    "head_chunk_of",
    "noting_heads",
    "set_head_chunk",
]

_CHUNK_ATTR = "_remat_head_chunk"
_REDUCTIONS = ("mean", "sum", "none")
_noting: list[list[tuple[nn.Module, int]]] = []  # open ``noting_heads`` records (NOTE [ A planned head ])


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module | torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    reduction: str = "mean",
    shift: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy(head(hidden).float(), targets)`` with one chunk of logits live at a time.

    Args:
        hidden: the last hidden states, ``[..., hidden_size]`` (e.g. ``[batch, seq, hidden]``).
        head: the output projection: an ``nn.Linear``-like module (``weight`` ``[vocab, hidden]``,
            optional ``bias``) or the weight tensor itself. Its logits are never kept.
        targets: class indices (int64) of shape ``hidden.shape[:-1]``; ``ignore_index`` marks
            positions that count for nothing.
        chunk_size: tokens per chunk (NOTE [ The chunked head ]); a plan applied with
            ``remat.apply`` overrides it for a head module (NOTE [ A planned head ]).
        ignore_index: as ``F.cross_entropy``'s.
        reduction: ``"mean"`` (over the tokens not ignored, as ``F.cross_entropy``), ``"sum"`` or
            ``"none"`` (one loss per token, 0 where ignored, shaped like ``targets``).
        shift: predict the next token, as transformers' causal-LM loss does: position ``t`` is
            scored against ``targets[..., t + 1]`` and the last position is ignored.

    Loss and gradients (of ``hidden``, the weight and the bias) equal the plain computation's to
    round-off; double backward is not supported.
    """
    weight, bias = _head_params(head)
    _check(hidden, weight, bias, targets, chunk_size, reduction)
    if isinstance(head, nn.Module):
        for record in _noting:
            if all(h is not head for h, _ in record):
                record.append((head, targets.numel()))
        chunk_size = head_chunk_of(head) or chunk_size
    if shift:
        targets = F.pad(targets[..., 1:], (0, 1), value=ignore_index)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    valid = flat_targets != ignore_index
    bad = valid & ((flat_targets < 0) | (flat_targets >= weight.shape[0]))
    if not _is_fake(bad) and bool(bad.any()):
        first = int(flat_targets[bad][0])
        raise InvalidValue(
            f"chunked_cross_entropy: target {first} is out of range for a head of "
            f"{weight.shape[0]} classes; expected 0 <= target < {weight.shape[0]} or "
            f"ignore_index={ignore_index}"
        )
    losses = _ChunkedCE.apply(flat_hidden, weight, bias, flat_targets, valid, chunk_size)
    if reduction == "none":
        return losses.reshape(targets.shape)
    total = losses.sum()
    return total if reduction == "sum" else total / valid.sum()


def _is_fake(t: torch.Tensor) -> bool:
    """A fake tensor (estimated mode) has no values to check."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _head_params(head: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(head, torch.Tensor):
        return head, None
    weight = getattr(head, "weight", None) if isinstance(head, nn.Module) else None
    if not isinstance(weight, torch.Tensor):
        raise InvalidType(
            "chunked_cross_entropy expects head as an nn.Linear-like module (with a weight of "
            f"[vocab, hidden]) or that weight tensor, got {type(head).__name__}"
            + (" without a weight" if isinstance(head, nn.Module) else "")
        )
    bias = getattr(head, "bias", None)
    return weight, bias if isinstance(bias, torch.Tensor) else None


def _check(
    hidden: Any, weight: torch.Tensor, bias: torch.Tensor | None, targets: Any, chunk_size: Any,
    reduction: str,
) -> None:
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        raise InvalidType(
            f"chunked_cross_entropy expects hidden as a floating-point tensor [..., hidden_size], "
            f"got {_describe(hidden)}"
        )
    if not isinstance(targets, torch.Tensor) or targets.dtype != torch.long:
        raise InvalidType(
            f"chunked_cross_entropy expects targets as an int64 tensor of class indices, got "
            f"{_describe(targets)}; convert with targets.long()"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise InvalidValue(
            f"chunked_cross_entropy: the head's weight is {list(weight.shape)}, expected "
            f"[vocab, {hidden.shape[-1]}] for hidden states of size {hidden.shape[-1]}"
        )
    if bias is not None and list(bias.shape) != [weight.shape[0]]:
        raise InvalidValue(f"chunked_cross_entropy: the head's bias is {list(bias.shape)}, "
                           f"expected [{weight.shape[0]}]")  # fmt: skip
    if targets.shape != hidden.shape[:-1]:
        raise InvalidValue(
            f"chunked_cross_entropy: targets of shape {list(targets.shape)} do not match hidden "
            f"states of shape {list(hidden.shape)}; expected targets of shape "
            f"{list(hidden.shape[:-1])} (one class index per hidden state)"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidValue(f"chunk_size must be an int >= 1 (tokens per chunk), got {chunk_size!r}")
    if reduction not in _REDUCTIONS:
        raise InvalidValue(f"reduction must be one of {list(_REDUCTIONS)}, got {reduction!r}")


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).removeprefix('torch.')} tensor of shape {list(x.shape)}"
    return f"a {type(x).__name__}"


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _ChunkedCE(torch.autograd.Function):
    """Per-token losses of a linear head, its logits recomputed in the backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        targets: torch.Tensor, valid: torch.Tensor, chunk_size: int,
    ) -> torch.Tensor:
        ctx.device_type = hidden.device.type
        ctx.autocast = _autocast_state(ctx.device_type)
        ctx.chunk_size = chunk_size
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        losses = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        safe = targets.where(valid, 0)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logits = F.linear(hidden[start:end], weight, bias).float()
            lse[start:end] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[start:end, None]).squeeze(1)
            losses[start:end] = (lse[start:end] - picked).where(valid[start:end], 0.0)
            del logits
        ctx.save_for_backward(hidden, weight, bias, safe, valid, lse)
        return losses

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, bias, safe, valid, lse = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        needs = ctx.needs_input_grad
        grad_hidden = torch.empty_like(hidden) if needs[0] else None
        # In the weight's dtype (NOTE [ The chunked head ]): an fp32 copy of a bf16 head's gradient
        # would cost twice the gradient itself, at a 128k vocabulary more than the chunks.
        grad_weight = torch.zeros_like(weight) if needs[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and needs[2] else None
        scale = grad_losses.float().where(valid, 0.0)
        n, step = hidden.shape[0], ctx.chunk_size
        with torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):
            for start in range(0, n, step):
                end = min(start + step, n)
                h = hidden[start:end]
                logits = F.linear(h, weight, bias)
                g = logits.float().sub_(lse[start:end, None]).exp_()  # softmax, in place
                del logits
                rows = torch.arange(end - start, device=g.device)
                g[rows, safe[start:end]] -= 1.0
                g.mul_(scale[start:end, None])
                g_low = g.to(h.dtype if not enabled else dtype)
                del g
                if grad_hidden is not None:
                    grad_hidden[start:end] = g_low @ weight.to(g_low.dtype)
                if grad_weight is not None and grad_weight.dtype == g_low.dtype:
                    grad_weight.addmm_(g_low.t(), h.to(g_low.dtype))
                elif grad_weight is not None:
                    grad_weight += g_low.t() @ h.to(g_low.dtype)
                if grad_bias is not None:
                    grad_bias += g_low.float().sum(0)
                del g_low
        return (
            grad_hidden,
            grad_weight,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None, None, None,
        )  # fmt: skip


# --- the planner's handles (NOTE [ A planned head ]) -------------------------------------------


@contextlib.contextmanager
def noting_heads() -> Iterator[list[tuple[nn.Module, int]]]:
    """Note every head module ``chunked_cross_entropy`` receives while the block runs, with the
    number of tokens of its first call."""
    record: list[tuple[nn.Module, int]] = []
    _noting.append(record)
    try:
        yield record
    finally:
        _noting.remove(record)


def set_head_chunk(head: nn.Module, chunk_size: int | None) -> None:
    """Make ``chunked_cross_entropy`` run ``head`` in chunks of ``chunk_size`` tokens whatever the
    call says; None takes that back."""
    if chunk_size is None:
        head.__dict__.pop(_CHUNK_ATTR, None)
    else:
        object.__setattr__(head, _CHUNK_ATTR, int(chunk_size))


def head_chunk_of(head: nn.Module) -> int | None:
    """The chunk size a plan set on ``head``, or None."""
    value = head.__dict__.get(_CHUNK_ATTR)
    return int(value) if value is not None else None
