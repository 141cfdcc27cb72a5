"""Data parallelism: a plan under DDP or FSDP2 (``fully_shard``), and per-rank memory for the planner.

- ``apply_distributed(model, plan, mode="ddp" | "fsdp")`` applies the plan, then wraps the model:
  ``DistributedDataParallel(model)``, or ``fully_shard`` on each block and then on the root.
- ``check_wrapping(model)`` is the order check (in ``remat.applier``, which calls it; NOTE [ Order:
  remat first, then DDP or fully_shard ] there): it refuses a model that ``fully_shard`` (or FSDP1)
  already wrapped, and gives the inner module of a DDP wrapper.
- ``per_rank_profile(profile, world_size=8, fsdp=True)`` turns a single-device ``Profile`` into the
  profile of one rank of a sharded job (pure arithmetic on the record, no torch:
  ``remat.plan.sharding``, NOTE [ Per-rank memory under FSDP2 ] there), and
  ``estimate_distributed`` is profile-for-a-device-you-do-not-have + that, in one CPU process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from remat.applier import WrappingError, apply, check_wrapping
from remat.errors import InvalidValue
from remat.measure.profiler import profile as _profile
from remat.plan.sharding import per_rank_profile
from remat.records import Plan, Profile

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
    if mode not in MODES:
        raise InvalidValue(f"unknown mode {mode!r}; expected one of {', '.join(map(repr, MODES))}")
    if mesh is not None and mode != "fsdp":
        raise InvalidValue(f"mesh= applies to mode='fsdp' only, got mode={mode!r}")
    target = check_wrapping(model)
    is_ddp = target is not model
    if is_ddp and mode != "ddp":
        raise WrappingError(
            f"the model is wrapped by DistributedDataParallel but mode={mode!r}; pass the plain "
            "model (ddp.module) to shard it, or mode='ddp'"
        )
    if is_ddp and wrap_kwargs:
        raise InvalidValue(
            f"the model is already wrapped by DistributedDataParallel; DDP options "
            f"{sorted(wrap_kwargs)} apply only when apply_distributed wraps it"
        )
    if mode == "fsdp" and plan.segments:
        raise WrappingError(
            f"the plan has multi-block segments ({len(plan.segments)}), which do not run under FSDP2 "
            "yet: a segment's replay runs its earlier blocks before fully_shard has gathered their "
            "parameters; solve without them (remat.solve(profile, budget, segments=False)), or use "
            "mode='ddp'"
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
    if device is None:
        raise InvalidValue("estimate_distributed needs a device to estimate for, e.g. device='h100'")
    single = _profile(model_factory, batch, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks, device=device)
    return per_rank_profile(single, world_size=world_size, fsdp=fsdp)



