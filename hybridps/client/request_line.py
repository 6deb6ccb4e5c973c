"""The line from one client to its node's daemon: a zmq DEALER socket and one request's round
trip on it.

Owns the zmq context and socket, the request ids, one round trip (a receive timeout, bounded
retries each on a fresh socket: zmq's "lazy pirate" pattern; late replies to an earlier try
and malformed ones skipped, a malformed answer to this request raised), and when a reply
last came.

Does not own what is asked or what a reply means (remote.py), the wire format
(common/protocol.py) or the framing (common/transport.py). Not thread-safe: its owner
serializes the calls.
"""

from __future__ import annotations

import itertools
import logging
import time

import zmq

from hybridps.common import protocol as p
from hybridps.common import transport
from hybridps.common.errors import ProtocolError

logger = logging.getLogger(__name__)


class RequestLine:
    """The socket to the daemon at ``endpoint``, connected when first used and replaced by a
    fresh one after a try that got no reply."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = None
        self._rcvtimeo_ms = -1  # the socket's receive timeout now (-1: blocking, zmq's default)
        self._ids = itertools.count(1)
        #: monotonic time of the last reply to a request
        self.last_contact_s = 0.0

    def next_id(self) -> int:
        """The id of a new request (every try of it sends the same)."""
        return next(self._ids)

    def roundtrip(self, request: p.Request, timeout_s: float, retries: int) -> p.Reply | None:
        """One request, up to ``retries`` more tries on a fresh socket; None if all time out.

        Every try sends the same request id, so the daemon applies a retried update only
        once (service.py, [Note: retries]).
        """
        frames = [transport.DELIMITER, p.encode_request(request)]
        for attempt in range(retries + 1):
            sock = self._connected_socket()
            sock.send_multipart(frames, copy=True)
            reply = self._await_reply(sock, request, timeout_s)
            if reply is not None:
                return reply
            # Lazy pirate: the socket may hold a dead connection; only a fresh one is sure to
            # reach a restarted daemon.
            self._close_socket()
            if attempt < retries:
                logger.info(
                    "no reply from %s to %s in %.2f s; retrying (%d/%d)",
                    self.endpoint,
                    request.OP,
                    timeout_s,
                    attempt + 1,
                    retries,
                )
        return None

    def _await_reply(self, sock: zmq.Socket, request: p.Request, timeout_s: float) -> p.Reply | None:
        """The reply to ``request`` within ``timeout_s``, or None."""
        deadline_s = time.monotonic() + timeout_s
        wait_ms = max(1, int(timeout_s * 1000))
        while wait_ms > 0:
            if wait_ms != self._rcvtimeo_ms:
                # A receive with a timeout is one call; poll-then-receive would be two.
                sock.setsockopt(zmq.RCVTIMEO, wait_ms)
                self._rcvtimeo_ms = wait_ms
            try:
                reply = transport.recv_reply(sock)
            except zmq.Again:
                return None
            except ProtocolError as exc:
                if isinstance(exc, p.BadMessage) and exc.request_id == request.request_id:
                    # The answer to this request, unreadable: waiting and retrying would
                    # only hide it behind "no manager answered".
                    raise ProtocolError(
                        f"the reply of the manager at {self.endpoint} to {request.OP} is malformed: {exc}. Run the "
                        f"daemon and the clients from the same hybridps installation",
                        exc.code,
                    ) from None
                logger.warning("ignoring a malformed reply from %s: %s", self.endpoint, exc)
                reply = None
            if reply is not None and reply.request_id == request.request_id:
                self.last_contact_s = time.monotonic()
                return reply
            # A malformed reply, or the late answer to a try that had timed out: wait on.
            wait_ms = int((deadline_s - time.monotonic()) * 1000)
        return None

    def _connected_socket(self) -> zmq.Socket:
        if self._socket is None:
            self._socket = transport.dealer(self._context, self.endpoint)
            self._rcvtimeo_ms = -1
        return self._socket

    def _close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def close(self) -> None:
        """Close the socket and end the context."""
        self._close_socket()
        self._context.term()
