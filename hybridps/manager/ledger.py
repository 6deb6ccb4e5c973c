"""The ledger: per-device capacity and per-client usage of one node's memory.

Owns the numbers (capacity, used, peak per device; bytes per client per device) and the
invariants on them: nothing goes negative, no device is booked past its capacity, a client
never removes more than it holds. Every failing call leaves the ledger unchanged.

Does not own placement decisions (policy.py), sockets (server.py) or time (leases are the
service's business; the ledger only records what it is told).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from hybridps.common.devices import DeviceSpec, canonical_device_name
from hybridps.common.errors import CapacityError, ManagerError
from hybridps.common.protocol import MAX_SIZE_BYTES, ClientInfo
from hybridps.common.units import format_bytes

__all__ = ["MAX_SIZE_BYTES", "ClientAccount", "DeviceAccount", "Ledger"]


@dataclasses.dataclass
class DeviceAccount:
    name: str
    capacity_bytes: int
    simulated: bool = False
    used_bytes: int = 0
    peak_bytes: int = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes


@dataclasses.dataclass
class ClientAccount:
    client_id: str
    info: ClientInfo
    usage: dict[str, int] = dataclasses.field(default_factory=dict)

    def held(self, device: str) -> int:
        return self.usage.get(device, 0)


class Ledger:
    """Capacity and usage of every device of a node, and what each client holds."""

    def __init__(self, devices: Iterable[DeviceSpec]):
        self._devices: dict[str, DeviceAccount] = {}
        for d in devices:
            self._devices[d.name] = DeviceAccount(d.name, d.capacity_bytes, d.simulated)
        if "cpu" not in self._devices:
            raise ManagerError("a ledger needs the 'cpu' device", code="bad_request")
        self._clients: dict[str, ClientAccount] = {}

    # -- devices ---------------------------------------------------------------------------

    def device(self, name: str) -> DeviceAccount:
        # The common case, a canonical name, skips the regex (a non-string falls through to
        # canonical_device_name, which names it in the error).
        acct = self._devices.get(name) if isinstance(name, str) else None
        if acct is not None:
            return acct
        try:
            return self._devices[canonical_device_name(name)]
        except (KeyError, ValueError):
            known = ", ".join(self._devices)
            raise ManagerError(f"unknown device {name!r}; this node has: {known}", code="unknown_device") from None

    @property
    def device_names(self) -> list[str]:
        return list(self._devices)

    def free_bytes(self) -> dict[str, int]:
        return {n: d.free_bytes for n, d in self._devices.items()}

    # -- clients ---------------------------------------------------------------------------

    def register(self, client_id: str, info: ClientInfo) -> ClientAccount:
        if client_id in self._clients:
            raise ManagerError(f"client {client_id!r} is already registered", code="duplicate_client")
        for name in info.devices:
            self.device(name)  # raises on an unknown device
        acct = ClientAccount(client_id, info)
        self._clients[client_id] = acct
        return acct

    def client(self, client_id: str) -> ClientAccount:
        try:
            return self._clients[client_id]
        except KeyError:
            raise ManagerError(f"unknown client {client_id!r}; register first", code="unknown_client") from None

    @property
    def clients(self) -> list[ClientAccount]:
        return list(self._clients.values())

    def unregister(self, client_id: str) -> dict[str, int]:
        """Drop a client and give back everything it held; returns what was reclaimed."""
        acct = self.client(client_id)
        for name, size in acct.usage.items():
            self._devices[name].used_bytes -= size
        del self._clients[client_id]
        return {n: s for n, s in acct.usage.items() if s}

    # -- usage -----------------------------------------------------------------------------

    def add(self, client_id: str, device: str, size: int) -> None:
        acct = self.client(client_id)
        dev = self.device(device)
        _check_size(size)
        if dev.used_bytes + size > dev.capacity_bytes:
            raise CapacityError(
                f"{dev.name} has {format_bytes(dev.free_bytes)} free of {format_bytes(dev.capacity_bytes)}; "
                f"cannot book {format_bytes(size)} ({size} B) for client {client_id}"
            )
        dev.used_bytes += size
        dev.peak_bytes = max(dev.peak_bytes, dev.used_bytes)
        acct.usage[dev.name] = acct.held(dev.name) + size

    def remove(self, client_id: str, device: str, size: int) -> None:
        acct = self.client(client_id)
        dev = self.device(device)
        _check_size(size)
        held = acct.held(dev.name)
        if size > held:
            raise ManagerError(
                f"client {client_id} removes {size} B from {dev.name} but holds only {held} B there; "
                f"report exactly what was added",
                code="over_remove",
            )
        dev.used_bytes -= size
        acct.usage[dev.name] = held - size

    def snapshot(self) -> dict:
        return {
            "devices": {
                n: {
                    "capacity_bytes": d.capacity_bytes,
                    "used_bytes": d.used_bytes,
                    "free_bytes": d.free_bytes,
                    "peak_bytes": d.peak_bytes,
                    "simulated": d.simulated,
                }
                for n, d in self._devices.items()
            },
            "clients": [
                {
                    "client_id": a.client_id,
                    "rank": a.info.rank,
                    "local_rank": a.info.local_rank,
                    "pid": a.info.pid,
                    "host": a.info.host,
                    "usage": {n: s for n, s in a.usage.items() if s},
                }
                for a in self._clients.values()
            ],
        }


def _check_size(size: object) -> None:
    if isinstance(size, bool) or not isinstance(size, int):
        raise ManagerError(f"size {size!r} must be an integer number of bytes", code="bad_size")
    if size < 0:
        raise ManagerError(f"size {size} is negative; sizes are byte counts >= 0", code="bad_size")
    if size > MAX_SIZE_BYTES:
        raise ManagerError(f"size {size} B is beyond any node's memory (limit {MAX_SIZE_BYTES} B)", code="bad_size")
