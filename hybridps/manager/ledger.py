"""The ledger: per-device capacity and per-client usage of one node's memory.

Owns the numbers (capacity, used, peak per device; bytes per client per device) and the
invariants on them: nothing goes negative, no device is booked past its capacity, a client
never removes more than it holds. Every failing call leaves the ledger unchanged.

Also owns the atomic verbs both managers serve (the daemon's service and the embedded
manager call these, so there is one implementation): ``update`` releases and books bytes on
any devices and books more on a device it chooses with the policy, all in one step (a
placement, a move between devices, a release); and ``register`` books what a returning
client already holds all or nothing. A caller holding the ledger's lock for one
call therefore cannot lose room it was offered.

Does not own placement rules (policy.py), sockets (server.py) or time (leases are the
service's business; the ledger only records what it is told).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from hybridps.common.devices import DeviceSpec, canonical_device_name
from hybridps.common.errors import CapacityError, HybridPSError, ManagerError
from hybridps.common.protocol import MAX_SIZE_BYTES, ClientInfo
from hybridps.common.units import format_bytes
from hybridps.manager import policy

__all__ = ["MAX_SIZE_BYTES", "ClientAccount", "DeviceAccount", "Ledger"]


@dataclasses.dataclass
class DeviceAccount:
    name: str
    capacity_bytes: int
    simulated: bool = False
    used_bytes: int = 0
    peak_bytes: int = 0
    #: where capacity_bytes came from (DeviceSpec.capacity_source), shown by `hybridps status`
    capacity_source: str = "config"

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
            self._devices[d.name] = DeviceAccount(d.name, d.capacity_bytes, d.simulated, capacity_source=d.capacity_source)
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

    def register(self, client_id: str, info: ClientInfo, holdings: Mapping[str, int] | None = None) -> ClientAccount:
        """Add a client; with ``holdings`` (bytes per device it holds already: a client that
        registers again after a restart or a lost lease) book them all, or raise and
        register nothing."""
        if client_id in self._clients:
            raise ManagerError(f"client {client_id!r} is already registered", code="duplicate_client")
        for name in info.devices:
            self.device(name)  # raises on an unknown device
        booked: dict[str, int] = {}
        for name, size in (holdings or {}).items():
            dev = self.device(name)
            _check_size(size)
            booked[dev.name] = booked.get(dev.name, 0) + size
        short = {n: s for n, s in booked.items() if s > self._devices[n].free_bytes}
        if short:
            what = "; ".join(
                f"{n}: {format_bytes(s)} ({s} B) held, {format_bytes(self._devices[n].free_bytes)} free" for n, s in short.items()
            )
            raise CapacityError(
                f"client {client_id} cannot be registered with what it holds: {what}. Its bytes were given to other "
                f"clients while it was away; nothing was booked for it"
            )
        acct = ClientAccount(client_id, info)
        self._clients[client_id] = acct
        for name, size in booked.items():
            self._book(acct, self._devices[name], size)
        return acct

    def reachable(self, client_id: str) -> tuple[str, ...]:
        """The devices a client may be given: those it listed, or every device."""
        return tuple(self.client(client_id).info.devices) or tuple(self._devices)

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

    def update(
        self,
        client_id: str,
        *,
        release: Mapping[str, int] | None = None,
        book: Mapping[str, int] | None = None,
        place_bytes: int = 0,
        refer_device: str | None = None,
        exclude: Sequence[str] = (),
    ) -> str | None:
        """Change what a client holds in one step: release ``release`` (bytes per device),
        book ``book`` (bytes per device), and book ``place_bytes`` on the device
        policy.schedule chooses near ``refer_device`` (default the CPU) and not in
        ``exclude``; returns that device, or None without a placement (``place_bytes`` 0).
        The releases come first: their room counts as free for the bookings and the choice.
        On failure nothing changes.
        """
        acct = self.client(client_id)
        releases = self._by_device(release) if release else {}
        bookings = self._by_device(book) if book else {}
        _check_size(place_bytes)
        placing = place_bytes > 0
        for name, size in releases.items():
            self._check_held(acct, self._devices[name], size)
        for name, size in bookings.items():
            if size > self._devices[name].free_bytes + releases.get(name, 0):
                raise CapacityError(self._refusal(client_id, name, size, releases))
        chosen = None
        if placing:
            refer = self.device(refer_device or "cpu").name
            free = self.free_bytes()
            for name, size in releases.items():
                free[name] += size
            for name, size in bookings.items():
                free[name] -= size
            chosen = self._devices[
                policy.schedule(
                    place_bytes, refer, free, self.reachable(client_id), exclude=_canonical_all(exclude, self._devices)
                )
            ]
        for name, size in releases.items():
            self._devices[name].used_bytes -= size
            acct.usage[name] = acct.held(name) - size
        for name, size in bookings.items():
            self._book(acct, self._devices[name], size)
        if chosen is None:
            return None
        self._book(acct, chosen, place_bytes)
        return chosen.name

    def _by_device(self, sizes: Mapping[str, int] | None) -> dict[str, int]:
        """``sizes`` by canonical device name (a device named twice: summed), each checked."""
        out: dict[str, int] = {}
        for name, size in (sizes or {}).items():
            dev = self.device(name)
            _check_size(size)
            out[dev.name] = out.get(dev.name, 0) + size
        return out

    def _refusal(self, client_id: str, device: str, size: int, releases: Mapping[str, int]) -> str:
        dev = self._devices[device]
        what = f"{format_bytes(size)} ({size} B)"
        sources = [name for name, s in releases.items() if s and name != device]
        action = f"move {what} there from {', '.join(sources)}" if sources else f"book {what}"
        return (
            f"{device} has {format_bytes(dev.free_bytes)} free of {format_bytes(dev.capacity_bytes)}; cannot {action} "
            f"for client {client_id}"
        )

    def _book(self, acct: ClientAccount, dev: DeviceAccount, size: int) -> None:
        dev.used_bytes += size
        dev.peak_bytes = max(dev.peak_bytes, dev.used_bytes)
        acct.usage[dev.name] = acct.held(dev.name) + size

    def _check_held(self, acct: ClientAccount, dev: DeviceAccount, size: int) -> None:
        held = acct.held(dev.name)
        if size > held:
            raise ManagerError(
                f"client {acct.client_id} releases {size} B on {dev.name} but holds only {held} B there; "
                f"release only what was booked",
                code="over_remove",
            )

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


def _canonical_all(names: Sequence[str], known: Mapping[str, object]) -> tuple[str, ...]:
    # A name the ledger keeps is canonical already (the common case: the mover sends them);
    # an unknown name in an exclude list cannot be chosen anyway, so it stays as given.
    out = []
    for name in names:
        if isinstance(name, str) and name in known:
            out.append(name)
            continue
        try:
            out.append(canonical_device_name(name))
        except (HybridPSError, ValueError, TypeError):
            out.append(name)
    return tuple(out)


def _check_size(size: object) -> None:
    if isinstance(size, bool) or not isinstance(size, int):
        raise ManagerError(f"size {size!r} must be an integer number of bytes", code="bad_size")
    if size < 0:
        raise ManagerError(f"size {size} is negative; sizes are byte counts >= 0", code="bad_size")
    if size > MAX_SIZE_BYTES:
        raise ManagerError(f"size {size} B is beyond any node's memory (limit {MAX_SIZE_BYTES} B)", code="bad_size")
