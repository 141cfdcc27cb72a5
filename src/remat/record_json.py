"""The JSON form of remat's records: writing, reading, and checking a file field by field
against the record's annotations (a bad field is named by its path). No torch here."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from remat.errors import RecordError
from remat.files import atomic_write
from remat.units import MAX_BYTES

__all__ = [
    "FieldError",
    "build_record",
    "dump_record",
    "load_record_text",
    "parse_json",
    "read_record_text",
    "write_record_text",
]

_T = TypeVar("_T")


def dump_record(record: Any, kind: str) -> str:
    data = {"kind": kind, **dataclasses.asdict(record)}
    return json.dumps(data, indent=2) + "\n"


def read_record_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise RecordError(f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(f"cannot read {path}: {e}") from None


def write_record_text(path: Path, text: str) -> None:
    atomic_write(path, text)  # NOTE [ Atomic outputs ] in remat.files


def parse_json(text: str, kind: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(f"not a remat {kind} file: invalid JSON ({e})") from None
    except RecursionError:  # json nests by recursion; no record is more than a few levels deep
        raise RecordError(f"not a remat {kind} file: JSON nested too deeply") from None


def load_record_text(cls: type[_T], text: str, kind: str, schema: int) -> _T:
    data = parse_json(text, kind)
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
        return build_record(cls, data, "")  # type: ignore[no-any-return]
    except FieldError as e:
        raise RecordError(f"malformed {kind} record: {e}") from None


# --- checking a record's JSON field by field -----------------------------------------------------


class FieldError(Exception):
    pass


def build_record(cls: Any, data: Any, where: str) -> Any:
    """``cls`` from its JSON form, every field checked against its annotation; a bad field is
    named by its path, e.g. ``blocks[0].options['keep'].kept_bytes``."""
    if not isinstance(data, dict):
        raise FieldError(f"{where or cls.__name__}: expected an object ({cls.__name__}), "
                          f"got {_kind(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise FieldError(f"unknown fields {unknown} for {cls.__name__}"
                          + (f" at {where}" if where else ""))
    missing = [name for name, f in fields.items() if name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise FieldError(f"{cls.__name__}{' at ' + where if where else ''} misses the fields "
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
# Net changes, measured differences, and sums of them: a block's numbers are over the level the cost
# model holds where it runs, which a block that frees more than it makes leaves below (the last of
# BS-RoFormer's band-split MLPs, whose outputs the model's code frees after it: kept -128,512 B).
_SIGNED = ("grad_bytes", "kept_bytes", "fwd_peak_bytes", "bwd_peak_bytes", "unpack_bytes", "stop_peak_bytes",
           "optimizer_peak_bytes", "post_fwd_peak_held_bytes", "post_bwd_peak_held_bytes", "extra_ms", "step_ms")


def _in_range(cls: Any, name: str, value: Any, where: str) -> Any:
    """Numbers in a record file within what a step can have: a file is checked where it is read,
    so that every stage after it (cost model, solvers, apply) sees numbers it can sum."""
    if isinstance(value, list):
        if name == "batch_shape" and any(d < 0 for d in value):
            raise FieldError(f"{where}: dimensions cannot be negative, got {value}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    limit: float = _MAX_FIELD_BYTES if isinstance(value, int) else _MAX_FIELD_MS
    if cls.__name__ in ("Plan", "Estimate"):  # a budget remat.units takes; sums of a profile's numbers
        limit = MAX_BYTES if isinstance(value, int) else 1e300
    if abs(value) > limit:
        shown = str(limit) if isinstance(value, int) else f"{limit:g}"
        raise FieldError(f"{where}: {value!r} is out of range (at most {shown} in size)")
    if name == "world_size" and value < 1:
        raise FieldError(f"{where}: expected at least 1 rank, got {value}")
    if value < 0 and name not in _SIGNED and name.endswith(("_bytes", "_ms")):
        raise FieldError(f"{where}: cannot be negative, got {value!r}")
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
        return build_record(hint, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise FieldError(f"{where}: expected a list, got {_kind(value)}")
        return [_value(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise FieldError(f"{where}: expected an object, got {_kind(value)}")
        return {_value(k, args[0], f"{where} key {k!r}"): _value(v, args[1], f"{where}[{k!r}]")
                for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise FieldError(f"{where}: expected true or false, got {_kind(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise FieldError(f"{where}: expected an integer, got {_kind(value)}")
        if abs(value) > MAX_BYTES:
            raise FieldError(f"{where}: {value} is out of range (at most {MAX_BYTES} in size)")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise FieldError(f"{where}: expected a number, got {_kind(value)}")
        if not math.isfinite(value) or abs(value) > 1e300:
            raise FieldError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise FieldError(f"{where}: expected a string, got {_kind(value)}")
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
