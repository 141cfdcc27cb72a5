"""Where fake steps run: the fake mode with the user's batch real in it (NOTE [ The batch's
values ]), and the model's caches emptied of what the steps put there (NOTE [ A cache the fake steps
fill ]). ``remat.measure.fake`` meters the steps."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import sys
import warnings
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import arg_tree_leaves, tree_flatten, tree_leaves, tree_unflatten

from remat.errors import out_of_memory
from remat.measure.preserve import batch_grads
from remat.units import format_bytes

__all__ = ["FakeSteps"]

log = logging.getLogger(__name__)

aten = torch.ops.aten


# NOTE [ The batch's values ]
# A forward may read the values of its batch: ESM-2 drops its padding mask when no token is padding
# (``if not padding_mask.any()``), transformers' models check whether an attention mask masks
# anything. On a fake batch that raises (``DataDependentOutputException``), the plain step cannot be
# predicted, and a profile below it ran the plain step for real: out of memory in a process that
# cannot hold it, where torch's checkpoint on every layer fits (tests/test_lean.py). So the fake
# steps take the user's batch as it is, real, and an op whose tensors are all real (the batch's, and
# what the model makes of them alone: a mask, a count) runs for real, as in the real step: the
# meter counts what it makes. Every op that meets a fake tensor (a weight) is fake. Not an op that
# writes into a real tensor the steps did not make (the batch is the user's; ``stft`` transposes
# what a real op made in place), nor one that makes a tensor from nothing or from Python data
# (``torch.tensor``: an optimizer's step counter stayed real, and its steps were timed as kernels),
# but ``arange``: positions the model makes from a length, and a small constant (``ones``,
# ``zeros``, ``full``, a window function, of at most ``_CONSTANT_BYTES``): segment-anything's prompt
# encoder pads the batch's point labels with ``-torch.ones`` and writes by ``labels == -1``, and
# ``istft`` checks the envelope of its ``hann_window`` (demucs): on fake constants both raised, and
# the steps were run for real. transformers' Llama
# without its cache makes its ``position_ids`` so, and its mask code asks whether they are packed
# sequences; on a fake ``arange`` it cannot tell (``is_tracing``), builds the causal mask, and SDPA
# repeats K and V: the plain step predicted 3 x [B, S, D] per layer above the real one (helpers 23
# and 25: a peft LoRA Llama's floor named 11% high, and budgets torch's checkpoint meets refused).
# A boolean mask from the batch that selects from what the weights made (a masked language model's
# loss, ``logits[mask]``, or ``masked_select``: x-clip's diagonal of its similarities by an
# ``arange == arange`` mask) gives way to the positions it selects, which fix the output's shape; the
# conversion is a transient of the real kernel too, which the lean steps measure as what no tensor
# holds. A read of what the weights made still raises, and the profile falls back as before. The
# RNG state a real op draws from is put back when the fake steps end. A tensor of the batch that
# requires grad (a physics-informed loss's coordinates) gets a fake gradient in the fake step, and
# ``remat.measure.preserve``'s ``batch_grads`` puts back the one it had; torch's warning that the
# fake mode read ``.grad`` of a real tensor made from it is the fake mode's, not the user's. A fake
# copy's buffer of a few integers is a real copy the steps own (``FakeSteps.real``): performer-pytorch
# reads its call counter (``if calls >= interval``), and the fake step raised where the real one reads it.


@functools.cache
def _writes(func: Any) -> bool:
    """Whether ``func`` writes into one of its arguments."""
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _written(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors ``func`` writes into."""
    named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    return [t for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write
            for t in tree_leaves(named.get(a.name)) if isinstance(t, torch.Tensor)]


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _AsTheRealStep(TorchDispatchMode):
    """What the fake mode does otherwise than the real step, as the real step does it: an op whose
    tensors are all real runs for real (NOTE [ The batch's values ]), a read of what every value
    finite gives is answered (NOTE [ Every value finite ]), outputs only the kernel sizes are sized
    by it (NOTE [ Outputs only the kernel sizes ]), an op the real kernel runs in place runs in
    place (NOTE [ In place where the real kernel is ])."""

    def __init__(self) -> None:
        super().__init__()
        self.finite: dict[int, tuple[weakref.ref[torch.Tensor], bool]] = {}
        """Fake boolean tensors (by id, while they live) whose every element is known where every
        value is finite."""
        self.zeros: weakref.ref[torch.Tensor] | None = None
        """The zeros a backward formula made last (NOTE [ In place where the real kernel is ])."""
        self.made: set[int] = set()
        """The storages (by address) of the real tensors the steps made: never the user's, so a
        write into them runs for real (NOTE [ The batch's values ])."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        if (func in _IN_PLACE and self.zeros is not None and self.zeros() is args[0]
                and torch._C._current_autograd_node() is not None):
            self.zeros = None
            return _IN_PLACE[func](*args, **kwargs)
        tensors = [t for t in arg_tree_leaves(*args, **kwargs) if isinstance(t, torch.Tensor)]
        writes = _writes(func)
        made = bool(tensors) or func._overloadpacket is aten.arange or _small_constant(func, args, kwargs)
        if (made and func not in _LIFTS and not any(isinstance(t, FakeTensor) for t in tensors)
                and (not writes or all(_address(t) in self.made for t in _written(func, args, kwargs)))):
            with unset_fake_temporarily():
                out = func(*args, **kwargs)
            self.made.update(_address(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            return out
        if func in _MASKED and any(_real_mask(i) for i in args[1]):  # ``logits[mask]``: a shape from the mask
            with unset_fake_temporarily():
                indices = [j for i in args[1] for j in (i.nonzero(as_tuple=True) if _real_mask(i) else [i])]
            return func(args[0], indices, *args[2:], **kwargs)
        if func is aten.masked_select.default and _real_mask(args[1]):  # x-clip's diagonal: as ``x[mask]``
            shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
            with unset_fake_temporarily():
                positions = args[1].expand(shape).nonzero(as_tuple=True)
            return aten.index.Tensor(args[0].expand(shape), list(positions))
        if func in _READS and (read := self._known(args[0])) is not None:  # NOTE [ Every value finite ]
            return read
        out = func(*args, **kwargs)
        if func in _ZEROS and torch._C._current_autograd_node() is not None:
            self.zeros = weakref.ref(out)
        if func in _SIZED_BY_THE_KERNEL:  # NOTE [ Outputs only the kernel sizes ]
            return _kernel_sized(func, args, kwargs, out)
        if isinstance(out, FakeTensor) and out.dtype == torch.bool and (known := self._finite(func, args)) is not None:
            self.finite[id(out)] = (weakref.ref(out), known)
        return out

    def _known(self, t: Any) -> bool | None:
        entry = self.finite.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0]() is t else None

    def _finite(self, func: Any, args: Any) -> bool | None:
        """What every element of ``func(*args)`` is where every value is finite, or None (NOTE
        [ Every value finite ])."""
        known = [self._known(a) for a in args[:2]]
        if func in _NEVER:
            return False
        if func in (aten.eq.Tensor, aten.ne.Tensor) and args[0] is args[1]:  # NaN alone differs from itself
            return func is aten.eq.Tensor
        if func in (aten.eq.Scalar, aten.ne.Scalar) and isinstance(args[1], float) and math.isinf(args[1]):
            return func is aten.ne.Scalar
        if func in _NOT and known[0] is not None:
            return not known[0]
        if func in _ALL_OR_ANY and known[0] is not None:
            return known[0]
        if func in _AND_OR and len(known) == 2 and known[0] is not None and known[1] is not None:
            both = func in (aten.mul.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default)
            return (known[0] and known[1]) if both else (known[0] or known[1])
        return None


# NOTE [ Every value finite ]
# A training forward may guard against values that overflowed: DETR's layers clamp their output
# ``if not torch.isfinite(hidden_states).all()``, BART's family in float16 checks ``isinf(...).any()
# or isnan(...).any()``. That reads what the weights made, which fake tensors cannot, and the plain
# step of transformers' DETR could not be predicted (profiled by running it). The fake steps answer
# such a read as a step whose values are all finite does (the step remat plans; a step that
# overflows is broken anyway): the ops run on fake tensors as they are, counted, and the answer
# follows them (``isinf``, ``isnan``: none; ``x == x``: all; ``|x| != inf``: all; and, or, not,
# ``all`` and ``any`` of those), for ``item()`` to read. Any other read still raises.

_READS = frozenset({aten._local_scalar_dense.default, aten.is_nonzero.default})
_NEVER = frozenset({aten.isinf.default, aten.isnan.default, aten.isposinf.default, aten.isneginf.default})
_NOT = frozenset({aten.logical_not.default, aten.bitwise_not.default})
_ALL_OR_ANY = frozenset({aten.all.default, aten.any.default, aten.all.dim, aten.any.dim, aten.all.dims, aten.any.dims})
_AND_OR = frozenset({aten.mul.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default, aten.bitwise_or.Tensor,
                     aten.logical_or.default})


_WINDOWS = (aten.hann_window, aten.hamming_window, aten.blackman_window, aten.bartlett_window, aten.kaiser_window)
_CONSTANTS = frozenset({aten.ones.default, aten.zeros.default, aten.full.default,
                        *(getattr(w, o) for w in _WINDOWS for o in w.overloads())})
_CONSTANT_BYTES = 1 << 20
"""The most bytes of a constant made from nothing that runs for real (NOTE [ The batch's values ]):
masks and paddings, never an activation's buffer."""


def _small_constant(func: Any, args: Any, kwargs: Any) -> bool:
    if func not in _CONSTANTS or torch.device(kwargs.get("device") or "cpu").type != "cpu":
        return False  # a constant for a device this machine may not have stays fake
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    numel = args[0] if isinstance(args[0], int) else math.prod(args[0])  # a window's length, or a size
    return numel * dtype.itemsize <= _CONSTANT_BYTES


_LIFTS = frozenset({aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.lift.default})
"""What ``torch.tensor(data)`` dispatches, its tensor made from Python data: a fake one, as before
(an optimizer's step counters, a model's constants)."""

_MASKED = frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                     aten._index_put_impl_.default})
"""Ops that take a list of indices, which may be boolean masks: one that is real (made from the
batch) gives way to the positions it selects, which fix the output's shape (NOTE [ The batch's
values ])."""


def _real_mask(index: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return (isinstance(index, torch.Tensor) and not isinstance(index, FakeTensor)
            and index.dtype in (torch.bool, torch.uint8))


# NOTE [ Outputs only the kernel sizes ]
# An op's fake kernel gives each output the size its meta function computes; for an output whose
# size only the real kernel knows, that is wrong. oneDNN's LSTM layer (``mkldnn_rnn_layer``, every
# float ``nn.LSTM`` on the CPU) returns a workspace that its backward reads: fake, 0 bytes; real,
# oneDNN's own padded layout (8,015,872 B for 512 steps of 4 x 64). A kept LSTM saves it, so plans
# that kept one were predicted far below their step: encodec's SEANet at 40% of its plain step
# predicted 13,685,672 B, measured 21,529,208 (helper 33). Such an op runs for real once per
# signature (shapes, dtypes, arguments), on zeros, and its fake outputs take the real sizes: the
# real step runs that op at those shapes anyway. Not where its arguments take more than
# ``_REAL_RUN_BYTES`` (a model planned for a device this machine is not, on a laptop): there the
# meta's sizes stand, and a warning says what is left out.

_REAL_RUN_BYTES = 256 * 2**20

_SIZED_BY_THE_KERNEL = frozenset({aten.mkldnn_rnn_layer.default})
_LEFT_OUT: set[Any] = set()
"""Those of ``_SIZED_BY_THE_KERNEL`` a warning said were too large to run, once per op."""


def _kernel_sized(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """``out``, each fake output with the size and dtype the real kernel gives it (NOTE [ Outputs
    only the kernel sizes ]); as it is where the real op cannot run."""
    from torch._subclasses.fake_tensor import FakeTensor

    leaves, spec = tree_flatten((args, kwargs))
    key = tuple(_Zeros(tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else t for t in leaves)
    if (nbytes := sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))) > _REAL_RUN_BYTES:
        if func not in _LEFT_OUT:
            _LEFT_OUT.add(func)
            log.warning("remat: %s's outputs are sized as its meta function sizes them (its workspace: 0 B), not by "
                        "running it on zeros, which would take %s: plans that keep it are predicted below their "
                        "step by its workspace", func, format_bytes(nbytes))
        return out
    try:
        sizes = _real_sizes(func, key, spec, torch.is_grad_enabled())
    except Exception as e:  # the real kernel refused these arguments: the meta's sizes
        if out_of_memory(e):  # the host's, as a fake step's own (NOTE [ Planning what does not fit ])
            raise
        return out
    outs, out_spec = tree_flatten(out)
    for i, (fake, size) in enumerate(zip(outs, sizes)):
        if isinstance(fake, FakeTensor) and size is not None and (fake.numel(), fake.dtype) != size:
            outs[i] = torch.empty(size[0], dtype=size[1], device=fake.device)  # fake: the fake mode is below
    return tree_unflatten(outs, out_spec)


@dataclasses.dataclass(frozen=True)
class _Zeros:
    """A tensor argument, as the real op runs on it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@functools.lru_cache(maxsize=64)
def _real_sizes(func: Any, key: tuple[Any, ...], spec: Any, grad: bool) -> tuple[tuple[int, torch.dtype] | None, ...]:
    """(elements, dtype) of each output of ``func`` run for real on zeros of ``key``'s shapes, with
    gradients on or off (oneDNN's LSTM makes its workspace only with them on)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.set_grad_enabled(grad):
        leaves = [torch.zeros(k.shape, dtype=k.dtype, device=k.device) if isinstance(k, _Zeros) else k for k in key]
        args, kwargs = tree_unflatten(leaves, spec)
        return tuple((t.numel(), t.dtype) if isinstance(t, torch.Tensor) else None
                     for t in tree_leaves(func(*args, **kwargs)))


# NOTE [ In place where the real kernel is ]
# Some backward formulas take an out-of-place op where a tensor is a subclass (for composite
# compliance) and an in-place one otherwise: torch's ``gather_backward`` makes zeros the size of the
# gathered tensor and, on real tensors, ``scatter_add_``s the gradient into them; on fake ones it
# ``scatter_add``s into a second buffer of that size. native-sparse-attention gathers from an
# expanded [B, T, T, d] per layer: the fake backward peaked 16 MiB a layer above the real one, and
# ``auto`` refused torch's every-block peak, naming a floor above the plain step (helper 34). In a
# backward, such an op on the zeros its formula made last runs in place on them, as the real one.

_IN_PLACE = {aten.scatter_add.default: aten.scatter_add_.default, aten.index_add.default: aten.index_add_.default,
             aten.index_put.default: aten.index_put_.default, aten.put.default: aten.put_.default}
"""Out-of-place ops a backward formula takes on a subclass, and what it takes on real tensors."""
_ZEROS = frozenset({aten.new_zeros.default, aten.zeros.default, aten.zeros_like.default})


# NOTE [ A cache the fake steps fill ]
# Model code may keep what it builds in a process-wide cache (``functools.lru_cache``: transformers'
# BEiT relative position index, DETR's position embedding). A fake step fills it with fake tensors,
# and the next real step reads one back: after ``remat.auto`` on a fresh BEiT the user's own step
# failed (``DataDependentOutputException``), and so did remat's verify. Fake steps run in
# ``FakeSteps``, which afterwards empties every LRU cache the model's code reaches (its
# classes' methods and modules, one closure deep: transformers' ``compile_compatible_method_lru_cache``)
# that they added to; a cache holds nothing its function cannot make again.


_NON_LEAF_GRAD = "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"
"""What torch warns when its fake mode converts a real tensor made from one that requires grad."""


class FakeSteps:
    """A fake mode to run steps in: entered, the mode is on; left, the LRU caches the model's code
    reaches that the steps added to are emptied (``watch`` notes them first), and the batch's
    gradients are as they were."""

    def __init__(self, mode: Any, batch: Any = None) -> None:
        self.mode = mode
        self.batch = batch
        """The user's batch, whose tensors' gradients are put back when the steps end."""
        self.misses: dict[int, tuple[Any, int]] = {}

    def watch(self, model: torch.nn.Module) -> None:
        """Note the caches ``model``'s code reaches, as they are now."""
        for cache in _lru_caches(model):
            self.misses.setdefault(id(cache), (cache, cache.cache_info().misses))

    def __enter__(self) -> FakeSteps:
        self._stack = contextlib.ExitStack()
        devices = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
        self._stack.enter_context(torch.random.fork_rng(devices=devices))  # NOTE [ The batch's values ]
        self._stack.enter_context(batch_grads(self.batch))
        self._stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=_NON_LEAF_GRAD, category=UserWarning)
        self._stack.enter_context(self.mode)
        self._as_real = self._stack.enter_context(_AsTheRealStep())
        return self

    def real(self, t: torch.Tensor) -> torch.Tensor:
        """A real copy of ``t`` that the steps own, so that they write into it for real (a fake
        copy's counter: NOTE [ The batch's values ])."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            copy = t.detach().clone()
        self._as_real.made.add(_address(copy))
        return copy

    def __exit__(self, *exc: Any) -> None:
        try:
            self._stack.__exit__(*exc)
        finally:
            for cache, misses in self.misses.values():
                if cache.cache_info().misses != misses:
                    cache.cache_clear()
                    self.misses[id(cache)] = (cache, cache.cache_info().misses)


def _lru_caches(model: torch.nn.Module) -> list[Any]:
    found: dict[int, Any] = {}

    def add(obj: Any, depth: int = 0) -> None:
        try:  # a module's global may raise anything on access (MONAI's placeholder for an optional import)
            obj = getattr(obj, "__func__", obj)  # a staticmethod's or classmethod's function
            cache = hasattr(obj, "cache_info") and hasattr(obj, "cache_clear")
        except Exception:
            return
        if cache:
            found[id(obj)] = obj
        elif depth < 2 and callable(obj):
            for cell in getattr(obj, "__closure__", None) or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    add(cell.cell_contents, depth + 1)

    modules = set()
    for cls in {c for m in model.modules() for c in type(m).__mro__}:
        if cls.__module__.split(".")[0] in ("torch", "builtins"):
            continue
        for value in vars(cls).values():
            add(value)
        modules.add(cls.__module__)
    for name in modules:
        for value in vars(sys.modules[name]).values() if name in sys.modules else ():
            add(value)
    return list(found.values())
