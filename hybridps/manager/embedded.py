"""The embedded manager: a ledger and the placement policy inside the client's process.

This is the default when no node daemon is configured (one rank, tests, notebooks). It
serves the same ``ManagerConnection`` interface as the daemon's client stub, so the chunk
manager cannot tell them apart.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
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

    def status(self) -> dict:
        with self._manager._lock:
            return self._manager.ledger.snapshot()

    def close(self) -> None:
        if self._closed:
            return
        with self._manager._lock:
            self._manager.ledger.unregister(self.client_id)
        self._closed = True
