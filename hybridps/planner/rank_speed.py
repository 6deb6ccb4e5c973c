"""The work of one rank's steady step in a multi-rank job, for the speed model.

Owns ``rank_step_work`` and ``collective_bytes``: one rank's ``speed.StepWork`` from the
single-rank simulation and the derived share (``ranks.RankShare``): what the rank computes,
steps and moves, and the bytes its collectives move over the node's links and the network,
as the multi-rank client does them ([Note: a rank's step]).

Does not own the share's derivation (``ranks``), the collectives' formulas of the report's
communication figures (``sharding.Communication``: upper bounds, a second gather of every
group), the rates (``rates``) or how the parts compose (``speed.compose``).

[Note: a rank's step]
Every rank of a data-parallel job computes the whole model on its own micro-batch, so its
compute, its host time per param tensor and its head are the single-rank simulation's. What
changes with the ranks:

- the optimizer rows it steps are its own (``share.owned_bytes`` of the model data), the
  part of them on its CPU in the proportion of its share the GPU cannot hold
  (``share.cpu_bytes``), the rest on its GPU;
- its host <-> GPU traffic is ``share.moved_bytes_per_step`` (the simulation's, scaled by
  its share; none when the share lives on its GPU); its disk traffic the same, at the rate the
  node's one disk tier gives each of the node's ranks moving as much at once (its rates over
  ``ranks_per_node``: on two ranks of a 2-vCPU VM with a disk tier the plan read 0.77 of the
  step at the disk's whole rate);
- its grads are not loose (loose grads are for one rank): every micro-batch's grads go into
  the gathered groups' grad slots, and only its own master rows are written back;
- its collectives, per micro-batch, for the layout's param chunks of ``P`` bytes (compute
  precision, padding included) and a shard group of ``S`` ranks: the forward's all-gather,
  ``P (S - 1) / S`` a rank in a ring; the backward's all-gather of the groups that were not
  kept gathered (the forward's last whole groups, their bytes counted with the rank's own
  chunk, within ``Config.live_gathered_bytes``: a tenth of the GPU unless set, and within
  what the GPU holds beside the activations' peak, the share and the working set: nothing
  where the share spills to the CPU, whose room the forward's activations take, as measured
  on simulated GPUs), ``(P - kept) (S - 1) / S``; the reduce-scatter of the grads of the
  param chunks that take them (``P_r``: all of them but frozen chunk groups),
  ``P_r (S - 1) / S``; and with ``R`` replicas the all-reduce of each reduced shard,
  ``2 P_r / S (R - 1) / R``. A shard group within a node moves its bytes at the node's rates,
  one that crosses nodes at the network's (a ring is as fast as its slowest link); the
  replicas' all-reduce the same by where the replicas are. Each collective among the node's
  ranks also takes the rates' fixed time (``node_collective_s``): one a chunk group's gather,
  regather, reduction and replicas' all-reduce.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hybridps.planner.ranks import RankShare
from hybridps.planner.simulation import Simulation
from hybridps.planner.speed import StepWork, d2h_bytes, h2d_bytes, step_work

#: ``Config.live_gathered_bytes``'s default: a tenth of the compute device
KEPT_GATHERED_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class CollectiveBytes:
    """Bytes one rank's collectives move per micro-batch, by the link they cross."""

    node_gather_bytes: int = 0
    node_reduce_bytes: int = 0
    network_bytes: int = 0
    #: collectives among the node's ranks (one a chunk group and kind; each has a fixed time)
    node_collectives: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def collective_bytes(share: RankShare, *, kept_gathered_bytes: int) -> CollectiveBytes:
    """The bytes of ``share``'s collectives per micro-batch ([Note: a rank's step]); the
    forward's last whole groups within ``kept_gathered_bytes`` are not gathered again for
    backward."""
    sharding = share.sharding
    s, r = sharding.shard_size, sharding.replicas
    p = share.communication.params_bytes
    ring = (s - 1) / s
    # whole groups are kept, their bytes counted with this rank's own chunk (gathers.py's retire)
    kept = min(p, kept_gathered_bytes // share.group_bytes * share.group_bytes) if share.group_bytes else 0
    reduced = share.communication.reduced_bytes  # frozen chunk groups take no grads
    gather = math.ceil((p + p - kept) * ring)
    reduce = math.ceil(reduced * ring)
    replica = math.ceil(2 * reduced / s * (r - 1) / r)
    groups = share.chunk_groups
    regathered = math.ceil(groups * (p - kept) / p) if p else 0
    shard_calls = (groups + regathered + share.reduced_groups) if s > 1 else 0
    replica_calls = share.reduced_groups if r > 1 else 0
    network = calls = 0
    if sharding.shard_group_crosses_nodes:
        network += gather + reduce
        gather = reduce = 0
    else:
        calls += shard_calls
    if sharding.replicas_cross_nodes:
        network += replica
        replica = 0
    else:
        calls += replica_calls
    return CollectiveBytes(
        node_gather_bytes=gather, node_reduce_bytes=reduce + replica, network_bytes=network, node_collectives=calls
    )


def _scaled(nbytes: int, share_bytes: int, base_bytes: int) -> int:
    """``nbytes`` in the proportion ``share_bytes / base_bytes`` (none where the base moved none)."""
    return round(nbytes * min(1.0, share_bytes / base_bytes)) if base_bytes else 0


def rank_step_work(
    sim: Simulation,
    model: Any,
    share: RankShare,
    *,
    gpu_bytes: int,
    micro_batches: int = 1,
    live_gathered_bytes: int | None = None,
) -> StepWork:
    """One rank's work a step in the job of ``share`` ([Note: a rank's step]): ``sim`` is the
    single-rank simulation it was derived from, ``gpu_bytes`` a rank's GPU (the default
    ``live_gathered_bytes`` is a tenth of it)."""
    base = step_work(sim, model, micro_batches=micro_batches)
    owned_fraction = min(1.0, share.owned_bytes / sim.model_data_bytes) if sim.model_data_bytes else 0.0
    owned_params = round(sim.n_params * owned_fraction)
    on_cpu = min(1.0, share.cpu_bytes / share.owned_bytes) if share.owned_bytes else 0.0
    cpu_params = round(owned_params * on_cpu)
    if base.cpu_step_params:  # the simulation's Python per chunk, in proportion
        cpu_chunks = math.ceil(base.cpu_step_chunks * cpu_params / base.cpu_step_params)
    else:
        cpu_chunks = math.ceil(share.chunks / share.sharding.shard_size * on_cpu)
    moved = share.moved_bytes_per_step
    cap = live_gathered_bytes if live_gathered_bytes is not None else int(gpu_bytes * KEPT_GATHERED_FRACTION)
    room = gpu_bytes - sim.non_model_peak_bytes - share.owned_bytes - share.gathered_bytes
    comm = collective_bytes(share, kept_gathered_bytes=0 if share.cpu_bytes else max(0, min(cap, room)))
    return dataclasses.replace(
        base,
        h2d_bytes=h2d_bytes(moved),
        d2h_bytes=d2h_bytes(moved),
        cpu_step_params=cpu_params,
        cpu_step_chunks=cpu_chunks,
        gpu_step_params=owned_params - cpu_params,
        disk_read_bytes=moved.get("nvme->cpu", 0),
        disk_write_bytes=moved.get("cpu->nvme", 0),
        disk_sharing_ranks=share.sharding.ranks_per_node,
        grads_loose=False,
        # the single rank's host memory work, in the proportion of its link bytes the share moves
        pageable_h2d_bytes=_scaled(base.pageable_h2d_bytes, h2d_bytes(moved), base.h2d_bytes),
        pageable_d2h_bytes=_scaled(base.pageable_d2h_bytes, d2h_bytes(moved), base.d2h_bytes),
        arena_grown_bytes=_scaled(base.arena_grown_bytes, h2d_bytes(moved), base.h2d_bytes),
        arena_released_bytes=_scaled(base.arena_released_bytes, d2h_bytes(moved), base.d2h_bytes),
        owned_params=owned_params,
        node_gather_bytes=comm.node_gather_bytes,
        node_reduce_bytes=comm.node_reduce_bytes,
        network_bytes=comm.network_bytes,
        node_collectives=comm.node_collectives,
    )
