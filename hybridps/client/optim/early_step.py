"""Early steps (``Config.overlap_step``): which chunk may step during backward, with which
backup, and how the speculative ones are undone.

Owns: ``overlap_step_on`` (the setting resolved for a client), ``choose`` (whether a chunk is
ready to step early now: the params that step, the device, the backup while speculating) and
``roll_back`` (every speculative early step of this backward undone from its backup). Does
not own the step itself (``ChunkedAdam._step_chunk``, adam.py, which hands its compute to the
step worker where it may), the speculation mode and the backups (speculation.py), nor the
decision to roll back (``ChunkedAdam.step_chunks``, from the clip and the fp16 overflow check
of grad_norm.py). Free functions: they change only the backups, the step counts and the
chunks they are given.

[Note: early steps]
With ``Config.overlap_step`` a chunk steps during backward once every grad of it is final
(``ChunkedAdam.step_chunk_early``; the backward hooks call it on one rank, the chunk groups
after a group's grads were reduced on several). Where that step runs on the CPU while a real
GPU computes, the calling thread only takes the chunks and chooses the runs; the Adam and the
write-back run on the step worker (step_worker.py), as many chunks in flight as backward
hands over (step_worker.py, [Note: nothing waits for the worker]), their copies to the CPU still
running when they are handed over, and the chunks stay taken until this thread sees the
compute done. Every entry point that reads
optimizer rows (``step_chunks``, ``clip_grad_norm_``, ``state_dict``, ``load_state_dict``)
first waits for the worker, and every other use of a chunk in flight settles it first
(chunk.py, [Note: a chunk handed over]); ``step()`` hands its own CPU chunks to the worker
too (step_worker.py, [Note: steps beside the next forward]). Clipping and fp16 are kept exact by
speculation and validation (speculation.py, [Note: speculation then validation]): an early
step assumes a clip coefficient of 1 and no overflow and keeps a backup; ``step_chunks``
restores and steps again the chunks whose speculation failed.

[Note: what overlap_step="auto" covers]
``"auto"`` steps chunks early only where that is exact without a backup: a loop that does
not clip and does not scale its loss (fp32 or bf16). A loop that clips (most LLM loops) or
runs fp16 would have to speculate, and ``"auto"`` does not (``Speculation(enabled=False)``):
its first backward that would need it leaves every chunk to the step after backward, as
``overlap_step=False`` does. ``overlap_step=True`` speculates there too; its backups cost 16
bytes a param a step, which on the hosts measured (docs/BENCHMARKS.md) cost more than the
Adam they hid. Where the CPU optimizer is the longest part of a step (a small batch, most
rows on the CPU), early steps move its work beside backward but do not shorten it: on an
H200 host, 1.31 B params at 8 x 1024 tokens, the step worker's Adam and fp32 copies (about
0.5 s) outlasted backward, and steps with early steps took 0.83-0.88 s against 0.75-0.90 s
without, across three runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hybridps.client.chunks.chunk import Chunk, ChunkKind
from hybridps.client.chunks.states import TensorState
from hybridps.client.optim.speculation import BACKUP_DEVICE, Backup, Speculation, SpeculationMode, chunk_norms

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.memory.mover import ChunkMover
    from hybridps.client.memory.placement import PlacementPolicy
    from hybridps.common.config import Config
    from hybridps.common.devices import DeviceSpec


def overlap_step_on(config: Config, compute: DeviceSpec) -> bool:
    """``Config.overlap_step`` resolved for this client: ``"auto"`` is on where grads reuse
    their param slots and a real CUDA GPU computes (not a simulated or meta one); see
    [Note: what overlap_step="auto" covers]."""
    if config.overlap_step == "auto":
        return config.grad_reuse and compute.is_gpu and not compute.simulated and not compute.meta
    return bool(config.overlap_step)


@dataclasses.dataclass(eq=False)
class EarlyStep:
    """A chunk that steps now, during backward."""

    #: the params that step (those holding a grad), in registration order
    infos: list[ParamInfo]
    #: where the step runs (the placement policy's step device)
    device: str
    #: the chunk's values before the step, while speculating
    backup: Backup | None


def host_memory(mover: ChunkMover, device: str) -> bool:
    """Whether payloads on ``device`` are host memory (the CPU, a simulated GPU)."""
    return mover.inventory[device].torch_device.type == "cpu"


def choose(
    index: int,
    *,
    store: ChunkStore,
    mover: ChunkMover,
    placement: PlacementPolicy,
    speculation: Speculation,
    param_group_of: list[int | None],
    steps: list[int],
    loss_scaled: bool,
) -> EarlyStep | None:
    """Chunk ``index`` as it steps now, or None where it must wait for the step after
    backward: a param of it that the optimizer trains still lacks its final grad, or one is
    in use, or this backward stopped stepping early, or its backup cannot be had."""
    all_infos = [i for i in store.chunk_params(index) if param_group_of[i.slot.index] is not None]
    if not all_infos or not all(i.has_grad for i in all_infos if i.param.requires_grad):
        return None
    if store.rows[ChunkKind.PARAM][index].counts[TensorState.COMPUTE]:
        return None  # a frozen param of it is still needed by backward: step it with the rest
    mode = speculation.begin(loss_scaled=loss_scaled)
    if mode is SpeculationMode.STOPPED:
        return None
    infos = [i for i in all_infos if i.has_grad]
    device = placement.step_device(store.rows[store.master_kind][index])
    backup = None
    if mode is SpeculationMode.SPECULATING:
        if not host_memory(mover, device):
            return None  # see speculation.py: no backup of a real GPU's chunk
        backup = _backup(index, infos, store=store, mover=mover, speculation=speculation, steps=steps)
        if backup is None:
            return None  # no room: this chunk and the rest step after backward
    return EarlyStep(infos, device, backup)


def _backup(
    index: int, infos: list[ParamInfo], *, store: ChunkStore, mover: ChunkMover, speculation: Speculation, steps: list[int]
) -> Backup | None:
    """A new backup of chunk ``index`` before its speculative step (None: no room), with the
    grads' norms taken where they lie when that is not host memory."""
    ordered = sorted(infos, key=lambda i: i.slot.index)
    backup = speculation.new_backup(
        index,
        ordered,
        [steps[i.slot.index] for i in ordered],
        store.layout.used(index),
        store.kind_dtype(store.grad_kind),
        [],
        moment_numel=store.rows[ChunkKind.MOMENTUM][index].capacity if store.compact_moments else None,
        moment_dtype=store.kind_dtype(ChunkKind.MOMENTUM),
    )
    if backup is None:
        return None
    grad_chunk = store.rows[store.grad_kind][index]
    assert grad_chunk.payload is not None
    if not host_memory(mover, grad_chunk.device):
        # the norms where the grads lie, as clip_grad_norm_ would take them there
        grad_chunk.wait_ready()
        views = [grad_chunk.view(i.slot) for i in ordered]
        low = store.param_dtype != torch.float32
        backup.norms[speculation.norm_type] = chunk_norms(views, speculation.norm_type, low)
    return backup


def roll_back(
    *,
    store: ChunkStore,
    mover: ChunkMover,
    speculation: Speculation,
    steps: list[int],
    stepped_early: set[int],
    set_has_grad: Callable[[ParamInfo, bool], None],
) -> None:
    """Undo every speculative early step of this backward: master, momentum, variance, grads
    and step counts as they were before it (speculation.py), each chunk taken out of
    ``stepped_early``. The chunks then hold grads again and step (or are skipped) with the
    others."""
    for index in sorted(speculation.backups):
        backup = speculation.backups[index]
        _restore(index, backup, store=store, mover=mover)
        for info, step in zip(backup.infos, backup.steps_before, strict=True):
            steps[info.slot.index] = step
            set_has_grad(info, True)  # the grads owner's flag: the chunk holds grads again
        stepped_early.discard(index)
        speculation.drop(index)
        speculation.rolled_back += 1


def _restore(index: int, backup: Backup, *, store: ChunkStore, mover: ChunkMover) -> None:
    """Chunk ``index``'s master, momentum, variance and grads from ``backup``, where they lie."""
    who = f"the roll-back of chunk {index}'s early step"
    taken: list[tuple[Chunk, list[TensorState] | TensorState]] = []
    try:
        for kind in dict.fromkeys((store.master_kind, ChunkKind.MOMENTUM, ChunkKind.VARIANCE, store.grad_kind)):
            chunk = store.rows[kind][index]
            mover.take(chunk, chunk.device or BACKUP_DEVICE, who=who)
            taken.append((chunk, backup.param_states if kind is store.grad_kind else TensorState.HOLD))
        payloads = [store.rows[kind][index].payload for kind in (store.master_kind, ChunkKind.MOMENTUM, ChunkKind.VARIANCE)]
        grad = store.rows[store.grad_kind][index].payload
        assert grad is not None and all(p is not None for p in payloads)
        backup.restore(*payloads, grad)
        for chunk, _ in taken:
            assert chunk.device is not None
            numel = backup.momentum.numel() if chunk.kind in (ChunkKind.MOMENTUM, ChunkKind.VARIANCE) else backup.used
            mover.count_transfer(BACKUP_DEVICE, chunk.device, numel * chunk.dtype.itemsize)
    finally:
        for chunk, after in reversed(taken):
            mover.give_back(chunk, after)
