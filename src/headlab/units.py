"""Units for people: bytes and FLOPs as text, and byte sizes read from text.

The bottom of the house: the memory guard, the cost model and the CLI all format with these.

    >>> human_bytes(34359738368), parse_bytes("10GiB"), parse_bytes("512M"), parse_bytes("1.5G")
    ('32.0 GiB', 10737418240, 536870912, 1610612736)
"""

from __future__ import annotations

import re

__all__ = ["human_bytes", "human_flops", "parse_bytes"]

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """``34359738368 -> '32.0 GiB'`` (powers of 1024); past 1024 of the largest unit in powers of ten,
    so a table keeps its columns: ``human_bytes(2**80) -> '1.21e+24 B'``."""
    n = float(n)
    if abs(n) >= 1024 ** len(_BYTE_UNITS):
        return f"{n:.2e} B"
    unit = _BYTE_UNITS[0]
    for unit in _BYTE_UNITS:
        if abs(n) < 1024 or unit == _BYTE_UNITS[-1]:
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


def human_flops(n: float) -> str:
    """``8.8e12 -> '8.80 TFLOP'``; past 1000 EFLOP in powers of ten."""
    if n >= 1e21:
        return f"{n:.2e} FLOP"
    for unit, scale in (
        ("EFLOP", 1e18),
        ("PFLOP", 1e15),
        ("TFLOP", 1e12),
        ("GFLOP", 1e9),
        ("MFLOP", 1e6),
        ("kFLOP", 1e3),
    ):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


# K, M, G, T, P with or without i and B: powers of 1024 (memory sizes, as `free -h` and torch print them)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgGtTpP]?)(i?)([bB]?)\s*$")


def parse_bytes(text: str) -> int | None:
    """Bytes from ``"10GiB"``, ``"512M"``, ``"1.5G"``, ``"4096"`` (K/M/G/T/P = powers of 1024,
    with or without ``i`` and ``B``); None when the text is not a size."""
    m = _SIZE.match(str(text))
    if m is None or (m.group(3) and not m.group(2)):
        return None
    power = " KMGTP".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * 1024**power)
