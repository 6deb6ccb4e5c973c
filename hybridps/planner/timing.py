"""Timing a callable on a device, for ``hybridps calibrate``'s measurements.

Owns the median of repeated runs after a warm-up (``median_seconds``), waiting for a device's
queued work (``device_sync``) and a precision's torch dtype (``precision_dtype``). Does not own
what is timed (``calibrate``, ``calibrate_attention``, ``calibrate_collectives``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1, sync: Callable[[], None] = lambda: None) -> float:
    """The median seconds of ``repeats`` calls of ``fn`` after ``warmup`` calls, each waited
    for with ``sync``."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_seconds(
    fns: tuple[Callable[[], Any], ...], repeats: int, warmup: int = 1, sync: Callable[[], None] = lambda: None
) -> list[tuple[float, ...]]:
    """Each round's seconds of every one of ``fns``, called in turns (``repeats`` rounds after
    ``warmup``): a drift of the machine's speed then falls on all of them alike, so a
    difference between two is taken round by round."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    sync()
    rounds = []
    for _ in range(repeats):
        times = []
        for fn in fns:
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        rounds.append(tuple(times))
    return rounds


def device_sync(device) -> Callable[[], None]:
    """What waits for ``device``'s queued work: ``torch.cuda.synchronize`` on a GPU, nothing on the CPU."""
    import torch

    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def precision_dtype(precision: str):
    """The torch dtype of a precision name (``Config.precision``)."""
    from hybridps.common.config import PRECISIONS

    return PRECISIONS[precision]
