"""Per-rank memory under data parallelism: a single-device ``Profile`` as one rank's profile.

``per_rank_profile(profile, world_size=8, fsdp=True)`` is pure arithmetic on the record (no torch):
the cost model and the solvers read the result like any other profile. ``remat.distributed`` puts
it together with profiling and with the wrapping itself.

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

from remat.errors import InvalidType, InvalidValue
from remat.plan.costmodel import estimate
from remat.plan.schedule import Phase, step_phases
from remat.records import BlockProfile, Profile

__all__ = ["per_rank_profile"]


def per_rank_profile(profile: Profile, *, world_size: int, fsdp: bool) -> Profile:
    """The profile of one rank of a ``world_size``-rank job, from a single-device ``profile``.

    ``profile`` is of one rank's step (its batch is the per-rank batch). With ``fsdp`` parameters,
    gradients and optimizer state are sharded as FSDP2 does with one ``fully_shard`` group per
    block plus the root; without, it is DDP. See NOTE [ Per-rank memory under FSDP2 ]. Pure
    arithmetic: the cost model and the solvers read the result like any other profile.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidValue(f"world_size must be an int >= 1 (ranks in the job), got {world_size!r}")
    if not isinstance(fsdp, bool):
        raise InvalidType(f"fsdp must be True or False, got {fsdp!r}")
    if profile.world_size != 1 or profile.fsdp or profile.gather_bytes:
        raise InvalidValue(
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
    # The parameter bytes FSDP2 holds unsharded during each phase of the step, beyond the shards.
    held = {(ph.stage, ph.part, ph.block): _gathered(ph, full, root, buffers)
            for ph in step_phases(len(full))}  # fmt: skip
    gather = max((held["forward", "block", i] for i in range(len(full))), default=0)
    blocks = [
        _sharded_block(block, shard(full[i]), held["forward", "block", i] - gather,
                       held["backward", "block", i] - gather)
        for i, block in enumerate(profile.blocks)
    ]  # fmt: skip
    pre, post = profile.pre, profile.post
    pre = dataclasses.replace(
        pre,
        kept_bytes=pre.kept_bytes + root,
        fwd_peak_bytes=pre.fwd_peak_bytes + held["forward", "pre", None],
        grad_bytes=pre.grad_bytes - root + shard(root),
    )
    heads = {
        name: dataclasses.replace(
            seg,
            fwd_peak_bytes=seg.fwd_peak_bytes + held["forward", "post", None],
            bwd_peak_bytes=seg.bwd_peak_bytes + held["backward", "post", None],
        )
        for name, seg in {"keep": post, **profile.head_options}.items()
    }
    post = heads.pop("keep")
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
        head_options=heads,
        blocks=blocks,
        gather_bytes=gather,
    )


def _gathered(phase: Phase, full: list[int], root: int, buffers: int) -> int:
    """Parameter bytes held unsharded during ``phase`` beyond the shards (NOTE [ Per-rank memory
    under FSDP2 ]): a block's own, its all-gather buffer and its neighbours' in flight; the
    root's in the embeddings' forward (after it, the root's stay as ``pre``'s kept bytes); the
    last block's buffer around the head."""
    if phase.block is not None:
        i = phase.block
        if phase.stage == "forward":
            return (1 + buffers) * full[i]
        before = full[i - 1] if i > 0 else 0
        after = full[i + 1] if i + 1 < len(full) else 0
        return full[i] + buffers * before + after
    if phase.part == "pre" and phase.stage == "forward":
        return (1 + buffers) * root
    if phase.part == "post":
        return buffers * (full[-1] if full else 0)
    return 0


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
