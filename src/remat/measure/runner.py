"""Extra traced and timed steps for options measured after the blocks' own runs (the head's
options, the tiled MLP): the same marked step as the profiler's, on the same clock.

``StepRunner`` wraps the profiler's marked step (``marked(mark, saved=None) -> the block hooks``): ``traced()``
runs one step under the memory tracer (``MemoryTracer`` on a real device, ``FakeMeter`` in
estimated mode) and returns its trace, hooks and mark times; ``times(configs)`` runs ``repeats``
timed steps of each configuration in turns (NOTE [ CPU time on a shared CPU ] in
``remat.measure.clock``) and returns the median phase times of each, in measured mode, or the traced
step's roofline times in estimated mode. The profiler builds it; the modules that measure options
use it, so that they need nothing private of the profiler's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from remat.devices import DeviceSpec
from remat.manual.options import clear_option, option_of, set_option, touched
from remat.measure import clock
from remat.measure.notes import StepNotes
from remat.measure.phases import median_times, phase_times
from remat.measure.tracer import MemoryTracer, Trace

__all__ = ["StepRunner", "every_block"]


class StepRunner:
    """Traced and timed steps of one model and batch (see the module's docstring)."""

    def __init__(
        self,
        marked: Callable[..., StepNotes],
        model: nn.Module,
        *,
        device: torch.device | None = None,
        spec: DeviceSpec | None = None,
        repeats: int = 1,
    ) -> None:
        assert (device is None) != (spec is None), "a real device or an estimated one"
        self.marked, self.model, self.device, self.spec, self.repeats = marked, model, device, spec, repeats

    @property
    def estimated(self) -> bool:
        return self.spec is not None

    def traced(self, kernels: bool = False) -> tuple[Trace, StepNotes, dict[str, float]]:
        """One step under the memory tracer: its trace, hooks, and (estimated mode) phase times.
        The step starts without gradients, as the profiler's traced steps do (a step that starts
        with them frees them first, and every level of its trace would be off by their bytes).
        ``kernels``: the trace measures each kernel's scratch too (a real step on the CPU)."""
        self.model.zero_grad(set_to_none=True)
        if self.spec is not None:
            from remat.measure.fake import FakeMeter

            meter = FakeMeter(self.spec, carrier=self.model)
            with meter:
                hooks = self.marked(meter.mark)
            stamps = {m.label: m.t_ms for m in meter.marks}
            return meter.trace, hooks, phase_times(stamps, hooks.order)
        assert self.device is not None
        with MemoryTracer(self.device, kernels) as tracer:
            hooks = self.marked(tracer.mark)
        return tracer.trace, hooks, {}

    def times(
        self, configs: Sequence[Callable[[], contextlib.AbstractContextManager[Any]]]
    ) -> list[dict[str, float]]:
        """Median phase times of each configuration (a context that sets it up), timed in turns."""
        if self.spec is not None:
            out = []
            for config in configs:
                with config():
                    out.append(self.traced()[2])
            return out
        assert self.device is not None
        device = self.device
        runs: list[list[dict[str, float]]] = [[] for _ in configs]
        with clock.no_gc():
            for _ in range(self.repeats):
                for config, config_runs in zip(configs, runs):
                    marks = _Clock(device)
                    with config():
                        hooks = self.marked(marks.mark)
                    config_runs.append(phase_times(marks.times, hooks.order))
        return [median_times(r) for r in runs]


class _Clock:
    """Marks for the timed steps on the step clock (NOTE [ CPU time on a shared CPU ])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, float] = {}

    def mark(self, label: str) -> None:
        self.times[label] = clock.step_clock_ms(self.device)


@contextlib.contextmanager
def every_block(named: Sequence[tuple[str, nn.Module]], option: str | Sequence[str]) -> Iterator[None]:
    """Every block of ``named`` with ``option`` (or one option each) while the block runs."""
    options = [option] * len(named) if isinstance(option, str) else list(option)
    previous = [option_of(m) if touched(m) else None for _, m in named]  # None: the module's own
    try:
        for (_, m), o in zip(named, options):
            set_option(m, o)
        yield
    finally:
        for (_, m), mode in zip(named, previous):
            if mode is None:  # NOTE [ A module's own checkpointing ] in remat.manual.options
                clear_option(m)
            else:
                set_option(m, mode)
