"""Checks of the planner's inputs and records: counts and byte figures.

Owns the small validators the planner's records run in ``__post_init__``, the messages they
raise (``ConfigError``, naming the field and what it must be), and the head count a message
suggests when heads do not divide the hidden size (``divisor_near``).

Does not own what the figures mean or which ones a record checks: each record says that.
"""

from __future__ import annotations

from hybridps.common.errors import ConfigError


def check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer (1 or more)")


def check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}={value!r} must be a whole number >= 0")


def check_bytes(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}={value!r} must be a whole number of bytes >= 0")


def divisor_near(n: int, target: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - target), d))
