"""The embedded manager: a ledger and the placement policy inside the client's process.

This is the default when no node daemon is configured (one rank, tests, notebooks). It
serves the same ``ManagerConnection`` interface as the daemon's client stub, so the chunk
mover cannot tell them apart (``add``, ``remove`` and ``schedule``, the design's verbs, and
``update``, of which ``add`` and ``remove`` are cases). ``update`` is the ledger's atomic verb, the same code the
daemon runs (ledger.py), under this manager's lock; ``schedule`` asks the same policy.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from hybridps.common.devices import DeviceSpec
from hybridps.common.protocol import ClientInfo
from hybridps.manager import policy
from hybridps.manager.ledger import Ledger
from hybridps.manager.verbs import BookingVerbs


class ManagerConnection(Protocol):
    """What a client needs from its node manager."""

    client_id: str

    def schedule(self, size: int, refer_device: str, exclude: Sequence[str] = ()) -> str:
        """The device ``size`` bytes would go to near ``refer_device`` and not in ``exclude``
        (nothing booked)."""
        ...

    def update(
        self,
        *,
        release: Mapping[str, int] | None = None,
        book: Mapping[str, int] | None = None,
        place_bytes: int = 0,
        refer_device: str = "cpu",
        exclude: Sequence[str] = (),
    ) -> str | None:
        """Release ``release`` and book ``book`` (bytes per device) and, with ``place_bytes``,
        book that many on the device chosen near ``refer_device`` and not in ``exclude``, in
        one step (the releases first); returns the chosen device, None without a placement."""
        ...

    def add(self, device: str, size: int) -> None:
        """Book ``size`` bytes on ``device`` (``update(book={device: size})``, verbs.py)."""
        ...

    def remove(self, device: str, size: int) -> None:
        """Release ``size`` bytes on ``device`` (``update(release={device: size})``)."""
        ...

    def settle(self, *, hold_releases: bool, phase: str | None = None) -> None:
        """Tell the manager every release held back and hold them back from now or not; a
        ``phase`` that begins books ahead what it took the last time (a daemon's stub:
        client/held_back.py); in-process bookings are told at once."""
        ...

    def status(self) -> dict: ...

    def close(self) -> None: ...


class EmbeddedManager:
    """A node manager living in this process. Thread-safe; one per client by default."""

    def __init__(self, devices: Iterable[DeviceSpec]):
        self.ledger = Ledger(devices)
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def connect(self, info: ClientInfo) -> EmbeddedConnection:
        with self._lock:
            client_id = f"embedded-{next(self._ids)}"
            self.ledger.register(client_id, info)
        return EmbeddedConnection(self, client_id, info)


class EmbeddedConnection(BookingVerbs):
    """One client's view of an EmbeddedManager: ``schedule``, ``update`` and the verbs
    ``add``/``remove`` over it (verbs.py)."""

    def __init__(self, manager: EmbeddedManager, client_id: str, info: ClientInfo):
        self._manager = manager
        self.client_id = client_id
        self._reachable = tuple(info.devices) or tuple(manager.ledger.device_names)
        self._closed = False

    def schedule(self, size: int, refer_device: str, exclude: Sequence[str] = ()) -> str:
        with self._manager._lock:
            free = self._manager.ledger.free_bytes()
            return policy.schedule(size, refer_device, free, self._reachable, exclude=exclude)

    def update(
        self,
        *,
        release: Mapping[str, int] | None = None,
        book: Mapping[str, int] | None = None,
        place_bytes: int = 0,
        refer_device: str = "cpu",
        exclude: Sequence[str] = (),
    ) -> str | None:
        with self._manager._lock:
            return self._manager.ledger.update(
                self.client_id,
                release=release,
                book=book,
                place_bytes=place_bytes,
                refer_device=refer_device,
                exclude=tuple(exclude),
            )

    def settle(self, *, hold_releases: bool, phase: str | None = None) -> None:
        """Nothing to tell: a booking here costs no round trip, so none is held back."""

    def status(self) -> dict:
        with self._manager._lock:
            return self._manager.ledger.snapshot()

    def close(self) -> None:
        if self._closed:
            return
        with self._manager._lock:
            self._manager.ledger.unregister(self.client_id)
        self._closed = True
