"""Bytes at the public edge: parse "6GiB" / "6.5GB" / "800MiB" / "60%" into ints, format for people.

Inside remat every byte count is an ``int``; strings exist only where a person types or reads them.
"""

from __future__ import annotations

import re

from remat.errors import InvalidType, InvalidValue

__all__ = ["axis_unit", "format_bytes", "parse_budget", "parse_bytes"]

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
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


def parse_bytes(value: int | float | str) -> int:
    """``6442450944``, ``"6GiB"``, ``"6.5GB"``, ``"800MiB"``, ``"512k"`` -> bytes as an int."""
    if isinstance(value, bool):
        raise InvalidType(f"expected a byte count (int) or a string like '6GiB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise InvalidValue(f"a byte count must be positive, got {value}")
        return value
    if isinstance(value, float):
        if value <= 0 or value != value:
            raise InvalidValue(f"a byte count must be positive, got {value}")
        return int(value)
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
    number = float(match.group(1))
    if number <= 0:
        raise InvalidValue(f"a size must be positive, got {value!r}")
    return int(number * _UNITS[unit])


def parse_budget(value: int | float | str, *, plain_peak_bytes: int | None = None) -> int:
    """A budget in bytes, or as a share of the plain step's peak ("60%")."""
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
            return int(plain_peak_bytes * share)
    return parse_bytes(value)


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
