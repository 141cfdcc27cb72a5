"""profile(): each block's memory and time under every option — measured here, or estimated.

The profiler measures; it never decides. It runs whole training steps with every block under one
option at a time (keep, selective, recompute), with marks at each block's forward and backward
boundaries, and turns the live-bytes trace into the per-block numbers of a ``Profile`` (NOTE [ From
a trace to a Profile ] in ``remat.measure.attribution``); then the head's options
(``remat.measure.heads``) and the tiled MLP (``remat.measure.tiles``) with the same marked step.

Time: per-block forward and backward times come from separate timed steps (medians; profiling slows
a step) in measured mode, and from the roofline clock in estimated mode. Recompute costs one forward
of the block; selective costs what its backward took beyond keep's. In measured mode, blocks of one
kind and size share the median of their times, since they do the same work.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from remat.devices import ROOFLINE_EFFICIENCY, DeviceSpec, get_device
from remat.errors import InvalidType, InvalidValue, ProfileError
from remat.manual.blocks import find_blocks
from remat.measure import step as _step
from remat.measure.attribution import assemble, phase_times
from remat.measure.compiled import add_options, check_budgets, measure_compiled, without_compiled
from remat.measure.handovers import note_handover_uses, note_returned
from remat.measure.heads import add_heads, measure_heads
from remat.measure.runner import StepRunner, every_block
from remat.measure.sides import (
    backward_mark,
    hooks_of,
    note_output,
    note_sides,
    noting_deaths,
    noting_saved,
    side_inputs,
)
from remat.measure.sides import first_tensor as _first_tensor
from remat.measure.sides import storage_key as _storage_key
from remat.measure.sides import with_skips as _with_skips
from remat.measure.tiles import add_tiles, measure_tiles
from remat.measure.tracer import MemoryTracer, Trace, base_bytes, host_link_bytes_per_s
from remat.models.hf import cache_off, every_layer, layerdrop_off, without_cache
from remat.plan.sharding import per_rank_profile
from remat.records import Profile, SideInput

__all__ = ["ProfileError", "profile"]

log = logging.getLogger(__name__)

_RUN_OPTIONS = ("keep", "selective", "recompute")


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
    compile_budgets: Sequence[float] = (),
) -> Profile:
    """Measure (or estimate) what each block costs under each option.

    Args:
        model: the model; in estimated mode a zero-argument factory that builds it (it is built
            inside ``FakeTensorMode``, so nothing is allocated).
        batch: the example batch (see ``remat.measure.step`` for the calling convention); in estimated mode
            it may be a factory too.
        loss_fn: ``loss_fn(output, batch) -> scalar`` or ``loss_fn(output)``; default: see
            ``remat.measure.step``.
        optimizer: an optimizer over the model's parameters, or a factory ``params -> optimizer``
            (needed in estimated mode). Its state counts towards the step's memory.
        blocks: glob patterns or modules; found automatically when None.
        device: None to measure on the batch's device; a device name from ``remat.devices.DEVICES``
            (``"h100"``, ``"rtx4090"``, ...) or a ``DeviceSpec`` to estimate for that device.
        repeats: timed steps per option in measured mode (medians).
        world_size, fsdp: the profile of one rank of a ``world_size``-rank data-parallel job (DDP,
            or FSDP2 with ``fsdp``), whose per-rank batch is ``batch``; see
            ``remat.plan.sharding.per_rank_profile``.
        compile_budgets: activation budgets in (0, 1] at which to measure every block compiled, as
            options ``compiled:<budget>`` (NOTE [ Compiled blocks ] in ``remat.manual.compiled``;
            measured mode only, a compile per budget).
    """
    if repeats < 1:
        raise InvalidValue(f"repeats must be >= 1, got {repeats}")
    _step.check_grad_mode("remat.profile")
    loss_fn = _step.resolve_loss_fn(loss_fn)
    compiled = check_budgets(compile_budgets)
    if device is None or (isinstance(device, str) and device.split(":")[0] in ("cuda",)):
        if not isinstance(model, nn.Module):
            raise InvalidType(
                f"measured mode needs the model itself (an nn.Module), got {type(model).__name__}; "
                "pass device='h100' (or another spec) to estimate from a factory"
            )
        _step.check_trainable(model, "remat.profile")
        # NOTE [ layerdrop ], NOTE [ No K/V cache in a planned training step ] in remat.models.hf
        with every_layer(model), without_cache(model):
            result = _measured(model, batch, loss_fn, optimizer, blocks, repeats, compiled)
    else:
        if compiled:
            raise InvalidValue("compile_budgets needs a measured profile (a real model, device=None): "
                               "a compiled graph's memory and speed cannot be estimated from fake tensors")
        result = _estimated(model, batch, loss_fn, optimizer, blocks, get_device(device))
    if world_size != 1 or fsdp:
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
        self.sides: dict[int, list[tuple[int, int]]] = {}  # block -> (storage key, bytes) of side inputs
        self.firsts: set[int] = set()  # storages of the blocks' first inputs and outputs
        self.running: list[int] = []
        self.deaths: dict[int, tuple[int, bool]] = {}  # NOTE [ Where a side input dies ]
        self.forward_done = False
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
            self.running.append(i)
            self.mark(f"fs{i}")
            x = _first_tensor((args, kwargs))
            note_sides(self, i, x, (args, kwargs))
            note_handover_uses(self, i, (args, kwargs))
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
            self.running = [j for j in self.running if j != i]
            y = _first_tensor(output)
            note_output(self, i, y)
            note_returned(self, i, output, y)
            self.out_bytes[i] = y.untyped_storage().nbytes() if y is not None else 0
            if y is not None and y.requires_grad:
                y.register_hook(backward_mark(self, i, self.mark))

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
    saved: dict[Any, set[int]] | None = None,
    saves: bool = False,
) -> _Hooks:
    """One training step with marks at the phases and block boundaries (and ``noting_saved``;
    ``saves``: a mark at each tensor a block saves)."""
    hooks = _Hooks(named, mark)
    hooks.base_keys = base_keys or set()
    try:
        with noting_saved(hooks, saved, mark if saves else None), noting_deaths(hooks, model):
            _step.train_step(model, batch, loss_fn, optimizer, mark=mark)
    finally:
        hooks.remove()
    if missing := [named[i][0] for i in range(len(named)) if i not in hooks.order]:
        raise ProfileError(f"blocks {missing} did not run in this step; remat plans blocks that run in every "
                           "step (turn off layerdrop or other random layer skips, or name them with blocks=)")
    return hooks


def _running(named: list[tuple[str, nn.Module]], explicit: bool, run: Callable[[], Any]) -> list[tuple[str, nn.Module]]:
    """The blocks that run in ``run()``, a warm-up step; a found stack that does not run is left out."""
    ran: set[str] = set()
    handles = [m.register_forward_pre_hook(lambda *_, n=n: ran.add(n) if torch.is_grad_enabled() else None)
               for n, m in named]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    stacks = {n.rpartition(".")[0] for n in ran}
    kept = [(n, m) for n, m in named if explicit or n.rpartition(".")[0] in stacks]
    if missing := [n for n, _ in kept if n not in ran] or ([n for n, _ in named] if not ran else []):
        raise ProfileError(f"blocks {missing} did not run in the training step; remat plans blocks that run "
                           "once per step with gradients (check blocks=, and that the model trains)")
    if len(kept) < len(named):
        log.info("left out stacks that do not run in a training step: %s", sorted({n for n, _ in named} - ran))
    return kept


def _base_keys(model: nn.Module, optimizer: Any, batch: Any) -> set[int]:
    tensors = [*model.parameters(), *model.buffers(), *_step.tensors_in(batch)]
    if optimizer is not None:
        tensors += list(_step.tensors_in([dict(s) for s in optimizer.state.values()]))
    return {_storage_key(t) for t in tensors}


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
    compiled: tuple[str, ...] = (),
) -> Profile:
    named = find_blocks(model, blocks)
    device = _step.batch_device(model, batch)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model.parameters())
    cuda = device.type == "cuda"
    traces: dict[str, tuple[Trace, _Hooks]] = {}
    times: dict[str, dict[str, float]] = {}
    with _step.preserved(model, optimizer):
        # warm-up: lazy state, allocator, and which blocks run
        named = _running(named, blocks is not None, lambda: _step.train_step(model, batch, loss_fn, optimizer))
        model.zero_grad(set_to_none=True)
        base = base_bytes(model, optimizer, batch, device)
        opt_bytes = _step.optimizer_bytes(optimizer)
        keys = _base_keys(model, optimizer, batch)
        for option in _RUN_OPTIONS:
            with every_block(named, option):
                model.zero_grad(set_to_none=True)
                with MemoryTracer(device) as tracer:
                    hooks = _marked_step(model, named, batch, loss_fn, optimizer, tracer.mark, keys,
                                         saves=option == "keep")
                traces[option] = (tracer.trace, hooks)
        sides = _sides(model, named, batch, loss_fn, optimizer, keys, traces["keep"][1])
        # Timed in turns, so that a change in the machine's load hits both options alike.
        marked = functools.partial(_marked_step, model, named, batch, loss_fn, optimizer, base_keys=keys)
        runner = StepRunner(marked, model, device=device, repeats=repeats)
        timed = runner.times([functools.partial(every_block, named, o) for o in ("keep", "selective")])
        times.update(zip(("keep", "selective"), timed))
        # NOTE [ The head's options ] in remat.records; NOTE [ The tiled MLP ] in remat.manual.tiled
        heads, tiles = measure_heads(model, named, runner), measure_tiles(named, runner)
        extra = measure_compiled(named, runner, compiled, sides, traces["keep"])  # NOTE [ Compiled blocks ]
    return without_compiled(add_options(_with_skips(hooks_of(traces["keep"][1]), add_tiles(add_heads(assemble(
        model=model,
        named=named,
        traces=traces,
        times=times,
        host_link_bytes_per_s=host_link_bytes_per_s(device) if cuda else None,
        smooth=True,
        sides=sides,
        device=str(device),
        mode="measured",
        dtype=_dtype_name(model),
        batch_shape=_step.batch_shape(batch),
        base_bytes=base,
        param_bytes=_step.param_bytes(model),
        optimizer_bytes=opt_bytes,
        batch_bytes=_step.batch_bytes(batch),
        device_memory_bytes=torch.cuda.get_device_properties(device).total_memory if cuda else None,
    ), heads), tiles)), extra))


def _sides(model: nn.Module, named: list[tuple[str, nn.Module]], batch: Any, loss_fn: Any,
           optimizer: Any, keys: set[int], traced: _Hooks) -> list[SideInput]:
    """The side inputs of the step ``traced`` saw, after a plain step that notes what each block
    saves: which side inputs a kept block holds (NOTE [ Side inputs ])."""
    saved: dict[Any, set[int]] = {}
    with every_block(named, "keep"):
        saving = _marked_step(model, named, batch, loss_fn, optimizer, lambda _: None, keys, saved)
    model.zero_grad(set_to_none=True)
    return side_inputs(hooks_of(traced), hooks_of(saving), saved, [n for n, _ in named])


def _estimated(
    factory: Any,
    batch: Any,
    loss_fn: Any,
    optimizer: Any,
    blocks: Any,
    spec: DeviceSpec,
) -> Profile:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.measure.fake import FakeMeter, convertible_parameters, to_fake

    if isinstance(factory, nn.Module):
        raise InvalidType(
            "estimated mode builds the model inside FakeTensorMode, so it needs a factory: "
            "pass model=lambda: MyModel(config) instead of a built module"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidType(
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
            raise InvalidType(f"the model factory returned a {type(model).__name__}, not an nn.Module")
        fake_batch = batch() if callable(batch) else to_fake(fake_mode, batch)
        opt = optimizer(model.parameters()) if optimizer is not None else None
        named = find_blocks(model, blocks)
        layerdrop_off(model)  # a fake model, thrown away after: nothing to put back
        cache_off(model)  # on a fake model, thrown away after: nothing to remove
        if opt is not None:
            # The optimizer creates its state on its first step; a step on zero gradients does
            # that without a forward and backward (fake tensors: nothing is computed anyway).
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
        named = _running(named, blocks is not None, lambda: _step.train_step(model, fake_batch, loss_fn, opt))
        keys = _base_keys(model, opt, fake_batch)
        for option in _RUN_OPTIONS:
            with every_block(named, option):
                model.zero_grad(set_to_none=True)
                meter = FakeMeter(spec)
                with meter:
                    hooks = _marked_step(model, named, fake_batch, loss_fn, opt, meter.mark, keys,
                                         saves=option == "keep")
                traces[option] = (meter.trace, hooks)
                stamps = {m.label: m.t_ms for m in meter.marks}
                times[option] = phase_times(stamps, hooks.order)
        sides = _sides(model, named, fake_batch, loss_fn, opt, keys, traces["keep"][1])
        param_bytes = _step.param_bytes(model)
        opt_bytes = _step.optimizer_bytes(opt)
        data = _step.batch_bytes(fake_batch)
        buffers = _step.storage_bytes(list(model.buffers()))
        marked = functools.partial(_marked_step, model, named, fake_batch, loss_fn, opt, base_keys=keys)
        runner = StepRunner(marked, model, spec=spec)
        heads, tiles = measure_heads(model, named, runner), measure_tiles(named, runner, times["keep"])
        return add_tiles(add_heads(assemble(
            model=model,
            named=named,
            traces=traces,
            times=times,
            host_link_bytes_per_s=spec.host_link_bytes_per_s * ROOFLINE_EFFICIENCY["host_link"]
            if spec.name != "cpu"
            else None,
            smooth=False,
            sides=sides,
                device=spec.name,
            mode="estimated",
            dtype=_dtype_name(model),
            batch_shape=_step.batch_shape(fake_batch),
            base_bytes=param_bytes + buffers + opt_bytes + data,
            param_bytes=param_bytes,
            optimizer_bytes=opt_bytes,
            batch_bytes=data,
            device_memory_bytes=spec.memory_bytes,
        ), heads), tiles)
