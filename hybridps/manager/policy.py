"""Placement policy: where a chunk of a given size should go. Pure functions, no state.

``schedule`` answers the seed's ``schedule(size, refer_device)``: the referred device if it
has room, else the CPU, else another GPU the client can reach (the one with most room), else
the disk tier (``nvme``: the slowest memory, taken last), else a CapacityError that names
every size involved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridps.common.errors import CapacityError
from hybridps.common.units import format_bytes


def schedule(
    size: int,
    refer_device: str,
    free_bytes: Mapping[str, int],
    reachable: Sequence[str],
    *,
    exclude: Sequence[str] = (),
) -> str:
    """Return the device for ``size`` bytes whose caller would prefer ``refer_device``.

    ``free_bytes`` is the room left on each device; ``reachable`` lists the devices the
    caller can use (the CPU is always reachable); ``exclude`` lists devices that must not be
    chosen (a device being evicted from).
    """
    candidates = [refer_device, "cpu"]
    others = sorted(
        (d for d in reachable if d not in ("cpu", refer_device)),
        key=lambda d: (d == "nvme", -free_bytes.get(d, 0), reachable.index(d)),
    )
    candidates += others
    for device in candidates:
        if device in exclude or device not in free_bytes:
            continue
        if free_bytes[device] >= size:
            return device
    free = ", ".join(f"{d} {format_bytes(free_bytes[d])}" for d in dict.fromkeys(candidates) if d in free_bytes)
    raise CapacityError(
        f"no device has room for {format_bytes(size)} ({size} B) near {refer_device}; free: {free}. "
        f"Give HybridPS more memory (Config.devices), use smaller chunks, or fewer ranks per node"
    )
