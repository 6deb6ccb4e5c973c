"""Process-group set-up for several ranks (torchrun or any launcher that sets the usual
environment: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from hybridps.common.errors import ConfigError


def init_distributed(backend: str | None = None, *, timeout_s: float = 600.0) -> tuple[int, int, int]:
    """Initialise torch.distributed from the environment; return (rank, local_rank, world_size).

    The backend defaults to NCCL when CUDA is available and gloo otherwise. With
    WORLD_SIZE unset this is a single rank and nothing is initialised.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size == 1 or dist.is_initialized():
        return (dist.get_rank(), local_rank, dist.get_world_size()) if dist.is_initialized() else (0, 0, 1)
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise ConfigError(f"WORLD_SIZE={world_size} but {var} is not set; launch with torchrun or set {var}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return rank, local_rank, world_size
