"""Profiling a step that does not fit: bytes from fake tensors, times from steps that fit.

# NOTE [ Planning what does not fit ]
The user who needs remat is the one whose plain step does not fit, so with a budget no step the
profiler runs may peak above it. The rules, in order:
1. The plain step runs first on fake tensors (a copy of the user's model whose parameters and
   buffers are fake, the batch and the optimizer likewise: ``remat.measure.estimated``). Nothing
   is allocated, and on the CPU its bytes are the real step's to the byte (the meter counts every
   storage, the RNG states checkpoints stash included: NOTE [ RNG states on the CPU ]).
2. Within the budget, the profile is measured as without one: every step it runs peaks at or
   below the plain step.
3. Over it, every byte of the profile comes from the profiler's steps on fake tensors (each block
   kept, selective, recomputed; the head's and the tiled MLP's options), and ``solve`` on it raises
   ``InfeasibleBudget`` when not even the floor fits, before a single real step. That floor is the
   tensors' alone (``InfeasibleBudget.estimated``): what no tensor holds, which only a real step
   measures, may raise it.
4. Times come from real steps, and a step runs only when the cost model predicts its peak within
   the budget from those bytes: every block recomputed with the leanest head (the lean step), and
   steps with one block of each kind kept, then selective, then tiled, among recomputed blocks, as
   many kinds a step as the budget allows (a 32-block model of one kind: one step per option). A
   block of a kind that fits no such step gets the lean step's numbers: keep's backward is the
   recomputed backward less its forward, and selective and tiled cost what recompute costs. A head
   option that fits no lean step is left out; the head as written, when it does not fit, is
   timed as the leanest head.
5. The plain step's peak and time are predicted (``Profile.plain_ran`` is False): the peak by the
   cost model from these bytes, the time as the lean step's less each recompute.
Why no step exceeds the budget: every real step is a configuration whose peak the cost model
predicts from bytes that are the step's own, and it runs only when that prediction is within the
budget. What can still differ is what no tensor holds (a CPU kernel's scratch space, the caching
allocator's reserve on CUDA): ``verify`` measures it, and ``auto(verify=True)`` re-solves for it.
When not even the lean step fits (the plans that do keep some blocks, or nest segments), the times
stay the roofline's, and a warning says so.
6. Predicted within the budget, the plain step may still run out of memory by what no tensor holds:
   a MONAI 3-D UNet's convolutions take 50 MB of scratch on the CPU beside a plain step of 73 MB on
   fake tensors (123 MB measured). Then the profile is made lean as if it were predicted over, with
   a warning, and the user's model as it was (``remat.measure.preserve``).
7. Where a lean profile's own step runs out of memory, the first is the floor plan's, whose peak is
   the lowest: no plan fits, and ``profile`` refuses the budget (``InfeasibleBudget.estimated``, the
   smallest above it), not as remat's fault (``remat.plan.refusals.ran_out_within``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch
from torch import nn

from remat.devices import DeviceSpec, get_device
from remat.errors import InfeasibleBudget, ProfileError, RematError, out_of_memory
from remat.manual.blocks import find_blocks, fingerprint
from remat.measure import step as _step
from remat.measure.estimated import (
    FAKE_LIMITS,
    FakeRun,
    fake_copy,
    fake_optimizer,
    fake_run,
    plain_peak,
)
from remat.measure.lean_steps import LeanSteps
from remat.measure.marked import base_keys, marked_step
from remat.measure.preserve import as_given, module_states, preserved
from remat.measure.runner import StepRunner
from remat.measure.tracer import KernelKey, host_link_bytes_per_s
from remat.plan.costmodel import estimate
from remat.plan.refusals import infeasible
from remat.plan.solver import solve
from remat.records import Profile
from remat.units import format_bytes, parse_budget

__all__ = ["Lean", "lean_profile", "lean_spec", "resolve_budget"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lean:
    """A budget, and the plain step's peak predicted against it."""

    budget_bytes: int
    plain_peak_bytes: int
    """The plain step's peak, predicted from fake tensors."""
    spec: DeviceSpec
    """The spec the fake steps run under (the CPU's, or the CUDA device's memory)."""

    @property
    def fits(self) -> bool:
        """Whether the plain step is predicted within the budget (NOTE [ Planning what does not
        fit ], rule 2; what no tensor holds may still make it run out: rule 6)."""
        return self.plain_peak_bytes <= self.budget_bytes


def resolve_budget(model: nn.Module, batch: Any, loss_fn: Any, optimizer: torch.optim.Optimizer | None,
                   budget: int | str) -> Lean | None:
    """The budget in bytes and the plain step's predicted peak; None when that cannot be predicted
    (a model whose forward reads tensor values runs no step on fake tensors)."""
    device = _step.batch_device(model, batch)
    spec = lean_spec(device)
    try:
        plain = plain_peak(model, batch, loss_fn, optimizer, spec)
    except RematError:  # what the user can act on (a model that cannot be copied, ...)
        raise
    except Exception as e:  # a forward that reads tensor values, an op fake tensors cannot run
        if out_of_memory(e):  # the host's memory, not the model's code: never run the plain step instead
            raise _ran_out_on_fakes(e) from e
        why = "its forward reads tensor values" if isinstance(e, FAKE_LIMITS) else str(e).split("\n")[0][:200]
        log.warning("remat: %s runs no step on fake tensors (%s: %s), so the plain step cannot be "
                    "predicted: it is profiled by running it, which needs it to fit the device",
                    type(model).__name__, type(e).__name__, why)
        return None
    budget_bytes = parse_budget(budget, plain_peak_bytes=plain,
                                device_memory_bytes=spec.memory_bytes if device.type == "cuda" else None)
    lean = Lean(budget_bytes=budget_bytes, plain_peak_bytes=plain, spec=spec)
    if not lean.fits:
        log.info("remat: the plain step is predicted at %s, over the budget of %s: profiling it lean",
                 format_bytes(plain), format_bytes(budget_bytes))
    return lean


def _ran_out_on_fakes(e: BaseException) -> ProfileError:
    """The host running out of memory in a step on fake tensors, before any real step: no refusal
    of the budget, and no reason to run the plain step instead."""
    return ProfileError(
        f"remat ran out of host memory planning on fake tensors, before any real step ({type(e).__name__}: "
        f"{str(e)[:200]}): the fake copy of the model and its steps take host memory, tens of MB on the CPU, "
        "where the budget's memory is that memory too. Give the process more memory than the budget, or "
        "plan where there is more and apply the saved plan here (Plan.save, Plan.load, remat.apply)")


def lean_spec(device: torch.device) -> DeviceSpec:
    """The spec fake steps of ``device`` run under: the CPU's (the same kernels, so the same
    bytes), with a CUDA device's name and memory."""
    spec = get_device("cpu")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        spec = dataclasses.replace(spec, name="cuda", memory_bytes=total)
    return spec


def lean_profile(model: nn.Module, batch: Any, loss_fn: Any, optimizer: torch.optim.Optimizer | None,
                 blocks: Any, repeats: int, lean: Lean) -> Profile:
    """The profile of a step the plain step does not fit (NOTE [ Planning what does not fit ])."""
    device = _step.batch_device(model, batch)
    make_opt = fake_optimizer(optimizer, model) if optimizer is not None else None
    if blocks is not None:  # by name: the fake copy's modules are not the user's
        blocks = [name for name, _ in find_blocks(model, blocks)]
    cuda = device.type == "cuda"
    fixed: dict[str, Any] = dict(device=str(device), mode="measured", plain_ran=False,
                                 device_memory_bytes=lean.spec.memory_bytes if cuda else None,
                                 fingerprint=fingerprint(model))  # the user's: a module's own copy may
    # order its submodules otherwise (e3nn's kernels, pickled, come back last: estimated.fake_copy)

    given = module_states(model)

    def fake_profile(kernels: dict[KernelKey, int]) -> tuple[FakeRun, Profile]:
        spec = dataclasses.replace(lean.spec, kernel_scratch=kernels)
        with as_given(given):  # NOTE [ A module's state is its buffers and its attributes ], rule 2
            run = fake_run(functools.partial(fake_copy, model), batch, loss_fn, make_opt, blocks, spec)
        if cuda:
            run.host_link_bytes_per_s = host_link_bytes_per_s(device)
        return run, run.profile(**fixed)

    try:
        run, fake = fake_profile({})
    except (RuntimeError, MemoryError) as e:
        if not out_of_memory(e):
            raise
        raise _ran_out_on_fakes(e) from e
    try:
        solve(fake, lean.budget_bytes)  # InfeasibleBudget before any real step (rule 3)
    except InfeasibleBudget as e:
        raise infeasible(fake, e.budget_bytes, e.smallest_bytes, e.dominant, estimated=True) from None
    modules = dict(model.named_modules())
    named = [(name, modules[name]) for name, _ in run.named]
    with preserved(model, optimizer, batch):
        keys = base_keys(model, optimizer, batch)
        marked = functools.partial(marked_step, model, named, batch, loss_fn, optimizer, base_keys=keys)
        runner = StepRunner(marked, model, device=device, repeats=repeats)
        steps = LeanSteps(runner, named, fake, run, lean.budget_bytes, fake_profile)
        measured = steps.run_steps()
    run = steps.run  # with the kernels' scratch (NOTE [ What each kernel allocates ] in remat.measure.tracer)
    if measured.roofline:
        fixed["mode"] = "estimated"
    prof = run.profile(measured.times, smooth=not measured.roofline, heads=measured.heads, tiles=measured.tiles,
                       **fixed)  # fmt: skip
    prof = measured.scratch.onto(prof)
    # rule 5: the plain step's peak with what no tensor holds (the fake step's was without it)
    return dataclasses.replace(prof, plain_peak_bytes=estimate(prof, {b.name: "keep" for b in prof.blocks}).peak_bytes)
