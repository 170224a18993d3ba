"""Byte quantities: parsing what users write, printing what people read.

Sizes are parsed by `pydantic.ByteSize`: decimal units are powers of 1000
("2k", "2KB" and "2 kb" are 2000 bytes; "1.5GB" is 1.5e9) and binary units
powers of 1024 ("2KiB" is 2048; "12GiB" is 12 x 2**30). Printing always uses
binary units, like CUDA's own messages.
"""

from __future__ import annotations

from pydantic import ByteSize, TypeAdapter, ValidationError

_SIZE = TypeAdapter(ByteSize)


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
    try:
        return int(_SIZE.validate_python(value.strip()))
    except ValidationError:
        raise ValueError(
            f"{what} {value!r} is not a size: write bytes as an int, or a number with one of "
            "B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000), e.g. '12GiB'"
        ) from None


def format_bytes(n: int | float) -> str:
    """``1536 -> '1.50 KiB'``: binary units, two decimals, like CUDA's messages."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"
