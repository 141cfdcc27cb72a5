"""remat under DDP and FSDP2: training equals one process, the order is enforced, per-rank memory.

- torchrun (2 CPU processes, gloo) runs tests/dist_worker.py: DDP and fully_shard with remat
  plans train like the plain wrapped model (bitwise) and like one process on the whole batch
  (to fp32 round-off).
- ``per_rank_profile`` on hand-made profiles, number by number.
- ``per_rank_profile`` against a step of ``fully_shard`` run under ``FakeTensorMode`` on torch's
  fake process group, measured byte by byte (``_ShardedMeter``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from remat import models
from remat.distributed import (
    WrappingError,
    apply_distributed,
    check_wrapping,
    estimate_distributed,
    per_rank_profile,
)
from remat.measure.clock import no_gc
from remat.plan.costmodel import estimate, smallest_feasible
from remat.plan.solver import frontier, smallest_any, solve
from remat.records import BlockProfile, OptionCost, Profile, Segment

WORKER = Path(__file__).with_name("dist_worker.py")


# --- torchrun: DDP and FSDP2 train like one process ---------------------------------------------


@pytest.mark.distributed
def test_ddp_and_fsdp_train_like_one_process(tmp_path: Path) -> None:
    # One launch for every scenario: starting two processes that import torch is most of the cost.
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0 and out.exists(), f"torchrun failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    results = json.loads(out.read_text())
    assert results.pop("world_size") == 2
    assert len(results) == 8
    for name, r in results.items():
        # Checkpointed blocks run their forward twice per step (forward and recompute), kept once;
        # so do the blocks of a segment (its forward, then its replay).
        inside = {b for first, last in r["segments"] for b in (first, last)}
        for block, option in r["choices"].items():
            again = option != "keep" or block in inside
            assert r["forward_calls"][block] == 3 * (2 if again else 1), (name, block)
        assert r["wrapped_class"].startswith("FSDP") == name.startswith("fsdp"), name
        # remat changes nothing under the same wrapper and data split: bitwise equal on the CPU.
        assert r["vs_plain_wrapped"] == {"grads": 0.0, "params": 0.0}, name
        # Against one process on the whole batch the sums run in another order (each rank's half,
        # then gloo's average): fp32 round-off, a few ulps of gradients of size <= ~0.1. The
        # worker reports the smallest atol with which allclose(rtol=1e-5) holds (measured: 4e-9).
        single = r["vs_single_process"]
        assert single["first_grads"]["atol_needed"] <= 1e-7, (name, single)
        if name.endswith("sgd"):
            assert single["params"]["atol_needed"] <= 1e-7, (name, single)
        else:
            # AdamW divides by sqrt(v): on entries whose gradient is ~0 a round-off difference
            # moves the update by a sizeable part of lr (1e-2). Measured: 4e-5, on the plain
            # wrapped model too (the check above), so it is the data split, not remat.
            assert single["params"]["atol_needed"] <= 2e-4, (name, single)
    refusals = results["fsdp_gpt_all_adamw_shard_first"]["refusals"]
    assert refusals[0].startswith(("PlanMismatch", "WrappingError")), refusals
    assert refusals[1].startswith("WrappingError: cannot apply a remat plan"), refusals


# --- the order ----------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """torch's fake process group: collectives return at once; fully_shard shards as on
    ``world_size`` ranks."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny(kind: str = "gpt") -> nn.Module:
    torch.manual_seed(0)
    cfg: models.ModelConfig
    if kind == "gpt":
        cfg = models.GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_head=2, n_embd=64, dropout=0.0)
    else:
        cfg = models.LlamaConfig(vocab_size=256, max_seq=32, n_layer=3, n_head=4, n_kv_head=2, dim=64, ffn_dim=128)
    return models.build_model(cfg)


def ids(batch_size: int = 2) -> tuple[torch.Tensor, ...]:
    return (torch.zeros(batch_size, 32, dtype=torch.long),)


# Python's cyclic garbage collector off, after one collection. Selective checkpointing leaves its
# cache of saved outputs in a reference cycle (remat's per-call recompute context class), freed
# whenever the collector happens to run: a step's bytes then depend on what ran before in the
# process (measured: 16 KiB on one Llama block's selective backward). Counting with the collector
# off makes both sides count the same bytes.
no_cyclic_gc = no_gc


@functools.cache
def estimated(kind: str) -> Profile:
    """The single-device profile of ``tiny(kind)``'s step with AdamW, estimated on fake tensors."""
    from remat.measure.profiler import profile

    with no_cyclic_gc():
        return profile(lambda: tiny(kind), ids, loss_fn=models.lm_loss,
                       optimizer=lambda ps: torch.optim.AdamW(ps), device="cpu")


def test_check_wrapping_refuses_a_sharded_model_and_unwraps_ddp() -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    plan = solve(estimated("gpt"), method="all")
    with fake_process_group(2):
        model = tiny()
        assert check_wrapping(model) is model
        ddp = DistributedDataParallel(model)
        assert check_wrapping(ddp) is model
        with pytest.raises(WrappingError, match="mode='ddp'"):
            apply_distributed(ddp, plan, mode="fsdp")
        with pytest.raises(ValueError, match="DDP options"):
            apply_distributed(ddp, plan, mode="ddp", broadcast_buffers=False)
        assert apply_distributed(ddp, plan, mode="ddp") is ddp
        assert all(blk.__dict__.get("forward") is not None for blk in model.blocks)

        model = tiny()
        fully_shard(model.blocks[1])
        with pytest.raises(WrappingError, match=r"submodule 'blocks\.1' is already wrapped by fully_shard"):
            check_wrapping(model)
        fully_shard(model)
        with pytest.raises(WrappingError, match=r"apply_distributed\(model, plan, mode='fsdp'\)"):
            apply_distributed(model, plan, mode="fsdp")

        model = tiny()
        names = list(plan.choices)
        segmented = dataclasses.replace(plan, segments=[[names[0], names[1]]])
        with pytest.raises(WrappingError, match="multi-block segments .* do not run under FSDP2"):
            apply_distributed(model, segmented, mode="fsdp")
        assert all("forward" not in blk.__dict__ for blk in model.blocks)  # nothing applied
        with pytest.raises(ValueError, match="expected one of 'ddp', 'fsdp'"):
            apply_distributed(model, plan, mode="fsdp2")
        with pytest.raises(ValueError, match="mesh= applies to mode='fsdp' only"):
            apply_distributed(model, plan, mode="ddp", mesh=object())
        sharded = apply_distributed(model, plan, mode="fsdp")
        assert sharded is model
        assert type(model).__name__ == "FSDPGPT"
        assert [type(b).__name__ for b in model.blocks] == ["FSDPBlock"] * 3
        # The plan survived the class change: the blocks' forwards are remat's; remove() still
        # gives the blocks their own forward back.
        from remat.applier import applied_plan, remove
        from remat.manual.options import option_of as mode_of

        assert [mode_of(b) for b in model.blocks] == ["recompute"] * 3
        assert applied_plan(model) is plan
        remove(model)
        assert [mode_of(b) for b in model.blocks] == ["keep"] * 3
        assert all("forward" not in b.__dict__ for b in model.blocks)


# --- per_rank_profile on hand-made profiles -----------------------------------------------------


def cost(kept: int, fwd: int, bwd: int, ms: float = 0.0) -> OptionCost:
    return OptionCost(kept_bytes=kept, fwd_peak_bytes=fwd, bwd_peak_bytes=bwd, extra_ms=ms)


def hand_profile(block_params: list[int], root: int = 400) -> Profile:
    """Blocks with the given parameter bytes (their gradients as large), a root of ``root`` bytes,
    AdamW-like state (two copies of the parameters) and a 16-byte batch."""
    blocks = [
        BlockProfile(name=f"layers.{i}", kind="Layer", param_bytes=p, grad_bytes=p, input_bytes=100,
                     fwd_ms=1.0, bwd_ms=2.0,
                     options={"keep": cost(300, 500, 200), "recompute": cost(100, 400, 600, 1.0)})
        for i, p in enumerate(block_params)
    ]
    params = sum(block_params) + root
    return Profile(
        model="Hand", fingerprint="0" * 16, device="h100", mode="estimated", dtype="float32",
        batch_shape=[2, 8], base_bytes=params + 2 * params + 16, param_bytes=params,
        optimizer_bytes=2 * params, batch_bytes=16, optimizer_peak_bytes=params,
        pre=Segment(kept_bytes=10, fwd_peak_bytes=50, bwd_peak_bytes=60, grad_bytes=40, fwd_ms=1.0, bwd_ms=1.0),
        post=Segment(kept_bytes=120, fwd_peak_bytes=200, bwd_peak_bytes=150, grad_bytes=400, fwd_ms=1.0, bwd_ms=1.0),
        blocks=blocks, plain_peak_bytes=0, plain_step_ms=10.0,
    )


def test_fsdp_shards_state_and_gathers_one_block_at_a_time() -> None:
    single = hand_profile([800, 800, 800])
    rank = per_rank_profile(single, world_size=4, fsdp=True)
    assert (rank.world_size, rank.fsdp) == (4, True)
    assert rank.param_bytes == 3 * 200 + 100  # each block and the root sharded four ways
    assert rank.optimizer_bytes == 5600 // 4
    assert rank.base_bytes == 700 + 1400 + 16  # the batch is per rank already: not divided
    assert rank.optimizer_peak_bytes == 700
    # The running block's parameters and one all-gather buffer (its own in forward, the
    # prefetched block's in backward).
    assert rank.gather_bytes == 2 * 800
    for block in rank.blocks:
        assert block.param_bytes == 200
        assert block.grad_bytes == 200  # full gradients reduce-scattered to a shard
        assert block.options["keep"].fwd_peak_bytes == 500
        assert block.options["keep"].kept_bytes == 300
    # In backward an inner block also holds the reduce-scatter buffer of the block after it.
    assert [b.options["keep"].bwd_peak_bytes for b in rank.blocks] == [200, 200 + 800, 200]
    assert [b.options["recompute"].bwd_peak_bytes for b in rank.blocks] == [600, 600 + 800, 600]
    # The root's 400 bytes stay gathered from the forward to the end of the backward (+ its
    # all-gather buffer in the embeddings' forward); its gradients end up as a 100-byte shard.
    assert rank.pre == dataclasses.replace(single.pre, kept_bytes=410, fwd_peak_bytes=850, grad_bytes=40 - 400 + 100)
    # The last block's all-gather buffer: kept to the end of the root's forward, and prefetched
    # when the head's backward starts.
    assert rank.post == dataclasses.replace(single.post, fwd_peak_bytes=1000, bwd_peak_bytes=950)
    assert rank.plain_peak_bytes == estimate(rank, {b.name: "keep" for b in rank.blocks}).peak_bytes
    # Unchanged: what identifies the step, and times.
    for name in ("model", "fingerprint", "device", "mode", "dtype", "batch_shape", "plain_step_ms", "batch_bytes"):
        assert getattr(rank, name) == getattr(single, name), name
    assert Profile.from_json(rank.to_json()) == rank


def test_fsdp_blocks_of_different_sizes() -> None:
    rank = per_rank_profile(hand_profile([400, 800, 1200], root=0), world_size=2, fsdp=True)
    assert rank.gather_bytes == 2 * 1200
    keep = [b.options["keep"] for b in rank.blocks]
    # forward: the block's own parameters and all-gather buffer, 2 * P_i
    assert [c.fwd_peak_bytes + rank.gather_bytes for c in keep] == [500 + 800, 500 + 1600, 500 + 2400]
    # backward: P_i, the prefetched P_(i-1) and the reduce-scatter buffer of P_(i+1)
    assert [c.bwd_peak_bytes + rank.gather_bytes for c in keep] == [
        200 + 400 + 800, 200 + 800 + 400 + 1200, 200 + 1200 + 800]
    assert rank.pre.kept_bytes == 10 and rank.pre.grad_bytes == 40


def test_fsdp_on_one_rank_has_no_all_gather_buffers() -> None:
    single = hand_profile([800, 800])
    rank = per_rank_profile(single, world_size=1, fsdp=True)
    assert rank.param_bytes == single.param_bytes and rank.base_bytes == single.base_bytes
    assert rank.gather_bytes == 800
    assert [b.options["keep"].bwd_peak_bytes for b in rank.blocks] == [200 + 800, 200]
    assert rank.pre.fwd_peak_bytes == 50 + 400 and rank.post == single.post


def test_ddp_adds_the_gradient_buckets() -> None:
    single = hand_profile([800, 800, 800])
    rank = per_rank_profile(single, world_size=8, fsdp=False)
    assert (rank.world_size, rank.fsdp, rank.gather_bytes) == (8, False, 0)
    assert rank.base_bytes == single.base_bytes + single.param_bytes
    assert rank.blocks == single.blocks and rank.pre == single.pre and rank.post == single.post
    assert per_rank_profile(single, world_size=1, fsdp=False) is single


def test_fsdp_lowers_the_smallest_budget() -> None:
    single = hand_profile([8000] * 4, root=4000)
    floors = [smallest_feasible(per_rank_profile(single, world_size=w, fsdp=True))[0] for w in (1, 2, 8)]
    assert floors[0] > floors[1] > floors[2]
    plan = solve(per_rank_profile(single, world_size=8, fsdp=True), floors[2])
    assert plan.estimate.peak_bytes <= floors[2]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"world_size": 0, "fsdp": True}, "world_size must be an int >= 1"),
        ({"world_size": True, "fsdp": True}, "world_size must be an int >= 1"),
        ({"world_size": 2.0, "fsdp": True}, "world_size must be an int >= 1"),
        ({"world_size": 2, "fsdp": "yes"}, "fsdp must be True or False"),
    ],
)
def test_per_rank_profile_validates(kwargs: dict[str, Any], error: str) -> None:
    with pytest.raises((ValueError, TypeError), match=error):
        per_rank_profile(hand_profile([800]), **kwargs)


def test_per_rank_profile_refuses_a_per_rank_profile() -> None:
    rank = per_rank_profile(hand_profile([800]), world_size=2, fsdp=True)
    with pytest.raises(ValueError, match="already per rank"):
        per_rank_profile(rank, world_size=2, fsdp=True)


# --- per_rank_profile against fully_shard on the fake process group ----------------------------


def _leaves(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors inside a tensor subclass (a DTensor's local shard)."""
    if type(t).__name__ != "FakeTensor" and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _leaves(inner)
    else:
        yield t


def _key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


class _ShardedMeter:
    """Peak bytes of one rank's step of a ``fully_shard`` model on fake tensors.

    Counts every storage an op creates (tensor subclasses unwrapped to their local tensors) until
    it is freed, like ``remat.measure.fake.FakeMeter``, plus the storages of FSDP2's unsharded parameters,
    which it allocates and frees by resizing them (``storage.resize_``), out of the dispatcher's
    sight: they are read again around every op.
    """

    def __init__(self, resizable: list[Any], known: set[int]) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        meter = self
        self.resizable = resizable
        self.known = known
        self.live = 0
        self.peak = 0
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, Any] = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                meter.bump()
                out = func(*args, **(kwargs or {}))
                ins = {_key(x) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for x in _leaves(t)}
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        for x in _leaves(t):
                            if _key(x) not in ins:
                                meter.track(x)
                meter.bump()
                return out

        self.mode = Mode()

    def bump(self) -> None:
        self.peak = max(self.peak, self.live + sum(s.nbytes() for s in self.resizable))

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = int(storage._cdata)
        if key in self.sizes or key in self.known:
            return
        self.sizes[key] = storage.nbytes()
        self.live += self.sizes[key]
        self.refs[key] = weakref.ref(storage, functools.partial(self.free, key))

    def free(self, key: int, _: Any) -> None:
        self.live -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)


def fsdp_step_peak(kind: str, choices: dict[str, str], world_size: int) -> int:
    """Peak bytes of rank 0's training step (AdamW) with ``fully_shard`` on ``world_size`` ranks."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    plan = dataclasses.replace(solve(estimated(kind), method="none"), choices=choices)
    with fake_process_group(world_size):
        # Outside FakeTensorMode: the mesh reads its ranks from a tensor.
        mesh = init_device_mesh("cpu", (world_size,))
        with FakeTensorMode(), no_cyclic_gc():
            return _fake_step_peak(kind, plan, mesh)


def _fake_step_peak(kind: str, plan: Any, mesh: Any) -> int:
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    model = apply_distributed(tiny(kind), plan, mode="fsdp", mesh=mesh)
    batch = ids()
    optimizer = torch.optim.AdamW(model.parameters())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        models.lm_loss(model(*batch), batch).backward()
        optimizer.step()

    step()  # creates the optimizer state and FSDP2's unsharded parameters (then resharded)
    optimizer.zero_grad(set_to_none=True)
    resizable = {}
    for module in model.modules():
        state = _get_module_fsdp_state(module)
        for group in state._fsdp_param_groups if state is not None else []:
            for param in group.fsdp_params:
                for t in param.all_gather_outputs:
                    resizable[_key(t)] = t.untyped_storage()
    state_tensors = [*model.parameters(), *model.buffers(), *batch,
                     *(v for s in optimizer.state.values() for v in s.values())]
    base = {_key(x): x.untyped_storage() for t in state_tensors for x in _leaves(t)}
    base_bytes = sum(s.nbytes() for k, s in base.items() if k not in resizable)
    meter = _ShardedMeter(list(resizable.values()), set(base) | set(resizable))
    get_rng_state = torch.get_rng_state

    def counted() -> torch.Tensor:  # as remat's meter: NOTE [ RNG states on the CPU ]
        state = get_rng_state()
        meter.track(state)
        return state

    torch.get_rng_state = counted
    try:
        with meter.mode:
            step()
    finally:
        torch.get_rng_state = get_rng_state
    return base_bytes + meter.peak


# (model, world size, options): even shards (the test's sizes divide by 2, 4 and 8), every option,
# a plan that mixes them, a model whose layers take extra arguments, and one rank.
FAKE_CASES = [
    ("gpt", 8, ("keep", "keep", "keep")),
    ("gpt", 8, ("recompute", "recompute", "recompute")),
    ("gpt", 4, ("selective", "recompute", "keep")),
    ("llama", 2, ("keep", "selective", "recompute")),
    ("gpt", 1, ("keep", "keep", "keep")),
]


@pytest.mark.parametrize(("kind", "world_size", "options"), FAKE_CASES)
def test_per_rank_profile_matches_fully_shard(kind: str, world_size: int, options: tuple[str, ...]) -> None:
    single = estimated(kind)
    choices = dict(zip((b.name for b in single.blocks), options))
    predicted = estimate(per_rank_profile(single, world_size=world_size, fsdp=True), choices).peak_bytes
    measured = fsdp_step_peak(kind, choices, world_size)
    # AdamW keeps a 4-byte step count per parameter on every rank (not sharded); the profile's
    # optimizer bytes are sharded as a whole. Nothing else differs.
    n_params = len(list(tiny(kind).parameters()))
    assert 0 <= measured - predicted <= 4 * n_params, (measured, predicted)


@pytest.mark.parametrize("world_size", [3, 6])
def test_per_rank_profile_with_uneven_shards(world_size: int) -> None:
    # FSDP2 pads each parameter's first dimension to a multiple of the world size, which the
    # arithmetic leaves out. Per parameter of row bytes r, at most r more in each of the four
    # shard-sized copies (parameter, gradient, Adam's two states) and (W - 1) r more in each of
    # the three full-size copies of a block's parameters (gathered, all-gather buffer,
    # reduce-scatter buffer).
    single = estimated("gpt")
    choices = {b.name: "keep" for b in single.blocks}
    predicted = estimate(per_rank_profile(single, world_size=world_size, fsdp=True), choices).peak_bytes
    measured = fsdp_step_peak("gpt", choices, world_size)
    rows = sum(p[0].numel() * p.element_size() if p.dim() > 1 else p.element_size()
               for p in tiny("gpt").parameters())
    assert 0 <= measured - predicted <= rows * (4 + 3 * (world_size - 1)), (measured, predicted)


def test_ddp_buckets_hold_one_copy_of_the_parameters() -> None:
    from torch.nn.parallel import DistributedDataParallel

    from remat.measure.storages import param_bytes
    from remat.measure.tracer import MemoryTracer

    model = tiny()
    with fake_process_group(2), MemoryTracer("cpu") as tracer:
        tracer.mark("before")
        ddp = DistributedDataParallel(model)  # kept: its buckets live as long as it does
        tracer.mark("after")
        del ddp
    grew = tracer.trace.mark("after").live_bytes - tracer.trace.mark("before").live_bytes
    assert grew == param_bytes(model)


def test_estimate_distributed_is_profile_then_per_rank_profile() -> None:
    rank = estimate_distributed(lambda: tiny("gpt"), ids, models.lm_loss,
                                lambda ps: torch.optim.AdamW(ps), device="cpu", world_size=8, fsdp=True)
    assert rank == per_rank_profile(estimated("gpt"), world_size=8, fsdp=True)
    with pytest.raises(ValueError, match="needs a device"):
        estimate_distributed(lambda: tiny("gpt"), ids, device=None, world_size=8, fsdp=True)  # type: ignore[arg-type]



def test_plans_for_fsdp_ranks_have_no_segments() -> None:
    # apply_distributed(mode="fsdp") refuses segments, so plans for an FSDP rank never have them
    # (a DDP rank's may: they train bit for bit like the plain wrapped model, above). On BiasLM
    # segments reach below every per-block plan.
    from remat.measure.profiler import profile

    torch.manual_seed(0)
    model = models.build_model(models.BiasLMConfig(n_layer=4, dim=32, n_head=2, max_seq=64, vocab_size=64))
    batch = models.make_batch(model, batch_size=2, seq_len=64)
    one = profile(model, batch, loss_fn=models.loss_fn_for(model), repeats=1)
    assert smallest_any(one)[0] < smallest_feasible(one)[0]
    sharded = dataclasses.replace(one, world_size=2, fsdp=True)
    low = smallest_any(sharded)[0]
    assert low == smallest_feasible(sharded)[0]
    assert all(not plan.segments for plan in frontier(sharded, points=6))
    assert not solve(sharded, low).segments
