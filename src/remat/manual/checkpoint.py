"""The manual tool: ``x3 = remat.checkpoint(layer3, x2)``, a sequential form, and a module form.

torch's non-reentrant ``torch.utils.checkpoint`` is the engine (RNG replay for dropout, autocast
state, kwargs, nested and non-tensor inputs/outputs, inputs that do not require grad, double
backward). remat adds what it gets wrong or leaves to the user:

- BatchNorm running statistics are updated once per step, not twice (NOTE [ BatchNorm in recompute ]).
- ``torch.no_grad()``, ``inference_mode`` and modules in ``eval()`` run the layer plainly: nothing
  to recompute, so no checkpoint bookkeeping (RNG stash, hooks) at all.
- Selective recomputation (keep the outputs of matmuls, convolutions and attention; recompute cheap
  ops) and offloading saved tensors to host memory, as options of the same call.
- Misuse is an error that says what was expected.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)
from torch.utils.checkpoint import (
    checkpoint as _torch_checkpoint,
)

from remat.errors import InvalidType, InvalidValue
from remat.records import CHECKPOINT_OPTIONS, CheckpointOption

__all__ = [
    "MODES",
    "SAVE_OPS",
    "checkpoint",
    "checkpoint_call",
    "checkpoint_module",
    "checkpoint_sequential",
    "default_policy",
    "is_checkpointed",
    "uncheckpoint_module",
]

log = logging.getLogger(__name__)

#: How a checkpointed call keeps what backward needs.
MODES = CHECKPOINT_OPTIONS  # NOTE [ One option vocabulary ] in remat.records


def _aten_ops(*names: str) -> frozenset[Any]:
    # Some kernels exist only in some builds (flash/cudnn attention): take the ones this torch has.
    ops: set[Any] = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.update(getattr(packet, o) for o in packet.overloads())
    return frozenset(ops)


#: Ops whose outputs the default selective policy keeps: the expensive ones (matmuls, convolutions,
#: attention). Everything else (pointwise, norms, softmax, dropout) is recomputed.
SAVE_OPS: frozenset[Any] = _aten_ops(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def default_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective policy: keep the outputs of ``SAVE_OPS``, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# NOTE [ BatchNorm in recompute ]
# A BatchNorm in training mode updates its running statistics as a side effect of its forward.
# Plain torch checkpointing runs that forward twice (once in the forward pass, once when the
# backward recomputes it), so running_mean/var move twice and num_batches_tracked counts twice
# (pytorch issue 96136). The normalisation uses the batch's statistics in training mode, never the
# running ones, so undoing the second update changes no output. While a recompute runs, a global
# forward pre-hook (registered for that recompute only, so it works for any callable) snapshots the
# running statistics of every _NormBase module before its forward; when the recompute ends, even
# when torch stops it early after the last needed tensor, the snapshots are written back.
# (Switching track_running_stats off instead would change which tensors batch_norm saves, and
# torch's checkpoint rightly refuses a recompute that saves a different set.)


class _RestoreRunningStats:
    def __init__(self, root: nn.Module | None) -> None:
        # The root module's own forward is called directly (not through __call__) by
        # checkpoint_module, so global hooks do not see it: snapshot its tree up front.
        self._root = root
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._handle: Any = None

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.training:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                buf = getattr(module, name, None)
                if isinstance(buf, torch.Tensor):
                    # Outside any dispatch mode: selective checkpointing's recompute mode would
                    # take this clone for an op of the block and refuse it.
                    with _disable_current_modes():
                        self._saved.append((buf, buf.detach().clone()))

    def __enter__(self) -> None:
        if self._root is not None:
            for module in self._root.modules():
                self._pre_hook(module, None)
        self._handle = nn.modules.module.register_module_forward_pre_hook(self._pre_hook)

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()
        with torch.no_grad(), _disable_current_modes():
            for buf, value in reversed(self._saved):
                buf.copy_(value)
        self._saved.clear()


class _Recompute:
    """The recompute context: torch's (selective) one, and the BatchNorm restore around it.

    A module-level class on purpose: a class defined per call sits in a reference cycle (every
    class does) that would keep the selective cache of saved outputs alive until Python's cyclic
    garbage collector runs, after the block's backward."""

    def __init__(self, rec: Any, root: nn.Module | None) -> None:
        self._rec = rec
        self._root = root
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self._rec)
        self._stack.enter_context(_RestoreRunningStats(self._root))

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


def _contexts(mode: str, policy: Any, fn: Any = None) -> Callable[[], tuple[Any, Any]]:
    root = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    root = root if isinstance(root, nn.Module) else None

    def make() -> tuple[Any, Any]:
        if mode == "selective":
            fwd, rec = create_selective_checkpoint_contexts(policy or default_policy)
        else:
            fwd, rec = contextlib.nullcontext(), contextlib.nullcontext()
        return fwd, _Recompute(rec, root)

    return make


def _runs_plainly(fn: Callable[..., Any]) -> bool:
    if not torch.is_grad_enabled():  # also off under inference_mode
        return True
    module = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    return isinstance(module, nn.Module) and not module.training


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    ``x3 = remat.checkpoint(layer3, x2)`` behaves like ``x3 = layer3(x2)`` (same outputs, same
    gradients, same random numbers for dropout, BatchNorm statistics updated once) but keeps only
    the inputs until the backward pass. Every keyword argument goes to ``fn``; for the other modes
    use ``checkpoint_call``.
    """
    return checkpoint_call(fn, args, kwargs)


def checkpoint_call(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    mode: CheckpointOption = "recompute",
    policy: Callable[..., Any] | Iterable[Any] | None = None,
) -> Any:
    """``checkpoint`` with its options spelled out, so that no name is taken from ``fn``'s kwargs.

    Args:
        fn: a module or any callable.
        args, kwargs: what ``fn`` is called with.
        mode: ``"recompute"`` (keep the inputs only), ``"selective"`` (also keep the outputs of
            matmuls/convolutions/attention, recompute the cheap ops), ``"offload"`` (run plainly,
            but move everything saved to host memory until backward), ``"recompute_offload"``
            (keep only the inputs, in host memory).
        policy: for ``mode="selective"``, a torch selective-checkpoint policy
            ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` or a collection of aten ops to keep.
    """
    kwargs = kwargs or {}
    if not callable(fn):
        raise InvalidType(
            f"remat.checkpoint expects a module or a callable as its first argument, got "
            f"{type(fn).__name__}; write remat.checkpoint(layer, x), not remat.checkpoint(x, layer)"
        )
    if mode not in MODES:
        raise InvalidValue(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if policy is not None and mode != "selective":
        raise InvalidValue(f"policy= applies to mode='selective' only, got mode={mode!r}")
    if _runs_plainly(fn):
        return fn(*args, **kwargs)
    if policy is not None and not callable(policy):
        policy = _policy_from_ops(policy)
    if mode == "offload":
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return fn(*args, **kwargs)
    if torch.compiler.is_compiling() and mode in ("recompute", "selective"):
        # NOTE [ Under torch.compile ]: dynamo accepts no closure as context_fn, and the
        # partitioner does the recompute itself (BatchNorm buffers are functionalized: updated once).
        if mode == "recompute":
            return _torch_checkpoint(fn, *args, use_reentrant=False, **kwargs)
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy or default_policy)
        return _torch_checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    if mode == "recompute_offload":
        return _recompute_offloaded(fn, tuple(args), kwargs)
    return _torch_checkpoint(
        fn,
        *args,
        use_reentrant=False,
        context_fn=_contexts(mode, policy, fn),  # type: ignore[arg-type]
        **kwargs,
    )


def _policy_from_ops(ops: Iterable[Any]) -> Callable[..., CheckpointPolicy]:
    keep = frozenset(ops)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


# NOTE [ Recompute with offloaded inputs ]
# Non-reentrant checkpointing keeps the block's inputs alive through the closure that recomputes
# it. To keep them in host memory instead, the checkpointed function receives host copies and moves
# them back to the device itself: the forward pays one device->host->device round trip per input,
# the recompute one host->device copy, and the device holds nothing of the block between forward
# and backward. Only tensors on an accelerator are moved; CPU tensors pass through unchanged.


def _recompute_offloaded(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    def to_host(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            return (x.to("cpu", non_blocking=True), x.device)
        return x

    def back(x: Any) -> Any:
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.device):
            return x[0].to(x[1], non_blocking=True)
        return x

    host_args = [to_host(a) for a in args]
    host_kwargs = {k: to_host(v) for k, v in kwargs.items()}

    def run(*_: Any) -> Any:
        return fn(*[back(a) for a in host_args], **{k: back(v) for k, v in host_kwargs.items()})

    return _torch_checkpoint(run, use_reentrant=False, context_fn=_contexts("recompute", None))


def checkpoint_sequential(
    blocks: nn.Sequential | Sequence[Callable[..., Any]],
    x: Any,
    *,
    segments: int,
    mode: CheckpointOption = "recompute",
) -> Any:
    """Run ``blocks`` one after another on ``x`` in ``segments`` checkpointed segments.

    Each segment keeps only its input; the last segment is checkpointed too (unlike
    ``torch.utils.checkpoint.checkpoint_sequential``, which keeps the last one), so the memory
    saving is what the segment count says.
    """
    items = list(blocks.children()) if isinstance(blocks, nn.Sequential) else list(blocks)
    if not items:
        raise InvalidValue("checkpoint_sequential got no blocks; pass an nn.Sequential or a list of callables")
    for i, item in enumerate(items):
        if not callable(item):
            raise InvalidType(f"block {i} is a {type(item).__name__}, not a module or callable")
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= len(items):
        raise InvalidValue(
            f"segments must be an int between 1 and the number of blocks ({len(items)}), got {segments!r}"
        )
    bounds = [round(i * len(items) / segments) for i in range(segments + 1)]

    def run_segment(start: int, stop: int, inp: Any) -> Any:
        for item in items[start:stop]:
            inp = item(inp)
        return inp

    for start, stop in itertools.pairwise(bounds):
        seg = functools.partial(run_segment, start, stop)
        x = checkpoint_call(seg, (x,), mode=mode) if _any_training(items[start:stop]) else seg(x)
    return x


def _any_training(items: Sequence[Any]) -> bool:
    modules = [m for m in items if isinstance(m, nn.Module)]
    return not modules or any(m.training for m in modules)


# --- the module form ----------------------------------------------------------------------------

_ORIGINAL = "_remat_original_forward"


def checkpoint_module(
    module: nn.Module,
    *,
    mode: CheckpointOption = "recompute",
    policy: Callable[..., Any] | Iterable[Any] | None = None,
) -> nn.Module:
    """Make every call of ``module`` checkpointed, in place; returns the same module.

    Nothing about the module changes but its ``forward``: parameter names, ``state_dict`` keys,
    ``named_modules``, hooks and ``train()/eval()`` are those of the original. In ``eval()`` or under
    ``no_grad`` it runs plainly. ``uncheckpoint_module`` undoes it. Calling it again replaces the
    mode.
    """
    if not isinstance(module, nn.Module):
        raise InvalidType(f"checkpoint_module expects an nn.Module, got {type(module).__name__}")
    if mode not in MODES:
        raise InvalidValue(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    uncheckpoint_module(module)
    original = module.forward
    object.__setattr__(module, _ORIGINAL, original)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not module.training:
            return original(*args, **kwargs)
        return checkpoint_call(original, args, kwargs, mode=mode, policy=policy)

    forward._remat_mode = mode  # type: ignore[attr-defined]
    object.__setattr__(module, "forward", forward)
    return module


def uncheckpoint_module(module: nn.Module) -> nn.Module:
    """Undo ``checkpoint_module``: the module's own ``forward`` again. A no-op on a plain module."""
    if _ORIGINAL in module.__dict__:
        del module.__dict__["forward"]
        original = module.__dict__.pop(_ORIGINAL)
        # An instance-level forward that existed before remat (rare) is put back as it was.
        bound_to_class = getattr(original, "__func__", None) is type(module).forward
        if getattr(original, "__self__", None) is not module or not bound_to_class:
            object.__setattr__(module, "forward", original)
    return module


def is_checkpointed(module: nn.Module) -> str | None:
    """The mode ``module`` is checkpointed with, or None."""
    if _ORIGINAL not in module.__dict__:
        return None
    return getattr(module.__dict__["forward"], "_remat_mode", None)
