"""Releases a client of the node daemon tells it late, bookings it makes ahead, and the
bookings they cover.

Owns, for one connection to a ``hybridps-manager`` daemon, the bytes per device that the daemon
books for the client beyond what it holds (released and not told yet, or booked ahead), since
when, what each phase of training took above its start the last time it ran, and the decision
for one ``update``: settled here against those bytes without a round trip, or sent, and then
which of the bytes held back go with it. Does not own the conversation (the client stub,
remote.py, sends what this decides and calls ``sent`` once the daemon applied it), nor when a
phase begins or ends (the client tells the stub: ``settle``).

[Note: releases held back]
Every chunk move books with the node manager: with the daemon, one round trip (0.1-0.5 ms
alone; about 1 ms where two ranks and the daemon share two cores, where the round trips took
a fifth of a step that moved 34 chunks). In a phase of training the moves come in pairs that
undo each other on each device: an eviction releases the GPU and books the CPU, the bring
that needed the room releases the CPU and books the GPU. So while a phase runs (the engine's
forward, backward or step: ``settle(hold_releases=True)`` by the client) a release is not
sent: its bytes stay booked for this client (held back), and a later booking on the same
device, or a placement whose first choice is that device, takes them without asking, since
they are room the daemon has given this client already and nobody else can hold. A booking
beyond them is sent with the bytes held back on its own devices (a placement the daemon
chooses, with those on every device it may choose: it picks by their room).

What the daemon books for the client is therefore never less than what the client holds
(no device is overcommitted) and more by the bytes held back (and, from a phase's start, by
what it booked ahead: [Note: a phase books ahead]). They are told, and the ledger
equals the client's holdings exactly again:
- at the end of each phase (the engine's forward, backward and step), so that wherever a
  script is between calls the node's status and the client agree (``settle``);
- with the next request once the oldest of them is ``HOLD_S`` old, and by the heartbeat
  thread (``beat``) when the line is quiet, so that a long phase on a GPU does not keep room
  from the node's other ranks much longer;
- before this client reads the node's status, and at close (the daemon gives back all).
Outside a phase every release is sent at once, as before: a script using the client's
``access``/``release`` directly sees an exact ledger after each call.

[Note: a phase books ahead]
Within a phase the moves do not always release before they book: a forward first brings chunks
into the room the step freed on the GPU, a backward makes its grads' chunks there, a step
moves grads to the CPU before it frees anything. A phase of training repeats what it did the
iteration before, so at its start (the client names it: ``settle(phase=...)``) the stub books
ahead, in one request, what the phase took on the rank's GPU above its start the last time it
ran (its holdings' highest rise there, ``growth_by_phase``), as bytes held back: the phase's
bookings then take them without asking, and its end tells the daemon what is left, as every
phase end does. A booking ahead the daemon refuses is not made (the phase asks as it goes);
one the phase outgrows is topped up by the bookings it sends. The daemon never books beyond a
device's room, and books ahead for one phase at most.

Only a rank's GPUs are booked ahead, not the host memory or the disk tier that every rank of
the node books from (``SHARED_DEVICES``): a rank holding its phase's peak for the whole phase
would take room another rank's booking might have had in between, and near a full host that
turns a run that fits into a CapacityError. There the phase's releases held back still cover
its later bookings. (A GPU that several clients share, which no launcher here sets up, would
be booked ahead as if it were one rank's.) On the ``manager_calls`` shape: 54 requests a
step, 11 with the GPU booked ahead, 5 with the host too (two ranks of ``hybridps train`` with
the daemon stepped 5-10 ms slower a step on the VM's two cores than with the host booked
ahead).

The rule for a placement mirrors the daemon's (manager/policy.py): the referred device if it
has room, else the CPU. The first of the two not excluded is chosen here only where the bytes
held back there cover it, which the daemon's room there includes; otherwise the daemon
chooses.

A daemon that restarted, or dropped the client whose process was stopped past its lease, no
longer books the bytes held back. A process stopped that long finds them older than it may
hold them (``HOLD_S``, a second, or half the lease where that is shorter; a lease is 10 s by
default), so its next update is sent,
and it registers again with what it holds (remote.py, [Note: restarts]). After a restart,
bookings settled here in the second before the next request are in what the client holds,
and are re-reported with it, all or nothing, as a client's bookings always are.

Sizes that are not whole numbers of bytes of at least 0 are never settled here: the daemon
refuses them as it always did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

#: the memory every rank of a node books from: never booked ahead ([Note: a phase books ahead])
SHARED_DEVICES = frozenset({"cpu", "nvme"})
#: seconds a release may wait for a request to carry it; an older one goes with the next
#: (at most half the daemon's lease: the client stub lowers it at registration)
HOLD_S = 1.0


@dataclasses.dataclass(frozen=True)
class Decision:
    """One ``update``'s fate: ``local`` (settled against the bytes held back, ``chosen`` the
    placement's device) or sent, with the bytes held back on ``sent_devices``."""

    local: bool
    chosen: str | None = None
    sent_devices: frozenset[str] = frozenset()
    #: sent as given, nothing held back with it (sizes the daemon refuses)
    raw: bool = False


class HeldBackReleases:
    """The bytes per device the daemon books for a client beyond what it holds (released and
    not told, or booked ahead), and what each phase took the last time it ran."""

    def __init__(self, hold_s: float = HOLD_S):
        self.hold_s = hold_s
        #: whether a phase of training runs: releases are held back (else each is sent at once)
        self.holding = False
        #: bytes the daemon books for the client beyond what it holds, by device
        self.bytes_by_device: dict[str, int] = {}
        #: monotonic time of the oldest release held back; None when none is
        self.since_s: float | None = None
        #: by phase: the most each device's holdings rose above their start the last time it ran
        self.growth_by_phase: dict[str, dict[str, int]] = {}
        self._phase: str | None = None
        self._start: dict[str, int] = {}
        self._peak: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.bytes_by_device)

    def aged(self, now_s: float) -> bool:
        """Whether the oldest release held back waited ``hold_s`` or longer."""
        return self.since_s is not None and now_s - self.since_s >= self.hold_s

    def decide(
        self,
        *,
        now_s: float,
        held: Mapping[str, int],
        release: Mapping[str, int],
        book: Mapping[str, int],
        place_bytes: int,
        refer_device: str,
        exclude: Collection[str],
    ) -> Decision:
        """Whether this update (bytes per canonical device) is settled here or sent; see
        [Note: releases held back]. ``held``: what the client holds now by its own count."""
        every = frozenset(self.bytes_by_device) | frozenset(release)
        sizes = (*release.values(), *book.values(), place_bytes)
        malformed = not all(type(n) is int and n >= 0 for n in sizes)
        over_release = not malformed and any(held.get(d, 0) < n for d, n in release.items())
        if malformed:
            return Decision(False, raw=True)  # for the daemon to refuse, as given
        if not self.holding or over_release or self.aged(now_s):
            return Decision(False, sent_devices=every)  # the daemon decides, and refuses an over-release
        room = dict(self.bytes_by_device)
        for device, size in release.items():
            room[device] = room.get(device, 0) + size
        uncovered = any(room.get(d, 0) < n for d, n in book.items())
        for device, size in book.items():
            room[device] = room.get(device, 0) - size
        chosen = None
        if place_bytes:
            first = next((d for d in dict.fromkeys((refer_device, "cpu")) if d not in exclude), None)
            if first is not None and room.get(first, 0) >= place_bytes:
                chosen = first
        if uncovered or (place_bytes and chosen is None):
            sent = frozenset(book)
            if place_bytes and chosen is None:  # the daemon chooses by the room of every device it may choose
                sent |= frozenset(d for d in every if d not in exclude)
            return Decision(False, sent_devices=sent)
        return Decision(True, chosen=chosen)

    def settle_locally(
        self, release: Mapping[str, int], book: Mapping[str, int], place_bytes: int, chosen: str | None, now_s: float
    ) -> None:
        """Apply a local decision: the releases held back, the bookings taken from them."""
        out = self.bytes_by_device
        for device, size in release.items():
            out[device] = out.get(device, 0) + size
        for device, size in book.items():
            out[device] -= size
        if chosen is not None:
            out[chosen] -= place_bytes
        self._tidy(now_s)

    def release_of(self, devices: Collection[str], release: Mapping[str, int]) -> dict[str, int]:
        """What a sent update releases on ``devices``: the bytes held back there and its own."""
        out = {}
        for device in devices:
            size = self.bytes_by_device.get(device, 0) + release.get(device, 0)
            if size:
                out[device] = size
        return out

    def sent(self, devices: Collection[str], release: Mapping[str, int], now_s: float) -> None:
        """The daemon applied an update that carried the bytes held back on ``devices``; the
        update's own releases elsewhere are held back from now."""
        for device in devices:
            self.bytes_by_device.pop(device, None)
        if not self.bytes_by_device:
            self.since_s = None  # every older release was told: the age starts again
        for device, size in release.items():
            if device not in devices:
                self.bytes_by_device[device] = self.bytes_by_device.get(device, 0) + size
        self._tidy(now_s)

    def clear(self) -> None:
        """Nothing held back (told, or voided by registering again)."""
        self.bytes_by_device.clear()
        self.since_s = None

    # -- booking ahead ([Note: a phase books ahead]) ---------------------------------------

    def ahead(self, phase: str) -> dict[str, int]:
        """What ``phase`` took above its start the last time it ran, on the devices it books
        ahead: a rank's GPUs, not the memory the node's ranks share ([Note: a phase books
        ahead])."""
        return {d: n for d, n in self.growth_by_phase.get(phase, {}).items() if d not in SHARED_DEVICES}

    def booked_ahead(self, bytes_by_device: Mapping[str, int], now_s: float) -> None:
        """The daemon booked ``bytes_by_device`` for the client beyond what it holds."""
        for device, size in bytes_by_device.items():
            self.bytes_by_device[device] = self.bytes_by_device.get(device, 0) + size
        self._tidy(now_s)

    def begin_phase(self, phase: str, held: Mapping[str, int]) -> None:
        """``phase`` starts with the client holding ``held``: its rise is watched from here."""
        self._phase, self._start, self._peak = phase, dict(held), {}

    def observe(self, held: Mapping[str, int]) -> None:
        """The client holds ``held`` now (after an update applied)."""
        if self._phase is None:
            return
        for device, size in held.items():
            rise = size - self._start.get(device, 0)
            if rise > self._peak.get(device, 0):
                self._peak[device] = rise

    def end_phase(self) -> None:
        """The phase being watched ended: its rise is what it books ahead next time."""
        if self._phase is not None:
            self.growth_by_phase[self._phase] = dict(self._peak)
        self._phase = None

    def _tidy(self, now_s: float) -> None:
        self.bytes_by_device = {d: n for d, n in self.bytes_by_device.items() if n}
        if not self.bytes_by_device:
            self.since_s = None
        elif self.since_s is None:
            self.since_s = now_s
