"""The planner's inputs and its verdict on one member of the family.

Owns ``PlanRequest`` (the model, the node, the training settings and the search's limits,
validated, with the defaults that depend on the node's disk tier resolved) and
``Evaluation`` (one member's simulation and the verdict built on it).

Does not own how a request is planned (``search``, ``largest``) or the node's own checks
(``node``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridps.common.config import PRECISIONS
from hybridps.common.errors import ConfigError
from hybridps.common.optimizer_states import parse_optimizer_states
from hybridps.common.units import format_bytes, parse_bytes
from hybridps.planner.defaults import (
    DEEPSPEED_BUFFER_FACTOR,
    DEFAULT_ITERATIONS,
    DEFAULT_MAX_LAYERS,
    DEFAULT_MAX_LAYERS_WITH_DISK,
    DEFAULT_MAX_PROBES,
    DEFAULT_SEARCH_SECONDS_WITH_DISK,
)
from hybridps.planner.model import PlannedModel
from hybridps.planner.node import NodeSpec
from hybridps.planner.optimizers import DEFAULT_OPTIMIZER, check_optimizer_name, check_optimizer_states
from hybridps.planner.ranks import RankShare
from hybridps.planner.sharding import Sharding
from hybridps.planner.simulation import Simulation
from hybridps.planner.validation import check_positive_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """The planner's inputs, validated."""

    model: PlannedModel
    node: NodeSpec
    precision: str = "fp16"
    grad_reuse: bool = True
    #: how Adam's momentum and variance are stored (``Config.optimizer_states``): "fp32", or
    #: "int8" (compact rows: 2.03 B a param for both instead of 8)
    optimizer_states: str = "fp32"
    #: the optimizer trained with (``optimizers.OPTIMIZER_NAMES``): which of its states are
    #: chunk rows is the client's probe of it (client/optim/state_layout.py)
    optimizer: str = DEFAULT_OPTIMIZER
    margin_bytes: int = 0
    chunk_size: int | None = None
    #: ``Config.casts_on_gpu``: "auto" (as a run resolves it), True or False
    casts_on_gpu: bool | str = "auto"
    #: plan a run on simulated GPUs (GPU chunks in host memory, the host arena unpinned, no
    #: real-GPU transients) instead of a real node
    simulated_gpus: bool = False
    #: None: 3 (the warm-up, a replay, the steady iteration: ``DEFAULT_ITERATIONS``)
    iterations: int | None = None
    search_largest: bool = True
    #: None: 1024, 16384 with a disk tier
    max_layers: int | None = None
    max_probes: int = DEFAULT_MAX_PROBES
    #: seconds of simulation the search may spend: a candidate whose simulation is predicted
    #: to take longer than what is left is not simulated, and the largest size is then the
    #: linear rule's (``LargestModel.method`` "linear rule", unconfirmed); None: no limit
    #: without a disk tier, ``DEFAULT_SEARCH_SECONDS_WITH_DISK`` with one; ``math.inf``: none
    search_seconds: float | None = None
    deepspeed_buffer_factor: float = DEEPSPEED_BUFFER_FACTOR
    #: ranks sharing one copy of the model data (``Config.shard_group_size``): "node", "world"
    #: or a number of ranks dividing the world
    shard_group_size: int | str = "node"
    #: the machine's measured rates for the predicted speed (``rates.MachineRates``); None:
    #: no prediction
    rates: Any = None
    #: micro-batches accumulated per optimizer step, for the predicted speed only (the
    #: simulation runs one: its memory is one micro-batch's)
    micro_batches: int = 1
    #: raise ``ShardGroupTooLargeError`` when the model's gathered chunk groups cannot fit the
    #: GPU (as the client does at registration); False: report it and plan on (comparisons)
    refuse_unfit_layout: bool = True

    def __post_init__(self) -> None:
        for attr in ("n_layer", "with_layers", "build", "inputs", "loss", "describe"):
            if not hasattr(self.model, attr):
                raise ConfigError(
                    f"model {self.model!r} lacks {attr!r}; pass a GPTShape(...) or a ModelFactory(build_fn=..., inputs_fn=..., n_layer=...)"
                )
        check_positive_int("n_layer", self.model.n_layer)
        if not isinstance(self.node, NodeSpec):
            raise ConfigError(f"node={self.node!r} must be a NodeSpec, e.g. NodeSpec.parse('8x80GiB', '1TiB')")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r}; use one of {', '.join(PRECISIONS)}")
        if not isinstance(self.grad_reuse, bool):
            raise ConfigError(f"grad_reuse={self.grad_reuse!r} must be True or False")
        try:
            object.__setattr__(self, "optimizer_states", parse_optimizer_states(self.optimizer_states).value)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not (isinstance(self.casts_on_gpu, bool) or self.casts_on_gpu == "auto"):
            raise ConfigError(f"casts_on_gpu={self.casts_on_gpu!r}; use 'auto', True or False")
        check_optimizer_name(self.optimizer)
        check_optimizer_states(self.optimizer, self.optimizer_states)
        object.__setattr__(self, "margin_bytes", parse_bytes(self.margin_bytes, what="margin"))
        if self.margin_bytes >= self.node.gpu_bytes:
            raise ConfigError(
                f"margin {format_bytes(self.margin_bytes)} leaves nothing of the {format_bytes(self.node.gpu_bytes)} GPU; "
                f"lower the margin"
            )
        if self.chunk_size is not None:
            check_positive_int("chunk_size", self.chunk_size)
        disk = self.node.has_disk
        if self.iterations is None:
            object.__setattr__(self, "iterations", DEFAULT_ITERATIONS)
        if self.max_layers is None:
            object.__setattr__(self, "max_layers", DEFAULT_MAX_LAYERS_WITH_DISK if disk else DEFAULT_MAX_LAYERS)
        if self.search_seconds is None and disk:
            object.__setattr__(self, "search_seconds", DEFAULT_SEARCH_SECONDS_WITH_DISK)
        if self.search_seconds is not None and (
            isinstance(self.search_seconds, bool)
            or not isinstance(self.search_seconds, (int, float))
            or not self.search_seconds > 0
        ):
            raise ConfigError(f"search_seconds={self.search_seconds!r} must be a number of seconds above 0 (inf: no limit)")
        check_positive_int("iterations", self.iterations)
        if self.iterations < 2:
            raise ConfigError(
                f"iterations={self.iterations}: the first iteration is the warm-up; plan with at least 2 so one "
                f"iteration replays the trace as training does"
            )
        check_positive_int("max_layers", self.max_layers)
        check_positive_int("max_probes", self.max_probes)
        check_positive_int("micro_batches", self.micro_batches)
        if not (isinstance(self.deepspeed_buffer_factor, (int, float)) and self.deepspeed_buffer_factor > 0):
            raise ConfigError(f"deepspeed_buffer_factor={self.deepspeed_buffer_factor!r} must be a positive number")
        object.__setattr__(self, "shard_group_size", self.sharding.requested)  # validated against the node

    @property
    def sharding(self) -> Sharding:
        return Sharding.resolve(self.shard_group_size, self.node)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Evaluation:
    """One member of the family on the node: the simulation and the verdict built on it."""

    sim: Simulation
    share: RankShare | None
    fits: bool
    reason: str
