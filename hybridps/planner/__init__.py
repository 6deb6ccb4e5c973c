"""``hybridps plan``: will a model train on a node, and how large a model of its family would.

The planner drives one or two training iterations of the real engine under
``simulate="meta"`` for each size it considers, reads ``memory_stats()`` and the client's
layout afterwards, derives per-rank shares for multi-rank jobs with hybrid sharding (the
shard group's chunk groups, what a node's ranks own, the communication per step), refuses a
shard group whose gathered chunk groups cannot fit the GPU, applies the peers'
(DeepSpeed ZeRO-Offload and ZeRO-3 offload) published placement rules, searches the largest
model of the family that fits and reports it all. It does not own chunk layout, placement,
eviction, tidal budgets or activation measurement: the engine does all of that exactly as in
training, with payloads on the meta device.

Modules, each importing only those above it:

- ``validation``: checks of counts and byte figures shared by the records;
- ``model``: the planned model family (``PlannedModel``, ``GPTShape``, ``ModelFactory``);
- ``node``: the node (``NodeSpec``, ``parse_gpus``);
- ``sharding``: the shard-group layout and its communication (``Sharding``,
  ``Communication``, ``ShardGroupTooLargeError``);
- ``attention``: attention on meta tensors as a real run saves it, only while simulating;
- ``simulation``: one meta-simulated run (``simulate``, ``Simulation``, ``DeviceFigures``);
- ``ranks``: one rank's derived share of a multi-rank job (``derive_rank_share``);
- ``host_peak``: one rank's host peak while building on meta and loading (``init_peak``);
- ``report``: the report's records, its JSON and its table (``PlanReport``);
- ``peers``: DeepSpeed's published rules (``peer_plans``);
- ``search``: the request, the verdict per size and the search (``plan``, ``Planner``);
- ``compare``: several node counts and shard group sizes side by side (``compare_layouts``);
- ``cli``: ``hybridps plan`` and ``python -m hybridps.planner``.

This module re-exports the names the rest of the project and users import from
``hybridps.planner``.
"""

from hybridps.planner.cli import add_subcommand, main, run_command
from hybridps.planner.compare import LayoutComparison, LayoutRow, compare_layouts
from hybridps.planner.host_peak import CHECKPOINT_BYTES_PER_PARAM, PROCESS_OVERHEAD_BYTES, InitPeak, init_peak
from hybridps.planner.model import GPTShape, ModelFactory, PlannedModel
from hybridps.planner.node import NodeSpec, parse_gpus
from hybridps.planner.peers import (
    DEEPSPEED_BUFFER_FACTOR,
    PEER_RULES,
    deepspeed_zero2_offload_bytes,
    deepspeed_zero3_offload_bytes,
    peer_plans,
)
from hybridps.planner.ranks import RankShare, derive_rank_share, owners_by_bytes
from hybridps.planner.report import HybridPSPlan, LargestModel, PeerPlan, PlanReport
from hybridps.planner.search import (
    DEFAULT_MAX_LAYERS,
    DEFAULT_MAX_PROBES,
    UNBOUNDED_CPU_BYTES,
    Evaluation,
    Planner,
    PlanRequest,
    plan,
)
from hybridps.planner.sharding import Communication, ShardGroupTooLargeError, Sharding, parse_shard_group_size
from hybridps.planner.simulation import DeviceFigures, Simulation, deepspeed_param_counts, simulate

__all__ = [
    "CHECKPOINT_BYTES_PER_PARAM",
    "DEEPSPEED_BUFFER_FACTOR",
    "DEFAULT_MAX_LAYERS",
    "DEFAULT_MAX_PROBES",
    "PEER_RULES",
    "PROCESS_OVERHEAD_BYTES",
    "UNBOUNDED_CPU_BYTES",
    "Communication",
    "DeviceFigures",
    "Evaluation",
    "GPTShape",
    "HybridPSPlan",
    "InitPeak",
    "LargestModel",
    "LayoutComparison",
    "LayoutRow",
    "ModelFactory",
    "NodeSpec",
    "PeerPlan",
    "PlanReport",
    "PlanRequest",
    "PlannedModel",
    "Planner",
    "RankShare",
    "ShardGroupTooLargeError",
    "Sharding",
    "Simulation",
    "add_subcommand",
    "compare_layouts",
    "deepspeed_param_counts",
    "deepspeed_zero2_offload_bytes",
    "deepspeed_zero3_offload_bytes",
    "derive_rank_share",
    "init_peak",
    "main",
    "owners_by_bytes",
    "parse_gpus",
    "parse_shard_group_size",
    "peer_plans",
    "plan",
    "run_command",
    "simulate",
]
