"""The embedded manager: a ledger and the placement policy inside the client's process.

This is the default when no node daemon is configured (one rank, tests, notebooks). It
serves the same ``ManagerConnection`` interface as the daemon's client stub, so the chunk
manager cannot tell them apart. ``place``, ``move`` and ``update`` are the ledger's atomic
verbs, the same code the daemon runs (ledger.py), under this manager's lock.
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


class ManagerConnection(Protocol):
    """What a client needs from its node manager."""

    client_id: str

    def add(self, device: str, size: int) -> None: ...

    def remove(self, device: str, size: int) -> None: ...

    def schedule(self, size: int, refer_device: str, exclude: Sequence[str] = ()) -> str: ...

    def place(self, size: int, refer_device: str, exclude: Sequence[str] = ()) -> str:
        """Choose a device near ``refer_device`` and book ``size`` bytes there, in one step."""
        ...

    def move(self, size: int, src: str, dst: str | None = None, *, refer_device: str = "cpu", exclude: Sequence[str] = ()) -> str:
        """Release ``size`` bytes on ``src`` and book them on ``dst`` (None: the device chosen
        near ``refer_device`` and not in ``exclude``), in one step; returns the destination."""
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


class EmbeddedConnection:
    """One client's view of an EmbeddedManager."""

    def __init__(self, manager: EmbeddedManager, client_id: str, info: ClientInfo):
        self._manager = manager
        self.client_id = client_id
        self._reachable = tuple(info.devices) or tuple(manager.ledger.device_names)
        self._closed = False

    def add(self, device: str, size: int) -> None:
        with self._manager._lock:
            self._manager.ledger.add(self.client_id, device, size)

    def remove(self, device: str, size: int) -> None:
        with self._manager._lock:
            self._manager.ledger.remove(self.client_id, device, size)

    def schedule(self, size: int, refer_device: str, exclude: Sequence[str] = ()) -> str:
        with self._manager._lock:
            free = self._manager.ledger.free_bytes()
            return policy.schedule(size, refer_device, free, self._reachable, exclude=exclude)

    def place(self, size: int, refer_device: str, exclude: Sequence[str] = ()) -> str:
        with self._manager._lock:
            return self._manager.ledger.place(self.client_id, size, refer_device, tuple(exclude))

    def move(self, size: int, src: str, dst: str | None = None, *, refer_device: str = "cpu", exclude: Sequence[str] = ()) -> str:
        with self._manager._lock:
            return self._manager.ledger.move(self.client_id, size, src, dst, refer_device=refer_device, exclude=tuple(exclude))

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

    def status(self) -> dict:
        with self._manager._lock:
            return self._manager.ledger.snapshot()

    def close(self) -> None:
        if self._closed:
            return
        with self._manager._lock:
            self._manager.ledger.unregister(self.client_id)
        self._closed = True
