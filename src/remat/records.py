"""The records that stages exchange: ``Profile`` (profile -> solve), ``Plan`` (solve -> apply/verify).

Frozen, keyword-only dataclasses with a docstring per field, units in names, bytes as ints, and a
JSON form that carries ``schema_version``. No torch here: the solver side must import without it.

# NOTE [ How a block's bytes are attributed ]
A chain of blocks passes one boundary tensor from block to block (the hidden state). Its bytes are
charged to the block that *consumes* it: a block that keeps, recomputes or selectively recomputes
keeps its input on the device until its backward; an offloaded block does not. So
``OptionCost.kept_bytes`` = the block's input (when kept on the device) + whatever the block's own
ops keep. The part before the blocks (embeddings) and after them (head, logits, loss) are measured
as fixed segments. The cost model (``remat.costmodel``) replays these numbers through a step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from remat.files import atomic_write
from remat.units import MAX_BYTES

__all__ = [
    "OPTIONS",
    "BlockProfile",
    "Estimate",
    "OptionCost",
    "Plan",
    "Profile",
    "RecordError",
    "Segment",
    "load_record",
]

PROFILE_SCHEMA = 1
PLAN_SCHEMA = 1

#: Every option a block can take, in order from most memory to least extra time.
OPTIONS: tuple[str, ...] = ("keep", "selective", "recompute", "offload", "recompute_offload")


class RecordError(ValueError):
    """A record file that cannot be read: wrong kind, wrong schema version, or malformed."""


@dataclass(frozen=True, kw_only=True)
class OptionCost:
    """What one way of keeping a block costs."""

    kept_bytes: int
    """Bytes this block holds on the device from the end of its forward until its backward starts
    (its input when kept on the device, plus what its ops keep). See NOTE [ How a block's bytes are
    attributed ]."""
    fwd_peak_bytes: int
    """Peak bytes above the live level at the start of the block's forward, during that forward."""
    bwd_peak_bytes: int
    """Peak bytes above the live level at the start of the block's backward, during that backward
    (recomputed or reloaded activations, gradient temporaries)."""
    extra_ms: float
    """Extra step time against keeping the block, milliseconds (recompute, copies not hidden)."""


@dataclass(frozen=True, kw_only=True)
class BlockProfile:
    """One block (for example one decoder layer) and the cost of each option for it."""

    name: str
    """The block's qualified module name, e.g. ``"layers.3"``."""
    kind: str
    """The block's class name, e.g. ``"Block"``; blocks of one kind are interchangeable."""
    param_bytes: int
    """Bytes of the block's own parameters (its gradients take as much); per rank when sharded."""
    grad_bytes: int
    """Net bytes that appear during the block's backward besides the freed activations: its
    parameters' gradients plus the change in the gradient flowing through it."""
    input_bytes: int
    """Bytes of the boundary tensor the block consumes."""
    fwd_ms: float
    """Forward time with the block kept, milliseconds (median over repeats)."""
    bwd_ms: float
    """Backward time with the block kept, milliseconds (median over repeats)."""
    options: dict[str, OptionCost]
    """The cost of each option that applies on this device, keyed by name from ``OPTIONS``."""


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A fixed part of the step outside the blocks: the part before them or after them."""

    kept_bytes: int
    """Bytes the segment keeps from its forward until its backward."""
    fwd_peak_bytes: int
    """Peak bytes above the level at the start of its forward, during that forward."""
    bwd_peak_bytes: int
    """Peak bytes above the level at the start of its backward, during that backward."""
    grad_bytes: int
    """Net bytes that appear during its backward besides the freed activations (its gradients)."""
    fwd_ms: float
    """Forward time, milliseconds."""
    bwd_ms: float
    """Backward time, milliseconds."""


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Everything the planner needs to know about one training step of one model on one device."""

    model: str
    """The model's class name."""
    fingerprint: str
    """A hash of the model's structure (module names, classes, parameter shapes and dtypes)."""
    device: str
    """The device the numbers are for: ``"cpu"``, ``"cuda"``, or an estimated spec like ``"h100"``."""
    mode: str
    """``"measured"`` (real steps on the device) or ``"estimated"`` (fake tensors and a roofline)."""
    dtype: str
    """The parameters' dtype (and autocast dtype when one was used), e.g. ``"float32"``."""
    batch_shape: list[int]
    """The shape of the batch's first tensor."""
    world_size: int = 1
    """Ranks the job runs on; with ``fsdp`` the parameter bytes here are per rank."""
    fsdp: bool = False
    """Whether parameters, gradients and optimizer state are sharded over ``world_size`` ranks."""
    base_bytes: int
    """Bytes live when the step starts and through all of it: parameters, optimizer state, batch."""
    param_bytes: int
    """Bytes of all parameters (per rank when sharded)."""
    optimizer_bytes: int
    """Bytes of optimizer state (0 without an optimizer)."""
    batch_bytes: int
    """Bytes of the batch tensors."""
    optimizer_peak_bytes: int
    """Peak bytes above ``base_bytes`` + all gradients during the optimizer step (temporaries)."""
    device_memory_bytes: int | None = None
    """Memory of the device when known (estimated mode or CUDA), for 'does it fit' messages."""
    pre: Segment
    """The part before the blocks (embeddings)."""
    post: Segment
    """The part after the blocks (final norm, head, logits, loss)."""
    blocks: list[BlockProfile]
    """The blocks in forward order."""
    plain_peak_bytes: int
    """Peak bytes of the plain step (every block kept), measured or estimated."""
    plain_step_ms: float
    """Time of the plain step, milliseconds (median)."""
    gather_bytes: int = 0
    """Under FSDP: bytes the cost model adds to every block's forward and backward for gathered
    parameters (the running block's and one all-gather buffer: twice the largest block's
    parameters; blocks' peaks carry the rest). See NOTE [ Per-rank memory under FSDP2 ] in
    ``remat.distributed``."""
    schema_version: int = PROFILE_SCHEMA
    """The record's schema version; files of another version are refused."""

    @property
    def options(self) -> tuple[str, ...]:
        """The options every block offers on this device."""
        common = set(OPTIONS)
        for block in self.blocks:
            common &= set(block.options)
        return tuple(o for o in OPTIONS if o in common)

    def to_json(self) -> str:
        return _dump(self, "profile")

    @classmethod
    def from_json(cls, text: str) -> Profile:
        return _load(cls, text, "profile", PROFILE_SCHEMA)

    def save(self, path: str | Path) -> None:
        _atomic_write(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(_read(Path(path)))


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """What the cost model predicts for one assignment of options to blocks."""

    peak_bytes: int
    """Predicted peak bytes of the whole step."""
    peak_phase: str
    """Where the peak falls, e.g. ``"backward of layers.0"`` or ``"optimizer step"``."""
    step_ms: float
    """Predicted step time, milliseconds."""
    overhead: float
    """Predicted step time over the plain step's, minus one (0.12 = 12% slower)."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One option per block, the budget it was solved for, and what it is predicted to cost."""

    choices: dict[str, str]
    """Block name -> option name, in forward order."""
    budget_bytes: int | None
    """The budget the plan was solved for (None for methods that take no budget)."""
    method: str
    """The solver that produced it: ``optimal``, ``none``, ``all``, ``every_k``, ``sqrt``, ``greedy``."""
    estimate: Estimate
    """The cost model's prediction for this plan."""
    model: str
    """The model's class name (from the profile)."""
    fingerprint: str
    """The model structure's fingerprint (from the profile): a plan is not applied elsewhere."""
    device: str
    """The device the profile was for."""
    dtype: str
    """The profile's dtype."""
    batch_shape: list[int]
    """The profile's batch shape."""
    schema_version: int = PLAN_SCHEMA
    """The record's schema version; files of another version are refused."""
    notes: list[str] = field(default_factory=list)
    """Free-form remarks from the solver (e.g. what dominates the peak)."""

    def to_json(self) -> str:
        return _dump(self, "plan")

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return _load(cls, text, "plan", PLAN_SCHEMA)

    def save(self, path: str | Path) -> None:
        _atomic_write(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(_read(Path(path)))


def load_record(path: str | Path) -> Profile | Plan:
    """Read a Profile or a Plan file, whichever it holds."""
    text = _read(Path(path))
    data = _parse(text, "record")
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "profile":
        return Profile.from_json(text)
    if kind == "plan":
        return Plan.from_json(text)
    raise RecordError(f"{path}: expected a remat 'profile' or 'plan' record, found kind={kind!r}")


# --- JSON --------------------------------------------------------------------------------------

_T = TypeVar("_T")


def _dump(record: Any, kind: str) -> str:
    data = {"kind": kind, **dataclasses.asdict(record)}
    return json.dumps(data, indent=2) + "\n"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise RecordError(f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(f"cannot read {path}: {e}") from None


def _atomic_write(path: Path, text: str) -> None:
    atomic_write(path, text)  # NOTE [ Atomic outputs ] in remat.files


def _parse(text: str, kind: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(f"not a remat {kind} file: invalid JSON ({e})") from None
    except RecursionError:  # json nests by recursion; no record is more than a few levels deep
        raise RecordError(f"not a remat {kind} file: JSON nested too deeply") from None


def _load(cls: type[_T], text: str, kind: str, schema: int) -> _T:
    data = _parse(text, kind)
    if not isinstance(data, dict) or data.get("kind") != kind:
        found = data.get("kind") if isinstance(data, dict) else type(data).__name__
        raise RecordError(f"expected a remat {kind} record, found kind={found!r}")
    version = data.get("schema_version")
    if version != schema:
        raise RecordError(
            f"this {kind} file has schema version {version!r}, but this remat reads version "
            f"{schema}; recreate it with this version (e.g. `remat {kind} ... --out FILE`)"
        )
    data.pop("kind")
    try:
        return _build(cls, data, "")  # type: ignore[no-any-return]
    except _FieldError as e:
        raise RecordError(f"malformed {kind} record: {e}") from None


# --- checking a record's JSON field by field -----------------------------------------------------


class _FieldError(Exception):
    pass


def _build(cls: Any, data: Any, where: str) -> Any:
    """``cls`` from its JSON form, every field checked against its annotation; a bad field is
    named by its path, e.g. ``blocks[0].options['keep'].kept_bytes``."""
    if not isinstance(data, dict):
        raise _FieldError(f"{where or cls.__name__}: expected an object ({cls.__name__}), "
                          f"got {_kind(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise _FieldError(f"unknown fields {unknown} for {cls.__name__}"
                          + (f" at {where}" if where else ""))
    missing = [name for name, f in fields.items() if name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise _FieldError(f"{cls.__name__}{' at ' + where if where else ''} misses the fields "
                          f"{missing}")
    hints = _hints(cls)
    kwargs = {}
    for name, value in data.items():
        at = f"{where}.{name}" if where else name
        kwargs[name] = _in_range(cls, name, _value(value, hints[name], at), at)
    return cls(**kwargs)


#: The largest byte count and time a record holds (1 PiB, ~11.6 days): far above any real step,
#: and low enough that the solvers' sums over thousands of blocks stay exact in int64.
_MAX_FIELD_BYTES = 2**50
_MAX_FIELD_MS = 1e9
_SIGNED = ("grad_bytes", "extra_ms", "step_ms")  # net changes, measured differences, and sums of them


def _in_range(cls: Any, name: str, value: Any, where: str) -> Any:
    """Numbers in a record file within what a step can have: a file is checked where it is read,
    so that every stage after it (cost model, solvers, apply) sees numbers it can sum."""
    if isinstance(value, list):
        if name == "batch_shape" and any(d < 0 for d in value):
            raise _FieldError(f"{where}: dimensions cannot be negative, got {value}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    limit: float = _MAX_FIELD_BYTES if isinstance(value, int) else _MAX_FIELD_MS
    if cls in (Plan, Estimate):  # a budget remat.units takes; sums of a profile's numbers
        limit = MAX_BYTES if isinstance(value, int) else 1e300
    if abs(value) > limit:
        shown = str(limit) if isinstance(value, int) else f"{limit:g}"
        raise _FieldError(f"{where}: {value!r} is out of range (at most {shown} in size)")
    if name == "world_size" and value < 1:
        raise _FieldError(f"{where}: expected at least 1 rank, got {value}")
    if value < 0 and name not in _SIGNED and name.endswith(("_bytes", "_ms")):
        raise _FieldError(f"{where}: cannot be negative, got {value!r}")
    return value


def _value(value: Any, hint: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:
            return _value(value, arms[0], where)
        raise AssertionError(hint)  # no record field is a union of two types
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise _FieldError(f"{where}: expected a list, got {_kind(value)}")
        return [_value(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _FieldError(f"{where}: expected an object, got {_kind(value)}")
        return {_value(k, args[0], f"{where} key {k!r}"): _value(v, args[1], f"{where}[{k!r}]")
                for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise _FieldError(f"{where}: expected true or false, got {_kind(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _FieldError(f"{where}: expected an integer, got {_kind(value)}")
        if abs(value) > MAX_BYTES:
            raise _FieldError(f"{where}: {value} is out of range (at most {MAX_BYTES} in size)")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _FieldError(f"{where}: expected a number, got {_kind(value)}")
        if not math.isfinite(value) or abs(value) > 1e300:
            raise _FieldError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise _FieldError(f"{where}: expected a string, got {_kind(value)}")
        return value
    raise AssertionError(f"no check for {hint!r} at {where}")


def _kind(value: Any) -> str:
    name = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(type(value))
    shown = repr(value)
    return f"{name or type(value).__name__} {shown[:40] + '...' if len(shown) > 40 else shown}"


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)
