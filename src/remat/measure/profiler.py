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

With a ``budget``, no step the profiler runs peaks above it: a step the plain step does not fit is
profiled lean (NOTE [ Planning what does not fit ] in ``remat.measure.lean``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from remat.devices import DeviceSpec, get_device
from remat.errors import InvalidType, InvalidValue, ProfileError, out_of_memory
from remat.manual.blocks import find_blocks
from remat.manual.options import as_written
from remat.measure import step as _step
from remat.measure import storages as _storages
from remat.measure.attribution import assemble
from remat.measure.collector import collecting_once
from remat.measure.compiled import add_options, check_budgets, measure_compiled, without_compiled
from remat.measure.estimated import (
    BatchFactory,
    FakeFloors,
    check_factory,
    fake_copy,
    fake_optimizer,
    fake_run,
)
from remat.measure.heads import add_heads, measure_heads
from remat.measure.lean import lean_profile, lean_spec, resolve_budget
from remat.measure.marked import base_keys, dtype_name, marked_step, option_runs, sides_of
from remat.measure.preserve import preserved
from remat.measure.runner import StepRunner, every_block
from remat.measure.sides import with_skips
from remat.measure.step_memory import base_bytes
from remat.measure.tied import calls_ms, every_call, tie, tied_where_needed
from remat.measure.tiles import add_tiles, measure_tiles
from remat.measure.tracer import MemoryTracer, host_link_bytes_per_s, sized
from remat.measure.warmup import by_floor, running
from remat.models.hf import layerdrop_blocks
from remat.plan.refusals import ran_out_within
from remat.plan.sharding import per_rank_profile
from remat.records import Profile

__all__ = ["ProfileError", "profile"]

log = logging.getLogger(__name__)


@collecting_once  # NOTE [ One full collection per call ] in remat.measure.collector
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
    budget: int | str | None = None,
) -> Profile:
    """Measure (or estimate) what each block costs under each option.

    Args:
        model: the model; in estimated mode a zero-argument factory that builds it (it is built
            inside ``FakeTensorMode``, so nothing is allocated).
        batch: the example batch (see ``remat.measure.step`` for the calling convention); in estimated mode
            it may be a factory too (a function or ``functools.partial`` that makes it).
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
        budget: measured mode: the most memory any step the profiler runs may take (bytes,
            ``"8GiB"``, ``"60%"`` of the plain step's predicted peak, or ``"device"``). When the
            plain step is predicted over it, the profile is made without running it (NOTE
            [ Planning what does not fit ] in ``remat.measure.lean``), or ``InfeasibleBudget``
            is raised, before any step runs, when no plan fits. Both modes: where no plan fits it
            with the modules that ran more than once kept, every call of them is checkpointed
            (NOTE [ Every call of a tied module ] in ``remat.measure.tied``).
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
        skipped = layerdrop_blocks(model)  # Profile.layerdrop
        # NOTE [ layerdrop ], NOTE [ No K/V cache in a planned training step ] in remat.models.hf
        with _step.as_planned(model), as_written(model):  # an applied plan's options off while profiling
            if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
                optimizer = optimizer(model.parameters())
            def on_device(within: int | str | None, tied: list[str]) -> Profile:
                with every_call(model, tied):
                    return _on_device(model, batch, loss_fn, optimizer, blocks, repeats, compiled, within)

            result = tied_where_needed(  # NOTE [ Every call of a tied module ]
                budget, on_device, lambda tied: calls_ms(model, batch, loss_fn, tied, repeats))
        result = dataclasses.replace(result, layerdrop=[b.name for b in result.blocks if b.name in skipped])
    else:
        if compiled:
            raise InvalidValue("compile_budgets needs a measured profile (a real model, device=None): "
                               "a compiled graph's memory and speed cannot be estimated from fake tensors")
        spec = get_device(device)
        result = tied_where_needed(budget, lambda _, tied: _estimated(model, batch, loss_fn, optimizer, blocks, spec, tied))
    if world_size != 1 or fsdp:
        result = per_rank_profile(result, world_size=world_size, fsdp=fsdp)
    return result


# --- the two modes ------------------------------------------------------------------------------


def _on_device(model: nn.Module, batch: Any, loss_fn: Any, optimizer: torch.optim.Optimizer | None, blocks: Any,
               repeats: int, compiled: tuple[str, ...], budget: int | str | None) -> Profile:
    """The measured profile, made within ``budget`` (NOTE [ Planning what does not fit ] in
    remat.measure.lean)."""
    lean = None if budget is None else resolve_budget(model, batch, loss_fn, optimizer, budget)
    if lean is None or lean.fits:
        try:
            return _measured(model, batch, loss_fn, optimizer, blocks, repeats, compiled)
        except (torch.OutOfMemoryError, RuntimeError, MemoryError) as e:
            if not out_of_memory(e):
                raise
            if lean is None:
                raise _plain_ran_out(model, budget, e) from e
            log.warning("remat: the plain step, predicted at %d bytes within the budget of %d, ran "
                        "out of memory (%s: what no tensor holds, such as a kernel's scratch space): "
                        "profiling it as a step that does not fit", lean.plain_peak_bytes,
                        lean.budget_bytes, str(e).split("\n")[0][:200])
    assert lean is not None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # what the step that ran out left in the allocator's cache
    if compiled:  # measured with every block compiled: not a step known to fit
        log.warning("remat: compiled options are left out: they are measured with every block "
                    "compiled, a step not known to fit the budget of %d bytes", lean.budget_bytes)
    try:
        return lean_profile(model, batch, loss_fn, optimizer, blocks, repeats, lean)
    except (torch.OutOfMemoryError, RuntimeError, MemoryError) as e:
        if not out_of_memory(e):
            raise
        raise ran_out_within(lean.budget_bytes, f"{type(e).__name__}: {str(e)[:300]}",
                             host=_step.batch_device(model, batch).type == "cpu") from e


def _plain_ran_out(model: nn.Module, budget: int | str | None, error: BaseException) -> ProfileError:
    """The error of a profile whose plain step had to run (no budget, or no step on fake tensors)
    and ran out of memory."""
    what = (f"{type(model).__name__} runs no step on fake tensors, so remat profiles it by running its plain "
            "step" if budget is not None else "A profile without a budget runs the plain step")
    todo = ("plan it where the plain step fits (on a device with more memory, plan.save(path) or remat plan "
            "--out, then remat.apply(model, remat.Plan.load(path)) here), or lower the batch" if budget is not None else
            "give a budget (remat.profile(..., budget=), remat.auto), and remat profiles it without running it "
            "where the model runs on fake tensors")
    return ProfileError(f"{what}, and that step ran out of memory on this device ({type(error).__name__}: "
                        f"{str(error).splitlines()[0][:200] if str(error) else ''}): {todo}.")


def _measured(
    model: nn.Module,
    batch: Any,
    loss_fn: Any,
    optimizer: Any,
    blocks: Any,
    repeats: int,
    compiled: tuple[str, ...] = (),
) -> Profile:
    named = find_blocks(model, blocks, required=False)
    device = _step.batch_device(model, batch)
    cuda = device.type == "cuda"
    with preserved(model, optimizer, batch):
        # warm-up: lazy state, allocator, and which blocks run
        with sized(device) as mark:  # NOTE [ A free the CPU trace cannot size ] in remat.measure.tracer
            named, coarse, repeated = running(model, named, blocks is not None, batch, loss_fn, optimizer, mark)
            make_opt = None if optimizer is None else fake_optimizer(optimizer, model)
            named = by_floor(named, coarse, FakeFloors(functools.partial(fake_copy, model), batch, loss_fn, make_opt,
                                                       lean_spec(device)))
        model.zero_grad(set_to_none=True)
        base = base_bytes(model, optimizer, batch, device)
        opt_bytes = _storages.optimizer_bytes(optimizer)
        keys = base_keys(model, optimizer, batch)
        runs = option_runs(model, named, batch, loss_fn, optimizer, keys, lambda: MemoryTracer(device))
        traces = {option: (tracer.trace, hooks) for option, (tracer, hooks) in runs.items()}
        sides, unsaved = sides_of(model, named, batch, loss_fn, optimizer, keys, traces["keep"][1])
        # Timed in turns, so that a change in the machine's load hits both options alike.
        marked = functools.partial(marked_step, model, named, batch, loss_fn, optimizer, base_keys=keys)
        runner = StepRunner(marked, model, device=device, repeats=repeats)
        timed_options: list[str] = [o for o in ("keep", "selective") if o in runs]  # NOTE [ A kept output changed in place ]
        timed = runner.times([functools.partial(every_block, named, o) for o in timed_options])
        times = dict(zip(timed_options, timed))
        # NOTE [ The head's options ] in remat.records; NOTE [ The tiled MLP ] in remat.manual.tiled
        heads, tiles = measure_heads(model, named, runner), measure_tiles(named, runner)
        extra = measure_compiled(named, runner, compiled, sides, traces["keep"])  # NOTE [ Compiled blocks ]
    return without_compiled(add_options(with_skips(traces["keep"][1], unsaved=unsaved, profile=add_tiles(add_heads(assemble(
        model=model,
        named=named,
        traces=traces,
        times=times,
        host_link_bytes_per_s=host_link_bytes_per_s(device) if cuda else None,
        smooth=True,
        sides=sides,
        device=str(device),
        mode="measured",
        dtype=dtype_name(model),
        batch_shape=_storages.batch_shape(batch),
        base_bytes=base,
        param_bytes=_storages.param_bytes(model),
        optimizer_bytes=opt_bytes,
        batch_bytes=_storages.batch_bytes(batch),
        device_memory_bytes=torch.cuda.get_device_properties(device).total_memory if cuda else None,
        repeated=repeated,
    ), heads), tiles)), extra))


def _estimated(factory: Any, batch: Any, loss_fn: Any, optimizer: Any, blocks: Any, spec: DeviceSpec,
               tied: list[str]) -> Profile:
    from remat.measure.fake import convertible_parameters

    check_factory(factory, optimizer)

    def build(steps: Any) -> nn.Module:
        with convertible_parameters(steps.mode):
            model = factory()
        if not isinstance(model, nn.Module):
            raise InvalidType(f"the model factory returned a {type(model).__name__}, not an nn.Module")
        tie(model, tied)  # NOTE [ Every call of a tied module ]: a fake model, thrown away after
        return model

    make_opt = None if optimizer is None else lambda m: optimizer(m.parameters())
    return fake_run(build, BatchFactory.of(batch), loss_fn, make_opt, blocks, spec).profile()
