"""zmq framing shared by the daemon, its client stub and the CLI.

Owns the multipart shape of a message on the wire and the one-shot request (a fresh socket,
one request, one reply or a timeout) used to ping a daemon or read its status.

A client sends ``[empty, body]`` from a DEALER (the shape a REQ socket sends, so either
works); the daemon's ROUTER receives ``[identity, empty, body]`` and answers
``[identity, empty, reply]``. Does not own the messages' content (common/protocol.py).
"""

from __future__ import annotations

import zmq

from hybridps.common import protocol
from hybridps.common.protocol import Reply, Request

DELIMITER = b""


def dealer(context: zmq.Context, endpoint: str) -> zmq.Socket:
    """A DEALER connected to ``endpoint`` that never blocks close() on unsent messages."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def send_request(sock: zmq.Socket, request: Request) -> None:
    sock.send_multipart([DELIMITER, protocol.encode_request(request)], copy=True)


def recv_reply(sock: zmq.Socket) -> Reply:
    """Decode one reply frame set; raises BadMessage when the daemon's answer is malformed."""
    frames = sock.recv_multipart(copy=True)
    if len(frames) != 2 or frames[0] != DELIMITER:
        raise protocol.BadMessage(f"reply has {len(frames)} frames, expected [empty, body]", "bad_frames")
    return protocol.decode_reply(frames[1])


def request_once(endpoint: str, request: Request, timeout_s: float, context: zmq.Context | None = None) -> Reply | None:
    """Send ``request`` on a fresh socket; the reply, or None when none came in ``timeout_s``."""
    own = context is None
    ctx = zmq.Context() if context is None else context
    try:
        sock = dealer(ctx, endpoint)
        try:
            send_request(sock, request)
            deadline_ms = max(1, int(timeout_s * 1000))
            while sock.poll(deadline_ms, zmq.POLLIN):
                reply = recv_reply(sock)
                if reply.request_id == request.request_id:
                    return reply
            return None
        finally:
            sock.close(linger=0)
    finally:
        if own:
            ctx.term()
