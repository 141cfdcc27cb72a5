"""The manual tool: ``x3 = remat.checkpoint(layer3, x2)``, a sequential form, and a module form.

torch's non-reentrant ``torch.utils.checkpoint`` is the engine (RNG replay for dropout, autocast
state, kwargs, nested and non-tensor inputs/outputs, inputs that do not require grad, double
backward), with torch's options taken with torch's meaning (NOTE [ torch's option names ] in
``_options``). remat adds what it gets wrong or leaves to the user:

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
from torch.utils.checkpoint import checkpoint as _torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from remat.errors import InvalidType, InvalidValue
from remat.manual.batchnorm import RestoreRunningStats, module_roots
from remat.manual.buffer_writes import ForwardWrites, ReplayWrites
from remat.manual.contexts import stop_passes_through, uncached_casts
from remat.manual.policy import SAVE_OPS, default_policy, resolve_policy
from remat.manual.torch_options import TORCH_OPTIONS, TorchOptions, pop_torch_options, torch_options
from remat.vocabulary import CHECKPOINT_OPTIONS, CheckpointOption

__all__ = [
    "MODES",
    "SAVE_OPS",
    "TORCH_OPTIONS",
    "checkpoint",
    "checkpoint_call",
    "checkpoint_sequential",
    "default_policy",
]

log = logging.getLogger(__name__)

#: How a checkpointed call keeps what backward needs.
MODES = CHECKPOINT_OPTIONS  # NOTE [ One option vocabulary ] in remat.vocabulary


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    ``x3 = remat.checkpoint(layer3, x2)`` behaves like ``x3 = layer3(x2)`` (same outputs, same
    gradients, same random numbers for dropout, BatchNorm statistics updated once) but keeps only
    the inputs until the backward pass.

    NOTE [ Keywords ]: a drop-in for ``torch.utils.checkpoint.checkpoint(fn, *args,
    use_reentrant=False, **kwargs)``. torch's option keywords (``use_reentrant=False``,
    ``preserve_rng_state``, ``determinism_check``, ``debug``, ``early_stop``, ``context_fn``) are
    torch's options, with torch's meaning, under grad, ``no_grad``, ``inference_mode`` and
    ``eval()`` alike; every other keyword goes to ``fn``. ``use_reentrant=True`` is refused. If
    ``fn`` declares a parameter named like one of torch's options, passing it here is refused
    (torch would silently take it); pass it with ``checkpoint_call(fn, args, kwargs)``, whose
    ``kwargs`` all go to ``fn``. remat's own options (``mode``, ``policy``) are ``checkpoint_call``'s.
    """
    options = pop_torch_options(fn, kwargs)
    return checkpoint_call(fn, args, kwargs, **options)


def checkpoint_call(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    mode: CheckpointOption = "recompute",
    policy: Callable[..., Any] | Iterable[Any] | None = None,
    allow_cache_entry_mutation: bool = False,
    use_reentrant: bool | None = None,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
) -> Any:
    """``checkpoint`` with its options spelled out, so that no name is taken from ``fn``'s kwargs.

    Args:
        fn: a module or any callable.
        args, kwargs: what ``fn`` is called with; every key of ``kwargs`` goes to ``fn``.
        mode: ``"recompute"`` (keep the inputs only), ``"selective"`` (also keep the outputs of
            matmuls/convolutions/attention, recompute the cheap ops), ``"offload"`` (run plainly,
            but move everything saved to host memory until backward), ``"recompute_offload"``
            (keep only the inputs, in host memory).
        policy: for ``mode="selective"``, a torch selective-checkpoint policy
            ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` or a collection of ops to keep
            (``torch.ops.aten.mm.default``; a packet ``torch.ops.aten.mm`` is refused, as by torch).
        allow_cache_entry_mutation: for ``mode="selective"``, as torch's
            ``create_selective_checkpoint_contexts``: allow in-place changes of a kept output.
        use_reentrant, preserve_rng_state, determinism_check, debug, early_stop, context_fn:
            torch's checkpoint options, with torch's meaning (``use_reentrant=True`` is refused).
            In ``offload`` mode nothing is recomputed, so only ``context_fn``'s forward context acts.
    """
    if not callable(fn):
        raise InvalidType(
            f"remat.checkpoint expects a module or a callable as its first argument, got "
            f"{type(fn).__name__}; write remat.checkpoint(layer, x), not remat.checkpoint(x, layer)"
        )
    options = torch_options(
        use_reentrant=use_reentrant,
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        debug=debug,
        early_stop=early_stop,
        context_fn=context_fn,
    )
    policy_fn = check_mode(mode, policy, allow_cache_entry_mutation)
    return run(fn, tuple(args), dict(kwargs or {}), mode, policy_fn, allow_cache_entry_mutation, options)


def check_mode(mode: str, policy: Any, allow_cache_entry_mutation: bool) -> Callable[..., Any] | None:
    """Validate remat's own options; the selective policy function, or None for other modes."""
    if mode not in MODES:
        raise InvalidValue(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if not isinstance(allow_cache_entry_mutation, bool):
        raise InvalidType(f"allow_cache_entry_mutation must be True or False, got {allow_cache_entry_mutation!r}")
    if mode != "selective":
        if policy is not None:
            raise InvalidValue(f"policy= applies to mode='selective' only, got mode={mode!r}")
        if allow_cache_entry_mutation:
            raise InvalidValue(f"allow_cache_entry_mutation= applies to mode='selective' only, got mode={mode!r}")
        return None
    return resolve_policy(policy)


def _runs_plainly(fn: Callable[..., Any]) -> bool:
    if not torch.is_grad_enabled():  # also off under inference_mode
        return True
    module = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    return isinstance(module, nn.Module) and not module.training


def run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mode: str,
    policy: Callable[..., Any] | None,
    allow_cache_entry_mutation: bool,
    options: TorchOptions,
) -> Any:
    """The checkpointed call, its options validated (``checkpoint_call`` and the module form)."""
    if _runs_plainly(fn) or mode == "offload":
        # Nothing recomputed: torch's checks and the user's forward context, as torch does them.
        offload = mode == "offload" and torch.is_grad_enabled() and not _runs_plainly(fn)
        with options.forward_context():
            if offload:
                with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
    torch_kwargs = options.torch_kwargs()
    if torch.compiler.is_compiling() and mode in ("recompute", "selective"):
        # NOTE [ Under torch.compile ]: dynamo accepts only a pair of dispatch modes from
        # context_fn, and the partitioner does the recompute itself (BatchNorm buffers are
        # functionalized: updated once). So remat's selective contexts are torch's own here.
        if mode == "selective":
            if options.context_fn is not None:
                raise InvalidValue(
                    "under torch.compile, mode='selective' and context_fn= cannot be combined: "
                    "torch.compile takes one pair of dispatch modes. Pass the ops to keep as policy="
                )
            torch_kwargs["context_fn"] = functools.partial(
                create_selective_checkpoint_contexts, policy, allow_cache_entry_mutation
            )
        if options.context_fn is None and mode == "recompute":
            del torch_kwargs["context_fn"]  # dynamo takes only a function or partial it can see
        if set(kwargs) & {*TORCH_OPTIONS, "function"}:  # fn's own, not torch's: bind them
            fn, kwargs = functools.partial(fn, **kwargs), {}
        return _torch_checkpoint(fn, *args, use_reentrant=False, **torch_kwargs, **kwargs)
    if mode == "recompute_offload":
        return _recompute_offloaded(fn, args, kwargs, torch_kwargs)
    # NOTE [ One tensor, passed twice ]
    # 1. torch's checkpoint saves each argument for the recompute as its own saved tensor. Under a
    #    saved-tensor hook of the caller's (``save_on_cpu``, a memory tracer's), they unpack as
    #    distinct objects, so ``mha(q, x, x)`` recomputes with ``key is not value``: torch's
    #    MultiheadAttention then projects key and value apart, and torch raises that the recompute
    #    saved other shapes (SigLIP's pooling head, torch 2.13; tests/test_checkpoint.py).
    # 2. So an argument that is the object of an earlier one is passed once, and the repeat
    #    rebuilt from it on every call: the recompute sees the identities the forward saw.
    first: dict[int, int] = {}  # id -> the position it first came at
    same = {i: first.setdefault(id(a), i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    same = {i: j for i, j in same.items() if j != i}
    staged = _Staged(fn, kwargs, policy, allow_cache_entry_mutation, args, same)
    distinct = [None if i in same else a for i, a in enumerate(args)]
    return _torch_checkpoint(staged, *distinct, use_reentrant=False, **torch_kwargs)


# NOTE [ remat's contexts inside torch's ]
# torch's checkpoint takes one context_fn, and refuses one in debug mode (it brings its own). So
# remat never passes its own contexts there: the user's context_fn (or none) goes to torch as it
# is, and remat's contexts (the selective caching modes, the BatchNorm restore) are entered by the
# checkpointed function itself. torch calls that function once in the forward and again for each
# recompute, so its first call is the forward: remat's forward context wraps it, and its recompute
# context wraps every later call. Both sit inside torch's (and the user's) contexts, where torch
# would have entered them. The user's kwargs are bound into the function too, so that torch never
# sees them: a kwarg of fn named like a torch option reaches fn.


class _Staged:
    """``fn`` with its kwargs bound, under remat's forward context on its first call and its
    recompute context after (NOTE [ remat's contexts inside torch's ]).

    A module-level class on purpose: a class defined per call sits in a reference cycle (every
    class does) that would keep the selective cache of saved outputs alive until Python's cyclic
    garbage collector runs, after the block's backward."""

    def __init__(
        self, fn: Callable[..., Any], kwargs: dict[str, Any], policy: Any, allow_mutation: bool, args: Any,
        same: dict[int, int],
    ) -> None:
        self.fn, self.kwargs, self.same = fn, kwargs, same  # NOTE [ One tensor, passed twice ]
        # Modules among the arguments, found now: holding the arguments themselves would keep
        # the inputs alive past torch's own saved (and maybe packed) copies.
        self.arg_roots = module_roots(args)
        self.started = False
        self.written: list[tuple[str, torch.Tensor]] = []  # NOTE [ A buffer the forward writes ]
        self.fwd: Any = contextlib.nullcontext()
        self.rec: Any = contextlib.nullcontext()
        if policy is not None:
            self.fwd, self.rec = create_selective_checkpoint_contexts(policy, allow_mutation)

    def __call__(self, *args: Any) -> Any:
        if self.same:
            args = tuple(args[self.same[i]] if i in self.same else a for i, a in enumerate(args))
        roots = module_roots(self.fn, self.kwargs) + self.arg_roots
        if not self.started:
            self.started = True
            with self.fwd, uncached_casts(), ForwardWrites(roots) as writes:
                out = self.fn(*args, **self.kwargs)
            self.written = writes.written
            return out
        with self.rec, RestoreRunningStats(roots), ReplayWrites(self.written, _named(self.fn)), stop_passes_through():
            return self.fn(*args, **self.kwargs)


def _named(fn: Callable[..., Any]) -> str:
    """``fn`` as an error names it: a module's class, else the function's name."""
    module = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if isinstance(module, nn.Module):
        return f"the checkpointed {type(module).__name__}"
    return f"the checkpointed {getattr(fn, '__qualname__', type(fn).__name__)}"


# NOTE [ Recompute with offloaded inputs ]
# Non-reentrant checkpointing keeps the block's inputs alive through the closure that recomputes
# it. To keep them in host memory instead, the checkpointed function receives host copies and moves
# them back to the device itself: the forward pays one device->host->device round trip per input,
# the recompute one host->device copy, and the device holds nothing of the block between forward
# and backward. Only tensors on an accelerator are moved; CPU tensors pass through unchanged. An
# empty tensor on each of the inputs' devices is the checkpoint's only argument, so that torch
# stashes and replays those devices' RNG states (it finds the devices from the arguments).


class _OnHost:
    __slots__ = ("device", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.device = tensor.to("cpu", non_blocking=True), tensor.device


def _to_host(x: Any) -> Any:
    return _OnHost(x) if isinstance(x, torch.Tensor) and x.device.type != "cpu" else x


def _back(x: Any) -> Any:
    return x.tensor.to(x.device, non_blocking=True) if isinstance(x, _OnHost) else x


def _run_offloaded(fn: Callable[..., Any], host_args: list[Any], host_kwargs: dict[str, Any], *_: Any) -> Any:
    return fn(*[_back(a) for a in host_args], **{k: _back(v) for k, v in host_kwargs.items()})


def _recompute_offloaded(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], torch_kwargs: dict[str, Any]
) -> Any:
    host_args = [_to_host(a) for a in args]
    host_kwargs = {k: _to_host(v) for k, v in kwargs.items()}
    devices = {a.device for a in [*host_args, *host_kwargs.values()] if isinstance(a, _OnHost)}
    markers = [torch.empty(0, device=d) for d in sorted(devices, key=str)]
    run_fn = functools.partial(_run_offloaded, fn, host_args, host_kwargs)
    staged = _Staged(run_fn, {}, None, False, (), {})
    return _torch_checkpoint(staged, *markers, use_reentrant=False, **torch_kwargs)


def checkpoint_sequential(
    functions: nn.Sequential | Sequence[Callable[..., Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    *,
    preserve_rng_state: bool = True,
    checkpoint_last: bool = False,
    mode: CheckpointOption = "recompute",
) -> Any:
    """Run ``functions`` one after another on ``input``, in ``segments`` segments.

    NOTE [ checkpoint_sequential ]: by default, torch's semantics and signature
    (``torch.utils.checkpoint.checkpoint_sequential(functions, segments, input,
    use_reentrant=False, preserve_rng_state=...)``): the blocks are cut into segments of
    ``len // segments`` blocks, the last one taking the rest; every segment but the last is
    checkpointed (keeps only its input), and the last runs plainly, so nothing of it is re-run.
    ``checkpoint_last=True`` is remat's variant: segments of near-equal length, every one
    checkpointed, the last included, so that the memory saving is what the segment count says,
    at the cost of re-running one more segment. ``mode`` (remat's modes) applies to the
    checkpointed segments. ``use_reentrant=True`` is refused.
    """
    items = list(functions.children()) if isinstance(functions, nn.Sequential) else list(functions)
    if not items:
        raise InvalidValue("checkpoint_sequential got no blocks; pass an nn.Sequential or a list of callables")
    for i, item in enumerate(items):
        if not callable(item):
            raise InvalidType(f"block {i} is a {type(item).__name__}, not a module or callable")
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= len(items):
        raise InvalidValue(
            f"segments must be an int between 1 and the number of blocks ({len(items)}), got {segments!r}"
        )
    options = torch_options(use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state)
    policy = check_mode(mode, None, False)
    if checkpoint_last:
        bounds = [round(i * len(items) / segments) for i in range(segments + 1)]
    else:
        size = len(items) // segments
        bounds = [i * size for i in range(segments)] + [len(items)]
    for i, (start, stop) in enumerate(itertools.pairwise(bounds)):
        seg = functools.partial(_run_blocks, items[start:stop])
        last = i == segments - 1
        if (last and not checkpoint_last) or not _any_training(items[start:stop]):
            input = seg(input)
        else:
            input = run(seg, (input,), {}, mode, policy, False, options)
    return input


def _run_blocks(blocks: Sequence[Callable[..., Any]], x: Any) -> Any:
    for block in blocks:
        x = block(x)
    return x


def _any_training(items: Sequence[Any]) -> bool:
    modules = [m for m in items if isinstance(m, nn.Module)]
    return not modules or any(m.training for m in modules)
