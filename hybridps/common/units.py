"""Byte quantities: parsing human units ("256MiB", "2GiB", "1.5GB", 4096) and printing them.

Owns the one place where a capacity string becomes an integer number of bytes, so every
error about a bad unit reads the same. Knows nothing of devices or configs.
"""

from __future__ import annotations

import re

from hybridps.common.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")

_ACCEPTED = "an integer number of bytes or a string such as '4096', '512KiB', '256MiB', '2GiB', '1.5GB'"


def align_up(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return -(-n // alignment) * alignment


def parse_bytes(value: int | float | str, *, what: str = "size") -> int:
    """Return ``value`` as a whole number of bytes.

    Integers are bytes. Strings take an optional unit: B, KB/MB/GB/TB (powers of 1000) or
    KiB/MiB/GiB/TiB (powers of 1024), case-insensitive. Raises ConfigError naming ``what``
    and the value when it cannot be read or is negative.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: {value!r} is not a byte quantity; give {_ACCEPTED}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{what}: {value!r} is not a finite byte quantity; give {_ACCEPTED}")
        n = int(value)
    elif isinstance(value, str):
        m = _PATTERN.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(f"{what}: cannot read {value!r} as bytes; give {_ACCEPTED}")
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(f"{what}: {value!r} ({type(value).__name__}) is not a byte quantity; give {_ACCEPTED}")
    if n < 0:
        raise ConfigError(f"{what}: {value!r} is negative; give {_ACCEPTED}")
    return n


def format_bytes(n: int | float) -> str:
    """Return ``n`` bytes as a short human string in binary units ("1.50 MiB")."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{int(n)} B" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
