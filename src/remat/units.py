"""Bytes at the public edge: parse "6GiB" / "6.5GB" / "800MiB" / "60%" into ints, format for people.

Inside remat every byte count is an ``int``; strings exist only where a person types or reads them.
"""

from __future__ import annotations

import math
import re

from remat.errors import InvalidType, InvalidValue

__all__ = ["DEVICE_BUDGET", "DEVICE_MARGIN", "MAX_BYTES", "axis_unit", "check_budget", "format_bytes", "parse_budget", "parse_bytes"]

#: The largest byte count remat takes (4 EiB): far above any machine's memory, far below int64
#: overflow, so that a budget of ``1e400`` or ``inf`` is an error that says so, not an overflow.
MAX_BYTES = 2**62

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


def parse_bytes(value: int | float | str) -> int:
    """``6442450944``, ``"6GiB"``, ``"6.5GB"``, ``"800MiB"``, ``"512k"`` -> bytes as an int.

    Raises ``TypeError`` for a value of another type and ``ValueError`` for one that does not
    parse, is not finite, is below one byte or above ``MAX_BYTES``."""
    if isinstance(value, bool):
        raise InvalidType(f"expected a byte count (int) or a string like '6GiB', got {value!r}")
    if isinstance(value, int | float):
        return _checked(value, repr(value), noun="a byte count")
    if not isinstance(value, str):
        raise InvalidType(
            f"expected a byte count (int) or a string like '6GiB', got {type(value).__name__}"
        )
    match = _BYTES_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidValue(
            f"cannot read {value!r} as a size: expected a number with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '6GiB', '6.5GB', '800MiB'"
        )
    return _checked(float(match.group(1)) * _UNITS[unit], repr(value), noun="a size")


def _checked(number: int | float, shown: str, *, noun: str) -> int:
    """``number`` of bytes as an int, or a ValueError that shows the value as the user gave it."""
    if isinstance(number, float) and not math.isfinite(number):
        raise InvalidValue(f"{noun} must be a finite number of bytes, got {shown}")
    if number <= 0:
        raise InvalidValue(f"{noun} must be positive, got {shown}")
    if number < 1:
        raise InvalidValue(f"{noun} must be at least 1 byte, got {shown} (a fraction of a byte)")
    if number > MAX_BYTES:
        raise InvalidValue(f"{noun} must be at most {MAX_BYTES} bytes (4 EiB), got {shown}")
    return int(number)


#: The budget that means "this device" (NOTE [ The device budget ]).
DEVICE_BUDGET = "device"

#: The share of a CUDA device's memory that the ``"device"`` budget leaves to the caching allocator.
DEVICE_MARGIN = 0.2


def parse_budget(value: int | float | str, *, plain_peak_bytes: int | None = None,
                 device_memory_bytes: int | None = None) -> int:
    """A budget in bytes, as a share of the plain step's peak ("60%"), or ``"device"``.

    # NOTE [ The device budget ]
    ``"device"`` is the device's total memory less ``DEVICE_MARGIN`` (20%): a budget counts what
    tensors take (``max_memory_allocated``), and the caching allocator reserves more than that
    (1.3-2x allocated in published LLM runs; ``verify`` measures it as ``reserved_peak_bytes``).
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` keeps the two close. On a CPU there is no
    such number to read: the budget must be given in bytes.
    """
    if isinstance(value, str) and value.strip().lower() == DEVICE_BUDGET:
        if device_memory_bytes is None:
            raise InvalidValue(
                "budget 'device' means the device's memory less a margin for the caching allocator, "
                "which remat reads only on a CUDA device; here give the budget in bytes, e.g. '8GiB' "
                "(on a CPU: the memory this process may use for the step)"
            )
        return _checked(device_memory_bytes * (1 - DEVICE_MARGIN), repr(value), noun="a budget")
    if isinstance(value, str):
        match = _PERCENT_RE.match(value)
        if match:
            share = float(match.group(1)) / 100.0
            if plain_peak_bytes is None:
                raise InvalidValue(
                    f"budget {value!r} is a share of the plain step's peak, which is not known here; "
                    "give the budget in bytes instead, e.g. '6GiB'"
                )
            if share <= 0:
                raise InvalidValue(f"a budget must be positive, got {value!r}")
            return _checked(plain_peak_bytes * share, repr(value), noun="a budget")
    return parse_bytes(value)


def check_budget(value: int | float | str) -> None:
    """Refuse a budget that can never be resolved, before anything expensive runs; a share
    (``"60%"``) is resolved later, against the plain step's predicted peak, and ``"device"``
    against the device's memory."""
    if isinstance(value, str) and value.strip().lower() == DEVICE_BUDGET:
        return
    if isinstance(value, str):
        match = _PERCENT_RE.match(value)
        if match:
            if not float(match.group(1)) > 0:
                raise InvalidValue(f"a budget must be positive, got {value!r}")
            return
    parse_bytes(value)


def format_bytes(n: int | float) -> str:
    """Binary units for people: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"


def axis_unit(max_bytes: float) -> tuple[str, float]:
    """The axis unit for values up to ``max_bytes``: GiB from 2 GiB up, else MiB (KiB if tiny)."""
    if max_bytes >= 2 * 2**30:
        return "GiB", float(2**30)
    if max_bytes >= 2 * 2**20:
        return "MiB", float(2**20)
    return "KiB", float(2**10)
