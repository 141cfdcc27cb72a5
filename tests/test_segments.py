"""Segments (NOTE [ A segment is one recompute frame over several calls ]): a run of blocks
recomputed as one unit, nested where asked, on the unmodified model: outputs and gradients equal
plain PyTorch's (and torch.utils.checkpoint's) bit for bit, and the measured peak goes down."""

from __future__ import annotations

import copy
import gc
import types

import pytest
import torch
import torch.nn.functional as F
from test_checkpoint import WrapsItsErrors
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat.errors import CheckpointError
from remat.manual.segments import apply_segments, remove_segments, segments_of
from remat.measure.step_memory import measure_step
from remat.measure.tracer import MemoryTracer
from remat.plan.segment_estimate import _replay_ms
from remat.plan.segments import forest


class Block(nn.Module):
    def __init__(self, d: int, p: float = 0.1) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc2(self.drop(F.gelu(self.fc1(self.ln(x)))))
        if mask is not None:
            h = h * mask
        return x + h


class Loop(nn.Module):
    """Blocks in a ModuleList, called in a loop with a mask: the user's forward is not touched."""

    def __init__(self, d: int = 16, n: int = 6, tuples: bool = False) -> None:
        super().__init__()
        self.emb = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 3)
        self.tuples = tuples

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        mask = (x[..., :1] > 0).to(h.dtype)
        for block in self.blocks:
            if self.tuples:
                h = _Pair.run(block, h, mask)
            else:
                h = block(h, mask=mask)
        return self.head(h)


class _Pair:
    @staticmethod
    def run(block: nn.Module, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return block(h, mask)[0]


class TupleBlock(Block):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        out = super().forward(x, mask)
        return out, out.detach().sum()


def _step(model: nn.Module, x: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() if p.grad is not None else torch.zeros(0) for p in model.parameters()]


SPANS = [
    [(0, 5)],
    [(1, 3)],
    [(0, 1), (2, 5)],
    [(0, 5), (0, 1)],  # nested at the start: shares the outer input
    [(0, 5), (3, 5)],  # nested at the end: the outer replay stops at the inner input
    [(0, 5), (1, 2), (3, 4)],
    [(0, 5), (1, 4), (2, 3), (2, 2)],  # three levels deep
    [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 5)],
]


@pytest.mark.parametrize("spans", SPANS, ids=str)
def test_outputs_and_gradients_equal_plain_bit_for_bit(spans: list[tuple[int, int]]) -> None:
    torch.manual_seed(0)
    model = Loop()
    x = torch.randn(4, 5, 8)
    plain = _step(model, x)
    seg = apply_segments(list(model.blocks), spans)
    assert seg is not None and segments_of(model.blocks[spans[0][0]]) is seg
    got = _step(model, x)
    assert torch.equal(got[0], plain[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], plain[1]))
    again = _step(model, x)  # a second step: frames from the first are gone
    assert all(torch.equal(a, b) for a, b in zip(again[1], plain[1]))
    remove_segments(list(model.blocks))
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("spans", SPANS, ids=str)
def test_each_block_runs_as_often_as_the_cost_model_counts(spans: list[tuple[int, int]]) -> None:
    """NOTE [ A tensor held once ]: every block is passed the same mask, and a nested replay still
    runs each block exactly as often as the cost model charges (``_replay_ms``, read with one
    millisecond on one block at a time). Held once per call, the mask would make the enclosing
    replay run an inner segment that ends it, which the model counts as not run."""
    torch.manual_seed(0)
    model = Loop()
    runs = [0] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        block.ln.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    apply_segments(list(model.blocks), spans)
    _step(model, torch.randn(4, 5, 8))
    trees = forest(spans, len(model.blocks))
    for j in range(len(model.blocks)):
        one = types.SimpleNamespace(ms=[float(i == j) for i in range(len(model.blocks))])
        assert runs[j] == 1 + sum(_replay_ms(one, t) for t in trees), (j, runs)  # type: ignore[arg-type]


def test_tuples_frozen_params_and_torch_checkpoint_agree() -> None:
    torch.manual_seed(0)
    model = Loop(tuples=True)
    model.blocks = nn.ModuleList(TupleBlock(16) for _ in range(6))
    for p in model.blocks[2].parameters():
        p.requires_grad_(False)
    x = torch.randn(4, 5, 8)
    plain = _step(model, x)
    ref = copy.deepcopy(model)
    for b in ref.blocks:
        b.forward = lambda *a, _b=b, **k: checkpoint(type(_b).forward, _b, *a, use_reentrant=False, **k)
    torch_ck = _step(ref, x)
    apply_segments(list(model.blocks), [(0, 5), (1, 3)])
    got = _step(model, x)
    for a, b, c in zip(got[1], plain[1], torch_ck[1]):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_batchnorm_stats_move_once_and_autocast_replays() -> None:
    class Conv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + F.relu(self.bn(self.conv(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Conv() for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(2, 4, 8, 8)
    twin = copy.deepcopy(net)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _step(twin, x)
    apply_segments(list(net.blocks), [(0, 3), (2, 3)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _step(net, x)
    assert all(torch.equal(a, b) for a, b in zip(got[1], plain[1]))
    for a, b in zip(net.buffers(), twin.buffers()):
        assert torch.equal(a, b)  # running stats and num_batches_tracked moved once


def test_a_block_out_of_order_is_an_error_and_the_next_step_is_clean() -> None:
    torch.manual_seed(0)
    model = Loop()
    apply_segments(list(model.blocks), [(1, 3)])
    h = torch.randn(2, 16)
    model.blocks[1](h)
    with pytest.raises(CheckpointError, match="expected block #2 next"):
        model.blocks[3](h)
    with pytest.raises(CheckpointError, match="starts at block #1"):
        model.blocks[1](h)
        model.blocks[2](h)
        model.blocks[1](h)
    x = torch.randn(4, 5, 8)
    _step(model, x)  # a full step after the errors works
    with torch.no_grad():  # and outside training nothing is recorded at all
        model.blocks[3](h)


def test_segments_must_nest() -> None:
    with pytest.raises(Exception, match="overlap"):
        apply_segments(list(Loop().blocks), [(0, 2), (1, 3)])


def test_measured_peak_goes_below_checkpointing_every_block() -> None:
    torch.manual_seed(0)
    model = Loop(d=32, n=8)
    x = torch.randn(8, 256, 8)
    loss = lambda out, batch: out.square().mean()  # noqa: E731
    every = apply_segments(list(model.blocks), [(i, i) for i in range(8)])
    assert every is not None
    every_peak = measure_step(model, (x,), loss_fn=loss, repeats=0).peak_bytes
    remove_segments(list(model.blocks))
    # Two outer segments of four, each replayed with three single-block inner segments.
    spans = [(0, 3), (4, 7), (0, 0), (1, 1), (2, 2), (4, 4), (5, 5), (6, 6)]
    apply_segments(list(model.blocks), spans)
    nested = measure_step(model, (x,), loss_fn=loss, repeats=0).peak_bytes
    remove_segments(list(model.blocks))
    plain = measure_step(model, (x,), loss_fn=loss, repeats=0).peak_bytes
    assert nested < every_peak < plain


def test_a_replay_stops_early_through_a_block_that_wraps_errors() -> None:
    """NOTE [ A recompute stopped early ] in remat.manual.contexts: the replay's ``Done`` passes
    through the block's own error (x-transformers' masked attention failed the backward)."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*[WrapsItsErrors(8) for _ in range(3)])
    x = torch.randn(4, 5, 8, requires_grad=True)
    blocks(x).sum().backward()
    plain = [p.grad.clone() for p in blocks.parameters()]
    blocks.zero_grad()
    apply_segments(list(blocks), [(0, 2), (1, 1)])
    try:
        blocks(x).sum().backward()
    finally:
        remove_segments(list(blocks))
    assert all(torch.equal(p.grad, g) for p, g in zip(blocks.parameters(), plain))


def test_a_replay_stopped_through_a_block_that_wraps_errors_leaves_nothing_behind() -> None:
    """NOTE [ A recompute stopped early ]: the stop's traceback and the wrapper's frame formed a
    cycle that held the replay's tensors until the garbage collector ran (x-transformers' masked
    attention: 1.78 MB per segment at the end of the step, a floor plan 4.9 MB over its
    prediction); with the collector off, a step with segments leaves what the plain step leaves."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*[WrapsItsErrors(64) for _ in range(3)])
    x = torch.randn(8, 32, 64, requires_grad=True)

    def left(spans: list[tuple[int, int]]) -> int:
        apply_segments(list(blocks), spans)
        gc.disable()
        try:
            with MemoryTracer(torch.device("cpu")) as tracer:
                tracer.mark("start")
                blocks(x).sum().backward()
                tracer.mark("end")
        finally:
            gc.enable()
            remove_segments(list(blocks))
            blocks.zero_grad(set_to_none=True)
            x.grad = None
        live = {m.label: m.live_bytes for m in tracer.trace.marks}
        return live["end"] - live["start"]

    assert left([(0, 2), (1, 1)]) == left([]) == left([(0, 0)])
