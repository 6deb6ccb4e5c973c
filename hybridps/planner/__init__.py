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

- ``defaults``: the figures the command line's parser shows, without torch;
- ``optimizers``: the optimizers a plan takes (``--optimizer``), built over the model as a
  script builds them, their state rows as the client lays them out (``planned_states``);
- ``meta_values``: stand-in values for reads of meta tensors an optimizer's own step makes;
- ``validation``: checks of counts and byte figures shared by the records;
- ``model``: the planned model family (``PlannedModel``, ``GPTShape``, ``ModelFactory``);
- ``hf_model``: a Hugging Face causal LM's config as a family (``HFCausalLMFamily``), built as
  ``hybridps train --model-config`` builds it (``hybridps.models.hf``);
- ``node``: the node, its disk tier included (``NodeSpec``, ``parse_gpus``);
- ``sharding``: the shard-group layout and its communication (``Sharding``,
  ``Communication``, ``ShardGroupTooLargeError``);
- ``attention``: attention on meta tensors as a real run saves it, only while simulating;
- ``meta_kernels``: each distinct op on meta tensors runs its meta kernel once while simulating;
- ``chunk_rows``: the bytes of a chunk's rows per kind, as the chunk store allocates them
  (fp32 or compact int8 moments: ``ChunkRows``);
- ``simulation``: one meta-simulated run (``simulate``, ``Simulation``, ``DeviceFigures``);
- ``rates``: a machine's measured rates, the shipped GPU profiles (``MachineRates``);
- ``speed``: the predicted seconds per step, tokens/s and TFLOPS of a plan (``predict_speed``);
- ``calibrate``: ``hybridps calibrate``, measuring this machine's rates;
- ``ranks``: one rank's derived share of a multi-rank job (``derive_rank_share``);
- ``host_peak``: one rank's host peak while building on meta and loading (``init_peak``);
- ``report``: the report's records, its JSON and its table (``PlanReport``);
- ``peers``: DeepSpeed's published rules (``peer_plans``);
- ``request``: the planner's inputs and its verdict on one size (``PlanRequest``, ``Evaluation``);
- ``largest``: the search for the largest model of the family, a part of ``Planner``;
- ``search``: the verdict per size and the plan (``plan``, ``Planner``);
- ``compare``: several node counts and shard group sizes side by side (``compare_layouts``);
- ``cli``: ``hybridps plan`` and ``python -m hybridps.planner``.

This module re-exports the names the rest of the project and users import from
``hybridps.planner``.
"""

from hybridps.common.lazy import lazy_exports

# the names below load on first use, so that the ``hybridps`` command line (which builds the
# ``plan`` parser in every command, ``hybridps status`` included) imports no torch
# ([Note: a lazy package] in hybridps/__init__.py)
_PUBLIC = {
    "add_subcommand": "hybridps.planner.cli",
    "main": "hybridps.planner.cli",
    "run_command": "hybridps.planner.cli",
    "LayoutComparison": "hybridps.planner.compare",
    "LayoutRow": "hybridps.planner.compare",
    "compare_layouts": "hybridps.planner.compare",
    "CHECKPOINT_BYTES_PER_PARAM": "hybridps.planner.host_peak",
    "PROCESS_OVERHEAD_BYTES": "hybridps.planner.host_peak",
    "InitPeak": "hybridps.planner.host_peak",
    "init_peak": "hybridps.planner.host_peak",
    "GPTShape": "hybridps.planner.model",
    "HFCausalLMFamily": "hybridps.planner.hf_model",
    "ModelFactory": "hybridps.planner.model",
    "PlannedModel": "hybridps.planner.model",
    "NodeSpec": "hybridps.planner.node",
    "parse_gpus": "hybridps.planner.node",
    "DEEPSPEED_BUFFER_FACTOR": "hybridps.planner.defaults",
    "PEER_RULES": "hybridps.planner.peers",
    "deepspeed_zero2_offload_bytes": "hybridps.planner.peers",
    "deepspeed_zero3_offload_bytes": "hybridps.planner.peers",
    "peer_plans": "hybridps.planner.peers",
    "RankShare": "hybridps.planner.ranks",
    "derive_rank_share": "hybridps.planner.ranks",
    "HybridPSPlan": "hybridps.planner.report",
    "LargestModel": "hybridps.planner.report",
    "PeerPlan": "hybridps.planner.report",
    "PlanReport": "hybridps.planner.report",
    "DEFAULT_MAX_LAYERS": "hybridps.planner.defaults",
    "DEFAULT_MAX_PROBES": "hybridps.planner.defaults",
    "OPTIMIZER_NAMES": "hybridps.planner.optimizers",
    "UNBOUNDED_CPU_BYTES": "hybridps.planner.search",
    "Evaluation": "hybridps.planner.request",
    "Planner": "hybridps.planner.search",
    "PlanRequest": "hybridps.planner.request",
    "plan": "hybridps.planner.search",
    "ChunkRows": "hybridps.planner.chunk_rows",
    "Communication": "hybridps.planner.sharding",
    "ShardGroupTooLargeError": "hybridps.planner.sharding",
    "Sharding": "hybridps.planner.sharding",
    "parse_shard_group_size": "hybridps.planner.sharding",
    "DeviceFigures": "hybridps.planner.simulation",
    "Simulation": "hybridps.planner.simulation",
    "deepspeed_param_counts": "hybridps.planner.simulation",
    "simulate": "hybridps.planner.simulation",
}


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())


__all__ = sorted(_PUBLIC)  # what the package exports, derived from the map above
