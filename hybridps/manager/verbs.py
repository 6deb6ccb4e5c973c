"""The design's booking verbs of a manager connection: ``add(device, size)`` and
``remove(device, size)``, beside ``schedule(size, refer_device)``.

Owns the two verbs as the cases of the one ``update`` request that they are on the wire
(docs/MANAGER.md, "The protocol"): ``add`` books ``size`` bytes on ``device``, ``remove``
releases them, each atomically under the manager's lock. Does not own ``update`` or
``schedule`` themselves (the embedded connection, embedded.py, and the daemon's client stub,
client/remote.py) nor the ledger's rules (ledger.py). The chunk mover sends ``update``
directly, since one chunk operation releases and books on several devices at once.
"""

from __future__ import annotations

from collections.abc import Callable


class BookingVerbs:
    """``add`` and ``remove`` over a connection's ``update`` (the class mixing this in has it:
    ``ManagerConnection.update`` in embedded.py)."""

    update: Callable[..., str | None]

    def add(self, device: str, size: int) -> None:
        """Book ``size`` bytes on ``device`` for this client (refused with a
        ``CapacityError`` where the device has not the room)."""
        self.update(book={device: size})

    def remove(self, device: str, size: int) -> None:
        """Release ``size`` bytes this client holds on ``device`` (refused, the ledger
        unchanged, where it holds fewer)."""
        self.update(release={device: size})
