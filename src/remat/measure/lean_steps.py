"""The real steps of a lean profile (rule 4 of NOTE [ Planning what does not fit ] in
``remat.measure.lean``): each predicted within the budget from the fake bytes, they give the
profile its times and what no tensor holds (NOTE [ What no tensor holds ] in
``remat.measure.scratch``)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn

from remat.manual.lm_head import HEAD_KEEP
from remat.manual.segments import apply_segments, remove_segments
from remat.measure.attribution import attribute
from remat.measure.estimated import FakeRun
from remat.measure.heads import HeadMeasures, head_option
from remat.measure.notes import PartNumbers
from remat.measure.runner import StepRunner, every_block
from remat.measure.scratch import Scratch
from remat.measure.tracer import KernelKey, sized
from remat.plan.head import estimate_with_head
from remat.plan.solver import smallest_any, solve
from remat.records import OptionCost, Profile
from remat.units import format_bytes

__all__ = ["LeanSteps", "Measured"]

log = logging.getLogger(__name__)


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
    """Whether the times are the roofline's (the lean step is predicted over the budget: none ran)."""


_Parts = dict[str, int]
"""Bytes a real step peaked above its fake twin in one phase (NOTE [ What no tensor holds ])."""


class LeanSteps:
    """The real steps of rule 4, each predicted within the budget, and what they give: times, and
    what no tensor holds (NOTE [ What no tensor holds ])."""

    def __init__(self, runner: StepRunner, named: list[tuple[str, nn.Module]], fake: Profile,
                 run: FakeRun, budget_bytes: int, remake: Callable[[dict[KernelKey, int]], tuple[FakeRun, Profile]]) -> None:
        self.runner, self.named, self.fake, self.run, self.budget = runner, named, fake, run, budget_bytes
        self.remake = remake
        """The fake steps again, with the kernel scratch a real step measured (NOTE [ What each
        kernel allocates ] in remat.measure.tracer): ``run`` and ``fake`` become theirs."""
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

    def _measure(self, options: Sequence[str], head: str, segments: Sequence[Sequence[str]] = (),
                 kernels: bool = False) -> tuple[list[PartNumbers], _Parts]:
        """Per block, and for the parts around them, what the real step of this configuration
        peaked above its fake twin (NOTE [ What no tensor holds ]); marks at every save, for the
        peak before a kept block's last save (``stop_peak``). ``kernels``: the fake steps are made
        again with the kernel scratch the real step measured, before its twin runs."""
        n, runner = len(self.names), self.runner
        with self._config(runner.model, self.named, options, head, segments):
            trace, hooks, _ = StepRunner(functools.partial(runner.marked, saves=True), runner.model,
                                         device=runner.device).traced(kernels)
            real = attribute(trace, hooks, n)
        if trace.kernel_scratch:
            self.run, self.fake = self.remake(trace.kernel_scratch)
        twin = self.run.runner
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
        # warm-up: lazy state, the allocator, sized frees (NOTE [ A free the CPU trace cannot size ] in
        # remat.measure.tracer); a selective block recomputed instead, whose replay met an op its forward
        # had not recorded where that forward made lazy state (CoCa's rotary table)
        warm = ["recompute" if plan.choices[n] == "selective" else plan.choices[n] for n in self.names]
        assert self.runner.device is not None  # the user's model's real steps
        with sized(self.runner.device) as mark, self._config(self.runner.model, self.named, warm, plan.head,
                                                              plan.segments):
            self.runner.marked(mark)
        blocks, parts = self._measure([plan.choices[n] for n in self.names], plan.head, plan.segments, kernels=True)
        s = self.scratch
        s.margin = max(0, *(v for b in blocks for v in (b.fwd_peak, b.bwd_peak, b.stop_peak) if v is not None))
        order = [b.name for b in self.fake.blocks]
        inside = {n for a, b in plan.segments for n in order[order.index(a):order.index(b) + 1]}
        for i, name in enumerate(self.names):
            if name not in inside:
                s.add(plan.choices[name], [name], [blocks[i]])
            else:  # its phases in the segment (NOTE [ What no tensor holds ])
                b = blocks[i]
                s.add("keep", [name], [b])
                s.add("recompute", [name], [dataclasses.replace(b, bwd_peak=max(b.bwd_peak, b.fwd_peak))])
        s.parts, s.heads[plan.head] = parts, parts
        self.corrected = s.onto(self.fake)

    def run_steps(self) -> Measured:
        self._first()
        if not self.fits(self.lean, self.head):
            log.warning("remat: the step with every block recomputed is predicted over the budget of %s, so "
                        "no step times the options (the plans that fit keep some blocks, or nest segments): "
                        "the profile's times are the roofline's, not measured", format_bytes(self.budget))
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
