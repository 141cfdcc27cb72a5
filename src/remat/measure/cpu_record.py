"""The CPU allocator's record, read a piece at a time: what ``remat.measure.tracer`` measures a
step's host memory with (NOTE [ How bytes are measured ] there).

# NOTE [ The CPU record's own memory ]
1. On the CPU the record of a step is host memory, the memory the budget is about (all of it, in a
   process whose address space is capped). Each event torch's profiler holds takes about 1 KB
   when it stops and is read (three copies: its results, its events and a Kineto trace), and the
   heap that grew stays mapped after it is dropped: 40,000 events peaked 36.9 MiB above the step
   and left 20.4 MiB. A model of many small ops was refused in a cap that torch's checkpoint on
   every block fits, by that much (benchmarks/record_cost.py measures a step's record).
2. So the record is cut: at a mark, once ``_CUT_NS`` have passed since the last cut, it stops, its
   events are folded into running sums (live bytes, the peak since the last mark, each kernel's
   scratch) and dropped, and a new one starts. Its memory is that of one piece, whatever the step.
3. A cut is safe only where no profiled range is open: a range that began in one record and ends
   in the next writes its end into the first's freed events. So a record holds no ranges but the
   ops, and those only where the kernels' scratch is measured (``ops=True``); there it is cut only
   where no op is running (``_inside_an_op``: not in a saved-tensors hook, a custom autograd
   Function's ``apply`` or a ``__torch_dispatch__``). A mark is no range either: a 977-byte
   allocation whose address the record shows, freed at once, and left out of the sums.
4. Never in a backward: the autograd engine runs each node under the thread state it took when
   the backward began, the profiler's with it, so what the nodes allocate after a cut would go to
   the stopped record (and be lost). A backward is one piece.
5. The profiler is started by its own calls, recording only memory events (and ops), never the
   autograd engine's nodes; ``torch.profiler.profile`` imports ``torch._dynamo`` on its first use.
   Not torch's legacy profiler: it records an op's end from a destructor, so a process that runs out
   of memory inside a traced step is aborted (``std::bad_alloc`` in ``terminate``).
6. Kineto writes two lines to the process's stderr at each start and stop (``USDT ...
   profiler_start``), which no setting but its environment at import silences: the calls run with
   file descriptor 2 on ``os.devnull``.
"""

from __future__ import annotations

import bisect
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

import torch
from torch._C._autograd import _disable_profiler, _enable_profiler, _prepare_profiler
from torch._C._profiler import (
    ProfilerActivity,
    ProfilerConfig,
    ProfilerState,
    RecordScope,
    _EventType,
    _ExperimentalConfig,
)

from remat.errors import InvalidState

__all__ = ["CpuRecord", "inside_an_op"]

_CONFIG = ProfilerConfig(
    state=ProfilerState.KINETO, report_input_shapes=False, profile_memory=True, with_stack=False,
    with_flops=False, with_modules=False, experimental_config=_ExperimentalConfig(),
)
_NO_RANGES = {RecordScope.STATIC_RUNTIME_MODEL}
"""The scopes of a record without ranges: one no training step enters (an empty set means all)."""
_CUT_NS = 25_000_000
"""How long a piece of the record runs before the next mark cuts it (NOTE [ The CPU record's own
memory ] rule 2): at most a few thousand events, a cut (about 1 ms) in every 25 ms of the step."""
_MARKER_BYTES = 977
"""A mark's allocation: an odd size, which only a byte tensor of as many elements takes (and a
step's own one at the mark's address, between two marks, would be taken for it)."""

_OP_CODES: set[CodeType] = {torch.autograd.function.Function.apply.__code__}
"""Code that runs inside an op's profiled range: a mark made under it cannot cut (rule 3)."""


def inside_an_op(func: Any) -> Any:
    """Declare ``func`` (a saved-tensors hook) as run inside an op: marks under it do not cut."""
    _OP_CODES.add(func.__code__)
    return func


def _inside_an_op(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code in _OP_CODES or frame.f_code.co_name == "__torch_dispatch__":
            return True
        frame = frame.f_back
    return False


@contextmanager
def _quiet() -> Iterator[None]:
    """Kineto's lines at a start and a stop off the process's stderr (rule 6)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to keep them off
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class CpuRecord:
    """The CPU allocator's events while the block runs, with marks, folded into running sums a
    piece at a time (NOTE [ The CPU record's own memory ]). ``keep=False``: the events are only
    recorded (a warm-up step's, so that a later record can size its frees), never read; ``ops``:
    each kernel's scratch is measured too (NOTE [ What each kernel allocates ] in
    remat.measure.tracer)."""

    def __init__(self, ops: bool = False, keep: bool = True) -> None:
        self.ops = ops
        self.keep = keep
        self.live = 0
        """Bytes allocated minus freed since the record began."""
        self.peak = 0
        """The highest ``live``."""
        self.marks: list[tuple[int, int, float]] = []
        """Per mark: live bytes there, the highest since the previous mark, ms since the start."""
        self.points: list[tuple[float, int]] = []
        """(ms since the start, live bytes) after every allocation or free."""
        self.scratch: dict[tuple[str, int], int] = {}
        """Per op and the bytes it made, the most it allocated beyond what it began and ended with."""
        self._since = 0  # the highest live bytes since the last mark
        self._t0: int | None = None
        self._markers: deque[int] = deque()  # the addresses of the marks not yet read, in order
        self._marker_half = False  # one of the first's two events read
        self._cut_at = 0

    def __enter__(self) -> CpuRecord:
        self._start()
        return self

    def __exit__(self, *exc: Any) -> None:
        result = self._stop()
        if exc[0] is None:
            self._fold(result)
            if self._markers:
                raise InvalidState(f"{len(self._markers)} marks were not found in the CPU record")

    def mark(self) -> None:
        """A mark here: its live bytes, and the highest since the previous one, in ``marks``."""
        if self.keep:
            marker = torch.empty(_MARKER_BYTES, dtype=torch.uint8)
            self._markers.append(marker.data_ptr())
            del marker
        if time.perf_counter_ns() >= self._cut_at and torch._C._current_graph_task_id() == -1 and not (
                self.ops and _inside_an_op(sys._getframe(1))):
            self._fold(self._stop())
            self._start()

    def _start(self) -> None:
        activities = {ProfilerActivity.CPU}
        with _quiet():
            _prepare_profiler(_CONFIG, activities)
            scopes = {RecordScope.FUNCTION} if self.ops else _NO_RANGES
            _enable_profiler(_CONFIG, activities, scopes)  # type: ignore[call-arg]  # the stub lacks scopes
        self._cut_at = time.perf_counter_ns() + _CUT_NS

    def _stop(self) -> Any:
        with _quiet():
            return _disable_profiler()

    def _fold(self, result: Any) -> None:
        """Add one piece's events to the sums and forget them."""
        if not self.keep:
            return
        events: list[tuple[int, int, int]] = []  # (ns, bytes, address), in the record's order
        ops: list[tuple[int, int, str]] = []  # (start ns, end ns, op)
        stack = list(reversed(result.experimental_event_tree()))
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation:
                f = e.extra_fields
                if f.device.type == "cpu":
                    events.append((e.start_time_ns, f.alloc_size, f.ptr))
                continue
            if e.tag == _EventType.TorchOp and e.name.startswith("aten::"):
                ops.append((e.start_time_ns, e.end_time_ns, e.name))
            stack.extend(reversed(e.children))
        events.sort(key=lambda x: x[0])  # stable: the record's order among equal times
        if self._t0 is None:
            self._t0 = events[0][0] if events else 0
        start, times, levels = self.live, [], []
        for ns, nbytes, ptr in events:
            if self._markers and ptr == self._markers[0] and abs(nbytes) == _MARKER_BYTES:
                if nbytes > 0:
                    self.marks.append((self.live, self._since, (ns - self._t0) / 1e6))
                    self._since = self.live
                if self._marker_half:  # both of its events seen (its free can come first, at the same time)
                    self._markers.popleft()
                self._marker_half = not self._marker_half
                continue
            self.live += nbytes
            self._since = max(self._since, self.live)
            self.peak = max(self.peak, self.live)
            self.points.append(((ns - self._t0) / 1e6, self.live))
            times.append(ns)
            levels.append(self.live)
        if ops:
            self._add_scratch(times, levels, start, ops)

    def _add_scratch(self, times: list[int], levels: list[int], start: int, ops: list[tuple[int, int, str]]) -> None:
        """Per op of a piece, the most it peaked above the larger of its live bytes at start and
        end (NOTE [ What each kernel allocates ] in remat.measure.tracer)."""
        for begin, end, op in ops:
            i, j = bisect.bisect_left(times, begin), bisect.bisect_right(times, end)
            before = levels[i - 1] if i else start
            after = levels[j - 1] if j else start
            extra = max(levels[i:j], default=before) - max(before, after)
            key = (op, after - before)
            if extra > self.scratch.get(key, 0):
                self.scratch[key] = extra
