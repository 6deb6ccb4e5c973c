"""Comparing shard-group layouts: one model on one node shape at several node counts and
shard group sizes, side by side.

Owns ``compare_layouts`` (one plan per (nodes, shard group size), every simulation shared:
the single-rank simulation does not depend on either), its records (``LayoutRow``,
``LayoutComparison``), their JSON and their table.

Does not own planning one layout (``search``), the layout's arithmetic (``sharding``,
``ranks``) or the single plan's report (``report``). A layout the client would refuse for
the model is planned on (its largest member that fits is still searched) and its row says
why it is refused.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

from hybridps.common.errors import ConfigError
from hybridps.common.units import format_bytes
from hybridps.planner.model import PlannedModel
from hybridps.planner.node import NodeSpec
from hybridps.planner.optimizers import DEFAULT_OPTIMIZER
from hybridps.planner.report import LargestModel, _count, _largest_text, _plain, _table
from hybridps.planner.request import PlanRequest
from hybridps.planner.search import Planner
from hybridps.planner.sharding import Communication, Sharding


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutRow:
    """One layout: figures of the given model on it, and the largest member that fits."""

    sharding: Sharding
    fits: bool
    reason: str
    refused: str | None
    #: gathered bytes per chunk group (shard_size x param chunk bytes) of the given model
    group_bytes: int
    #: the largest module's gathered groups (param + grad chunks without grad reuse)
    gathered_bytes: int
    #: model data one rank owns, and what a node's ranks own together
    owned_bytes: int
    node_owned_bytes: int
    gpu_need_bytes: int
    cpu_node_bytes: int
    communication: Communication
    largest: LargestModel | None
    #: communication per rank per step of the largest member (None: none fits, or no search)
    largest_communication: Communication | None
    largest_group_bytes: int | None

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutComparison:
    """Every layout compared, for one model and node shape (nodes vary by row)."""

    model: dict
    n_params: int
    precision: str
    node_shape: str
    rows: tuple[LayoutRow, ...]
    seconds: float
    simulations: int
    #: how Adam's momentum and variance are stored (``Config.optimizer_states``)
    optimizer_states: str = "fp32"
    #: the optimizer planned (``optimizers.OPTIMIZER_NAMES``) and its state rows' bytes per param
    optimizer: str = DEFAULT_OPTIMIZER
    optimizer_state_bytes_per_param: float = 8.0

    def to_dict(self) -> dict:
        return {
            "comparison": {
                "model": {**self.model, "n_params": self.n_params},
                "precision": self.precision,
                "optimizer_states": self.optimizer_states,
                "optimizer": self.optimizer,
                "optimizer_state_bytes_per_param": round(self.optimizer_state_bytes_per_param, 6),
                "node_shape": self.node_shape,
                "layouts": [r.to_dict() for r in self.rows],
                "seconds": round(self.seconds, 3),
                "simulations": self.simulations,
            }
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def format_table(self) -> str:
        model = ", ".join(f"{k}={v}" for k, v in self.model.items())
        lines = [
            f"HybridPS shard-group layouts (planned, not measured): {model}",
            f"  {_count(self.n_params)} params, {self.precision}, optimizer states {self.optimizer_states}; per node: "
            f"{self.node_shape}",
            f"  optimizer {self.optimizer}: {self.optimizer_state_bytes_per_param:.2f} B/param of optimizer state",
            "",
        ]
        rows = [
            (
                "nodes",
                "world",
                "shard group",
                "replicas",
                "given model",
                "gathered/group",
                "largest module",
                "owned/rank",
                "comm/rank/step",
                "across nodes",
                "ZeRO-3 world",
                "largest of the family",
                "comm at largest",
            )
        ]
        for r in self.rows:
            sh, c = r.sharding, r.communication
            named = f'"{sh.requested}" = {sh.shard_size}' if isinstance(sh.requested, str) else str(sh.shard_size)
            verdict = "refused" if r.refused else ("fits" if r.fits else "does not fit")
            rows.append(
                (
                    str(sh.nodes),
                    str(sh.world_size),
                    named,
                    str(sh.replicas),
                    verdict,
                    format_bytes(r.group_bytes),
                    format_bytes(r.gathered_bytes),
                    format_bytes(r.owned_bytes),
                    format_bytes(c.total_bytes),
                    format_bytes(c.inter_node_bytes),
                    format_bytes(c.zero3_world_bytes),
                    _largest_text(r.largest),
                    format_bytes(r.largest_communication.total_bytes) if r.largest_communication else "-",
                )
            )
        lines += _table(rows)
        for r in self.rows:
            if r.refused:
                lines.append(f"\n  refused: {r.refused}")  # the message names the layout
            elif not r.fits:
                lines.append(f"\n  {r.sharding.describe()}: does not fit: {r.reason}")
        lines.append(
            "\ncomm/rank/step: bytes one rank sends per step, all-gathers and reduce-scatter in the shard group "
            "(3 x params x (S-1)/S) + all-reduce of the owned shard across replicas (2 x params/S x (R-1)/R); "
            "ZeRO-3 world: 3 x params x (W-1)/W."
        )
        lines.append(f"Planned in {self.seconds:.1f} s ({self.simulations} simulations shared by every layout).")
        return "\n".join(lines)


def compare_layouts(
    model: PlannedModel,
    node: NodeSpec,
    *,
    nodes: Sequence[int],
    shard_group_sizes: Sequence[int | str],
    **request: Any,
) -> LayoutComparison:
    """Plan ``model`` on ``node``'s shape (GPUs, CPU and ranks per node; its ``nodes`` is
    replaced) at each count of ``nodes`` and each of ``shard_group_sizes``; ``request``
    holds the other ``PlanRequest`` fields (precision, margin_bytes, chunk_size, ...).

    A shard group size that does not divide a world is an error naming it; a layout the
    client would refuse for the model is planned on and marked refused."""
    if not nodes or not shard_group_sizes:
        raise ConfigError("compare_layouts needs at least one node count and one shard group size")
    start = time.perf_counter()
    simulations: dict = {}
    rows = []
    first = None
    for n in nodes:
        shape = dataclasses.replace(node, nodes=n)
        for size in shard_group_sizes:
            req = PlanRequest(model=model, node=shape, shard_group_size=size, refuse_unfit_layout=False, **request)
            planner = Planner(req, simulations)
            report = planner.run()
            first = first or report
            h = report.hybridps
            share = h.rank_share
            largest_ev = planner.evals.get(h.largest.n_layer) if h.largest and h.largest.n_layer else None
            largest_share = largest_ev.share if largest_ev is not None else None
            rows.append(
                LayoutRow(
                    sharding=h.sharding,
                    fits=h.fits,
                    reason=h.reason,
                    refused=h.refused,
                    group_bytes=h.group_bytes,
                    gathered_bytes=share.gathered_bytes if share else h.min_compute_bytes,
                    owned_bytes=h.model_data_bytes,
                    node_owned_bytes=share.node_owned_bytes if share else h.model_data_bytes,
                    gpu_need_bytes=h.gpu_need_bytes,
                    cpu_node_bytes=h.cpu_node_bytes,
                    communication=h.communication,
                    largest=h.largest,
                    largest_communication=largest_share.communication if largest_share else None,
                    largest_group_bytes=largest_share.group_bytes if largest_share else None,
                )
            )
    assert first is not None
    return LayoutComparison(
        model=dict(first.model),
        n_params=first.n_params,
        precision=first.precision,
        optimizer_states=first.optimizer_states,
        optimizer=first.optimizer,
        optimizer_state_bytes_per_param=first.optimizer_state_bytes_per_param,
        node_shape=f"{node.gpus} x {format_bytes(node.gpu_bytes)} GPU, {format_bytes(node.cpu_bytes)} CPU, "
        + (f"{format_bytes(node.nvme_bytes)} NVMe, " if node.has_disk else "")
        + f"{node.ranks_per_node} ranks",
        rows=tuple(rows),
        seconds=time.perf_counter() - start,
        simulations=len(simulations),
    )
