"""Estimated mode: the step runs on fake tensors; bytes are exact, times come from a roofline.

# NOTE [ Fake tensors on the CPU device ]
The model is built and run inside ``FakeTensorMode`` on the *CPU* device: every op computes only
shapes, dtypes and strides, nothing is allocated, so a 7B model "runs" on a laptop. Two traps:
fake *CUDA* tensors abort the process on a CPU build once autograd touches them, and the *meta*
device takes the math SDPA path (it materialises the S x S attention matrix) and overstates
attention memory about 4x. On fake CPU, SDPA takes the flash-attention-for-CPU kernel, whose saved
tensors (output, logsumexp) match the GPU flash/cuDNN kernels'.

Bytes: a dispatch mode sees every op's outputs; a new storage is counted when it appears and
uncounted when it is freed (a weakref on the storage, as torch's own MemTracker does), each
storage once. Kernel workspaces are invisible here (they are not tensors), which is why estimated
and measured CPU bytes can differ by a kernel's scratch space.

Building the model there: a factory may convert it (``.to(torch.bfloat16)``, ``.half()``), as users
write. See NOTE [ Converting fake parameters ].

Time: each kernel costs max(FLOPs / peak FLOP/s, bytes moved / bandwidth) + a launch overhead, with
FLOPs from torch's FlopCounterMode registry and the peaks derated by ``ROOFLINE_EFFICIENCY``. Views
cost nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import arg_tree_leaves, tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from remat.devices import ROOFLINE_EFFICIENCY, DeviceSpec
from remat.measure.storages import carried_tensors, storage_key
from remat.measure.tracer import Mark, Trace, by_op, kernel_scratch

__all__ = ["FakeMeter", "convertible_parameters"]

aten = torch.ops.aten


def _cpu_flash_flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query.shape, key.shape, value.shape))


def _cpu_flash_bwd_flops(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape))


log = logging.getLogger(__name__)


class _StrongMemo(dict):  # type: ignore[type-arg]
    """A memo that holds its tensors itself, without weak references (NOTE [ Converting fake
    parameters ])."""


@contextlib.contextmanager
def convertible_parameters(fake_mode: Any) -> Iterator[None]:
    """Inside it, modules built in ``fake_mode`` can be converted (``.to(dtype)``, ``.half()``).

    # NOTE [ Converting fake parameters ]
    ``Module._apply`` (behind ``.to``, ``.half``, ``.bfloat16``) always replaces a fake parameter
    with ``torch.utils.swap_tensors``, which refuses a tensor that has a weak reference. The fake
    mode's converter keeps one to every tensor it makes from a meta tensor (a memo, so that the
    same meta tensor gives the same fake tensor), new parameters included, so the first ``.to``
    in a factory fails with "Couldn't swap Embedding.weight". While a factory builds the model
    its memo holds them by plain references for that while (a factory may still turn real
    constants into fake ones and look them up, as transformers' ``post_init`` does with
    ``torch.tensor([])``); the weak memo is restored afterwards for the step. Only this one mode
    object is touched: no process-wide state.
    """
    converter: Any = getattr(
        getattr(fake_mode, "fake_tensor_converter", None), "meta_converter", None
    )
    memo = getattr(converter, "tensor_memo", None)
    if memo is None:  # another torch: nothing to work around (tests check the conversion works)
        yield
        return
    converter.tensor_memo = _StrongMemo()
    try:
        yield
    finally:
        converter.tensor_memo = memo


# The CPU flash kernel is what fake CPU tensors take; count it as the GPU kernels are counted.
_EXTRA_FLOPS: dict[Any, Callable[..., int]] = {}
if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA_FLOPS[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_flash_flops
    _EXTRA_FLOPS[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_flash_bwd_flops


# NOTE [ Gradients summed in place ]
# A fake tensor is a subclass, and for one the backward takes out-of-place paths where the real step
# works in place: autograd sums two gradients of one tensor as ``old + new`` (real: ``old.add_(new)``
# when it holds the only reference to a dense ``old``), and ``index_select``'s backward is
# ``new_zeros(...).index_add(...)`` (real: ``index_add_``). So in the backward such an op's output
# counts in the peak only if its first operand outlives it (``_settle_sum``, at the next op or mark):
# where that operand died with the op, the real step reused it. Measured in ``test_lean``'s graph
# convolution (torch_geometric's GIN: 768,000 B per block).

#: Out-of-place ops the backward runs on fake tensors where the real step runs them in place:
#: autograd's sum of gradients, ``index_select``'s backward (``new_zeros(...).index_add``).
_SUMMED_IN_PLACE = frozenset({aten.add.Tensor, aten.index_add.default})


# NOTE [ A Python number autograd keeps ]
# ``x * 0.5`` and ``x / d`` reach the dispatcher with the number as a Python scalar, and autograd
# keeps it for the backward as a 0-dim tensor of its own (8 bytes, a double or a long) that no op
# returns, so the meter would not see it: on the CPU it is device memory, and a gMLP's attention
# (``sim * self.scale``) kept 8 B more per block than its fake twin, and a lean profile's plan
# measured 8 B over its prediction (segformer-pytorch's too; 24 B under bf16 autocast in
# TimeSformer's). The meter counts that tensor while it lives: after the op, it takes it from the
# output's backward node (``_saved_other``), which frees it in that node's backward. On a GPU it is
# host memory, and uncounted.
_KEEPS_ITS_NUMBER = frozenset({aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor})


class FakeMeter(TorchDispatchMode):
    """Live bytes and a roofline clock through code that runs on fake tensors.

    Enter it inside ``FakeTensorMode``. ``mark(label)`` records the live bytes, the peak since the
    previous mark and the clock; ``trace`` has the marks; ``clock_ms`` is the time so far.
    """

    def __init__(self, spec: DeviceSpec, carrier: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.carrier = carrier
        """The model whose carried tensors' frees count (rule 4 of NOTE [ A tensor carried from one
        step into the next ] in remat.measure.marked)."""
        self._by_op = by_op(spec.kernel_scratch)  # NOTE [ What each kernel allocates ] in remat.measure.tracer
        self.live = 0
        self.peak = 0
        self._peak_since = 0
        self.clock_ms = 0.0
        self.marks: list[Mark] = []
        self._storages: dict[int, int] = {}
        self._refs: dict[int, Any] = {}
        self._numbers: list[weakref.ref[torch.Tensor]] = []
        """Outputs whose backward node keeps a Python number, until the node is there to read."""
        self._summed: tuple[int, int] | None = None
        """An op of ``_SUMMED_IN_PLACE``'s (key of its first operand, live bytes with its output),
        until it is known whether that operand died with it (NOTE [ Gradients summed in place ])."""
        self.flop_errors: dict[str, str] = {}
        """Ops whose FLOP formula failed -> why; their time is the memory-bound estimate alone."""

    # -- bytes ------------------------------------------------------------------------------------

    def _track(self, t: torch.Tensor, peak: bool = True) -> int:
        storage = t.untyped_storage()
        key = int(storage._cdata)
        if key in self._storages:
            return 0
        nbytes = int(storage.nbytes())
        self._storages[key] = nbytes
        self._refs[key] = weakref.ref(storage, functools.partial(self._free_ref, key))
        self.live += nbytes
        if peak:
            self._at_least(self.live)
        return nbytes

    def _at_least(self, live: int) -> None:
        self.peak = max(self.peak, live)
        self._peak_since = max(self._peak_since, live)

    def _settle_sum(self) -> None:
        """A gradient sum's peak, now that it is known whether its first term died with it (NOTE
        [ Gradients summed in place ])."""
        if self._summed is not None:
            key, live = self._summed
            self._summed = None
            if key in self._storages:  # the term outlived the sum: autograd's own sum allocates too
                self._at_least(live)

    def _free_ref(self, key: int, ref: Any) -> None:
        self._free(key)

    def _free(self, key: int) -> None:
        nbytes = self._storages.pop(key, 0)
        self._refs.pop(key, None)
        self.live -= nbytes

    def _kept_numbers(self) -> None:
        """Counts the numbers the last ops' backward nodes keep (NOTE [ A Python number autograd keeps ])."""
        waiting = []
        for ref in self._numbers:
            if (t := ref()) is None:
                continue
            if t.grad_fn is None:  # autograd has not made the node yet (it asks the output's device first)
                waiting.append(ref)
            elif isinstance(number := getattr(t.grad_fn, "_saved_other", None), torch.Tensor) and number.dim() == 0:
                self._track(number)
        self._numbers = waiting

    def mark(self, label: str) -> None:
        self._settle_sum()
        self._kept_numbers()
        self.marks.append(
            Mark(label=label, live_bytes=self.live, peak_bytes=self._peak_since, t_ms=self.clock_ms)
        )
        self._peak_since = self.live

    def __enter__(self) -> FakeMeter:
        self._get_rng_state = None
        if self.spec.name == "cpu" and torch.get_rng_state != self._counted_rng_state:  # NOTE [ RNG states on the CPU ]
            self._get_rng_state = torch.get_rng_state
            torch.get_rng_state = self._counted_rng_state
        try:
            for *_, t in carried_tensors(self.carrier) if self.carrier is not None else ():
                self._carry(t)
            return super().__enter__()  # type: ignore[no-any-return]
        except BaseException:
            self._restore()
            raise

    def _carry(self, t: torch.Tensor) -> None:
        """Count the free of a storage made before the meter, as the live bytes' drop (rule 4 of NOTE
        [ A tensor carried from one step into the next ] in remat.measure.marked)."""
        storage = t.untyped_storage()
        key = int(storage._cdata)
        if key not in self._storages:
            self._storages[key] = int(storage.nbytes())
            self._refs[key] = weakref.ref(storage, functools.partial(self._free_ref, key))

    def __exit__(self, *exc: Any) -> None:
        try:
            self._settle_sum()
            self._kept_numbers()
            super().__exit__(*exc)
        finally:
            self._restore()

    def _restore(self) -> None:
        if self._get_rng_state is not None:
            torch.get_rng_state = self._get_rng_state
            self._get_rng_state = None

    def _counted_rng_state(self) -> torch.Tensor:
        """``torch.get_rng_state``, its tensor counted while it lives.

        # NOTE [ RNG states on the CPU ]
        A checkpoint stashes the CPU RNG state (5056 bytes) for its recompute, and a segment frame
        one per block; ``torch.get_rng_state`` makes that tensor outside the dispatcher, so the
        meter would not see it, and on the CPU device it is device memory: each checkpointed block
        measured 5056 bytes over its fake prediction. The meter counts it while it is in use (on
        a GPU it is host memory and stays uncounted)."""
        assert self._get_rng_state is not None
        state = self._get_rng_state()
        self._settle_sum()
        self._track(state)
        return state

    @property
    def trace(self) -> Trace:
        points = [(m.t_ms, m.live_bytes) for m in self.marks]
        return Trace(marks=list(self.marks), points=points, peak_bytes=self.peak)

    # -- dispatch ---------------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self._settle_sum()
        if self._numbers:
            self._kept_numbers()
        out = func(*args, **kwargs)
        if (func in _KEEPS_ITS_NUMBER and self.spec.name == "cpu" and torch.is_grad_enabled() and len(args) == 2
                and isinstance(args[1], (int, float)) and not isinstance(args[1], bool)
                and isinstance(args[0], torch.Tensor) and args[0].requires_grad and isinstance(out, torch.Tensor)):
            self._numbers.append(weakref.ref(out))
        inputs = [t for t in arg_tree_leaves(*args, **kwargs) if isinstance(t, torch.Tensor)]
        in_keys = {storage_key(t) for t in inputs}
        summed = self._gradient_sum(func, args, kwargs, out)
        written = 0
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and storage_key(t) not in in_keys:
                written += self._track(t, peak=summed is None)
        if summed is not None:
            self._summed = (summed, self.live)
        elif self.spec.kernel_scratch:  # NOTE [ What each kernel allocates ] in remat.measure.tracer
            self._at_least(self.live + kernel_scratch(self.spec.kernel_scratch, self._by_op, func._schema.name, written))
        if written or func in _EXTRA_FLOPS or func._overloadpacket in flop_registry:
            self.clock_ms += self._kernel_ms(func, args, kwargs, out, inputs, written)
        return out

    def _gradient_sum(self, func: Any, args: Any, kwargs: Any, out: Any) -> int | None:
        """The storage key of the first term when this op may be autograd's sum of two gradients of
        one tensor, which the real step sums in place (NOTE [ Gradients summed in place ])."""
        if func not in _SUMMED_IN_PLACE or torch.is_grad_enabled() or (func is aten.add.Tensor and kwargs):
            return None
        old = args[0]
        if not (isinstance(old, torch.Tensor) and isinstance(out, torch.Tensor)):
            return None
        if (old.shape != out.shape or old.dtype != out.dtype or old.layout != torch.strided
                or torch._C._current_autograd_node() is None):
            return None
        key = storage_key(old)
        return key if key in self._storages and is_non_overlapping_and_dense_or_false(old) else None

    def _kernel_ms(
        self, func: Any, args: Any, kwargs: Any, out: Any, inputs: list[torch.Tensor], written: int
    ) -> float:
        flops = 0
        count = _EXTRA_FLOPS.get(func)
        try:
            if count is not None:
                flops = count(*args, **kwargs)
            elif func._overloadpacket in flop_registry:
                flops = int(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
        except Exception as e:  # a flop formula that does not take this overload's arguments
            flops = 0
            name = str(func)
            if name not in self.flop_errors:  # say it once per op: the time is an underestimate
                self.flop_errors[name] = f"{type(e).__name__}: {e}"
                log.warning(
                    "remat: the FLOP formula of %s failed (%s); its estimated time counts only "
                    "the bytes it moves, not its FLOPs", name, self.flop_errors[name],
                )
        read = sum(t.numel() * t.element_size() for t in inputs)
        dtype = next((str(t.dtype).removeprefix("torch.") for t in inputs if t.is_floating_point()), "float32")
        spec = self.spec
        compute_s = flops / (spec.peak_flops(dtype) * ROOFLINE_EFFICIENCY["flops"])
        memory_s = (read + written) / (spec.bandwidth_bytes_per_s * ROOFLINE_EFFICIENCY["bandwidth"])
        return max(compute_s, memory_s) * 1e3 + spec.kernel_overhead_us * 1e-3
