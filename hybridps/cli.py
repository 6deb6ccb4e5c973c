"""Command-line entry points: ``hybridps-manager`` (the node daemon) and ``hybridps`` (tools).

Owns argument parsing, the logging set-up (the only place that installs log handlers), the
text rendering of a daemon's status, and turning a HybridPS error into one clear line on
stderr and a non-zero exit code. ``hybridps`` has one subcommand per ``_cmd_<name>``
function, each with its parser built in ``_add_<name>_parser``; add new ones the same way.

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

from hybridps.common.devices import DeviceSpec, available_cpu_bytes, canonical_device_name
from hybridps.common.endpoints import TOKEN_ENV, resolve_endpoint, token_from_env
from hybridps.common.errors import ConfigError, HybridPSError
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
        help="a device and its capacity, e.g. cpu=64GiB or cuda:0=8GiB (repeat). Without SIZE: what the machine "
        "has. Without any --device: the CPU and every visible GPU",
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
        help=f"shared secret every request must carry (default ${TOKEN_ENV}); required on a non-loopback tcp endpoint",
    )
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT", help="serve Prometheus metrics on this port (0: any free port)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics server (default 127.0.0.1)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def manager_main(argv: Sequence[str] | None = None) -> int:
    """``hybridps-manager``: run the node daemon until SIGTERM or SIGINT."""
    args = _manager_parser().parse_args(argv)
    _setup_logging(args.log_level)
    # Imported here so that `hybridps status` does not load the daemon's modules.
    from hybridps.manager.metrics import Metrics, MetricsHTTPServer
    from hybridps.manager.server import ManagerServer, serve_until_signalled
    from hybridps.manager.service import ManagerService

    http: MetricsHTTPServer | None = None
    try:
        simulate = {None: False, "missing": True, "always": "always"}[args.simulate]
        devices = manager_devices(args.device, simulate=simulate, cpu_reserve=args.cpu_reserve)
        endpoint = resolve_endpoint(args.endpoint)
        metrics = Metrics()
        service = ManagerService(devices, lease_s=args.lease_s, metrics=metrics, info={"endpoint": endpoint})
        server = ManagerServer(service, endpoint, token=token_from_env(args.token))

        def ready() -> None:
            nonlocal http
            if args.metrics_port is not None:
                http = MetricsHTTPServer(args.metrics_host, args.metrics_port, lambda: metrics.render(service.status()))
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
    if cpu is None:
        reserve = parse_bytes(cpu_reserve, what="--cpu-reserve")
        available = available_cpu_bytes()
        if reserve >= available:
            raise ConfigError(
                f"--cpu-reserve {format_bytes(reserve)} leaves nothing of the {format_bytes(available)} available; "
                f"lower it or give the CPU's capacity with --device cpu=SIZE"
            )
        cpu = available - reserve
    devices.append(DeviceSpec(name="cpu", capacity_bytes=cpu))
    if not requested:
        requested = {name: None for name in visible}
    for name, cap in requested.items():
        if name in visible:
            limit = visible[name]
            if cap is not None and cap > limit:
                raise ConfigError(f"--device {name}={cap}: this GPU can give at most {format_bytes(limit)} ({limit} B)")
            devices.append(DeviceSpec(name=name, capacity_bytes=limit if cap is None else cap))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridps", description="HybridPS tools.")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_status_parser(subparsers)
    from hybridps import planner, train  # their parsers live with their code

    train.add_subcommand(subparsers)
    planner.add_subcommand(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``hybridps COMMAND ...``"""
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
    sub.add_argument("--watch", type=_positive_float, default=None, metavar="SECONDS", help="print again every SECONDS until Ctrl-C")
    sub.add_argument("--token", default=None, help=f"the daemon's token (default ${TOKEN_ENV})")
    sub.add_argument("--timeout", type=_positive_float, default=2.0, metavar="SECONDS", help="how long to wait for the daemon (default 2)")
    sub.set_defaults(func=_cmd_status)


def _cmd_status(args: argparse.Namespace) -> int:
    from hybridps.client.remote import query_status

    while True:
        try:
            status = query_status(args.endpoint, token=args.token, timeout_s=args.timeout)
        except HybridPSError as exc:
            print(f"hybridps status: {exc}", file=sys.stderr, flush=True)
            return 1
        if args.json:
            print(json.dumps(status, sort_keys=True), flush=True)
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
    """The text of ``hybridps status``: a header, a device table, a client table."""
    lines = [
        f"hybridps-manager on {status.get('endpoint', '?')}: pid {status.get('pid', '?')}, instance "
        f"{status.get('instance_id', '?')}, up {_duration(status.get('uptime_s', 0))}, lease {status.get('lease_s', 0):g} s"
    ]
    if status.get("metrics_url"):
        lines.append(f"metrics: {status['metrics_url']}")
    devices = status.get("devices", {})
    rows = [("DEVICE", "KIND", "CAPACITY", "USED", "FREE", "PEAK")]
    for name, d in devices.items():
        kind = "cpu" if name == "cpu" else ("simulated GPU" if d.get("simulated") else "GPU")
        rows.append((name, kind, *(format_bytes(d[k]) for k in ("capacity_bytes", "used_bytes", "free_bytes", "peak_bytes"))))
    totals = status.get("totals", {})
    if totals:
        rows.append(("total", "", *(format_bytes(totals[k]) for k in ("capacity_bytes", "used_bytes", "free_bytes")), ""))
    lines += ["", *_table(rows, right=(2, 3, 4, 5))]
    clients = status.get("clients", [])
    lines += ["", f"CLIENTS ({len(clients)})" if clients else "CLIENTS: none registered"]
    if clients:
        names = list(devices)
        rows = [("RANK", "LOCAL", "PID", "HOST", "LAST SEEN", *names, "CLIENT ID")]
        for c in sorted(clients, key=lambda c: (c.get("host", ""), c["rank"], c["pid"])):
            usage = c.get("usage", {})
            rows.append(
                (
                    str(c["rank"]),
                    str(c.get("local_rank", "")),
                    str(c["pid"]),
                    c.get("host") or "?",
                    f"{c.get('last_seen_age_s', 0):.1f} s ago",
                    *(format_bytes(usage.get(n, 0)) for n in names),
                    c["client_id"],
                )
            )
        lines += _table(rows, right=tuple(range(5, 5 + len(names))))
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]], right: tuple[int, ...] = ()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
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
