"""Test helper: whatever may answer on a daemon's endpoint, as a plain zmq socket in a thread.

``FakeEndpoint(answer)`` binds a ROUTER on a short private ipc path and answers every
request with ``answer(request)``: the request as a msgpack map, the reply as a map packed
as is (so a test can send what no real daemon would) or None for no reply. Used as a context
manager; an exception in the thread, or a thread that does not stop, fails the test.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable

import msgpack
import pytest
import zmq

from tests.daemon import short_tempdir

POLL_MS = 50


def error_reply(request: dict, code: str, message: str, **extra) -> dict:
    """An error reply to ``request`` with any code and message, framed as the daemon does."""
    return {
        "v": request.get("v"),
        "id": request.get("id"),
        "instance_id": "fake",
        "ok": False,
        "kind": "error",
        "code": code,
        "message": message,
        **extra,
    }


def ok_reply(request: dict, kind: str, **fields) -> dict:
    return {"v": request.get("v"), "id": request.get("id"), "instance_id": "fake", "ok": True, "kind": kind, **fields}


class FakeEndpoint:
    def __init__(self, answer: Callable[[dict], dict | None]):
        self.answer = answer
        self.requests: list[dict] = []
        self._dir = short_tempdir()
        self.endpoint = f"ipc://{self._dir / 'fake.sock'}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.endpoint)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="fake-endpoint", daemon=True)

    def __enter__(self) -> FakeEndpoint:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        alive = self._thread.is_alive()
        if not alive:
            self._socket.close(linger=0)
            self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        if alive:
            pytest.fail("the fake endpoint's thread did not stop")
        if self._error is not None:
            raise AssertionError(f"the fake endpoint failed: {self._error!r}") from self._error

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._socket.poll(POLL_MS):
                    continue
                identity, _, body = self._socket.recv_multipart()
                request = msgpack.unpackb(body, raw=False)
                self.requests.append(request)
                reply = self.answer(request)
                if reply is not None:
                    self._socket.send_multipart([identity, b"", msgpack.packb(reply, use_bin_type=True)])
        except BaseException as exc:  # reported by __exit__
            self._error = exc
