"""The step on fake tensors: every byte of a ``Profile`` without allocating one, and roofline times.

``fake_run`` runs the profiler's marked steps (every block kept, selective, recomputed; the head's
and the tiled MLP's options) inside ``FakeTensorMode`` and keeps what it saw as a ``FakeRun``;
``FakeRun.profile`` assembles the ``Profile`` from it, with the roofline's times (estimated mode)
or with times measured on the real device (a lean profile, NOTE [ Planning what does not fit ] in
``remat.measure.lean``). The model is either built in the fake mode by the user's factory, or is
a fake copy of the user's own model (``fake_copy``), which is how remat plans a step that does not
fit: the copy's tensors cost nothing, its modules are the user's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat.crossing import Crossing
from remat.devices import ROOFLINE_EFFICIENCY, DeviceSpec
from remat.errors import InvalidType, InvalidValue
from remat.manual.blocks import find_blocks
from remat.measure import step as _step
from remat.measure import storages as _storages
from remat.measure.attribution import assemble
from remat.measure.heads import HeadMeasures, add_heads, measure_heads
from remat.measure.marked import (
    Hooks,
    base_keys,
    dtype_name,
    marked_step,
    option_runs,
    sides_of,
)
from remat.measure.notes import StepNotes
from remat.measure.phases import phase_times
from remat.measure.runner import StepRunner
from remat.measure.sides import with_skips
from remat.measure.tiles import add_tiles, measure_tiles
from remat.measure.tracer import Trace
from remat.measure.warmup import by_floor, running
from remat.models.hf import cache_off, layerdrop_blocks, layerdrop_off
from remat.plan.solver import smallest_any
from remat.records import OptionCost, Profile

if TYPE_CHECKING:
    from remat.measure.fake_steps import FakeSteps

__all__ = ["FAKE_LIMITS", "BatchFactory", "FakeFloors", "FakeRun", "fake_copy", "fake_optimizer", "fake_run",
           "plain_peak"]


def _fake_limits() -> tuple[type[Exception], ...]:
    from torch._subclasses import fake_tensor as ft

    names = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException")
    return tuple(getattr(ft, n) for n in names if hasattr(ft, n))


#: What a model's step raises on fake tensors when its forward reads tensor values (``.item()``,
#: a data-dependent shape) or runs an op fake tensors do not support.
FAKE_LIMITS = _fake_limits()



@dataclasses.dataclass(frozen=True)
class BatchFactory:
    """A batch that ``make()`` makes inside the fake mode: estimated mode's factory. A batch may be
    callable itself (torch_geometric's ``Data`` is: ``data(*keys)`` yields its items), so a
    factory is one only as the profiler's edge says (``of``), never by being callable."""

    make: Callable[[], Any]

    @classmethod
    def of(cls, batch: Any) -> Any:
        """``batch`` as a factory where it is a function, a method or a ``functools.partial``;
        else the batch itself."""
        factory = inspect.isfunction(batch) or inspect.ismethod(batch) or isinstance(batch, functools.partial)
        return cls(batch) if factory else batch


@dataclasses.dataclass(kw_only=True)
class FakeRun:
    """What the marked steps on fake tensors saw: all of a ``Profile`` but its measured times."""

    model: nn.Module
    """The fake model (the user's copy, or what the factory built)."""
    named: list[tuple[str, nn.Module]]
    """Its blocks that run, in the order ``find_blocks`` gives them."""
    traces: dict[str, tuple[Trace, Hooks]]
    """Option -> the traced step with every block under it."""
    times: dict[str, dict[str, float]]
    """Option -> the roofline's phase times of that step (``phase_times``'s keys)."""
    sides: list[Crossing]
    unsaved: StepNotes
    """The notes of a forward that saved nothing (``sides_of``)."""
    heads: HeadMeasures | None
    """The head's chunked options (bytes, and the roofline's times), when the loss has a head."""
    tiles: dict[str, OptionCost]
    """Block name -> its ``tiled`` option, for the blocks that offer it."""
    fixed: dict[str, Any]
    """``assemble``'s fields from the step's setup (device, mode, dtype, base bytes, ...)."""
    host_link_bytes_per_s: float | None
    steps: Any
    """The fake mode the model lives in (a ``FakeSteps``: NOTE [ A cache the fake steps fill ]):
    enter it to run more steps of it."""
    runner: StepRunner
    """Traced steps of the fake model (``runner.traced()``, inside ``steps``)."""

    def profile(self, times: dict[str, dict[str, float]] | None = None, *, smooth: bool = False,
                heads: HeadMeasures | None = None, tiles: dict[str, OptionCost] | None = None,
                **fixed: Any) -> Profile:
        """The ``Profile``: these bytes, with ``times`` (default: the roofline's), ``heads`` and
        ``tiles`` (default: the fake run's), and ``fixed`` over the run's own fields."""
        prof = assemble(model=self.model, named=self.named, traces=self.traces, times=times or self.times,
                        host_link_bytes_per_s=self.host_link_bytes_per_s, smooth=smooth, sides=self.sides,
                        **(self.fixed | fixed))  # fmt: skip
        prof = add_tiles(add_heads(prof, heads if heads is not None else self.heads),
                         tiles if tiles is not None else self.tiles)
        return with_skips(self.traces["keep"][1], prof, self.unsaved)


def fake_run(make_model: Callable[[Any], nn.Module], batch: Any, loss_fn: Any,
             make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None, blocks: Any,
             spec: DeviceSpec) -> FakeRun:
    """The profiler's steps on fake tensors. ``make_model(steps)`` makes the model inside the
    fake mode of ``steps`` (a ``FakeSteps``); ``make_optimizer(model)`` its optimizer; ``batch`` the user's, taken as it is (NOTE
    [ The batch's values ] in remat.measure.fake_steps), or a ``BatchFactory`` made inside the mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.measure.fake import FakeMeter
    from remat.measure.fake_steps import FakeSteps

    made = isinstance(batch, BatchFactory)
    steps = FakeSteps(FakeTensorMode(allow_non_fake_inputs=True), None if made else batch)
    with steps:
        model = make_model(steps)
        steps.watch(model)
        step_batch = batch.make() if made else batch  # the user's, real: NOTE [ The batch's values ] in remat.measure.fake_steps
        opt = make_optimizer(model) if make_optimizer is not None else None
        named = find_blocks(model, blocks, required=False)
        skipped = layerdrop_blocks(model)  # Profile.layerdrop
        layerdrop_off(model)  # a fake model, thrown away after: nothing to put back
        cache_off(model)  # on a fake model, thrown away after: nothing to remove
        _create_state(model, opt)
        named, coarse, repeated = running(model, named, blocks is not None, step_batch, loss_fn, opt)
    if coarse:  # rule 9, outside the fake mode, whose tensors another one's steps cannot take
        floors = FakeFloors(make_model, batch, loss_fn, make_optimizer, spec)
        named = by_floor(named, coarse, floors)
        if (chosen := floors.runs.get(tuple(n for n, _ in named))) is not None:
            return dataclasses.replace(chosen, fixed=chosen.fixed | {"repeated": repeated})  # its blocks named
    with steps:
        keys = base_keys(model, opt, step_batch)
        runs = option_runs(model, named, step_batch, loss_fn, opt, keys, lambda: FakeMeter(spec, carrier=model))
        traces = {option: (meter.trace, hooks) for option, (meter, hooks) in runs.items()}
        times = {option: phase_times({m.label: m.t_ms for m in meter.marks}, hooks.order)
                 for option, (meter, hooks) in runs.items()}
        sides, unsaved = sides_of(model, named, step_batch, loss_fn, opt, keys, traces["keep"][1])
        param_bytes = _storages.param_bytes(model)
        opt_bytes = _storages.optimizer_bytes(opt)
        data = _storages.batch_bytes(step_batch)
        buffers = _storages.storage_bytes(list(model.buffers()))
        marked = functools.partial(marked_step, model, named, step_batch, loss_fn, opt, base_keys=keys)
        runner = StepRunner(marked, model, spec=spec)
        heads, tiles = measure_heads(model, named, runner), measure_tiles(named, runner, times["keep"])
    return FakeRun(
        model=model, named=named, traces=traces, times=times, sides=sides, unsaved=unsaved, heads=heads, tiles=tiles,
        steps=steps, runner=runner,
        host_link_bytes_per_s=spec.host_link_bytes_per_s * ROOFLINE_EFFICIENCY["host_link"]
        if spec.name != "cpu" else None,
        fixed=dict(
            device=spec.name, mode="estimated", dtype=dtype_name(model), batch_shape=_storages.batch_shape(step_batch),
            base_bytes=param_bytes + buffers + opt_bytes + data, param_bytes=param_bytes,
            optimizer_bytes=opt_bytes, batch_bytes=data, device_memory_bytes=spec.memory_bytes,
            layerdrop=[n for n, _ in named if n in skipped], repeated=repeated,
        ),
    )  # fmt: skip


@dataclasses.dataclass
class FakeFloors:
    """The floor of the model ``make_model`` makes with the blocks named, from its profile on fake
    tensors: what rule 9 of NOTE [ Blocks by what runs ] (``remat.manual.settle``) compares. Each
    run is kept (``runs``): the chosen list's is the fake run itself, not run again."""

    make_model: Callable[[Any], nn.Module]
    batch: Any
    loss_fn: Any
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None
    spec: DeviceSpec
    runs: dict[tuple[str, ...], FakeRun] = dataclasses.field(default_factory=dict)

    def __call__(self, names: list[str]) -> int:
        run = fake_run(self.make_model, self.batch, self.loss_fn, self.make_optimizer, names, self.spec)
        self.runs[tuple(names)] = run
        return smallest_any(run.profile())[0]


def plain_peak(model: nn.Module, batch: Any, loss_fn: Any, optimizer: torch.optim.Optimizer | None,
               spec: DeviceSpec, configure: Callable[[nn.Module], Any] | None = None) -> int:
    """The plain step's peak bytes (the batch, parameters, gradients and optimizer state
    included), from one step of a fake copy of ``model``: nothing is allocated. ``configure``:
    called on the copy first (to apply a plan to it), for that step's peak instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.measure.fake import FakeMeter
    from remat.measure.fake_steps import FakeSteps

    steps = FakeSteps(FakeTensorMode(allow_non_fake_inputs=True), batch)
    steps.watch(model)
    with steps:
        fake = fake_copy(model, steps)
        opt = fake_optimizer(optimizer, model)(fake) if optimizer is not None else None
        cache_off(fake)
        layerdrop_off(fake)  # a fake copy, thrown away after: nothing to put back
        if configure is not None:
            configure(fake)
        _create_state(fake, opt)
        fake.zero_grad(set_to_none=True)
        _step.train_step(fake, batch, loss_fn, opt)  # lazy state, as the profiler's warm-up
        fake.zero_grad(set_to_none=True)
        meter = FakeMeter(spec)
        with meter:
            _step.train_step(fake, batch, loss_fn, opt)
        base = (_storages.param_bytes(fake) + _storages.storage_bytes(list(fake.buffers()))
                + _storages.optimizer_bytes(opt) + _storages.batch_bytes(batch))
    return base + meter.peak


def _create_state(model: nn.Module, opt: torch.optim.Optimizer | None) -> None:
    """The optimizer's state, made as its first step makes it: a step on zero gradients (fake
    tensors: nothing is computed anyway)."""
    if opt is None:
        return
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def fake_copy(model: nn.Module, steps: FakeSteps) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are fake tensors of the same shapes,
    dtypes, devices and ``requires_grad`` (tied ones stay tied): the user's own modules, at no
    memory. So are the tensors a module holds as plain attributes, alone or in lists, tuples and
    dicts: ``deepcopy`` under the fake mode cannot give a real tensor a storage (MONAI's attention
    keeps ``att_mat = torch.Tensor()``, its DynUNet a list of its deep supervision's heads). A
    ``staticmethod`` held on an instance (rotary-embedding-torch's) is shared: no deepcopy takes it,
    and so is a sparse tensor (openai-whisper's ``alignment_heads``), whose fake twin holds none of
    its values. A buffer of a few integers (a counter, a flag) is a real copy the steps own: a
    forward that reads it (performer-pytorch redraws its projections every so many calls) runs on
    the copy's values, as the real step does on the model's (NOTE [ The batch's values ] in
    remat.measure.fake_steps)."""
    fake_mode = steps.mode
    memo: dict[int, Any] = {}
    counters = {id(t) for t in model.buffers() if _counter(t)}
    for t in (*model.parameters(), *model.buffers()):
        if t.layout != torch.strided:  # a fake sparse tensor holds no values (its bytes 0): shared, as it is
            memo[id(t)] = t
            continue
        if id(t) in counters:
            memo[id(t)] = steps.real(t)
            continue
        fake = fake_mode.from_tensor(t)
        memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
    for module in model.modules():
        for value in _storages.tensors_in(list(vars(module).values())):
            if id(value) not in memo:
                memo[id(value)] = fake_mode.from_tensor(value)
        for value in vars(module).values():  # a function held on an instance: shared, as functions are
            if isinstance(value, (staticmethod, classmethod)):
                memo[id(value)] = value
    try:
        twin = copy.deepcopy(model, memo)
    except Exception as e:
        raise InvalidType(
            f"remat plans a step that does not fit on a copy of the model whose tensors are fake, "
            f"and {type(model).__name__} could not be copied ({type(e).__name__}: {e}); make it "
            "copyable with copy.deepcopy, or give a budget the plain step fits"
        ) from e
    _put_back_fakes(model, twin, memo)
    return twin


_COUNTER_ELEMENTS = 64
"""The most elements of an integer buffer a fake copy keeps real (``fake_copy``)."""


def _counter(t: torch.Tensor) -> bool:
    return (t.layout == torch.strided and not t.is_floating_point() and not t.is_complex()
            and t.numel() <= _COUNTER_ELEMENTS and t.device.type != "meta")


def _put_back_fakes(model: nn.Module, twin: nn.Module, memo: dict[int, Any]) -> None:
    """Give ``twin`` the fakes of ``memo`` where its module's own ``__getstate__`` copied a tensor
    without them: e3nn's kernels pickle a submodule, whose buffers ``pickle.loads`` rebuilt on the
    meta device, and the fake step failed (meta and cpu), so a budget below the plain step ran it."""
    twins = dict(twin.named_modules(remove_duplicate=False))
    for name, module in model.named_modules(remove_duplicate=False):
        if (copied := twins.get(name)) is None:
            continue
        for kind in ("_parameters", "_buffers"):
            mine, theirs = getattr(module, kind), getattr(copied, kind)
            for key, t in mine.items():
                if t is not None and id(t) in memo and key in theirs and theirs[key] is not memo[id(t)]:
                    theirs[key] = memo[id(t)]


def fake_optimizer(optimizer: torch.optim.Optimizer,
                   model: nn.Module) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """A factory of ``optimizer``'s twin over a fake copy of ``model``: the same class, parameter
    groups and hyperparameters."""

    def make(fake: nn.Module) -> torch.optim.Optimizer:
        index = {id(p): q for p, q in zip(model.parameters(), fake.parameters())}
        groups = [{**g, "params": [index[id(p)] for p in g["params"] if id(p) in index]}
                  for g in optimizer.param_groups]
        try:
            return type(optimizer)([g for g in groups if g["params"]])  # type: ignore[call-arg]
        except Exception as e:
            raise InvalidValue(
                f"remat plans a step that does not fit with a twin of the optimizer over fake tensors, "
                f"and {type(optimizer).__name__}(param_groups) failed ({type(e).__name__}: {e}); pass "
                "the optimizer as a factory, optimizer=lambda params: MyOptimizer(params, ...)"
            ) from e

    return make


def check_factory(factory: Any, optimizer: Any) -> None:
    """Estimated mode's arguments: a model factory, and an optimizer factory when any."""
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
