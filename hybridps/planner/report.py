"""What ``hybridps plan`` found, as records, as JSON and as a table.

Owns the report's records (``PlanReport``; ``HybridPSPlan`` for HybridPS on the node;
``PeerPlan`` for a peer; ``LargestModel`` for the largest member of the family that fits),
``PlanReport.to_dict()`` (the ``--json`` output) and ``_format_report`` (the table).

Does not own how the figures are found (``search``, ``simulation``, ``ranks``, ``peers``,
``host_peak``): records here are filled there and only checked and printed here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from hybridps.common.config import PRECISIONS
from hybridps.common.errors import ConfigError
from hybridps.common.optimizer_states import OPTIMIZER_STATES
from hybridps.common.units import format_bytes
from hybridps.planner.host_peak import InitPeak
from hybridps.planner.node import NodeSpec
from hybridps.planner.optimizers import DEFAULT_OPTIMIZER, check_optimizer_name, describe
from hybridps.planner.ranks import RankShare
from hybridps.planner.sharding import Communication, Sharding
from hybridps.planner.simulation import DeviceFigures
from hybridps.planner.validation import check_bytes, check_count

# -- records ------------------------------------------------------------------------------


#: ``LargestModel.method`` of a largest size the search did not simulate: it takes the size
#: the linear rule through simulated sizes gives (search.Planner.predict_largest) when the
#: simulations at the boundary would take longer than the search's time allows
RULE = "linear rule"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LargestModel:
    """The largest member of the model's family that fits, and how it was found: "simulated"
    (``n_layer`` simulated, and with ``confirmed`` so is ``n_layer + 1``, which does not
    fit), "published rule" (the peers) or ``RULE``."""

    method: str
    n_layer: int  # 0: not even one layer fits
    n_params: int
    #: True when the boundary was checked (n_layer fits and n_layer + 1 does not)
    confirmed: bool
    probes: int = 0
    at_search_limit: bool = False
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.n_layer, int) or self.n_layer < 0:
            raise ConfigError(f"LargestModel.n_layer={self.n_layer!r} must be an int >= 0")
        check_count("n_params", self.n_params)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerPlan:
    """A peer's static placement of this model on this node."""

    name: str
    rule: str
    gpu_model_states_bytes: int
    #: GPU per rank: model states + the same activations HybridPS measured + margin
    gpu_need_bytes: int
    cpu_node_bytes: int
    fits: bool
    reason: str
    largest: LargestModel | None = None

    def __post_init__(self) -> None:
        for f in ("gpu_model_states_bytes", "gpu_need_bytes", "cpu_node_bytes"):
            check_bytes(f, getattr(self, f))


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridPSPlan:
    """HybridPS on this node: the simulated run (single rank) or its derived share."""

    fits: bool
    reason: str
    #: True for multi-rank jobs: per-rank figures derived from the single-rank layout
    derived: bool
    chunk_size_elements: int | None
    chunk_bytes: int
    chunks: int
    padding_fraction: float
    #: model data of one rank (all of it for a single rank)
    model_data_bytes: int
    min_compute_bytes: int
    min_compute_module: str
    gpu: DeviceFigures | None
    cpu: DeviceFigures | None
    #: CPU of one node: every rank of the node holds its share there
    cpu_node_bytes: int
    moved_bytes_per_step: Mapping[str, int]
    non_model_peak_bytes: int
    #: what the GPU of a rank must hold at once: activations + the working set of the
    #: largest module (gathered chunks in multi-rank jobs) + margin; chunks fill the rest
    gpu_need_bytes: int
    simulation_failure: str | None = None
    rank_share: RankShare | None = None
    largest: LargestModel | None = None
    warnings: tuple[str, ...] = ()
    #: one rank's host peak while the model is built on meta and loaded (per rank)
    init: InitPeak | None = None
    #: the shard-group layout planned (one rank: a group of one)
    sharding: Sharding | None = None
    #: gathered bytes per chunk group: shard_size x param chunk bytes
    group_bytes: int = 0
    #: the simulated rank's model data over the model's params, padding included: every
    #: kind of chunk (about 14 for 16-bit params with grad reuse and fp32 optimizer states,
    #: 8.03 with int8 ones); 0 when the simulation stopped at initialize
    model_data_bytes_per_param: float = 0.0
    #: bytes per rank per step of the layout's collectives, and of ZeRO-3 over the world
    communication: Communication | None = None
    #: why the client would refuse this layout for the model at registration (the plan went
    #: on because it was asked to: a comparison of layouts); None: not refused
    refused: str | None = None
    #: the disk tier (``--nvme``; every field below None without one): its figures for one
    #: rank (device "nvme"; for several ranks its share of the node's disk, derived), the
    #: most the node's ranks keep on it together, and in a steady iteration (not the warm-up)
    #: the bytes the node's disk reads and writes (all its ranks') and the seconds they take
    #: at its bandwidths
    nvme: DeviceFigures | None = None
    nvme_node_bytes: int | None = None
    nvme_read_bytes_per_step: int | None = None
    nvme_write_bytes_per_step: int | None = None
    nvme_read_s_per_step: float | None = None
    nvme_write_s_per_step: float | None = None

    def __post_init__(self) -> None:
        for f in ("nvme_node_bytes", "nvme_read_bytes_per_step", "nvme_write_bytes_per_step"):
            if getattr(self, f) is not None:
                check_bytes(f, getattr(self, f))
        for f in (
            "group_bytes",
            "chunk_bytes",
            "model_data_bytes",
            "min_compute_bytes",
            "cpu_node_bytes",
            "non_model_peak_bytes",
            "gpu_need_bytes",
        ):
            check_bytes(f, getattr(self, f))
        if not 0.0 <= self.padding_fraction < 1.0:
            raise ConfigError(f"padding_fraction={self.padding_fraction!r} must be in [0, 1)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanReport:
    """Everything ``hybridps plan`` found. ``to_dict()`` is the ``--json`` output."""

    model: Mapping[str, Any]
    n_params: int
    precision: str
    grad_reuse: bool
    margin_bytes: int
    iterations: int
    node: NodeSpec
    hybridps: HybridPSPlan
    peers: tuple[PeerPlan, ...]
    largest_model_method: str | None
    seconds: Mapping[str, float]
    notes: tuple[str, ...] = ()
    #: GPU bytes planned beside the margin for a real GPU's transients (Planner.transient_allowance)
    transient_allowance_bytes: int = 0
    #: how Adam's momentum and variance are stored (``Config.optimizer_states``)
    optimizer_states: str = "fp32"
    #: the optimizer planned (``optimizers.OPTIMIZER_NAMES``)
    optimizer: str = DEFAULT_OPTIMIZER
    #: its states kept as chunk rows and beside them, by name (the client's probe of its step)
    optimizer_state_rows: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    optimizer_side_states: tuple[str, ...] = ("step",)
    #: bytes of its state rows per param (``Simulation.state_bytes_per_param``): 8 for Adam's
    #: fp32 moments, 4 for one row, 0 for SGD without momentum, about 2.03 for compact moments
    optimizer_state_bytes_per_param: float = 8.0
    #: the predicted steady step on a machine's rates (``speed.SpeedPrediction``); None: not
    #: predicted, ``speed_note`` says why (else it names the rates and the composition)
    speed: Any = None
    speed_note: str = ""

    def __post_init__(self) -> None:
        check_count("n_params", self.n_params)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r}; use one of {', '.join(PRECISIONS)}")
        if self.optimizer_states not in OPTIMIZER_STATES:
            raise ConfigError(f"optimizer_states={self.optimizer_states!r}; use one of {', '.join(OPTIMIZER_STATES)}")
        check_optimizer_name(self.optimizer)

    @property
    def fits(self) -> bool:
        return self.hybridps.fits

    def to_dict(self) -> dict:
        hybrid = _plain(self.hybridps)
        if not self.node.has_disk:  # a plan without a disk tier reports what it did before there was one
            for key in DISK_FIELDS:
                del hybrid[key]
            if hybrid["rank_share"] is not None:
                for key in RANK_SHARE_DISK_FIELDS:
                    del hybrid["rank_share"][key]
        return {
            "fits": self.fits,
            "model": {**self.model, "n_params": self.n_params},
            "training": {
                "precision": self.precision,
                "grad_reuse": self.grad_reuse,
                "optimizer_states": self.optimizer_states,
                "optimizer": self.optimizer,
                "optimizer_state_rows": list(self.optimizer_state_rows),
                "optimizer_state_bytes_per_param": round(self.optimizer_state_bytes_per_param, 6),
                "margin_bytes": self.margin_bytes,
                "transient_allowance_bytes": self.transient_allowance_bytes,
                "iterations": self.iterations,
            },
            "node": self.node.to_dict(),
            "hybridps": hybrid,
            "peers": [_plain(p) for p in self.peers],
            "largest_model_method": self.largest_model_method,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "notes": list(self.notes),
            "speed": {
                "predicted": self.speed is not None,
                "note": self.speed_note,
                **(self.speed.to_dict() if self.speed is not None else {}),
            },
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def format_table(self) -> str:
        return _format_report(self)


#: the keys of ``hybridps`` in the JSON that only a plan with a disk tier has
DISK_FIELDS = (
    "nvme",
    "nvme_node_bytes",
    "nvme_read_bytes_per_step",
    "nvme_write_bytes_per_step",
    "nvme_read_s_per_step",
    "nvme_write_s_per_step",
)
#: the same of ``hybridps.rank_share``
RANK_SHARE_DISK_FIELDS = ("nvme_bytes", "nvme_node_bytes", "cpu_step_bytes")


# -- output -------------------------------------------------------------------------------


def _plain(obj: Any) -> Any:
    """Dataclasses to dicts, mappings to dicts, tuples to lists (JSON-ready)."""
    if isinstance(obj, (InitPeak, Sharding, Communication)):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, float):
        return round(obj, 6)
    return obj


_PEER_TITLES = {"deepspeed-zero-offload": "DeepSpeed ZeRO-Offload", "deepspeed-zero3-offload": "DeepSpeed ZeRO-3 offload"}


def _gb(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _secs(s: float) -> str:
    return f"{s:.1f} s" if s >= 1 or s == 0 else f"{s:.2g} s"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def _largest_text(largest: LargestModel | None) -> str:
    if largest is None:
        return "-"
    if largest.n_layer == 0:
        return "none"
    more = "+" if largest.at_search_limit else ""
    check = "" if largest.confirmed else (" (linear rule, unconfirmed)" if largest.method == RULE else " (unconfirmed)")
    return f"{largest.n_layer}{more} layers, {_count(largest.n_params)} params{check}"


def _format_report(r: PlanReport) -> str:
    h = r.hybridps
    model = ", ".join(f"{k}={v}" for k, v in r.model.items())
    lines = [
        f"HybridPS capacity plan (planned, not measured): {model}",
        f"  {_count(r.n_params)} params, {r.precision}, grad reuse {'on' if r.grad_reuse else 'off'}, "
        f"optimizer states {r.optimizer_states}, margin {format_bytes(r.margin_bytes)}"
        + (f" + {format_bytes(r.transient_allowance_bytes)} real-GPU transients" if r.transient_allowance_bytes else "")
        + f"; {r.node.describe()}",
        _optimizer_line(r),
        "",
    ]
    disk = r.node.has_disk
    rows = [("", "fits", "GPU need/rank", "CPU/node", *(("disk/node",) if disk else ()), "largest of the family")]
    hyb_gpu = h.gpu_need_bytes if h.simulation_failure is None else None
    tag = " (derived)" if h.derived else " (simulated)"
    hyb_cpu = h.cpu_node_bytes if h.simulation_failure is None else None
    hyb_disk = (_gb(h.nvme_node_bytes if h.simulation_failure is None else None),) if disk else ()
    rows.append(("HybridPS" + tag, "yes" if h.fits else "no", _gb(hyb_gpu), _gb(hyb_cpu), *hyb_disk, _largest_text(h.largest)))
    for p in r.peers:
        rows.append(
            (
                _PEER_TITLES.get(p.name, p.name),
                "yes" if p.fits else "no",
                _gb(p.gpu_need_bytes),
                _gb(p.cpu_node_bytes),
                *(("-",) if disk else ()),
                _largest_text(p.largest),
            )
        )
    lines += _table(rows)
    lines.append("")
    if h.chunk_size_elements:
        lines.append(
            f"HybridPS layout: chunk size {h.chunk_size_elements} elements ({format_bytes(h.chunk_bytes)} per "
            f"{r.precision} chunk), {h.chunks} chunk rows, padding {100 * h.padding_fraction:.1f}%, model data "
            f"{format_bytes(h.model_data_bytes)}{' per rank' if h.derived else ''} "
            f"({h.model_data_bytes_per_param:.2f} B/param{' of the whole model' if h.derived else ''}, optimizer states "
            f"{r.optimizer_states}); smallest GPU working set "
            f"{format_bytes(h.min_compute_bytes)} ({h.min_compute_module}"
            f"{', its chunk groups gathered' if h.derived else ''})"
        )
    lines += _device_lines(h)
    if h.cpu is not None and h.cpu.arena_bytes:
        lines.append(
            f"  host arena: {format_bytes(h.cpu.arena_bytes)} held at most (the CPU's param chunks and free slots; "
            f"page-locked on a real GPU, booked on the CPU)"
        )
    if h.init is not None:
        i = h.init
        lines.append(
            f"  host peak per rank at init + load: {format_bytes(i.host_peak_bytes)} (model data on the host "
            f"{format_bytes(i.host_model_data_bytes)} + transient {format_bytes(max(i.replay_transient_bytes, i.load_transient_bytes))} "
            f"+ process {format_bytes(i.process_overhead_bytes)})"
        )
    moved = ", ".join(f"{k} {format_bytes(v)}" for k, v in h.moved_bytes_per_step.items()) or "none"
    lines.append(f"  moved per step{' (derived)' if h.derived else ''}: {moved}")
    lines += _disk_lines(r)
    if r.speed is not None:
        lines.append(f"  predicted speed: {r.speed.describe()}")
    elif r.speed_note:
        lines.append(f"  predicted speed: none ({r.speed_note})")
    lines += _layout_lines(h)
    if not h.fits:
        lines.append(f"  does not fit: {h.reason}")
    for w in h.warnings:
        lines.append(f"  warning: {w}")
    if r.largest_model_method:
        lines += ["", f"Largest model search: {r.largest_model_method}."]
    lines += ["", "Peers' rules:"] + [f"  - {p.rule}" for p in r.peers]
    lines += ["", "Notes:"] + [f"  - {n}" for n in r.notes]
    s = r.seconds
    lines.append(f"\nPlanned in {s['total']:.1f} s (first simulation {s['simulation']:.1f} s, search {s['search']:.1f} s).")
    return "\n".join(lines)


def _optimizer_line(r: PlanReport) -> str:
    """The optimizer planned, its state rows and their bytes per param, in one line."""
    rows = r.optimizer_state_rows
    kept = (
        f"{', '.join(rows)} as {r.optimizer_states} chunk row{'s' if len(rows) > 1 else ''}" if rows else "no state in chunk rows"
    )
    side = f" ({', '.join(r.optimizer_side_states)} beside them)" if r.optimizer_side_states else ""
    return (
        f"  optimizer {r.optimizer} ({describe(r.optimizer)}): {kept}{side}, "
        f"{r.optimizer_state_bytes_per_param:.2f} B/param of optimizer state"
    )


def _device_lines(h: HybridPSPlan) -> list[str]:
    """The table of the devices: GPU, CPU and the disk tier when there is one."""
    dev_rows = [("device", "capacity", "model data after step", "peak model data", "activations peak", "peak total")]
    for d in (h.gpu, h.cpu, h.nvme):
        if d is not None:
            dev_rows.append(
                (
                    d.device + (" (derived)" if d.derived else ""),
                    _gb(d.capacity_bytes),
                    _gb(d.model_data_bytes),
                    _gb(d.peak_bytes),
                    _gb(d.non_model_peak_bytes) if d.device.startswith("cuda") else "-",
                    _gb(d.peak_total_bytes) if d.device.startswith("cuda") else "-",
                )
            )
    return ["  " + line for line in _table(dev_rows)]


def _disk_lines(r: PlanReport) -> list[str]:
    """The disk's bytes and seconds per step (none without a disk tier)."""
    h, n = r.hybridps, r.node
    if not n.has_disk or h.nvme_read_bytes_per_step is None:
        return []
    which = " (derived, the node's ranks together)" if h.derived else " (steady iteration)"
    return [
        f"  disk per step{which}: reads "
        f"{format_bytes(h.nvme_read_bytes_per_step)} ({_secs(h.nvme_read_s_per_step)} at {n.nvme_read_gbps:g} GB/s), "
        f"writes {format_bytes(h.nvme_write_bytes_per_step)} ({_secs(h.nvme_write_s_per_step)} at "
        f"{n.nvme_write_gbps:g} GB/s); the node's disk holds {format_bytes(h.nvme_node_bytes)} at most"
    ]


def _layout_lines(h: HybridPSPlan) -> list[str]:
    """The shard-group layout, its gathered groups and its communication per rank per step."""
    sh, c, share = h.sharding, h.communication, h.rank_share
    if sh is None or c is None or share is None:
        return []
    where = {True: "crosses nodes", False: "inside a node"}
    return [
        f"  layout: {sh.describe()}; a node's ranks own {sh.node_model_copies:g} cop"
        f"{'y' if sh.node_model_copies == 1 else 'ies'} of the model data ({format_bytes(share.node_owned_bytes)})",
        f"  gathered per chunk group: {format_bytes(h.group_bytes)} ({sh.shard_size} x "
        f"{format_bytes(share.param_chunk_bytes)} param chunks of {share.chunk_size_elements} elements; largest group "
        f"{format_bytes(share.largest_group_bytes)}), {share.chunk_groups} groups",
        f"  communication per rank per step: shard group {format_bytes(c.shard_group_bytes)} (2 all-gathers + "
        f"reduce-scatter, {where[sh.shard_group_crosses_nodes]}), replicas {format_bytes(c.replica_bytes)} "
        f"(all-reduce of the owned shard, {where[sh.replicas_cross_nodes]}), total {format_bytes(c.total_bytes)}, "
        f"across nodes {format_bytes(c.inter_node_bytes)}; ZeRO-3 over the world: {format_bytes(c.zero3_world_bytes)} "
        f"(params {format_bytes(c.params_bytes)})",
    ] + ([f"  refused: {h.refused}"] if h.refused else [])


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
