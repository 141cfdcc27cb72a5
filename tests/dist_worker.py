"""One rank of the data-parallel checks in tests/test_distributed.py; torchrun launches it:

    torchrun --standalone --nproc_per_node 2 tests/dist_worker.py OUT.json

Every rank builds the same model, applies the same plan (rank 0 solves it and broadcasts its JSON),
wraps the model with DDP or fully_shard (gloo, CPU), and trains a few steps on its own shard of a
global batch. Every rank also trains a plain, unwrapped copy on the whole global batch; rank 0
writes, per scenario, the largest differences in the gradients of the last step and in the
parameters after the last step, and how often each block's forward ran (twice per step when it is
recomputed). The test asserts on that file.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from remat import models
from remat.applier import PlanMismatch, apply
from remat.distributed import WrappingError, apply_distributed
from remat.manual.blocks import find_blocks
from remat.manual.options import set_option as _set
from remat.measure.profiler import profile
from remat.plan.segment_estimate import estimate_segments
from remat.plan.solver import solve
from remat.records import Plan, Profile

STEPS = 3
RTOL = 1e-5
GLOBAL_BATCH = 4



def build(kind: str) -> tuple[nn.Module, Callable[[Any, Any], torch.Tensor], tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    cfg: models.ModelConfig
    if kind == "gpt":
        cfg = models.GPTConfig(vocab_size=128, block_size=16, n_layer=3, n_head=2, n_embd=32, dropout=0.0)
    else:
        cfg = models.LlamaConfig(vocab_size=128, max_seq=16, n_layer=3, n_head=4, n_kv_head=2, dim=32, ffn_dim=64)
    model = models.build_model(cfg)
    batch = models.make_batch(model, batch_size=GLOBAL_BATCH, generator=torch.Generator().manual_seed(1))
    return model, models.loss_fn_for(model), batch


@functools.cache
def estimated(kind: str) -> Profile:
    """The model's profile, estimated on fake tensors (deterministic, so every plan is too)."""
    _, loss_fn, batch = build(kind)
    return profile(lambda: build(kind)[0], batch, loss_fn=loss_fn, device="cpu")


def shared_plan(kind: str, how: str) -> Plan:
    """Rank 0 makes the plan; every rank gets the same JSON."""
    text = [""]
    if dist.get_rank() == 0:
        prof = estimated(kind)
        if how == "segments":  # blocks 0..1 one segment, block 2 recomputed: NOTE [ A segment is one recompute frame ]
            names = [b.name for b in prof.blocks]
            choices = {n: "recompute" if i == 2 else "keep" for i, n in enumerate(names)}
            segments = [[names[0], names[1]]]
            plan = dataclasses.replace(solve(prof, method="none"), choices=choices, segments=segments,
                                       estimate=estimate_segments(prof, choices, segments), method="manual")
        elif how == "mixed":
            options = ["recompute", "selective", "keep"]
            choices = dict(zip((b.name for b in prof.blocks), options))
            plan = dataclasses.replace(solve(prof, method="all"), choices=choices, method="manual")
        else:
            plan = solve(prof, method="all") if how == "all" else solve(prof, "75%")
        text = [plan.to_json()]
    dist.broadcast_object_list(text, src=0)
    return Plan.from_json(text[0])


def local(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    return tuple(t[rank * per : (rank + 1) * per] for t in batch)


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: DTensors (FSDP2's sharded parameters and gradients) are all-gathered."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Counter:
    """Forward calls of each block's first child, forward and recompute alike (the block's own
    forward is replaced by remat, so count one level down)."""

    def __init__(self, model: nn.Module) -> None:
        self.counts: dict[str, int] = {}
        for name, block in find_blocks(model):
            child = next(block.children())
            self.counts[name] = 0
            child.register_forward_pre_hook(self._hook(name))

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.counts[name] += 1

        return hook


def train(
    model: nn.Module, batch: Any, loss_fn: Any, optimizer: torch.optim.Optimizer
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """STEPS steps: the gradients of each step and the parameters after the last, whole tensors
    by parameter name (without DDP's ``module.`` prefix)."""
    grads = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(*batch), batch).backward()
        grads.append({n.removeprefix("module."): full(p.grad).detach().clone() for n, p in model.named_parameters()})
        optimizer.step()
    params = {n.removeprefix("module."): full(p).detach().clone() for n, p in model.named_parameters()}
    return grads, params


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """The largest difference, and the smallest ``atol`` with which
    ``torch.allclose(got, want, rtol=RTOL, atol=atol)`` holds for every tensor."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    diffs = {n: (got[n] - want[n]).abs() for n in want}
    return {
        "max_abs": max(d.max().item() for d in diffs.values()),
        "atol_needed": max((d - RTOL * want[n].abs()).max().clamp_min(0).item() for n, d in diffs.items()),
    }


def wrap(kind: str, plan: Plan, mode: str, order: str) -> tuple[nn.Module, nn.Module, list[str]]:
    """A fresh model with ``plan`` applied and wrapped in ``order``: (to train, inner, refusals)."""
    model, _, _ = build(kind)
    refusals: list[str] = []
    if order == "remat_first":
        wrapped = apply_distributed(model, plan, mode=mode)
    elif order == "ddp_first":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = apply_distributed(DistributedDataParallel(model), plan, mode="ddp")
    else:  # "shard_first": the order remat refuses, done by hand to show what it would do
        from torch.distributed.fsdp import fully_shard

        for name in plan.choices:
            fully_shard(model.get_submodule(name))
        fully_shard(model)
        for attempt in (lambda: apply(model, plan), lambda: apply_distributed(model, plan, mode="fsdp")):
            try:
                attempt()
                refusals.append("accepted")
            except (PlanMismatch, WrappingError) as e:
                refusals.append(f"{type(e).__name__}: {e}")
        for name, option in plan.choices.items():
            _set(model.get_submodule(name), option)
        wrapped = model
    return wrapped, model, refusals


def scenario(kind: str, how: str, mode: str, opt: str, order: str) -> dict[str, Any]:
    model, loss_fn, batch = build(kind)
    plan = shared_plan(kind, how)
    keep = dataclasses.replace(plan, choices={n: "keep" for n in plan.choices}, method="none")
    # The single-process reference: the plain model on the whole batch.
    want_grads, want_params = train(model, batch, loss_fn, make_optimizer(opt, model.parameters()))
    # The same wrapper without remat: what remat must not change at all.
    plain, _, _ = wrap(kind, keep, mode, "remat_first")
    plain_grads, plain_params = train(plain, local(batch), loss_fn, make_optimizer(opt, plain.parameters()))
    wrapped, inner, refusals = wrap(kind, plan, mode, order)
    counter = Counter(inner)
    grads, params = train(wrapped, local(batch), loss_fn, make_optimizer(opt, wrapped.parameters()))
    out: dict[str, Any] = {
        "choices": plan.choices,
        "segments": plan.segments,
        "forward_calls": counter.counts,
        "wrapped_class": type(inner.get_submodule(next(iter(plan.choices)))).__name__,
        "vs_plain_wrapped": {
            "grads": max(compare(g, w)["max_abs"] for g, w in zip(grads, plain_grads)),
            "params": compare(params, plain_params)["max_abs"],
        },
        "vs_single_process": {
            "first_grads": compare(grads[0], want_grads[0]),
            "params": compare(params, want_params),
        },
    }
    if refusals:
        out["refusals"] = refusals
    return out


SCENARIOS = {
    "ddp_gpt_all_sgd": ("gpt", "all", "ddp", "sgd", "remat_first"),
    "ddp_gpt_mixed_adamw_ddp_first": ("gpt", "mixed", "ddp", "adamw", "ddp_first"),
    "fsdp_gpt_all_adamw": ("gpt", "all", "fsdp", "adamw", "remat_first"),
    "fsdp_gpt_solved_sgd": ("gpt", "solved", "fsdp", "sgd", "remat_first"),
    "fsdp_llama_mixed_adamw": ("llama", "mixed", "fsdp", "adamw", "remat_first"),
    "fsdp_gpt_all_adamw_shard_first": ("gpt", "all", "fsdp", "adamw", "shard_first"),
    "ddp_gpt_segments_adamw": ("gpt", "segments", "ddp", "adamw", "remat_first"),
    "ddp_llama_segments_sgd": ("llama", "segments", "ddp", "sgd", "remat_first"),
}


def main(out_path: str) -> None:
    warnings.simplefilter("error")  # as pytest's filterwarnings = error, which a subprocess escapes
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        results = {name: scenario(*args) for name, args in SCENARIOS.items()}
        results["world_size"] = dist.get_world_size()  # type: ignore[assignment]
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump(results, f, indent=2)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
