"""Daemon metrics: request and error counters, latency histograms, Prometheus text output.

Owns the counters the daemon keeps about itself (requests and errors by op, expired
leases, handling time by op) and their rendering, together with the ledger's figures
(per-device and per-client bytes), in the Prometheus text exposition format; and a small
stdlib HTTP server that serves that text on ``/metrics`` from a thread, with its access rule.

Does not own the ledger's numbers (it renders a status snapshot it is given) nor when
things are counted (the service and the server call it).

[Note: metrics access]
The same rule as the daemon's tcp endpoint (server.py, [Note: who may talk to the daemon]):
a loopback port is open to every local user. With a token (the daemon's), every scrape must
send ``Authorization: Bearer TOKEN`` (Prometheus: ``authorization: {credentials: TOKEN}``)
and gets everything, on any address. Without one the server listens on a loopback address
only, and leaves client ids and pids out: ``hybridps_manager_client_bytes`` is summed per
rank and device, so no local user learns which ids to send requests for.
"""

from __future__ import annotations

import bisect
import collections
import enum
import hmac
import http.server
import logging
import threading
from collections.abc import Callable

from hybridps.common.endpoints import is_loopback_host
from hybridps.common.errors import ConfigError

logger = logging.getLogger(__name__)

#: Histogram bucket bounds in seconds: the daemon's handling time is tens of microseconds,
#: so the buckets are dense there and sparse up to a slow 100 ms.
LATENCY_BUCKETS_S = (10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 100e-3)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsAccess(enum.Enum):
    """Who may read the metrics (see [Note: metrics access])."""

    #: Every scrape sends ``Authorization: Bearer TOKEN``; everything is served.
    BEARER_TOKEN = "bearer token"
    #: No token: loopback only, client ids and pids left out.
    LOOPBACK_REDACTED = "loopback, without client ids"


def metrics_access(host: str, token: str) -> MetricsAccess:
    """The access rule for a metrics server on ``host``; ConfigError where none is safe."""
    if token:
        return MetricsAccess.BEARER_TOKEN
    if not is_loopback_host(host):
        raise ConfigError(
            f"--metrics-host {host} can be reached from other machines and the metrics name every client; the "
            f"metrics server only listens there with the manager's token (--token or HYBRIDPS_TOKEN; scrapes send "
            f"'Authorization: Bearer TOKEN'). Or keep the default --metrics-host 127.0.0.1"
        )
    return MetricsAccess.LOOPBACK_REDACTED


class _Histogram:
    __slots__ = ("counts", "count", "total_s")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.count = 0
        self.total_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.count += 1
        self.total_s += seconds


class Metrics:
    """Counters of one daemon. Thread-safe: the poll loop writes, the HTTP thread reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[tuple[str, str]] = collections.Counter()
        self.leases_expired = 0
        self._latency: dict[str, _Histogram] = {}

    def count(self, op: str, error_code: str | None = None) -> None:
        with self._lock:
            self.requests[op] += 1
            if error_code is not None:
                self.errors[(op, error_code)] += 1

    def observe(self, op: str, seconds: float) -> None:
        with self._lock:
            hist = self._latency.get(op)
            if hist is None:
                hist = self._latency[op] = _Histogram()
            hist.observe(seconds)

    def lease_expired(self) -> None:
        with self._lock:
            self.leases_expired += 1

    def render(self, status: dict, *, with_client_ids: bool = True) -> str:
        """Prometheus text of these counters and of ``status`` (ManagerService.status()).

        ``with_client_ids`` False: client bytes summed per rank and device, without client
        ids and pids (see [Note: metrics access]).
        """
        out: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")

        def sample(name: str, labels: dict[str, object], value: float) -> None:
            if labels:
                text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                out.append(f"{name}{{{text}}} {_number(value)}")
            else:
                out.append(f"{name} {_number(value)}")

        devices = status.get("devices", {})
        family("hybridps_manager_device_capacity_bytes", "gauge", "Bytes the daemon may book on the device.")
        for name, d in devices.items():
            sample(
                "hybridps_manager_device_capacity_bytes",
                {"device": name, "simulated": str(d["simulated"]).lower()},
                d["capacity_bytes"],
            )
        family("hybridps_manager_device_used_bytes", "gauge", "Bytes booked on the device by all clients.")
        for name, d in devices.items():
            sample("hybridps_manager_device_used_bytes", {"device": name}, d["used_bytes"])
        family("hybridps_manager_device_peak_bytes", "gauge", "Highest booking of the device since the daemon started.")
        for name, d in devices.items():
            sample("hybridps_manager_device_peak_bytes", {"device": name}, d["peak_bytes"])
        clients = status.get("clients", [])
        family("hybridps_manager_clients", "gauge", "Registered clients.")
        sample("hybridps_manager_clients", {}, len(clients))
        family("hybridps_manager_client_bytes", "gauge", "Bytes a client holds on a device.")
        if with_client_ids:
            for c in clients:
                for device, size in c["usage"].items():
                    labels = {"client_id": c["client_id"], "rank": c["rank"], "pid": c["pid"], "device": device}
                    sample("hybridps_manager_client_bytes", labels, size)
        else:
            per_rank: collections.Counter[tuple[object, str]] = collections.Counter()
            for c in clients:
                for device, size in c["usage"].items():
                    per_rank[(c["rank"], device)] += size
            for (rank, device), size in per_rank.items():
                sample("hybridps_manager_client_bytes", {"rank": rank, "device": device}, size)

        with self._lock:
            requests = dict(self.requests)
            errors = dict(self.errors)
            expired = self.leases_expired
            latency = {op: (list(h.counts), h.count, h.total_s) for op, h in self._latency.items()}
        family("hybridps_manager_requests_total", "counter", "Requests answered, by op ('invalid' when undecodable).")
        for op, n in sorted(requests.items()):
            sample("hybridps_manager_requests_total", {"op": op}, n)
        family("hybridps_manager_errors_total", "counter", "Error replies, by op and error code.")
        for (op, code), n in sorted(errors.items()):
            sample("hybridps_manager_errors_total", {"op": op, "code": code}, n)
        family("hybridps_manager_leases_expired_total", "counter", "Clients dropped for missing heartbeats.")
        sample("hybridps_manager_leases_expired_total", {}, expired)
        family("hybridps_manager_request_duration_seconds", "histogram", "Time the daemon spent on a request, by op.")
        for op, (counts, count, total_s) in sorted(latency.items()):
            cumulative = 0
            for bound, n in zip(LATENCY_BUCKETS_S, counts[: len(LATENCY_BUCKETS_S)], strict=True):  # the last count is +Inf's
                cumulative += n
                sample("hybridps_manager_request_duration_seconds_bucket", {"op": op, "le": repr(bound)}, cumulative)
            sample("hybridps_manager_request_duration_seconds_bucket", {"op": op, "le": "+Inf"}, count)
            sample("hybridps_manager_request_duration_seconds_sum", {"op": op}, total_s)
            sample("hybridps_manager_request_duration_seconds_count", {"op": op}, count)
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


class MetricsHTTPServer:
    """Serves ``render(with_client_ids=...)`` on ``http://HOST:PORT/metrics`` from a daemon
    thread, under ``metrics_access(host, token)`` (ConfigError where that refuses)."""

    def __init__(self, host: str, port: int, render: Callable[..., str], *, token: str = ""):
        self.access = metrics_access(host, token)
        handler = _handler_for(render, token if self.access is MetricsAccess.BEARER_TOKEN else "")
        self._httpd = http.server.ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hybridps-metrics", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/metrics"

    def start(self) -> None:
        self._thread.start()
        logger.info("metrics on %s (access: %s)", self.url, self.access.value)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def _handler_for(render: Callable[..., str], token: str) -> type[http.server.BaseHTTPRequestHandler]:
    expected = f"Bearer {token}".encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if token and not hmac.compare_digest(self.headers.get("Authorization", "").encode(), expected):
                body = b"this metrics server needs the manager's token: send 'Authorization: Bearer TOKEN'\n"
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Bearer realm="hybridps-manager"')
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404, "metrics are on /metrics")
                return
            try:
                body = render(with_client_ids=bool(token)).encode()
            except Exception:  # a scrape must never take the daemon down
                logger.exception("rendering metrics failed")
                self.send_error(500, "rendering metrics failed; see the daemon's log")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's signature
            logger.debug("metrics %s - %s", self.address_string(), format % args)

    return Handler
