"""profile(): each block's memory and time under every option — measured here, or estimated.

The profiler measures; it never decides. It runs whole training steps with every block under one
option at a time (keep, selective, recompute), with marks at each block's forward and backward
boundaries, and turns the live-bytes trace into the per-block numbers of a ``Profile``.

# NOTE [ From a trace to a Profile ]
For each option the profiler replays the cost model's own bookkeeping along the measured marks, so
that ``estimate(profile, every block = option)`` reproduces the measured peak of that step exactly
and mixed plans are additive combinations of measured pieces:
- kept_bytes(block) = live after its forward - live before + its input - its output (its input is
  charged to it, its output to its consumer; see NOTE [ How a block's bytes are attributed ]).
- fwd/bwd_peak_bytes = the measured peak inside the block's forward/backward minus the cost
  model's live level there.
- grad_bytes(block) = live after its backward - live before + its kept bytes.
Offload options are derived, not run: nothing of the block stays on the device, everything it
would keep comes back for its backward, and the copies both ways cost bytes / host-link bandwidth
that compute does not hide (``save_on_cpu`` copies on the compute stream).

Time: per-block forward and backward times come from separate timed steps (medians; profiling slows
a step) in measured mode, and from the roofline clock in estimated mode. Recompute costs one forward
of the block; selective costs what its backward took beyond keep's. In measured mode, blocks of one
kind and size share the median of their times, since they do the same work.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from remat import step as _step
from remat.blocks import find_blocks, fingerprint
from remat.devices import ROOFLINE_EFFICIENCY, DeviceSpec, get_device
from remat.measure import MemoryTracer, Trace, _base_bytes
from remat.records import BlockProfile, OptionCost, Profile, Segment

__all__ = ["ProfileError", "profile"]

log = logging.getLogger(__name__)

_RUN_OPTIONS = ("keep", "selective", "recompute")


class ProfileError(ValueError):
    """The model cannot be profiled as given (a block that runs twice, no gradients, ...)."""


def profile(
    model: nn.Module | Callable[[], nn.Module],
    batch: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
    blocks: Sequence[str] | Sequence[nn.Module] | None = None,
    device: str | DeviceSpec | None = None,
    repeats: int = 3,
    world_size: int = 1,
    fsdp: bool = False,
) -> Profile:
    """Measure (or estimate) what each block costs under each option.

    Args:
        model: the model; in estimated mode a zero-argument factory that builds it (it is built
            inside ``FakeTensorMode``, so nothing is allocated).
        batch: the example batch (see ``remat.step`` for the calling convention); in estimated mode
            it may be a factory too.
        loss_fn: ``loss_fn(output, batch) -> scalar`` or ``loss_fn(output)``; default: see
            ``remat.step``.
        optimizer: an optimizer over the model's parameters, or a factory ``params -> optimizer``
            (needed in estimated mode). Its state counts towards the step's memory.
        blocks: glob patterns or modules; found automatically when None.
        device: None to measure on the batch's device; a device name from ``remat.devices.DEVICES``
            (``"h100"``, ``"rtx4090"``, ...) or a ``DeviceSpec`` to estimate for that device.
        repeats: timed steps per option in measured mode (medians).
        world_size, fsdp: the profile of one rank of a ``world_size``-rank data-parallel job (DDP,
            or FSDP2 with ``fsdp``), whose per-rank batch is ``batch``; see
            ``remat.distributed.per_rank_profile``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    _step.check_grad_mode("remat.profile")
    loss_fn = _step.resolve_loss_fn(loss_fn)
    if device is None or (isinstance(device, str) and device.split(":")[0] in ("cuda",)):
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"measured mode needs the model itself (an nn.Module), got {type(model).__name__}; "
                "pass device='h100' (or another spec) to estimate from a factory"
            )
        _step.check_trainable(model, "remat.profile")
        result = _measured(model, batch, loss_fn, optimizer, blocks, repeats)
    else:
        result = _estimated(model, batch, loss_fn, optimizer, blocks, get_device(device))
    if world_size != 1 or fsdp:
        from remat.distributed import per_rank_profile

        result = per_rank_profile(result, world_size=world_size, fsdp=fsdp)
    return result


# --- running steps with marks -------------------------------------------------------------------


class _Hooks:
    """Marks at each block's forward start/end and backward start/end, and its boundary bytes."""

    def __init__(self, named: list[tuple[str, nn.Module]], mark: Callable[[str], None]) -> None:
        self.mark = mark
        self.order: list[int] = []
        self.in_bytes: dict[int, int] = {}
        self.out_bytes: dict[int, int] = {}
        self.base_keys: set[int] = set()
        self.handles = []
        for i, (_, module) in enumerate(named):
            self.handles.append(module.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(i)))

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not torch.is_grad_enabled():
                return
            if i in self.order:
                raise ProfileError(
                    f"block {i} ({type(module).__name__}) ran twice in one step; remat plans blocks "
                    "that run once per step (name other blocks with blocks=)"
                )
            self.order.append(i)
            self.mark(f"fs{i}")
            x = _first_tensor((args, kwargs))
            self.in_bytes[i] = 0
            if x is not None:
                if _storage_key(x) not in self.base_keys:
                    self.in_bytes[i] = x.untyped_storage().nbytes()
                if x.requires_grad:
                    x.register_hook(lambda g: self.mark(f"be{i}"))

        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            self.mark(f"fe{i}")
            y = _first_tensor(output)
            self.out_bytes[i] = y.untyped_storage().nbytes() if y is not None else 0
            if y is not None and y.requires_grad:
                y.register_hook(lambda g: self.mark(f"bs{i}"))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _marked_step(
    model: nn.Module,
    named: list[tuple[str, nn.Module]],
    batch: Any,
    loss_fn: Any,
    optimizer: Any,
    mark: Callable[[str], None],
    base_keys: set[int] | None = None,
) -> _Hooks:
    """One training step with marks at the step's phases and at every block's boundaries."""
    hooks = _Hooks(named, mark)
    hooks.base_keys = base_keys or set()
    try:
        _step.train_step(model, batch, loss_fn, optimizer, mark=mark)
    finally:
        hooks.remove()
    return hooks


def _first_tensor(obj: Any) -> torch.Tensor | None:
    for t in _step._tensors(obj):
        if t.is_floating_point():
            return t
    return None


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


@contextmanager
def _every_block(named: list[tuple[str, nn.Module]], option: str) -> Iterator[None]:
    from remat.applier import _set, mode_of

    previous = [mode_of(m) for _, m in named]
    try:
        for _, m in named:
            _set(m, option)
        yield
    finally:
        for (_, m), mode in zip(named, previous):
            _set(m, mode)


def _base_keys(model: nn.Module, optimizer: Any, batch: Any) -> set[int]:
    tensors = [*model.parameters(), *model.buffers(), *_step._tensors(batch)]
    if optimizer is not None:
        tensors += list(_step._tensors([dict(s) for s in optimizer.state.values()]))
    return {_storage_key(t) for t in tensors}


class _Clock:
    """Marks for the timed steps on the step clock (NOTE [ CPU time on a shared CPU ])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, float] = {}

    def mark(self, label: str) -> None:
        self.times[label] = _step.step_clock_ms(self.device)


# --- turning traces into numbers ----------------------------------------------------------------


def _segments_and_blocks(
    trace: Trace, hooks: _Hooks, n: int, keeps_input: bool
) -> tuple[Segment, Segment, list[dict[str, int]], int]:
    """Replay the cost model along the trace (NOTE [ From a trace to a Profile ])."""
    live = {m.label: m.live_bytes for m in trace.marks}
    order = hooks.order
    first, last = order[0], order[-1]

    def peak(a: str, b: str) -> int:
        return trace.peak_between(a, b)

    def be(i: int) -> str:
        # A block whose input needs no gradient (the first, behind a frozen embedding) has no
        # backward-end hook; its backward ends where the step's backward does.
        return f"be{i}" if f"be{i}" in live else "optimizer"

    level = 0
    pre_kept = live[f"fs{first}"] - live["forward"] - hooks.in_bytes[first]
    pre_fwd_peak = peak("forward", f"fs{first}") - level
    level += pre_kept
    per_block: list[dict[str, int]] = [{} for _ in range(n)]
    for i in order:
        kept = live[f"fe{i}"] - live[f"fs{i}"] - hooks.out_bytes[i]
        kept += hooks.in_bytes[i] if keeps_input else 0
        per_block[i]["fwd_peak"] = peak(f"fs{i}", f"fe{i}") - level
        per_block[i]["kept"] = kept
        level += kept
    post_kept = live["backward"] - live[f"fe{last}"] + hooks.out_bytes[last]
    post_fwd_peak = peak(f"fe{last}", "backward") - level
    level += post_kept
    post_bwd_peak = peak("backward", f"bs{last}") - level
    post_grad = live[f"bs{last}"] - live["backward"] + post_kept
    level += post_grad - post_kept
    for i in reversed(order):
        per_block[i]["bwd_peak"] = peak(f"bs{i}", be(i)) - level
        per_block[i]["grad"] = live[be(i)] - live[f"bs{i}"] + per_block[i]["kept"]
        level += per_block[i]["grad"] - per_block[i]["kept"]
    pre_bwd_peak = peak(be(first), "optimizer") - level
    pre_grad = live["optimizer"] - live[be(first)] + pre_kept
    optimizer_peak = peak("optimizer", "end") - live["optimizer"]
    pre = Segment(
        kept_bytes=pre_kept, fwd_peak_bytes=pre_fwd_peak, bwd_peak_bytes=pre_bwd_peak,
        grad_bytes=pre_grad, fwd_ms=0.0, bwd_ms=0.0,
    )
    post = Segment(
        kept_bytes=post_kept, fwd_peak_bytes=post_fwd_peak, bwd_peak_bytes=post_bwd_peak,
        grad_bytes=post_grad, fwd_ms=0.0, bwd_ms=0.0,
    )
    return pre, post, per_block, optimizer_peak


def _phase_times(times: dict[str, float], order: list[int]) -> dict[str, float]:
    """Milliseconds of each phase between marks of one step."""
    first, last = order[0], order[-1]
    be = {i: times.get(f"be{i}", times["optimizer"]) for i in order}
    out = {
        "step": times["end"] - times["forward"],
        "pre_fwd": times[f"fs{first}"] - times["forward"],
        "post_fwd": times["backward"] - times[f"fe{last}"],
        "post_bwd": times[f"bs{last}"] - times["backward"],
        "pre_bwd": times["optimizer"] - be[first],
    }
    for i in order:
        out[f"fwd{i}"] = times[f"fe{i}"] - times[f"fs{i}"]
        out[f"bwd{i}"] = be[i] - times[f"bs{i}"]
    return out


def _median_times(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _assemble(
    *,
    model: nn.Module,
    named: list[tuple[str, nn.Module]],
    traces: dict[str, tuple[Trace, _Hooks]],
    times: dict[str, dict[str, float]],
    host_link_bytes_per_s: float | None,
    smooth: bool,
    **fixed: Any,
) -> Profile:
    n = len(named)
    trace_keep, hooks_keep = traces["keep"]
    order = hooks_keep.order
    if sorted(order) != list(range(n)):
        missing = [named[i][0] for i in range(n) if i not in order]
        raise ProfileError(
            f"blocks {missing} did not run in the step; remat plans blocks that run once per "
            "step with gradients (check blocks=)"
        )
    pre, post, keep_blocks, optimizer_peak = _segments_and_blocks(trace_keep, hooks_keep, n, True)
    per_option = {"keep": keep_blocks}
    for option in ("selective", "recompute"):
        if option in traces:
            trace, hooks = traces[option]
            per_option[option] = _segments_and_blocks(trace, hooks, n, True)[2]
    t_keep = times["keep"]
    fwd = [t_keep[f"fwd{i}"] for i in range(n)]
    bwd = [t_keep[f"bwd{i}"] for i in range(n)]
    sel_extra = [0.0] * n
    if "selective" in times:
        t_sel = times["selective"]
        # A selective recompute re-runs every cheap op of the block: never free. When timing
        # noise hides it, charge a tenth of the block's forward (the share of time pointwise ops,
        # norms and softmax take next to the matmuls in a transformer block) rather than zero.
        sel_extra = [
            min(max(0.1 * fwd[i], t_sel[f"fwd{i}"] + t_sel[f"bwd{i}"] - fwd[i] - bwd[i]), fwd[i])
            for i in range(n)
        ]
    param_bytes = [_step.storage_bytes(list(m.parameters())) for _, m in named]
    if smooth:
        groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for i, (_, m) in enumerate(named):
            groups[(type(m).__name__, param_bytes[i], hooks_keep.in_bytes[i], keep_blocks[i]["kept"])].append(i)
        for members in groups.values():
            for series in (fwd, bwd, sel_extra):
                med = statistics.median(series[i] for i in members)
                for i in members:
                    series[i] = med
        # Selective is worth the bytes it keeps only when it is clearly cheaper than a full
        # recompute. Within timing noise of it (10%) it costs what recompute costs, so that a
        # rerun on a loaded machine does not flip plans between the two.
        sel_extra = [fwd[i] if sel_extra[i] > 0.9 * fwd[i] else sel_extra[i] for i in range(n)]
    out: list[BlockProfile] = []
    for i, (name, module) in enumerate(named):
        options: dict[str, OptionCost] = {"keep": _cost(keep_blocks[i], 0.0)}
        if "selective" in per_option:
            options["selective"] = _cost(per_option["selective"][i], sel_extra[i])
        if "recompute" in per_option:
            options["recompute"] = _cost(per_option["recompute"][i], fwd[i])
        if host_link_bytes_per_s:
            k, r = keep_blocks[i], per_option["recompute"][i]
            options["offload"] = OptionCost(
                kept_bytes=0,
                fwd_peak_bytes=k["fwd_peak"],
                bwd_peak_bytes=k["bwd_peak"] + k["kept"],
                extra_ms=2 * k["kept"] / host_link_bytes_per_s * 1e3,
            )
            options["recompute_offload"] = OptionCost(
                kept_bytes=0,
                fwd_peak_bytes=r["fwd_peak"],
                bwd_peak_bytes=r["bwd_peak"] + r["kept"],
                extra_ms=fwd[i] + 2 * r["kept"] / host_link_bytes_per_s * 1e3,
            )
        out.append(
            BlockProfile(
                name=name,
                kind=type(module).__name__,
                param_bytes=param_bytes[i],
                grad_bytes=keep_blocks[i]["grad"],
                input_bytes=hooks_keep.in_bytes[i],
                fwd_ms=fwd[i],
                bwd_ms=bwd[i],
                options=options,
            )
        )
    ordered = [out[i] for i in order]
    pre = _with_times(pre, t_keep["pre_fwd"], t_keep["pre_bwd"])
    post = _with_times(post, t_keep["post_fwd"], t_keep["post_bwd"])
    return Profile(
        model=type(model).__name__,
        fingerprint=fingerprint(model),
        pre=pre,
        post=post,
        blocks=ordered,
        optimizer_peak_bytes=optimizer_peak,
        plain_peak_bytes=fixed["base_bytes"] + trace_keep.peak_bytes,
        plain_step_ms=t_keep["step"],
        **fixed,
    )


def _cost(numbers: dict[str, int], extra_ms: float) -> OptionCost:
    return OptionCost(
        kept_bytes=numbers["kept"],
        fwd_peak_bytes=numbers["fwd_peak"],
        bwd_peak_bytes=numbers["bwd_peak"],
        extra_ms=extra_ms,
    )


def _with_times(seg: Segment, fwd_ms: float, bwd_ms: float) -> Segment:
    return Segment(
        kept_bytes=seg.kept_bytes, fwd_peak_bytes=seg.fwd_peak_bytes, bwd_peak_bytes=seg.bwd_peak_bytes,
        grad_bytes=seg.grad_bytes, fwd_ms=fwd_ms, bwd_ms=bwd_ms,
    )


def _dtype_name(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return str(p.dtype).removeprefix("torch.") if p is not None else "float32"


# --- the two modes ------------------------------------------------------------------------------


def _measured(
    model: nn.Module,
    batch: Any,
    loss_fn: Any,
    optimizer: Any,
    blocks: Any,
    repeats: int,
) -> Profile:
    named = find_blocks(model, blocks)
    device = _step.batch_device(model, batch)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters())
    cuda = device.type == "cuda"
    options = _RUN_OPTIONS
    traces: dict[str, tuple[Trace, _Hooks]] = {}
    times: dict[str, dict[str, float]] = {}
    with _step.preserved(model, optimizer):
        _step.train_step(model, batch, loss_fn, optimizer)  # warm-up: lazy state, allocator
        model.zero_grad(set_to_none=True)
        base = _base_bytes(model, optimizer, batch, device)
        opt_bytes = _step.optimizer_bytes(optimizer)
        keys = _base_keys(model, optimizer, batch)
        for option in options:
            with _every_block(named, option):
                model.zero_grad(set_to_none=True)
                with MemoryTracer(device) as tracer:
                    hooks = _marked_step(model, named, batch, loss_fn, optimizer, tracer.mark, keys)
                traces[option] = (tracer.trace, hooks)
        # Timed in turns, so that a change in the machine's load hits both options alike.
        runs: dict[str, list[dict[str, float]]] = {"keep": [], "selective": []}
        with _step.no_gc():
            for _ in range(repeats):
                for option, option_runs in runs.items():
                    with _every_block(named, option):
                        clock = _Clock(device)
                        hooks = _marked_step(model, named, batch, loss_fn, optimizer, clock.mark)
                        option_runs.append(_phase_times(clock.times, hooks.order))
        times.update((option, _median_times(option_runs)) for option, option_runs in runs.items())
    return _assemble(
        model=model,
        named=named,
        traces=traces,
        times=times,
        host_link_bytes_per_s=_host_link(device) if cuda else None,
        smooth=True,
        device=str(device),
        mode="measured",
        dtype=_dtype_name(model),
        batch_shape=_step.batch_shape(batch),
        base_bytes=base,
        param_bytes=_step.param_bytes(model),
        optimizer_bytes=opt_bytes,
        batch_bytes=_step.batch_bytes(batch),
        device_memory_bytes=torch.cuda.get_device_properties(device).total_memory if cuda else None,
    )


def _host_link(device: torch.device) -> float:
    """Measured pinned host<->device copy bandwidth, bytes/s (median of a few 64 MiB copies)."""
    host = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    rates = []
    for _ in range(5):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize(device)
        rates.append(2 * host.numel() / (time.perf_counter() - t0))
    return statistics.median(rates)


def _estimated(
    factory: Any,
    batch: Any,
    loss_fn: Any,
    optimizer: Any,
    blocks: Any,
    spec: DeviceSpec,
) -> Profile:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.fake import FakeMeter, convertible_parameters

    if isinstance(factory, nn.Module):
        raise TypeError(
            "estimated mode builds the model inside FakeTensorMode, so it needs a factory: "
            "pass model=lambda: MyModel(config) instead of a built module"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "estimated mode needs the optimizer as a factory, e.g. "
            "optimizer=lambda params: torch.optim.AdamW(params)"
        )
    fake_mode = FakeTensorMode()
    traces: dict[str, tuple[Trace, _Hooks]] = {}
    times: dict[str, dict[str, float]] = {}
    with fake_mode:
        with convertible_parameters(fake_mode):
            model = factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"the model factory returned a {type(model).__name__}, not an nn.Module")
        fake_batch = batch() if callable(batch) else _to_fake(fake_mode, batch)
        opt = optimizer(model.parameters()) if optimizer is not None else None
        named = find_blocks(model, blocks)
        if opt is not None:
            # The optimizer creates its state on its first step; a step on zero gradients does
            # that without a forward and backward (fake tensors: nothing is computed anyway).
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
        keys = _base_keys(model, opt, fake_batch)
        for option in _RUN_OPTIONS:
            with _every_block(named, option):
                model.zero_grad(set_to_none=True)
                meter = FakeMeter(spec)
                with meter:
                    hooks = _marked_step(model, named, fake_batch, loss_fn, opt, meter.mark, keys)
                traces[option] = (meter.trace, hooks)
                stamps = {m.label: m.t_ms for m in meter.marks}
                times[option] = _phase_times(stamps, hooks.order)
        param_bytes = _step.param_bytes(model)
        opt_bytes = _step.optimizer_bytes(opt)
        data = _step.batch_bytes(fake_batch)
        buffers = _step.storage_bytes(list(model.buffers()))
        return _assemble(
            model=model,
            named=named,
            traces=traces,
            times=times,
            host_link_bytes_per_s=spec.host_link_bytes_per_s * ROOFLINE_EFFICIENCY["host_link"]
            if spec.name != "cpu"
            else None,
            smooth=False,
            device=spec.name,
            mode="estimated",
            dtype=_dtype_name(model),
            batch_shape=_step.batch_shape(fake_batch),
            base_bytes=param_bytes + buffers + opt_bytes + data,
            param_bytes=param_bytes,
            optimizer_bytes=opt_bytes,
            batch_bytes=data,
            device_memory_bytes=spec.memory_bytes,
        )


def _to_fake(mode: Any, batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return mode.from_tensor(batch)
    if isinstance(batch, dict):
        return {k: _to_fake(mode, v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_fake(mode, v) for v in batch)
    return batch
