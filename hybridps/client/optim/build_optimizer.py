"""Building one client's chunked optimizer from the optimizer a script handed over.

Owns the order in which the optimizer's parts are made and which of them each one is given:
the hand-over (registration.py), the step counts and the step worker they share, one chunk's
step (chunk_step.py) with its arithmetic and the casts on the GPU, the grads it steps with
(step_grads.py), the early steps (early_step.py), the iteration's step (iteration_step.py)
and the torch surface over them (adam.py). Does not own what any of them does, nor the layout
of the optimizer's state rows (the client's ``register_optim``, which calls this first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from hybridps.client.optim import registration
from hybridps.client.optim.adam import ChunkedAdam
from hybridps.client.optim.chunk_step import ChunkArithmetic, ChunkStep, StepPlans
from hybridps.client.optim.device_casts import DeviceCasts
from hybridps.client.optim.early_step import EarlySteps
from hybridps.client.optim.iteration_step import IterationStep
from hybridps.client.optim.step_grads import StepGrads
from hybridps.client.optim.step_worker import StepWorker

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.placement import PlacementPolicy
    from hybridps.client.optim.loss_scaler import LossScaler
    from hybridps.client.sharding.groups import ChunkGroups


def build_optimizer(
    store: ChunkStore,
    mover: ChunkMover,
    optimizer: object,
    *,
    placement: PlacementPolicy,
    set_has_grad: Callable[[ParamInfo, bool], None],
    groups: ChunkGroups | None = None,
    on_zero_grad: Callable[[], None] | None = None,
    scaler: LossScaler | None = None,
    step_driver: Callable | None = None,
    step_listeners: Iterable[Callable[[str, int], None]] = (),
    zero_grad_listeners: Iterable[Callable[[], None]] = (),
) -> ChunkedAdam:
    """The chunked optimizer that replaces ``optimizer`` (one, or a list of several over
    disjoint params). ``set_has_grad`` records whether a param holds a grad (the grads' owner,
    grads.py), ``on_zero_grad`` is told when zero_grad drops every grad; ``scaler``: the fp16
    loss scaler (None: no loss scaling); ``step_driver``: what ``step()`` runs instead of the
    plain step (the engine's step, which ends its iteration); ``step_listeners`` are called as
    ``("start" | "end", index)`` around each chunk's step, ``zero_grad_listeners`` after
    every zero_grad."""
    handed = registration.hand_over(store, optimizer)
    steps = [0] * len(store.params)
    worker = StepWorker()
    arithmetic = ChunkArithmetic(store, handed.parts_by_param, handed.param_groups, StepPlans(handed.group_of), steps)
    # casts on the GPU never apply under a loss scale or with several ranks (device_casts.py)
    casts = DeviceCasts(store, mover, enabled=store.config.casts_on_gpu and scaler is None and groups is None)
    chunk_step = ChunkStep(store, mover, placement, arithmetic, worker, casts, step_listeners=step_listeners)
    grads = StepGrads(store, mover, chunk_step, handed.group_of, set_has_grad=set_has_grad, on_zero_grad=on_zero_grad)
    adam_only = all(p.torch_step is None for p in handed.parts)  # the early steps' condition
    early = EarlySteps(store, mover, chunk_step, grads, worker, steps, adam_only=adam_only, scaler=scaler)
    iteration = IterationStep(store, chunk_step, early, grads, worker, steps, scaler=scaler, groups=groups)
    return ChunkedAdam(
        handed,
        iteration,
        store=store,
        mover=mover,
        groups=groups,
        scaler=scaler,
        step_driver=step_driver,
        zero_grad_listeners=zero_grad_listeners,
    )
