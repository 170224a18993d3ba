"""Byte quantities: parsing what users write, printing what people read."""

from __future__ import annotations

import re

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, what: str = "size") -> int:
    """Bytes from an int or a string such as ``"12GiB"``, ``"512 MiB"``, ``"1.5GB"``.

    Raises ValueError naming `what` and the accepted forms.
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be bytes (int) or a string like '12GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must not be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{what} must be bytes (int) or a string like '12GiB', got {type(value).__name__}")
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS and unit != "":
        raise ValueError(
            f"{what} {value!r} is not a size: write bytes as an int, or a number with one of "
            "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB (e.g. '12GiB')"
        )
    return int(float(match.group(1)) * _UNITS.get(unit, 1))


def format_bytes(n: int | float) -> str:
    """``1536 -> '1.50 KiB'``: binary units, two decimals, like CUDA's messages."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"
