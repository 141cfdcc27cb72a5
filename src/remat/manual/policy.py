"""Selective recomputation policies: the default one, and a user's policy validated as torch does.

# NOTE [ Selective policies ]
A policy is what ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` takes: a function
``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` (or a bool), or a collection of ops whose
outputs are kept. torch compares each dispatched op, an ``OpOverload`` such as
``torch.ops.aten.mm.default``, with the collection, so a packet (``torch.ops.aten.mm``) in it
never matches and silently keeps nothing. torch refuses a packet with ``ValueError``, and so does
remat (a drop-in raises where torch raises): the message names the overloads the packet has and
the one to write (``torch.ops.aten.mm.default``), and keeps torch's own phrases, so code that
matches torch's message matches remat's. Anything else (``[2]``, a string) is refused the same
way, with what is allowed. A collection of ops becomes an ``OpsPolicy``, which pickles by op name
(torch's ops themselves do not pickle), so a module checkpointed with one can be saved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from remat.errors import InvalidType, InvalidValue

__all__ = ["SAVE_OPS", "OpsPolicy", "default_policy", "resolve_policy"]


def _aten_ops(*names: str) -> frozenset[Any]:
    # Some kernels exist only in some builds (flash/cudnn attention): take the ones this torch has.
    ops: set[Any] = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.update(getattr(packet, o) for o in packet.overloads())
    return frozenset(ops)


#: Ops whose outputs the default selective policy keeps: the expensive ones (matmuls, convolutions,
#: attention). Everything else (pointwise, norms, softmax, dropout) is recomputed.
SAVE_OPS: frozenset[Any] = _aten_ops(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def default_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective policy: keep the outputs of ``SAVE_OPS``, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_name(op: Any) -> tuple[str, str]:
    if isinstance(op, torch._ops.OpOverload):
        return op._schema.name, op._overloadname
    raise InvalidType(f"cannot pickle a selective policy that keeps {op!r}: only OpOverloads pickle by name")


def _op_from_name(qualified: str, overload: str) -> Any:
    namespace, name = qualified.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _ops_policy_from_names(names: tuple[tuple[str, str], ...]) -> OpsPolicy:
    return OpsPolicy(_op_from_name(q, o) for q, o in names)


class OpsPolicy:
    """Keep the outputs of ``ops`` (``OpOverload``s), recompute every other op."""

    def __init__(self, ops: Iterable[Any]) -> None:
        self.ops = frozenset(ops)

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in self.ops else CheckpointPolicy.PREFER_RECOMPUTE

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpsPolicy) and other.ops == self.ops

    def __hash__(self) -> int:
        return hash(self.ops)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ops_policy_from_names, (tuple(sorted(_op_name(op) for op in self.ops)),))

    def __repr__(self) -> str:
        return f"OpsPolicy({sorted(str(op) for op in self.ops)})"


def resolve_policy(policy: Callable[..., Any] | Iterable[Any] | None) -> Callable[..., Any]:
    """The policy function for ``policy`` (None: ``default_policy``), validated (NOTE [ Selective policies ])."""
    if policy is None:
        return default_policy
    if callable(policy):
        return policy
    if isinstance(policy, (str, bytes)) or not isinstance(policy, Iterable):
        raise InvalidType(
            f"policy must be a function (ctx, op, *args, **kwargs) -> CheckpointPolicy or a list of ops "
            f"such as [torch.ops.aten.mm.default], got {type(policy).__name__} {policy!r}"
        )
    ops: set[Any] = set()
    for op in policy:
        if not isinstance(op, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
            raise InvalidValue(_not_an_op(op))
        ops.add(op)
    return OpsPolicy(ops)


def _not_an_op(op: Any) -> str:
    # torch's phrases ("Expected op in `op_list` to be an OpOverload", "update the OpOverloadPacket
    # to a specific OpOverload") are kept, so code that matches torch's message matches this one.
    got = f"Expected op in `op_list` to be an OpOverload but got: {op!r} of type {type(op).__name__}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        name = "torch.ops." + op._qualified_op_name.replace("::", ".")
        overloads = op.overloads()
        pick = "default" if "default" in overloads else overloads[0]
        return (
            f"{got}. A packet such as {name} never matches: the ops a policy sees are its overloads "
            f"({', '.join(overloads)}). Please update the OpOverloadPacket to a specific OpOverload, "
            f"e.g. {name}.{pick} (list several to keep several), as torch requires"
        )
    return (
        f"{got}. Each entry must be an op such as torch.ops.aten.mm.default (an OpOverload); "
        "for any other rule, pass a function (ctx, op, *args, **kwargs) -> CheckpointPolicy"
    )
