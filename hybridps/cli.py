"""Command-line entry points: ``hybridps-manager`` (the node daemon) and ``hybridps`` (tools).

Owns argument parsing, the logging set-up (the only place that installs log handlers), the
text rendering of a daemon's status (whose every string is made safe to show first: the
daemon, or whatever answers on its socket, is another process; see [Note: peer text] in
common/text.py), and turning a HybridPS error into one clear line on stderr and a non-zero
exit code. ``hybridps`` has one subcommand per ``_cmd_<name>`` function, each with its
parser built in ``_add_<name>_parser``; add new ones the same way.

Does not own what the daemon does (manager/) nor how a client talks to it (client/remote.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hybridps.common.devices import (
    GPU_SOURCE,
    NVME,
    DeviceSpec,
    available_cpu_memory,
    canonical_device_name,
    gpu_driver_present,
)
from hybridps.common.endpoints import TOKEN_ENV, parse_endpoint, resolve_endpoint, token_from_env
from hybridps.common.errors import ConfigError, HybridPSError
from hybridps.common.missing_numpy import quiet_missing_numpy
from hybridps.common.text import MAX_PEER_NAME_CHARS, safe_data, safe_text
from hybridps.common.units import format_bytes, parse_bytes

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 10.0
DEFAULT_CPU_RESERVE = "2GiB"


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


# -- hybridps-manager ---------------------------------------------------------------------


def _manager_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridps-manager",
        description="The node manager daemon: books every rank's memory per device and answers schedule().",
        epilog="Example with simulated GPUs: hybridps-manager --device cpu=64GiB --device cuda:0=8GiB "
        "--device cuda:1=8GiB --simulate. See docs/MANAGER.md.",
    )
    parser.add_argument(
        "--endpoint",
        default="auto",
        help="where to listen: 'auto' (default: this user's ipc socket), ipc:///path or tcp://HOST:PORT",
    )
    parser.add_argument(
        "--device",
        action="append",
        default=[],
        metavar="NAME[=SIZE]",
        help="a device and its capacity, e.g. cpu=64GiB, cuda:0=8GiB or nvme=2TiB (the disk tier the node's ranks "
        "share; a size is needed) (repeat). Without SIZE: what the machine has. Without any --device: the CPU and "
        "every visible GPU",
    )
    parser.add_argument(
        "--simulate",
        nargs="?",
        const="missing",
        default=None,
        choices=["missing", "always"],
        help="simulate listed GPUs that are not visible ('--simulate' alone), or every listed GPU ('--simulate always')",
    )
    parser.add_argument(
        "--cpu-reserve",
        default=DEFAULT_CPU_RESERVE,
        metavar="SIZE",
        help=f"CPU memory left to the system when the CPU's capacity is not given (default {DEFAULT_CPU_RESERVE})",
    )
    parser.add_argument(
        "--lease-s",
        type=_positive_float,
        default=DEFAULT_LEASE_S,
        help=f"a client silent this long is dropped and its bytes reclaimed (default {DEFAULT_LEASE_S:g})",
    )
    parser.add_argument(
        "--token",
        default=None,
        help=f"shared secret every request (and metrics scrape, as 'Authorization: Bearer TOKEN') must carry "
        f"(default ${TOKEN_ENV}); required on any tcp endpoint, loopback included",
    )
    parser.add_argument(
        "--insecure-local-tcp",
        action="store_true",
        help="allow a loopback tcp endpoint without a token: every user of this machine can then read the status and "
        "register, book for and unregister any client. Not for a non-loopback address",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=None, metavar="PORT", help="serve Prometheus metrics on this port (0: any free port)"
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address of the metrics server (default 127.0.0.1). Without a token: loopback only, and client ids and "
        "pids are left out; with one, scrapes send 'Authorization: Bearer TOKEN'",
    )
    parser.add_argument(
        "--roster-file",
        default=None,
        metavar="PATH",
        help="where the registered clients are listed, so that a restarted daemon awaits them before booking new "
        "room (default: beside the ipc socket, or in the runtime directory for tcp; 'none' keeps no roster)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def manager_main(argv: Sequence[str] | None = None) -> int:
    """``hybridps-manager``: run the node daemon until SIGTERM or SIGINT."""
    quiet_missing_numpy()  # before torch is imported ([Note: torch's NumPy warning at import])
    args = _manager_parser().parse_args(argv)
    _setup_logging(args.log_level)
    # Imported here so that `hybridps status` does not load the daemon's modules.
    from hybridps.manager.metrics import Metrics, MetricsHTTPServer, metrics_access
    from hybridps.manager.recovery import RosterFile, roster_path
    from hybridps.manager.server import ManagerServer, serve_until_signalled
    from hybridps.manager.service import ManagerService

    http: MetricsHTTPServer | None = None
    try:
        simulate = {None: False, "missing": True, "always": "always"}[args.simulate]
        devices = manager_devices(args.device, simulate=simulate, cpu_reserve=args.cpu_reserve)
        endpoint = resolve_endpoint(args.endpoint)
        metrics = Metrics()
        if args.roster_file == "none":
            roster = None
        else:
            roster = RosterFile(Path(args.roster_file) if args.roster_file else roster_path(parse_endpoint(endpoint)))
        service = ManagerService(devices, lease_s=args.lease_s, metrics=metrics, info={"endpoint": endpoint}, roster=roster)
        token = token_from_env(args.token)
        server = ManagerServer(service, endpoint, token=token, insecure_local_tcp=args.insecure_local_tcp)
        if args.metrics_port is not None:
            metrics_access(args.metrics_host, token)  # refuse before taking the endpoint

        def ready() -> None:
            nonlocal http
            # The endpoint is ours now: an earlier instance's roster is no live daemon's.
            service.resume_from_roster()
            if args.metrics_port is not None:
                http = MetricsHTTPServer(
                    args.metrics_host,
                    args.metrics_port,
                    lambda with_client_ids: metrics.render(service.status(), with_client_ids=with_client_ids),
                    token=token,
                )
                service.info["metrics_url"] = http.url
                http.start()
            for d in devices:
                logger.info("managing %s", d.describe())
            # Everything allocated so far (torch's modules among it) lives as long as the
            # daemon; frozen, it is never scanned again, so no full garbage collection can
            # stall every client for the ~50-100 ms such a scan takes.
            gc.freeze()
            print(f"hybridps-manager listening on {server.url}", flush=True)

        try:
            serve_until_signalled(server, on_ready=ready)
        finally:
            if http is not None:
                http.close()
    except (HybridPSError, OSError) as exc:
        print(f"hybridps-manager: {exc}", file=sys.stderr, flush=True)
        return 1
    logger.info("stopped")
    return 0


def manager_devices(specs: Sequence[str], *, simulate: bool | str, cpu_reserve: str | int) -> list[DeviceSpec]:
    """The daemon's devices from ``--device NAME[=SIZE]`` flags and the machine.

    ``simulate``: False (listed GPUs must be visible), True (simulate the missing ones) or
    "always" (simulate every listed GPU; the machine's GPUs are not even probed).
    """
    requested: dict[str, int | None] = {}
    for spec in specs:
        name, sep, size = spec.partition("=")
        canon = canonical_device_name(name)
        if canon in requested:
            raise ConfigError(f"--device lists {canon} twice; keep one")
        requested[canon] = parse_bytes(size, what=f"--device {spec}") if sep else None
    visible = {} if simulate == "always" else probe_gpu_capacities()
    devices: list[DeviceSpec] = []
    cpu = requested.pop("cpu", None)
    cpu_source = "config"
    if cpu is None:
        reserve = parse_bytes(cpu_reserve, what="--cpu-reserve")
        figure = available_cpu_memory()
        available, cpu_source = figure.bytes, f"{figure.source} less --cpu-reserve"
        if reserve >= available:
            raise ConfigError(
                f"--cpu-reserve {format_bytes(reserve)} leaves nothing of the {format_bytes(available)} available; "
                f"lower it or give the CPU's capacity with --device cpu=SIZE"
            )
        cpu = available - reserve
    devices.append(DeviceSpec(name="cpu", capacity_bytes=cpu, capacity_source=cpu_source))
    if NVME in requested:  # the node's disk tier: its ranks share this capacity (docs/MANAGER.md)
        nvme = requested.pop(NVME)
        if nvme is None:
            raise ConfigError("--device nvme needs a capacity, the disk the node's ranks may fill: --device nvme=2TiB")
        devices.append(DeviceSpec(name=NVME, capacity_bytes=nvme))
    if not requested:
        requested = {name: None for name in visible}
    for name, cap in requested.items():
        if name in visible:
            limit = visible[name]
            if cap is not None and cap > limit:
                raise ConfigError(f"--device {name}={cap}: this GPU can give at most {format_bytes(limit)} ({limit} B)")
            devices.append(
                DeviceSpec(
                    name=name,
                    capacity_bytes=limit if cap is None else cap,
                    capacity_source=GPU_SOURCE if cap is None else "config",
                )
            )
        elif simulate:
            if cap is None:
                raise ConfigError(f"{name} is simulated (no such GPU is visible) and needs a capacity: --device {name}=8GiB")
            devices.append(DeviceSpec(name=name, capacity_bytes=cap, simulated=True))
        else:
            raise ConfigError(
                f"{name} is not a visible GPU (visible: {', '.join(visible) or 'none'}); pass --simulate to simulate it "
                f"in CPU memory, or list a visible one"
            )
    return devices


_PROBE = "import json; from hybridps.common.devices import visible_gpu_capacities as f; print(json.dumps(f()))"


def probe_gpu_capacities() -> dict[str, int]:
    """Bytes HybridPS may use on each visible GPU, measured in a short-lived child process.

    Asking CUDA for a GPU's free memory creates a CUDA context on it, which holds hundreds of
    MiB of that GPU for the life of the process. The daemon lives as long as the node's job,
    so it asks from a child and never holds a context itself.
    """
    if not gpu_driver_present():  # no GPU driver on this machine: torch is not even imported
        return {}
    import torch

    if not torch.cuda.is_available():  # asks the driver, creates no context
        return {}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise ConfigError(
            f"probing the GPUs' free memory failed ({proc.stderr.strip()[-1000:]}); give each GPU's capacity with "
            f"--device cuda:N=SIZE"
        )
    return {str(k): int(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


# -- hybridps -----------------------------------------------------------------------------


def _train(args: argparse.Namespace) -> int:
    from hybridps.train import run_command  # torch and the engine, only once a run is asked for

    return run_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridps", description="HybridPS tools.")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_status_parser(subparsers)
    from hybridps import planner, train_args  # their parsers live with their code, without torch

    train_args.add_subcommand(subparsers, _train)
    planner.add_subcommand(subparsers)
    from hybridps.planner import calibrate  # imports torch only when it measures

    calibrate.add_subcommand(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``hybridps COMMAND ...``"""
    quiet_missing_numpy()  # before torch is imported ([Note: torch's NumPy warning at import])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    _setup_logging(args.log_level)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


def _add_status_parser(subparsers: argparse._SubParsersAction) -> None:
    sub = subparsers.add_parser("status", help="devices, clients and totals of this node's manager daemon")
    sub.add_argument("--endpoint", default="auto", help="the daemon's endpoint (default: this user's ipc socket)")
    sub.add_argument("--json", action="store_true", help="print one JSON object (one per line with --watch)")
    sub.add_argument(
        "--watch", type=_positive_float, default=None, metavar="SECONDS", help="print again every SECONDS until Ctrl-C"
    )
    sub.add_argument("--token", default=None, help=f"the daemon's token (default ${TOKEN_ENV})")
    sub.add_argument(
        "--timeout", type=_positive_float, default=2.0, metavar="SECONDS", help="how long to wait for the daemon (default 2)"
    )
    sub.set_defaults(func=_cmd_status)


def _cmd_status(args: argparse.Namespace) -> int:
    from hybridps.client.remote import query_status

    while True:
        try:
            status = query_status(args.endpoint, token=args.token, timeout_s=args.timeout)
        except HybridPSError as exc:
            # The text may quote what answered on the endpoint: one safe line.
            print(f"hybridps status: {safe_text(str(exc))}", file=sys.stderr, flush=True)
            return 1
        if args.json:
            # Valid JSON whatever was sent: bounded strings, no NaN, no bytes.
            print(json.dumps(safe_data(status), sort_keys=True), flush=True)
        else:
            if args.watch and sys.stdout.isatty():
                print("\033[H\033[2J", end="")  # clear the screen between refreshes
            print(format_status(status), flush=True)
        if args.watch is None:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:  # the way to leave --watch
            return 0


def format_status(status: dict) -> str:
    """The text of ``hybridps status``: a header, a device table, a client table.

    A field the daemon did not send (another version) or sent in another form shows as
    ``?``, and a last line names those fields; what is there is printed all the same. Every
    string is made safe to show first (``safe_data``), and so is each cell, whatever its type:
    the only control characters in the text are the newlines between its lines.
    """
    cells = _StatusCells(safe_data(status))
    lines = _status_header(cells)
    devices = cells.section("devices", dict)
    lines += ["", *_device_table(cells, devices)]
    sources = [
        f"  {name}: {cells.shown(d['capacity_source'])}"
        for name, d in devices.items()
        if isinstance(d, dict) and d.get("capacity_source")
    ]
    if sources:
        lines += ["capacity from:", *sources]
    lines += _client_lines(cells, list(devices))
    missing = cells.missing
    if missing:
        shown = ", ".join(missing[:12]) + (f" and {len(missing) - 12} more" if len(missing) > 12 else "")
        lines += ["", f"? = not in this daemon's status (another hybridps version?): {shown}"]
    return "\n".join(lines)


class _StatusCells:
    """The cells of one daemon status (already through ``safe_data``), each made safe to
    show; every field found absent or in another form is shown as ``?`` and noted in
    ``missing``, in the order the text meets it."""

    def __init__(self, status: object):
        self.status = status
        self.missing: list[str] = []

    @staticmethod
    def shown(value: object) -> str:
        return safe_text(value, MAX_PEER_NAME_CHARS)

    def field(self, mapping: object, key: str, where: str, fmt=str) -> str:
        """``mapping[key]`` through ``fmt``, or ``?`` with ``where + key`` noted missing."""
        if isinstance(mapping, dict) and mapping.get(key) is not None:
            try:
                return self.shown(fmt(mapping[key]))
            except (TypeError, ValueError, OverflowError):
                pass
        self.missing.append(f"{where}{key}")
        return "?"

    def held(self, usage: object, device: str, where: str) -> str:
        """The bytes a client's ``usage`` holds on ``device`` (0 B when the device is not in it)."""
        if not isinstance(usage, dict):
            return "?"  # named once per client
        return self.field(usage, device, f"{where}usage.", format_bytes) if device in usage else format_bytes(0)

    def section(self, key: str, kind: type) -> object:
        """The status's top-level ``key`` when it is a ``kind``, else an empty one, noted missing."""
        value = self.status.get(key) if isinstance(self.status, dict) else None
        if value is None or not isinstance(value, kind):
            self.missing.append(key)
            return kind()
        return value


def _status_header(cells: _StatusCells) -> list[str]:
    """The daemon's line, its metrics address, and the recovery it is in, if any."""
    status, field, shown = cells.status, cells.field, cells.shown
    lines = [
        f"hybridps-manager on {field(status, 'endpoint', '')}: pid {field(status, 'pid', '')}, instance "
        f"{field(status, 'instance_id', '')}, up {field(status, 'uptime_s', '', _duration)}, "
        f"lease {field(status, 'lease_s', '', lambda v: f'{float(v):g}')} s"
    ]
    if isinstance(status, dict) and status.get("metrics_url"):
        lines.append(f"metrics: {shown(status['metrics_url'])}")
    recovery = status.get("recovery") if isinstance(status, dict) else None
    if isinstance(recovery, dict) and recovery.get("state") == "awaiting":
        awaiting = recovery.get("awaiting")
        if not isinstance(awaiting, list):
            cells.missing.append("recovery.awaiting")
            awaiting = []
        lines.append(
            f"recovering: new bookings wait up to {field(recovery, 'left_s', 'recovery.', lambda v: f'{float(v):.1f}')} s "
            f"for {len(awaiting)} client(s) of the earlier instance: {safe_text(', '.join(map(shown, awaiting)))}"
        )
    return lines


def _device_table(cells: _StatusCells, devices: dict) -> list[str]:
    """One row per device (capacity, used, free, peak) and the node's totals."""
    field = cells.field
    rows = [("DEVICE", "KIND", "CAPACITY", "USED", "FREE", "PEAK")]
    for name, d in devices.items():
        kind = name if name in ("cpu", NVME) else ("simulated GPU" if isinstance(d, dict) and d.get("simulated") else "GPU")
        rows.append(
            (
                str(name),
                kind,
                *(
                    field(d, k, f"devices.{name}.", format_bytes)
                    for k in ("capacity_bytes", "used_bytes", "free_bytes", "peak_bytes")
                ),
            )
        )
    totals = cells.section("totals", dict)
    if totals:
        rows.append(
            (
                "total",
                "",
                *(field(totals, k, "totals.", format_bytes) for k in ("capacity_bytes", "used_bytes", "free_bytes")),
                "",
            )
        )
    return _table(rows, right=(2, 3, 4, 5))


def _client_lines(cells: _StatusCells, names: list) -> list[str]:
    """The client table: one row per client, with what it holds on each of the devices ``names``."""
    field, shown = cells.field, cells.shown
    clients = [c if isinstance(c, dict) else {} for c in cells.section("clients", list)]
    lines = ["", f"CLIENTS ({len(clients)})" if clients else "CLIENTS: none registered"]
    if not clients:
        return lines
    rows = [("RANK", "LOCAL", "PID", "HOST", "LAST SEEN", *names, "CLIENT ID")]
    for c in sorted(clients, key=lambda c: (str(c.get("host", "")), _sort_key(c.get("rank")), _sort_key(c.get("pid")))):
        where = f"clients[{shown(c.get('client_id', '?'))}]."
        usage = c.get("usage")
        if not isinstance(usage, dict):
            cells.missing.append(f"{where}usage")
        rows.append(
            (
                field(c, "rank", where),
                field(c, "local_rank", where),
                field(c, "pid", where),
                field(c, "host", where, lambda v: str(v) or "?"),
                field(c, "last_seen_age_s", where, lambda v: f"{float(v):.1f} s ago"),
                *(cells.held(usage, n, where) for n in names),
                field(c, "client_id", where),
            )
        )
    return lines + _table(rows, right=tuple(range(5, 5 + len(names))))


def _sort_key(value: object) -> tuple[int, int, str]:
    return (0, value, "") if isinstance(value, int) else (1, 0, str(value))


def _table(rows: list[tuple[str, ...]], right: tuple[int, ...] = ()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


if __name__ == "__main__":  # pragma: no cover - `python -m hybridps.cli`
    sys.exit(main())
