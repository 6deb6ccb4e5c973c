"""The error of a collective that failed or of ranks whose orders differ: one sentence that
names the ranks, the collective number and the chunk group.

Owns: ``CollectiveError``, reading the cause out of the backend's error, the post-mortem of a
failed collective (``failure_in_group``: this rank posts where it failed, watches the peers'
records for up to two heartbeat periods and sorts them into arrived, missing, dead or frozen,
and diverged), the message of an order check that found different digests
(``order_message``: the ranks exchange their recent collectives through the store and name the
first where they differ), and the message of a store host that stopped answering.

Does not own: the records it reads and the heartbeat thread that posts them, nor the verdict
that thread gives while a collective waits (``watchdog.py``, whose advice sentences these
messages end with too); the collectives, their positions and the order digest
(``collectives.py``, which calls in here on a failure and passes itself as ``Watched``).

[Note: why a post-mortem of our own]
torch's group timeout says only that *this* rank waited too long, gloo's "Connection closed
by peer" gives an address and port, and NCCL's flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``)
dumps per-rank traces to be compared offline and does not exist for gloo. None of them knows
which chunk group a collective moved or whether the ranks' orders diverged. The watchdog's
records and digest cost one store request per heartbeat period and one small all-reduce per
iteration, work with any backend that has a store, and turn those failures into one
sentence naming the ranks, the collective number and the chunk group.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import logging
import os
import re
import time
from typing import Protocol

import torch.distributed as dist

from hybridps.client.sharding.watchdog import (
    _ADVICE_DEAD,
    _ADVICE_ORDER,
    PeerWatch,
    Position,
    _get_all,
    _peer_json,
    _position_text,
    _record_position,
    dead_message,
    pos_key,
    read_records,
)
from hybridps.common.errors import HybridPSError

logger = logging.getLogger(__name__)


class CollectiveError(HybridPSError, RuntimeError):
    """Ranks did not meet at a collective (a rank died, hangs, or runs a different order)."""


_LATE_HINT = (
    ". A rank that waited too long for a late one gave up first: raise collective_timeout_s if a rank legitimately "
    "computes that long between collectives"
)
#: gloo ends the process of a rank that receives more bytes than its collective expects
_GLOO_MISMATCH = (
    " If that rank's log ends with gloo's \"Received data size doesn't match expected size\", the ranks diverged: "
    "gloo ends the process of a rank whose collective receives a larger message than it expects"
)


class Watched(Protocol):
    """What a post-mortem reads of the collectives of one group (``collectives.Collectives``);
    it writes only ``position.failed``."""

    rank: int
    world_size: int
    #: the job's rank of each rank of the group: what messages call them
    global_ranks: list[int]
    store: dist.Store | None
    store_address: str | None
    prefix: str
    timeout_s: float
    heartbeat_period_s: float
    position: Position
    watch: PeerWatch | None
    seq: int
    order_checks: int
    history: collections.deque[tuple[int, int, str, str, int, int]]


def store_host_description(address: str | None) -> str:
    """Who hosts the store: torchrun's agent when it uses its own store, else rank 0."""
    at = f" at {address}" if address else ""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return f"the store host, torchrun's agent{at}, stopped answering; the agent (or its node) is likely dead"
    return f"the store host, rank 0{at}, stopped answering; rank 0 is likely dead"


def _cause(exc: BaseException) -> str:
    """The backend's error in one line, without gloo's source location and boilerplate."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    text = text.split(". This is typically", 1)[0]
    return text[:240]


def _is_timeout(cause: str) -> bool:
    return "timed out" in cause.lower() or "timeout" in cause.lower()


def _first_difference(mine: list, ref: list) -> tuple[int, tuple | None, tuple | None] | None:
    """The first collective (by issue number) where two histories of ``(issued, seq, op,
    what, bytes, running digest)`` differ, with both entries (None: that history has none
    there), or None where they agree."""
    a, b = {e[0]: e for e in mine}, {e[0]: e for e in ref}
    if not a and not b:
        return None
    start = max(min(a, default=0), min(b, default=0))
    for index in range(start, max(max(a, default=0), max(b, default=0)) + 1):
        x, y = a.get(index), b.get(index)
        if x is None or y is None or x[5] != y[5]:
            return index, x, y
    return None


def _rank_list(ranks: list[int]) -> str:
    """``0, 2, 5-9``: ranks, with runs folded."""
    out: list[str] = []
    for r in ranks:
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


# -- the store host ---------------------------------------------------------------------------


def store_lost(watch: PeerWatch | None) -> BaseException | None:
    """The network error with which the store stopped answering the heartbeat thread."""
    error = watch.store_error if watch is not None else None
    return error[1] if error is not None and isinstance(error[1], dist.DistNetworkError) else None


def store_lost_message(comm: Watched, seq: int, op: str, what: str, exc: BaseException) -> str:
    return (
        f"{store_host_description(comm.store_address)}. Rank {comm.global_ranks[comm.rank]} lost it at "
        f"{_position_text(op, what)} (collective #{seq}): {_cause(exc)}. Check that rank's log and exit status and "
        f"restart the job from the last checkpoint"
    )


# -- a failed collective ----------------------------------------------------------------------


@dataclasses.dataclass
class _Watching:
    """The peers' records during the post-mortem: as first read, and as last read."""

    first: list[dict | None]
    latest: list[dict | None]
    period_s: float
    #: how long the peers are watched at most: two heartbeat periods and a half second
    window_s: float
    #: how long they were watched
    observed_s: float = 0.0
    #: why the watching stopped early, for the message ("" when it did not)
    store_note: str = ""

    def settled(self, i: int) -> bool:
        """Peer ``i`` is alive or accounted for: it failed or closed too, or beat since the first read."""
        rec, was = self.latest[i], self.first[i]
        if rec is None:
            return False
        return bool(rec.get("failed") or rec.get("closed")) or (was is not None and rec["beat"] != was["beat"])


@dataclasses.dataclass
class _RollCall:
    """Where the ranks of the group are, by their records, at a collective that failed."""

    arrived: list[int]
    missing: list[int] = dataclasses.field(default_factory=list)
    #: a message per peer whose heartbeat stopped
    dead: list[str] = dataclasses.field(default_factory=list)
    #: (peer, op, what) of peers at the same collective number with another collective
    diverged: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    #: where each missing peer is
    notes: list[str] = dataclasses.field(default_factory=list)
    #: peers that arrived and failed there too
    gave_up: list[str] = dataclasses.field(default_factory=list)


def failure_in_group(
    comm: Watched, at: tuple[int, str, str], op: str, what: str, exc: BaseException, started: float
) -> CollectiveError:
    """The error for a collective ``op`` of ``what`` that raised at position ``at``
    (its own, or the compound operation's it is part of): names the ranks that did not
    come, from the peers' records (see watchdog.py's [Note: the watchdog])."""
    if isinstance(exc, CollectiveError):
        return exc
    seq, at_op, at_what = at
    me = comm.global_ranks[comm.rank]
    doing = getattr(exc, "doing", None)  # the shared-memory link saw the pieces of another collective
    if doing:
        comm.position.failed = (*at, _cause(exc))
        text = "; ".join(f"rank {comm.global_ranks[r]} is at {_position_text(o, w)}" for r, o, w in doing)
        return CollectiveError(
            f"ranks diverged at collective #{seq}: {text}. {_ADVICE_ORDER}; found by the shared-memory link, before "
            f"any byte of the other collective was taken"
        )
    cause = _cause(exc)
    elapsed_s = time.monotonic() - started
    timed_out = _is_timeout(cause)
    how = f"timed out after {comm.timeout_s:g} s" if timed_out else f"failed after {elapsed_s:.1f} s ({cause})"
    here = f"{_position_text(op, what)} (collective #{seq})"
    if (op, what) != (at_op, at_what):
        here = f"{_position_text(op, what)}, part of {_position_text(at_op, at_what)} (collective #{seq})"
    comm.position.failed = (*at, cause)
    if comm.store is None or comm.world_size == 1:
        return CollectiveError(f"{here} {how} on rank {me}; no store to ask the other ranks where they are")
    lost = exc if isinstance(exc, dist.DistNetworkError) else store_lost(comm.watch)
    if lost is not None:
        return CollectiveError(store_lost_message(comm, seq, op, what, lost))
    peers = [r for r in range(comm.world_size) if r != comm.rank]
    keys = [pos_key(comm.prefix, r) for r in peers]
    try:
        comm.store.set(pos_key(comm.prefix, comm.rank), comm.position.record(comm.watch.beats if comm.watch else 0))
        first = read_records(comm.store, keys)
    except dist.DistNetworkError as lost:
        return CollectiveError(store_lost_message(comm, seq, op, what, lost))
    except Exception as err:
        return CollectiveError(f"{here} {how} on rank {me}; the store did not answer the post-mortem: {_cause(err)}")
    seen = _watch_peers(comm.store, keys, first, comm.heartbeat_period_s)
    roll = _roll_call(comm, peers, seen, at, op, what)
    return _failure_message(comm, roll, here, how, cause, timed_out, at, seen.store_note)


def _watch_peers(store, keys: list[str], first: list[dict | None], heartbeat_period_s: float) -> _Watching:
    """Watch the peers for up to two heartbeat periods: a live one beats (or has failed
    too), a dead or frozen one does not."""
    period_s = heartbeat_period_s if heartbeat_period_s > 0 else 0.5
    seen = _Watching(first=first, latest=list(first), period_s=period_s, window_s=2 * period_s + 0.5)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seen.window_s:
        unsettled = [i for i in range(len(keys)) if not seen.settled(i)]
        if not unsettled:
            break
        time.sleep(min(0.25, period_s / 4))
        try:  # only the peers still unsettled: at a failure most ranks post theirs at once
            for i, rec in zip(unsettled, read_records(store, [keys[i] for i in unsettled]), strict=True):
                seen.latest[i] = rec
        except Exception as err:
            seen.store_note = f" (the store stopped answering during the post-mortem: {_cause(err)})"
            break
    seen.observed_s = time.monotonic() - t0
    return seen


def _roll_call(comm: Watched, peers: list[int], seen: _Watching, at: tuple[int, str, str], op: str, what: str) -> _RollCall:
    """Sort the peers by their last records: arrived at this collective (or past it), dead
    or frozen (no beat during the watch), at the same number with another collective, or
    elsewhere."""
    seq, at_op, at_what = at
    job = comm.global_ranks
    now_wall = time.time()
    roll = _RollCall(arrived=[comm.rank])
    for i, peer in enumerate(peers):
        rec = seen.latest[i]
        if rec is None:
            roll.missing.append(peer)
            roll.notes.append(f"rank {job[peer]} never posted where it is (it died early, or has not started)")
            continue
        p_seq, p_op, p_what, blocked = _record_position(rec)
        age_s = max(seen.observed_s, now_wall - float(rec["t"]))
        if not seen.settled(i) and rec["beat"] > 0 and (seen.observed_s >= seen.period_s + 0.25 or age_s >= seen.window_s):
            roll.dead.append(dead_message(job[peer], rec, age_s, seen.period_s, job[comm.rank], op, what, seq))
            roll.missing.append(peer)
        elif p_seq == seq and (p_op, p_what) == (at_op, at_what):
            roll.arrived.append(peer)
            if rec.get("failed"):
                roll.gave_up.append(f"rank {job[peer]} failed there too ({rec['failed'][3]})")
        elif p_seq == seq:
            roll.diverged.append((peer, p_op, p_what))
        elif p_seq > seq and not blocked:
            roll.arrived.append(peer)  # already past it (asynchronous collectives were issued after)
        else:
            roll.missing.append(peer)
            state = "failed" if rec.get("failed") else "closed its collectives" if rec.get("closed") else "is"
            doing = "blocked" if blocked else "last issued"
            roll.notes.append(
                f"rank {job[peer]} {state} at {_position_text(p_op, p_what)} (collective #{p_seq}, {doing}; heartbeat "
                f"{max(0.0, now_wall - float(rec['t'])):.1f} s old)"
            )
    return roll


def _failure_message(
    comm: Watched,
    roll: _RollCall,
    here: str,
    how: str,
    cause: str,
    timed_out: bool,
    at: tuple[int, str, str],
    store_note: str,
) -> CollectiveError:
    """The error of the roll call: dead peers first, then a divergence, then who is missing."""
    seq, at_op, at_what = at
    job = comm.global_ranks
    me = job[comm.rank]
    if roll.dead:
        lost_peer = "closed" in cause.lower() or "reset" in cause.lower()
        return CollectiveError(
            f"{here} failed on rank {me}: ranks {[job[r] for r in roll.missing]} did not arrive: {'; '.join(roll.dead)}. "
            f"{_ADVICE_DEAD}.{_GLOO_MISMATCH if lost_peer else ''}{store_note}"
        )
    if roll.diverged:
        doing = "; ".join(f"rank {job[r]} is at {_position_text(o, w)}" for r, o, w in roll.diverged)
        return CollectiveError(
            f"ranks diverged at collective #{seq}: rank {me} is at {_position_text(at_op, at_what)}; {doing}. "
            f"{_ADVICE_ORDER}. On rank {me} the collective {how}{store_note}"
        )
    arrived = sorted(job[r] for r in roll.arrived)
    if roll.missing:
        return CollectiveError(
            f"{here} {how} on rank {me}: ranks {[job[r] for r in roll.missing]} did not arrive (arrived: {arrived}); "
            f"{'; '.join(roll.notes)}. A rank died, hangs, or runs a different order of chunk accesses"
            f"{' (or computes longer than collective_timeout_s between two collectives)' if timed_out else ''}"
            f"{store_note}"
        )
    return CollectiveError(
        f"{here} {how} on rank {me}, although every rank arrived at it (arrived: {arrived})"
        f"{'; ' + '; '.join(roll.gave_up) if roll.gave_up else ''}"
        f"{_LATE_HINT if timed_out or roll.gave_up else ''}{store_note}"
    )


# -- ranks whose orders differ ----------------------------------------------------------------


def order_message(comm: Watched, what: str) -> str:
    """After ``check_order`` found different digests, in two rounds through the store:
    rank 0 posts its collectives since the last check that passed, every rank finds the
    first where its own differ and posts that one, and every rank reads those posts.
    Store traffic: one history (``8 + ~50`` bytes per collective) read by every rank,
    and one small post per rank read by every rank."""
    head = f"ranks diverged: their collectives since the last order check differ at the order check at {what}"
    if comm.store is None:
        return f"{head} (no store to compare them). {_ADVICE_ORDER}"
    base = f"{comm.prefix}/order/{comm.order_checks}"
    keys = [f"{base}/{r}" for r in range(comm.world_size)]
    timeout = datetime.timedelta(seconds=comm.timeout_s)
    try:
        ref, posts = _post_first_differences(comm, comm.store, base, keys, timeout)
    except dist.DistNetworkError as lost:
        return f"{head}; {store_lost_message(comm, comm.seq, 'check_order', what, lost)}"
    except Exception as err:
        return f"{head}; not every rank posted its collectives ({_cause(err)}). {_ADVICE_ORDER}"
    return _divergence_message(comm, what, head, ref, posts)


def _post_first_differences(
    comm: Watched, store: dist.Store, base: str, keys: list[str], timeout: datetime.timedelta
) -> tuple[list[tuple], list]:
    """The two rounds of ``order_message``: rank 0's history (the reference), and every
    rank's first difference from it (``[issue number, seq, own entry, reference entry]``,
    None where it has none)."""
    if comm.rank == 0:
        store.set(f"{base}/ref", json.dumps(list(comm.history)))
    store.wait([f"{base}/ref"], timeout)
    ref = [tuple(e) for e in json.loads(bytes(store.get(f"{base}/ref")).decode())]
    first = _first_difference(list(comm.history), ref)
    if first is None:
        post = None
    else:
        index, mine, theirs = first
        post = [index, mine[1] if mine else comm.seq, mine and list(mine[2:5]), theirs and list(theirs[2:5])]
    store.set(keys[comm.rank], json.dumps(post))
    store.wait(keys, timeout)
    posts = [_peer_json(v) for v in _get_all(store, keys)]
    _leave_together(comm, store, base, timeout)
    return ref, posts


def _leave_together(comm: Watched, store: dist.Store, base: str, timeout: datetime.timedelta) -> None:
    """A last round: every rank waits until every rank has read the posts, so none leaves
    first. Each raises right after and may exit, and the rank hosting the store takes it
    along: a peer still reading then lost the store ("Connection reset by peer") instead of
    naming the divergence. Best effort: a rank that never reads only costs the others the
    timeout, and what they read stands."""
    if store.add(f"{base}/read", 1) == comm.world_size:
        store.set(f"{base}/all_read", "1")
    try:
        store.wait([f"{base}/all_read"], timeout)
    except Exception:  # the posts are read; a peer that never reads changes nothing here
        logger.debug("not every rank confirmed reading the order check's posts", exc_info=True)


def _divergence_message(comm: Watched, what: str, head: str, ref: list[tuple], posts: list) -> str:
    """The first collective where the ranks differ, from every rank's post: what each
    group of ranks issued there (with its size when only the sizes differ)."""
    job = comm.global_ranks
    found = [p for p in posts if p is not None]
    if not found:
        return (
            f"{head}, before the last {len(ref)} collectives of rank {job[0]} (which every rank issued alike; raise "
            f"history_len to see further back). {_ADVICE_ORDER}"
        )
    index = min(p[0] for p in found)
    ref_entry = next(p[3] for p in found if p[0] == index)
    entries = {r: (p[2] if p is not None and p[0] == index else ref_entry) for r, p in enumerate(posts)}
    entries[0] = ref_entry
    mine_post = posts[comm.rank]
    seq = mine_post[1] if mine_post is not None and mine_post[0] == index else next(p[1] for p in found if p[0] == index)
    if len({tuple(e) if e else None for e in entries.values()}) == 1:
        return (
            f"{head}, before collective #{seq} (the first of the last {len(ref)} collectives each rank keeps; raise "
            f"history_len to see further back). {_ADVICE_ORDER}"
        )
    only_sizes = len({tuple(e[:2]) if e else None for e in entries.values()}) == 1
    by_entry: dict = {}
    for r in range(comm.world_size):
        e = entries[r]
        by_entry.setdefault(tuple(e) if e else None, []).append(r)
    parts = []
    for entry, ranks in sorted(by_entry.items(), key=lambda kv: (comm.rank not in kv[1], kv[1][0])):
        named = [job[r] for r in ranks]
        who = f"rank {named[0]} is" if len(named) == 1 else f"ranks {_rank_list(named)} are"
        if entry is None:
            parts.append(f"{who} at the order check already (fewer collectives)")
        else:
            parts.append(f"{who} at {_position_text(entry[0], entry[1])}{f' ({entry[2]} bytes)' if only_sizes else ''}")
    more = f"; and {len(parts) - 6} more" if len(parts) > 6 else ""
    return (
        f"ranks diverged at collective #{seq}: {'; '.join(parts[:6])}{more}. {_ADVICE_ORDER}; found by the order "
        f"check at {what}, before any optimizer step"
    )
