"""The CPU record read a piece at a time (NOTE [ The CPU record's own memory ] in
remat.measure.cpu_record): a trace cut at every mark it may be cut at is the trace of one record."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from remat.measure import cpu_record
from remat.measure.cpu_record import inside_an_op
from remat.measure.tracer import MemoryTracer, Trace

_START = cpu_record.CpuRecord._start


def _traced_step(monkeypatch: pytest.MonkeyPatch, cut_ns: int) -> tuple[Trace, list[tuple[bool, bool]]]:
    """A conv net's training step traced with its kernels, marked at each module's forward, at each
    saved tensor (inside its op) and at each block's gradient (in the backward)."""
    monkeypatch.setattr(cpu_record, "_CUT_NS", cut_ns)
    starts: list[tuple[bool, bool]] = []  # per piece begun: in a backward, in a saved-tensors hook

    def noted(self: cpu_record.CpuRecord) -> None:
        starts.append((torch._C._current_graph_task_id() != -1, in_pack[0]))
        _START(self)

    monkeypatch.setattr(cpu_record.CpuRecord, "_start", noted)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.GELU()) for _ in range(3)])
    x = torch.randn(2, 4, 16, 16, requires_grad=True)
    in_pack = [False]
    with MemoryTracer("cpu", kernels=True) as tracer:
        handles = [m.register_forward_hook(lambda *_: tracer.mark("module")) for m in model.modules()]

        @inside_an_op
        def pack(t: torch.Tensor) -> torch.Tensor:
            in_pack[0] = True
            tracer.mark("saved")
            in_pack[0] = False
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = x
            for block in model:
                y = block(y)
                y.register_hook(lambda g: tracer.mark("gradient"))
            tracer.mark("forward")
        y.square().mean().backward()
        tracer.mark("backward")
    for h in handles:
        h.remove()
    return tracer.trace, starts


def test_a_trace_cut_at_every_mark_it_may_be_cut_at_is_the_trace_of_one_record(monkeypatch: pytest.MonkeyPatch) -> None:
    whole, one = _traced_step(monkeypatch, 10**18)
    cut, pieces = _traced_step(monkeypatch, 0)
    assert len(one) == 1 and len(pieces) > 8  # cut at every module's forward
    assert not any(in_backward or in_pack for in_backward, in_pack in pieces)  # NOTE's rules 3 and 4
    assert [(m.label, m.live_bytes, m.peak_bytes) for m in cut.marks] == [
        (m.label, m.live_bytes, m.peak_bytes) for m in whole.marks]
    assert [live for _, live in cut.points] == [live for _, live in whole.points]
    assert cut.peak_bytes == whole.peak_bytes > 0
    assert cut.kernel_scratch == whole.kernel_scratch
    assert any(op.startswith("aten::convolution_backward") for op, _ in cut.kernel_scratch)


def test_kineto_s_lines_at_each_start_and_stop_stay_off_stderr(capfd: Any) -> None:
    with MemoryTracer("cpu") as tracer:
        tracer.mark("a")
        x = torch.empty(1000)
        tracer.mark("b")
    del x
    assert tracer.trace.mark("b").live_bytes == 4000
    assert "profiler_st" not in capfd.readouterr().err
