"""Data parallelism: a plan under DDP or FSDP2 (``fully_shard``), and per-rank memory for the planner.

- ``apply_distributed(model, plan, mode="ddp" | "fsdp")`` applies the plan, then wraps the model:
  ``DistributedDataParallel(model)``, or ``fully_shard`` on each block and then on the root.
- ``check_wrapping(model)`` is the order check: it refuses a model that ``fully_shard`` (or FSDP1)
  already wrapped, and gives the inner module of a DDP wrapper.
- ``per_rank_profile(profile, world_size=8, fsdp=True)`` turns a single-device ``Profile`` into the
  profile of one rank of a sharded job (pure arithmetic on the record, no torch), and
  ``estimate_distributed`` is profile-for-a-device-you-do-not-have + that, in one CPU process.

# NOTE [ Order: remat first, then DDP or fully_shard ]
remat's ``apply`` replaces ``forward`` on each block instance (NOTE [ Applying without replacing
modules ] in ``remat.applier``); ``fully_shard`` changes each sharded module's class to a dynamic
``FSDP<Block>`` subclass and registers forward pre/post hooks that all-gather and free the block's
parameters. Hooks run in ``nn.Module.__call__`` around whatever ``forward`` is, so the checkpoint
always runs inside FSDP's hooks, whichever came first: the recompute in backward happens after
FSDP's pre-backward hook has all-gathered the parameters again, and never re-enters the hooks. Both
orders train to the same numbers on torch 2.13 (tests/dist_worker.py checks it). remat still
allows one order only, apply first:
- a plan is checked against the structure of the plain model (``Plan.fingerprint``); after
  ``fully_shard`` the blocks' classes are renamed (``FSDPBlock``), so the fingerprint no longer
  matches and the plan could only be applied unchecked (``strict=False``);
- the per-rank profile below assumes every planned block is its own FSDP group, which
  ``apply_distributed`` guarantees and an arbitrary pre-sharded model does not;
- it is the order torchtitan uses (activation checkpointing, then ``fully_shard``).
DDP does not change the module it wraps, so a DDP-wrapped model is accepted: the plan is applied to
``ddp.module`` (whose names are the plan's names; on the wrapper they carry a ``module.`` prefix).

# NOTE [ Per-rank memory under FSDP2 ]
The single-device profile is of one rank's step (its batch is the per-rank batch). FSDP2 as
``apply_distributed`` sets it up: one ``fully_shard`` group per block, one for the root (the
parameters outside the blocks: embeddings, final norm, head), default options. With ``W`` ranks,
``shard(x) = ceil(x / W)``, ``P_i`` block i's parameter bytes and ``R`` the root's:
- State: parameters and optimizer state are sharded, buffers and the batch are not; the optimizer
  step's temporaries (foreach copies) are per parameter, so they shrink to ``shard`` too.
- Forward of block i: FSDP2 all-gathers its parameters into a flat buffer, copies them out into
  the unsharded parameters, and keeps the buffer until the next group's copy-out (to overlap it
  with the next all-gather); the block's parameters are freed after its forward
  (``reshard_after_forward=True`` for non-root groups). Live beyond the shards: ``2 P_i``.
- Backward of block i: its parameters are gathered again (``P_i``), the group before it is
  prefetched into an all-gather buffer (``P_(i-1)``), and the reduce-scatter buffer of the block
  after it is kept until this block's reduce-scatter (``P_(i+1)``; at most one is kept by
  default). Its full gradients appear as on one device (in ``bwd_peak_bytes``) and are
  reduce-scattered to a shard when its backward ends: ``grad_bytes`` keeps only the shard.
- ``gather_bytes = 2 max(P_i)``, which the cost model adds to every block's forward and backward;
  each block's ``fwd_peak_bytes`` and ``bwd_peak_bytes`` are corrected by ``2 P_i - gather`` and
  ``P_(i-1) + P_i + P_(i+1) - gather`` (0 and 0 or ``P`` when the blocks are all alike; negative
  corrections, for a block smaller than the largest, are fine: only the sum is a peak).
- The root stays gathered from the start of the forward to the end of the backward
  (``reshard_after_forward=False`` for the root), and so do its full gradients: the ``pre``
  segment keeps ``R`` more bytes from its forward until its backward, holds ``R`` more (the root's
  all-gather buffer) during its forward, and its ``grad_bytes`` shrink by ``R - shard(R)`` when
  the backward ends. The last block's all-gather buffer (``P_n``) is still live in the head's
  forward and is prefetched again when the head's backward starts: ``post`` peaks grow by it.
- With one rank there are no all-gather buffers (the shard is copied into the parameters).
tests/test_distributed.py runs ``fully_shard`` under ``FakeTensorMode`` on torch's fake process
group and finds these numbers exact to the byte but for AdamW's unsharded 4-byte step counts.
Not modelled: FSDP2 pads each parameter's first dimension to a multiple of ``W`` (up to a row
per parameter and copy); mixed precision (``MixedPrecisionPolicy``: gathered parameters in
another dtype than the shards), CPU offload, ``reshard_after_forward=False`` or an int; and
communication time: times are the single-device ones (prefetched collectives overlap compute).

DDP (``fsdp=False``, ``W > 1``): nothing is sharded; DDP's reducer holds one flat copy of every
gradient in its buckets from construction on (``gradient_as_bucket_view=False``, the default), so
``base_bytes`` grows by the parameter bytes (an overestimate when some parameters are frozen: the
buckets hold the trainable ones only).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from remat.records import BlockProfile, Plan, Profile

if TYPE_CHECKING:
    from torch import nn

    from remat.devices import DeviceSpec

__all__ = [
    "MODES",
    "WrappingError",
    "apply_distributed",
    "check_wrapping",
    "estimate_distributed",
    "per_rank_profile",
]

log = logging.getLogger(__name__)

#: How ``apply_distributed`` wraps the model after applying the plan.
MODES: tuple[str, ...] = ("ddp", "fsdp")

# Class names, compared by name so that checking needs no torch.distributed import.
_SHARDED = ("FSDPModule", "FullyShardedDataParallel")
_DDP = "DistributedDataParallel"


class WrappingError(ValueError):
    """remat was asked to apply a plan to a model that is already sharded: the order is wrong."""


# --- the order ---------------------------------------------------------------------------------


def _mro_names(module: Any) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def check_wrapping(model: nn.Module) -> nn.Module:
    """The module a plan is applied to: ``model``, or ``model.module`` for a DDP wrapper.

    Raises ``WrappingError`` when ``model`` or one of its submodules is already sharded by
    ``fully_shard`` (or FSDP1): remat's ``apply`` must come first (NOTE [ Order: remat first,
    then DDP or fully_shard ]).
    """
    if _DDP in _mro_names(model):
        inner = model.module
        assert not isinstance(inner, type(model)), "DDP wrapping DDP"
        return check_wrapping(inner)  # type: ignore[arg-type]
    for name, module in model.named_modules():
        names = _mro_names(module)
        if names & set(_SHARDED):
            where = f"its submodule {name!r}" if name else "it"
            kind = "fully_shard" if "FSDPModule" in names else "FullyShardedDataParallel"
            raise WrappingError(
                f"cannot apply a remat plan to this {type(model).__name__}: {where} is already "
                f"wrapped by {kind} (class {type(module).__name__}). Apply the plan to the plain "
                "model first, then shard it: remat.distributed.apply_distributed(model, plan, "
                "mode='fsdp') does both in that order."
            )
    return model


def apply_distributed(
    model: nn.Module,
    plan: Plan,
    *,
    mode: str,
    strict: bool = True,
    mesh: Any = None,
    **wrap_kwargs: Any,
) -> nn.Module:
    """Apply ``plan`` to ``model``, then wrap it for data parallelism; returns the model to train.

    Args:
        model: the plain model (every rank builds the same one), or a DDP-wrapped model with
            ``mode="ddp"``; a model already sharded by ``fully_shard`` is refused.
        plan: the plan, the same on every rank (e.g. ``Plan.load`` of one file).
        mode: ``"ddp"``: returns ``DistributedDataParallel(model, **wrap_kwargs)`` (or the given
            DDP wrapper). ``"fsdp"``: calls ``fully_shard(block, mesh=mesh, **wrap_kwargs)`` on
            each block the plan names, then on ``model``, and returns ``model`` (sharded in place).
        strict: passed to ``remat.apply`` (the model must have the plan's fingerprint).
        mesh: the ``DeviceMesh`` for ``fully_shard``; None for its default (all ranks).
        wrap_kwargs: more keyword arguments for ``DistributedDataParallel`` or ``fully_shard``.

    The process group must be initialised (``torch.distributed.init_process_group``).
    """
    from remat.applier import apply

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(map(repr, MODES))}")
    if mesh is not None and mode != "fsdp":
        raise ValueError(f"mesh= applies to mode='fsdp' only, got mode={mode!r}")
    target = check_wrapping(model)
    is_ddp = target is not model
    if is_ddp and mode != "ddp":
        raise WrappingError(
            f"the model is wrapped by DistributedDataParallel but mode={mode!r}; pass the plain "
            "model (ddp.module) to shard it, or mode='ddp'"
        )
    if is_ddp and wrap_kwargs:
        raise ValueError(
            f"the model is already wrapped by DistributedDataParallel; DDP options "
            f"{sorted(wrap_kwargs)} apply only when apply_distributed wraps it"
        )
    apply(target, plan, strict=strict)
    if mode == "ddp":
        if is_ddp:
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, **wrap_kwargs)
    from torch.distributed.fsdp import fully_shard

    modules = dict(model.named_modules())
    for name in plan.choices:
        fully_shard(modules[name], mesh=mesh, **wrap_kwargs)
    fully_shard(model, mesh=mesh, **wrap_kwargs)
    log.info("sharded %d blocks and the root with fully_shard", len(plan.choices))
    return model


# --- per-rank memory ---------------------------------------------------------------------------


def per_rank_profile(profile: Profile, *, world_size: int, fsdp: bool) -> Profile:
    """The profile of one rank of a ``world_size``-rank job, from a single-device ``profile``.

    ``profile`` is of one rank's step (its batch is the per-rank batch). With ``fsdp`` parameters,
    gradients and optimizer state are sharded as FSDP2 does with one ``fully_shard`` group per
    block plus the root; without, it is DDP. See NOTE [ Per-rank memory under FSDP2 ]. Pure
    arithmetic: the cost model and the solvers read the result like any other profile.
    """
    from remat.plan.costmodel import estimate

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 (ranks in the job), got {world_size!r}")
    if not isinstance(fsdp, bool):
        raise TypeError(f"fsdp must be True or False, got {fsdp!r}")
    if profile.world_size != 1 or profile.fsdp or profile.gather_bytes:
        raise ValueError(
            f"this profile is already per rank (world_size={profile.world_size}, "
            f"fsdp={profile.fsdp}); pass the single-device profile"
        )
    if not fsdp:
        if world_size == 1:
            return profile
        # NOTE [ Per-rank memory under FSDP2 ], last paragraph: DDP's gradient buckets.
        out = dataclasses.replace(
            profile, world_size=world_size, base_bytes=profile.base_bytes + profile.param_bytes
        )
    else:
        out = _sharded(profile, world_size)
    plain = estimate(out, {b.name: "keep" for b in out.blocks}).peak_bytes
    return dataclasses.replace(out, plain_peak_bytes=plain)


def _sharded(profile: Profile, world_size: int) -> Profile:
    """NOTE [ Per-rank memory under FSDP2 ]."""

    def shard(nbytes: int) -> int:
        return -(-nbytes // world_size)

    # With one rank FSDP2 copies the shard into the unsharded parameters directly: no buffer.
    buffers = 1 if world_size > 1 else 0
    full = [b.param_bytes for b in profile.blocks]
    # Blocks that share parameters (rare) count them more than once: the root then has none.
    root = max(0, profile.param_bytes - sum(full))
    params = shard(root) + sum(shard(p) for p in full)
    optimizer = shard(profile.optimizer_bytes)
    gather = (1 + buffers) * max(full, default=0)
    blocks = []
    for i, block in enumerate(profile.blocks):
        before = full[i - 1] if i > 0 else 0
        after = full[i + 1] if i + 1 < len(full) else 0
        fwd = (1 + buffers) * full[i] - gather
        bwd = full[i] + buffers * before + after - gather
        blocks.append(_sharded_block(block, shard(full[i]), fwd, bwd))
    last = full[-1] if full else 0
    pre, post = profile.pre, profile.post
    pre = dataclasses.replace(
        pre,
        kept_bytes=pre.kept_bytes + root,
        fwd_peak_bytes=pre.fwd_peak_bytes + (1 + buffers) * root,
        grad_bytes=pre.grad_bytes - root + shard(root),
    )
    post = dataclasses.replace(
        post,
        fwd_peak_bytes=post.fwd_peak_bytes + buffers * last,
        bwd_peak_bytes=post.bwd_peak_bytes + buffers * last,
    )
    return dataclasses.replace(
        profile,
        world_size=world_size,
        fsdp=True,
        base_bytes=profile.base_bytes - profile.param_bytes - profile.optimizer_bytes + params + optimizer,
        param_bytes=params,
        optimizer_bytes=optimizer,
        optimizer_peak_bytes=shard(profile.optimizer_peak_bytes),
        pre=pre,
        post=post,
        blocks=blocks,
        gather_bytes=gather,
    )


def _sharded_block(block: BlockProfile, shard: int, fwd: int, bwd: int) -> BlockProfile:
    options = {
        name: dataclasses.replace(
            c, fwd_peak_bytes=c.fwd_peak_bytes + fwd, bwd_peak_bytes=c.bwd_peak_bytes + bwd
        )
        for name, c in block.options.items()
    }
    return dataclasses.replace(
        block,
        param_bytes=shard,
        grad_bytes=block.grad_bytes - block.param_bytes + shard,
        options=options,
    )


def estimate_distributed(
    model_factory: Callable[[], nn.Module],
    batch: Any,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    optimizer: Callable[[Any], Any] | None = None,
    *,
    device: str | DeviceSpec,
    world_size: int,
    fsdp: bool,
    blocks: Sequence[str] | None = None,
) -> Profile:
    """Estimate one rank's step of a ``world_size``-rank job on ``device``, in this CPU process.

    Profiles the per-rank step in estimated mode (the model built in ``FakeTensorMode``, nothing
    allocated; ``batch`` is the per-rank batch or a factory of it; see ``remat.profile``) and
    shards it with ``per_rank_profile``.
    """
    from remat.measure.profiler import profile as _profile

    if device is None:
        raise ValueError("estimate_distributed needs a device to estimate for, e.g. device='h100'")
    single = _profile(model_factory, batch, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks, device=device)
    return per_rank_profile(single, world_size=world_size, fsdp=fsdp)



