"""Who is where: this rank's place in the job, the store behind the process group, the
device the backend moves tensors from, the store namespace of one client's collectives, and
the process group the collectives run on.

Owns: the job's rank, local rank and world size (given, from ``torch.distributed``, or from
torchrun's environment: ``_topology``), the store of the default process group that the
watchdog writes its records to (``_store_of``) and its address (``store_address``), the
backend's device (``_backend_device``), the namespace of the n-th client on a process group
(``_collectives_prefix``), and building a process group over the same ranks with the
collective timeout (``own_group``).

Does not own: the mesh of shard groups and replicas (``mesh.py``), the collectives run on
these groups and their order digest (``collectives.py``), the watchdog's records
(``watchdog.py``), which rank owns which chunk (``chunks/ownership.py``). Imports
nothing of the client.
"""

from __future__ import annotations

import collections
import datetime
import logging
import os

import torch
import torch.distributed as dist

from hybridps.common.errors import ConfigError, StateError

logger = logging.getLogger(__name__)


def _topology(rank, local_rank, world_size, group) -> tuple[int, int, int]:
    """(rank, local_rank, world_size): given, else from torch.distributed, else torchrun's
    environment, else a single rank."""
    if world_size is None:
        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size(group)
        else:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
            if world_size > 1:
                raise StateError(
                    f"WORLD_SIZE={world_size} but torch.distributed is not initialized; call "
                    f"hybridps.init_distributed() (or torch.distributed.init_process_group) first"
                )
    if rank is None:
        rank = dist.get_rank(group) if world_size > 1 else int(os.environ.get("RANK", "0"))
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank if world_size > 1 else 0)))
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world_size {world_size}")
    return rank, local_rank, world_size


def _store_of(group: dist.ProcessGroup | None):
    """The store behind the default process group (for the collective watchdog), if any."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # a custom group without a store: no watchdog, only the backend's timeout
        return None


def store_address(store) -> str | None:
    """``host:port`` of the TCPStore behind ``store`` (through PrefixStores), if it is one."""
    for _ in range(16):
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host is not None and port is not None else None


def _backend_device(group: dist.ProcessGroup | None, compute) -> torch.device:
    """NCCL moves CUDA tensors only; gloo takes CPU tensors."""
    try:
        backend = dist.get_backend(group)
    except Exception:
        return torch.device("cpu")
    if backend == "nccl" and compute.is_gpu and not compute.simulated:
        return compute.torch_device
    return torch.device("cpu")


#: clients created so far per process group (None: the default group), in this process
_CLIENTS_OF_GROUP: collections.Counter = collections.Counter()


def _collectives_prefix(process_group) -> str:
    """A store namespace of the collectives of one client: the n-th client on a process
    group. Every rank creates its clients in the same order, so the ranks agree on n. Without
    it a second client on the same group (an engine made after another was closed) reused
    the first one's watchdog keys: a rank already in the new client's collective #k met a
    slower rank's #k of the old one and reported a divergence that was not there."""
    key = id(process_group) if process_group is not None else None
    n = _CLIENTS_OF_GROUP[key]
    _CLIENTS_OF_GROUP[key] += 1
    return f"hybridps/c{n}"


def own_group(group: dist.ProcessGroup | None, world_size: int, timeout_s: float) -> dist.ProcessGroup | None:
    """A process group over the same ranks as ``group`` (of ``world_size`` ranks) whose
    collectives time out after ``timeout_s`` (``new_group`` is itself a collective: every rank
    creates its clients in the same order). Falls back to ``group`` when none can be made."""
    if world_size == 1 or not dist.is_available() or not dist.is_initialized():
        return group
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        if group is None or group == dist.group.WORLD:
            return dist.new_group(timeout=timeout)
        ranks = dist.get_process_group_ranks(group)
        return dist.new_group(ranks, timeout=timeout, backend=dist.get_backend(group), use_local_synchronization=True)
    except Exception as exc:
        logger.debug(
            "collectives run on the given process group with its own timeout (no group with a timeout of %g s: %s)",
            timeout_s,
            exc,
        )
        return group
