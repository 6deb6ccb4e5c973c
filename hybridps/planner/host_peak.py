"""One rank's host memory while its model is built on meta, initialized into its chunks and
loaded from safetensors (``meta_init`` + ``initialize`` + ``load_pretrained``).

Owns ``InitPeak``, ``init_peak`` and the constants they assume: the process's own overhead
and the checkpoint's bytes per param.

Does not own where the model data lives during training (``simulation``, ``ranks``) or the
warning when a node's ranks together pass its CPU (``search``).
"""

from __future__ import annotations

import dataclasses

from hybridps.planner.node import NodeSpec
from hybridps.planner.ranks import RankShare
from hybridps.planner.simulation import Simulation

#: host memory of a training process beyond its model data: torch's kernels and libraries,
#: gloo's buffers, Python objects. Measured on this project's CPU machines at 75-100 MiB per
#: rank; a CUDA context and its libraries add several hundred MiB (an H100 rank held 0.8 GiB
#: more than its booked chunks right after init).
PROCESS_OVERHEAD_BYTES = {"simulated": 128 << 20, "gpu": 1 << 30}

#: bytes per param of the checkpoint the load figure assumes (fp32 safetensors)
CHECKPOINT_BYTES_PER_PARAM = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class InitPeak:
    """Host memory of one rank while its model is built on meta, initialized into its chunks
    and loaded from safetensors (``meta_init`` + ``initialize`` + ``load_pretrained``).

    [Note: the init peak]
    Nothing is materialized whole: a rank holds its own chunks (the model data it keeps on
    the host: all of it on simulated GPUs) plus, at any moment, one op's values. The replay of
    the model's init holds the largest param's value in its own dtype (fp32). The streamed
    load reads tensor by tensor from memory-mapped files; the file pages a rank has read stay
    mapped, and counted in its RSS, until the file is closed, so the load adds the rank's
    share of the checkpoint plus the largest tensor widened to fp32. The peak is the larger
    of the two, over the rank's host model data and the process's own overhead.
    """

    host_model_data_bytes: int
    replay_transient_bytes: int
    load_transient_bytes: int
    process_overhead_bytes: int

    @property
    def host_peak_bytes(self) -> int:
        return (
            self.host_model_data_bytes + max(self.replay_transient_bytes, self.load_transient_bytes) + self.process_overhead_bytes
        )

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "host_peak_bytes": self.host_peak_bytes}


def init_peak(sim: Simulation, share: RankShare | None, node: NodeSpec, *, simulated_gpus: bool) -> InitPeak:
    """One rank's host peak during meta init and streamed loading (see [Note: the init peak])."""
    # each rank reads the tensors of the chunks it owns: 1/shard_size of the checkpoint
    readers = share.sharding.shard_size if share is not None else node.world_size
    largest = max(sim.param_numels, default=0)
    if share is not None:
        host = share.owned_bytes if simulated_gpus else share.cpu_bytes
    else:
        host = sim.model_data_bytes if simulated_gpus else (sim.cpu.peak_bytes if sim.cpu else 0)
    return InitPeak(
        host_model_data_bytes=host,
        replay_transient_bytes=largest * 4,
        load_transient_bytes=-(-sim.n_params * CHECKPOINT_BYTES_PER_PARAM // readers) + largest * 4,
        process_overhead_bytes=PROCESS_OVERHEAD_BYTES["simulated" if simulated_gpus else "gpu"],
    )
