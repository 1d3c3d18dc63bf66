"""Sizes as users write them (``"1GiB"``, ``"512MB"``, ``"300k"``, a byte count), for the engine's memory options and
the planner's budget flags alike."""

from __future__ import annotations

import math

UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10 ** 3, "mb": 10 ** 6,
         "gb": 10 ** 9, "tb": 10 ** 12, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "b": 1}


def parse_size(value: str | int) -> int:
    """``"1GiB"``, ``"512MB"``, ``"300k"`` or a byte count -> a positive number of bytes (ValueError otherwise)."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}")
    if isinstance(value, int):
        n = value
    else:
        s = str(value).strip().lower().replace(" ", "")
        unit = next((u for u in sorted(UNITS, key=len, reverse=True) if s.endswith(u)), "")
        try:
            x = float(s[:len(s) - len(unit)])
        except ValueError:
            raise ValueError(f"invalid size {value!r}; use a byte count or a number with a unit, e.g. 512MiB, "
                             "4GiB") from None
        if not math.isfinite(x):
            raise ValueError(f"invalid size {value!r}")
        n = int(x * UNITS.get(unit, 1))
    if n <= 0:
        raise ValueError(f"invalid size {value!r}; it must be more than 0 bytes")
    return n
