"""One way to print a size in bytes, so that a file reads the same in every message (binary units, IEC names).

`format_bytes(40_894_464)` -> '39.0 MiB': the demo summary, push's warning, the disk and memory checks all call it.
"""

from __future__ import annotations

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | float) -> str:
    """`n` bytes as 'N B' below 1 KiB, else one decimal in the largest binary unit it reaches ('39.0 MiB'), no
    decimal from 100 of a unit on ('256 MiB'). Negative sizes keep their sign (a shortfall)."""
    sign, value = ("-" if n < 0 else ""), abs(float(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    for i, unit in enumerate(_UNITS):
        value /= 1024
        shown = f"{value:.0f}" if value >= 100 else f"{value:.1f}"
        if float(shown) < 1024 or i == len(_UNITS) - 1:  # 1023.7 MiB reads '1.0 GiB', not '1024 MiB'
            return f"{sign}{shown} {unit}"
    raise AssertionError("unreachable")
