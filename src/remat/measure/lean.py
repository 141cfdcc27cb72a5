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
When not even the lean step fits (only nested segments do), the times stay the roofline's, and a
warning says so.
6. Predicted within the budget, the plain step may still run out of memory by what no tensor holds:
   a MONAI 3-D UNet's convolutions take 50 MB of scratch on the CPU beside a plain step of 73 MB on
   fake tensors (123 MB measured). Then the profile is made lean as if it were predicted over, with
   a warning, and the user's model as it was (``remat.measure.preserve``).
7. Where a lean profile's own step runs out of memory, the first is the floor plan's, whose peak is
   the lowest: no plan fits, and ``profile`` refuses the budget (``InfeasibleBudget.estimated``, the
   smallest above it), not as remat's fault (``remat.plan.refusals.ran_out_within``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from remat.devices import DeviceSpec, get_device
from remat.errors import InfeasibleBudget, RematError
from remat.manual.blocks import find_blocks
from remat.manual.lm_head import HEAD_KEEP
from remat.manual.segments import apply_segments, remove_segments
from remat.measure import step as _step
from remat.measure.attribution import attribute
from remat.measure.estimated import (
    FAKE_LIMITS,
    FakeRun,
    fake_copy,
    fake_optimizer,
    fake_run,
    plain_peak,
)
from remat.measure.heads import HeadMeasures, head_option
from remat.measure.marked import base_keys, marked_step
from remat.measure.notes import PartNumbers
from remat.measure.preserve import preserved
from remat.measure.runner import StepRunner, every_block
from remat.measure.scratch import Scratch
from remat.measure.tracer import host_link_bytes_per_s
from remat.plan.costmodel import estimate
from remat.plan.head import estimate_with_head
from remat.plan.refusals import tensors_alone
from remat.plan.solver import smallest_any, solve
from remat.records import OptionCost, Profile
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
    run = fake_run(functools.partial(fake_copy, model), batch, loss_fn, make_opt, blocks, lean.spec)
    cuda = device.type == "cuda"
    if cuda:
        run.host_link_bytes_per_s = host_link_bytes_per_s(device)
    fixed: dict[str, Any] = dict(device=str(device), mode="measured", plain_ran=False,
                                 device_memory_bytes=lean.spec.memory_bytes if cuda else None)
    fake = run.profile(**fixed)
    try:
        solve(fake, lean.budget_bytes)  # InfeasibleBudget before any real step (rule 3)
    except InfeasibleBudget as e:
        raise tensors_alone(e) from None
    modules = dict(model.named_modules())
    named = [(name, modules[name]) for name, _ in run.named]
    with preserved(model, optimizer):
        keys = base_keys(model, optimizer, batch)
        marked = functools.partial(marked_step, model, named, batch, loss_fn, optimizer, base_keys=keys)
        runner = StepRunner(marked, model, device=device, repeats=repeats)
        measured = _Timing(runner, named, fake, run, lean.budget_bytes).run_steps()
    if measured.roofline:
        fixed["mode"] = "estimated"
    prof = run.profile(measured.times, smooth=not measured.roofline, heads=measured.heads, tiles=measured.tiles,
                       **fixed)  # fmt: skip
    prof = measured.scratch.onto(prof)
    # rule 5: the plain step's peak with what no tensor holds (the fake step's was without it)
    return dataclasses.replace(prof, plain_peak_bytes=estimate(prof, {b.name: "keep" for b in prof.blocks}).peak_bytes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """What the real steps of a lean profile measured."""

    times: dict[str, dict[str, float]]
    """``assemble``'s times: ``keep`` (the plain step's phases) and ``selective``; the roofline's
    when no lean step fits (``roofline``)."""
    heads: HeadMeasures | None
    """The head's options that a lean step fits, with their measured times."""
    tiles: dict[str, OptionCost]
    """The tiled options, with their measured extra times."""
    scratch: Scratch
    roofline: bool = False
    """Whether the times are the roofline's (only nested segments fit: no lean step ran)."""


_Parts = dict[str, int]
"""Bytes a real step peaked above its fake twin in one phase (NOTE [ What no tensor holds ])."""


class _Timing:
    """The real steps of rule 4, each predicted within the budget, and what they give: times, and
    what no tensor holds (NOTE [ What no tensor holds ])."""

    def __init__(self, runner: StepRunner, named: list[tuple[str, nn.Module]], fake: Profile,
                 run: FakeRun, budget_bytes: int) -> None:
        self.runner, self.named, self.fake, self.run, self.budget = runner, named, fake, run, budget_bytes
        self.names = [n for n, _ in named]
        self.lean = ["recompute"] * len(named)
        self.scratch = Scratch()
        self.corrected = fake
        """The fake bytes with the scratch measured so far (none yet): what steps are gated by."""
        heads = [HEAD_KEEP, *(run.heads.segments if run.heads else {})]
        self.head = min(heads, key=lambda h: self.peak(self.lean, h))  # the first of the leanest
        self.all_heads = heads
        by_name = {b.name: b for b in fake.blocks}
        kinds: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for i, name in enumerate(self.names):
            b = by_name[name]
            kinds[(b.kind, b.param_bytes, b.input_bytes, b.options["keep"].kept_bytes)].append(i)
        self.kinds = list(kinds.values())
        """Blocks of one kind and size; the first of each is run for all of them."""
        self.scratch.kinds = [[self.names[i] for i in k] for k in self.kinds]

    def peak(self, options: Sequence[str], head: str) -> int:
        return estimate_with_head(self.corrected, dict(zip(self.names, options)), head).peak_bytes

    def fits(self, options: Sequence[str], head: str) -> bool:
        return self.peak(options, head) <= self.budget

    def _with(self, option: str, firsts: Sequence[int]) -> list[str]:
        return [option if i in firsts else o for i, o in enumerate(self.lean)]

    def _groups(self, option: str, offered: Callable[[int], bool]) -> list[list[int]]:
        """The first block of each kind that offers ``option``, packed into steps that fit."""
        groups: list[list[int]] = []
        current: list[int] = []
        for first in (kind[0] for kind in self.kinds if offered(kind[0])):
            if self.fits(self._with(option, [*current, first]), self.head):
                current.append(first)
            elif self.fits(self._with(option, [first]), self.head):
                groups.append(current)
                current = [first]
        return [g for g in [*groups, current] if g]

    @contextlib.contextmanager
    def _config(self, model: nn.Module, named: Sequence[tuple[str, nn.Module]], options: Sequence[str],
                head: str, segments: Sequence[Sequence[str]] = ()) -> Iterator[None]:
        """The blocks of ``named`` with ``options``, the head with ``head``, and ``segments`` over
        them (a plan's, as ``remat.apply`` sets them)."""
        with every_block(named, options), contextlib.ExitStack() as stack:
            if self.run.heads is not None:
                stack.enter_context(head_option(model, self.run.heads.name, head, self.run.heads.causal_lm))
            if segments:
                order = [b.name for b in self.fake.blocks]
                modules = dict(named)
                blocks = [modules[name] for name in order]
                stack.callback(remove_segments, blocks)  # first: undone even if applying fails
                apply_segments(blocks, [(order.index(a), order.index(b)) for a, b in segments], order)
            yield

    def _real(self, options: Sequence[str], head: str) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        return functools.partial(self._config, self.runner.model, self.named, options, head)

    def _measure(self, options: Sequence[str], head: str,
                 segments: Sequence[Sequence[str]] = ()) -> tuple[list[PartNumbers], _Parts]:
        """Per block, and for the parts around them, what the real step of this configuration
        peaked above its fake twin (NOTE [ What no tensor holds ]); marks at every save, for the
        peak before a kept block's last save (``stop_peak``)."""
        n, runner, twin = len(self.names), self.runner, self.run.runner
        with self._config(runner.model, self.named, options, head, segments):
            real = attribute(*StepRunner(functools.partial(runner.marked, saves=True), runner.model,
                                         device=runner.device).traced()[:2], n)
        with self.run.steps, self._config(self.run.model, self.run.named, options, head, segments):
            fake = attribute(*StepRunner(functools.partial(twin.marked, saves=True), twin.model,
                                         spec=twin.spec).traced()[:2], n)
        blocks = [r.minus(f) for r, f in zip(real[2], fake[2])]
        parts = {"post_kept": real[1].kept_bytes - fake[1].kept_bytes,  # NOTE [ What no tensor holds ]
                 "pre_grad": real[0].grad_bytes - fake[0].grad_bytes,
                 "post_grad": real[1].grad_bytes - fake[1].grad_bytes,
                 "pre_fwd": real[0].fwd_peak_bytes - fake[0].fwd_peak_bytes,
                 "pre_bwd": real[0].bwd_peak_bytes - fake[0].bwd_peak_bytes,
                 "post_fwd": real[1].fwd_peak_bytes - fake[1].fwd_peak_bytes,
                 "post_bwd": real[1].bwd_peak_bytes - fake[1].bwd_peak_bytes,
                 "optimizer": real[3] - fake[3]}
        return blocks, parts

    def _first(self) -> None:
        """The floor plan's step (the lowest predicted peak): the scratch every later step is
        gated with (NOTE [ What no tensor holds ])."""
        plan = solve(self.fake, smallest_any(self.fake)[0])
        with self._config(self.runner.model, self.named, [plan.choices[n] for n in self.names], plan.head,
                          plan.segments):
            self.runner.marked(lambda _: None)  # warm-up: lazy state, the allocator
        blocks, parts = self._measure([plan.choices[n] for n in self.names], plan.head, plan.segments)
        s = self.scratch
        s.margin = max(0, *(v for b in blocks for v in (b.fwd_peak, b.bwd_peak, b.stop_peak) if v is not None))
        order = [b.name for b in self.fake.blocks]
        inside = {n for a, b in plan.segments for n in order[order.index(a):order.index(b) + 1]}
        for i, name in enumerate(self.names):  # a block in a segment ran no option of its own
            if name not in inside:
                s.add(plan.choices[name], [name], [blocks[i]])
        s.parts, s.heads[plan.head] = parts, parts
        self.corrected = s.onto(self.fake)

    def run_steps(self) -> Measured:
        self._first()
        if not self.fits(self.lean, self.head):
            log.warning("remat: not even every block recomputed fits the budget of %s (only nested "
                        "segments do): the profile's times are the roofline's, not measured",
                        format_bytes(self.budget))
            return Measured(times={o: t for o, t in self.run.times.items() if o in ("keep", "selective")}, heads=self.run.heads,
                            tiles=self.run.tiles, scratch=self.scratch, roofline=True)
        lean_blocks, lean_parts = self._measure(self.lean, self.head)
        self.scratch.add("recompute", self.names, lean_blocks)
        self.scratch.parts = self.scratch.heads[self.head] = lean_parts
        self.corrected = self.scratch.onto(self.fake)
        heads = [h for h in self.all_heads if h != self.head and self.fits(self.lean, h)]
        tiled = self.run.tiles
        groups = {
            "keep": self._groups("keep", lambda i: True),
            "selective": self._groups("selective", lambda i: "selective" in self.fake.options),
            "tiled": self._groups("tiled", lambda i: self.names[i] in tiled),
        }
        for option, gs in groups.items():
            for g in gs:
                blocks = self._measure(self._with(option, g), self.head)[0]
                members = list(self._members(g))
                self.scratch.add(option, [self.names[i] for i, _ in members], [blocks[first] for _, first in members])
        for h in heads:
            self.scratch.heads[h] = self._measure(self.lean, h)[1]
        if HEAD_KEEP in self.scratch.heads:
            self.scratch.parts = self.scratch.heads[HEAD_KEEP]
        configs = [(self.lean, self.head), *((self.lean, h) for h in heads)]
        configs += [(self._with(o, g), self.head) for o, gs in groups.items() for g in gs]
        measured = self.runner.times([self._real(*c) for c in configs])
        lean = measured[0]
        by_head = dict(zip([self.head, *heads], measured))
        rest = iter(measured[1 + len(heads):])
        timed = {o: [(g, next(rest)) for g in gs] for o, gs in groups.items()}
        keep = self._keep(lean, timed["keep"], by_head.get(HEAD_KEEP))
        return Measured(
            times={"keep": keep} | ({"selective": self._selective(keep, timed["selective"])}
                                    if "selective" in self.fake.options else {}),
            heads=self._heads(by_head), tiles=self._tiles(keep, timed["tiled"]), scratch=self.scratch,
        )  # fmt: skip

    def _members(self, firsts: Sequence[int]) -> Iterator[tuple[int, int]]:
        """(block, the first of its kind) for every block of the kinds ``firsts`` stand for."""
        for first in firsts:
            for i in next(k for k in self.kinds if k[0] == first):
                yield i, first

    def _each(self, steps: list[tuple[list[int], dict[str, float]]]) -> Iterator[tuple[int, int, dict[str, float]]]:
        """(block, the first of its kind, that step's times) for every block whose kind was timed."""
        for firsts, t in steps:
            for i, first in self._members(firsts):
                yield i, first, t

    def _keep(self, lean: dict[str, float], steps: list[tuple[list[int], dict[str, float]]],
              head_keep: dict[str, float] | None) -> dict[str, float]:
        keep = dict(lean)
        for i in range(len(self.names)):  # a recomputed backward runs the forward once more
            keep[f"bwd{i}"] = max(lean[f"bwd{i}"] - lean[f"fwd{i}"], 0.0)
        for i, first, t in self._each(steps):
            keep[f"fwd{i}"], keep[f"bwd{i}"] = t[f"fwd{first}"], t[f"bwd{first}"]
        if head_keep is not None:
            keep["post_fwd"], keep["post_bwd"] = head_keep["post_fwd"], head_keep["post_bwd"]
        keep["step"] = lean["step"] + sum(keep[k] - lean[k] for k in lean if k != "step")
        return keep

    def _selective(self, keep: dict[str, float], steps: list[tuple[list[int], dict[str, float]]]) -> dict[str, float]:
        sel = {}
        for i in range(len(self.names)):  # untimed: what a recompute costs
            sel[f"fwd{i}"], sel[f"bwd{i}"] = keep[f"fwd{i}"], keep[f"bwd{i}"] + keep[f"fwd{i}"]
        for i, first, t in self._each(steps):
            sel[f"fwd{i}"], sel[f"bwd{i}"] = t[f"fwd{first}"], t[f"bwd{first}"]
        return sel

    def _tiles(self, keep: dict[str, float], steps: list[tuple[list[int], dict[str, float]]]) -> dict[str, OptionCost]:
        extra = {self.names[i]: keep[f"fwd{i}"] for i in range(len(self.names))}  # untimed: recompute's
        for i, first, t in self._each(steps):
            fwd = keep[f"fwd{i}"]
            extra[self.names[i]] = max(t[f"fwd{first}"] + t[f"bwd{first}"] - fwd - keep[f"bwd{i}"], fwd / 20)
        return {name: dataclasses.replace(cost, extra_ms=extra[name]) for name, cost in self.run.tiles.items()}

    def _heads(self, by_head: dict[str, dict[str, float]]) -> HeadMeasures | None:
        heads = self.run.heads
        if heads is None:
            return None
        segments = {o: dataclasses.replace(seg, fwd_ms=by_head[o]["post_fwd"], bwd_ms=by_head[o]["post_bwd"])
                    for o, seg in heads.segments.items() if o in by_head}
        keep = by_head.get(HEAD_KEEP)
        return dataclasses.replace(heads, segments=segments, keep_fwd_ms=keep["post_fwd"] if keep else None,
                                   keep_bwd_ms=keep["post_bwd"] if keep else None)
