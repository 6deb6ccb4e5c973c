"""Grad norms of a chunked step: the global norm that ``clip_grad_norm_`` clips by, the fp16
overflow check, and a stored grad as ``param.grad`` shows it.

Owns: how these figures are computed over chunks and across ranks, exactly as
``torch.nn.utils.clip_grad_norm_`` computes the norm (per-param norms, then the norm of
those; see adam_kernels.py, [Note: exactness]), and one step's ``Clip`` (its bound, its total norm,
the coefficient the step multiplies grads by). Does not own when a clip or an overflow
check happens, nor what a failed speculation undoes (``IterationStep``, iteration_step.py),
the backups whose figures it reads (speculation.py), or the loss scale (loss_scaler.py). Every function
here is free: it reads the store, the backups and the groups it is given, and changes
nothing but the tensors it returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from hybridps.client.optim.speculation import Backup, chunk_norms
from hybridps.common.errors import StateError

if TYPE_CHECKING:
    from hybridps.client.chunks.store import ChunkStore, ParamInfo
    from hybridps.client.sharding.groups import ChunkGroups

#: the grads of one chunk that a norm reads: its params' live grads, or the backup of its
#: speculative early step (speculation.py)
NormSource = tuple[list["ParamInfo"], "Backup | None"]


@dataclasses.dataclass(frozen=True, eq=False)
class Clip:
    """One step's ``clip_grad_norm_``: its bound, the total norm it found (unscaled under
    fp16) and the coefficient the step multiplies the grads by."""

    max_norm: float
    norm_type: float
    total: torch.Tensor
    coef: torch.Tensor
    finite: bool

    def again(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """A second clip in the same step: it clips nothing more and returns the first norm;
        one with another bound raises."""
        if (float(max_norm), float(norm_type)) != (self.max_norm, self.norm_type):
            raise StateError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) after clip_grad_norm_(max_norm="
                f"{self.max_norm}, norm_type={self.norm_type}) in the same step: HybridPS folds clipping into the step, "
                f"once. Clip once per step with the bound you want"
            )
        return self.total

    def refuse_nonfinite(self, norm_type: float) -> None:
        """``error_if_nonfinite=True``: raise as torch does where the total is inf or NaN
        (``norm_type`` as the caller gave it, for the message)."""
        if not self.finite:
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite ({self.total.item()}); cannot clip"
            )

    def coef_is_one(self) -> bool:
        """Whether the coefficient is exactly 1: what a speculative early step assumed."""
        return self.coef.is_meta or bool(self.coef == 1.0)


def clip(
    store: ChunkStore,
    sources: list[NormSource],
    max_norm: float,
    norm_type: float,
    *,
    groups: ChunkGroups | None,
    scale: float | None,
    grad_view: Callable[[ParamInfo], torch.Tensor] | None = None,
) -> Clip:
    """The clip of this step's grads ``sources`` to ``max_norm``: the total norm (divided by
    the loss ``scale`` under fp16) and the coefficient, as ``torch.nn.utils.clip_grad_norm_``.
    ``grad_view``: a param's grad as held (its slot by default; loose grads, loose_grads.py)."""
    total = total_norm(store, sources, norm_type, groups, grad_view)
    if scale is not None:
        total = total / scale
    finite = True if total.is_meta else bool(torch.isfinite(total))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return Clip(float(max_norm), float(norm_type), total, coef, finite)


def norm_sources(params: list[ParamInfo], param_group_of: list[int | None], backups: Mapping[int, Backup]) -> list[NormSource]:
    """The grads of this step by chunk, in the order they would have without early steps: a
    chunk's live grads, or the backup of its speculative early step."""
    stepped = {i.slot.index: b for b in backups.values() for i in b.infos}
    out: dict[int, NormSource] = {}
    for info in params:
        if param_group_of[info.slot.index] is None:
            continue
        if info.has_grad:
            out.setdefault(info.chunk, ([], None))[0].append(info)
        elif info.slot.index in stepped:
            out.setdefault(info.chunk, ([], stepped[info.slot.index]))
    return list(out.values())


def total_norm(
    store: ChunkStore,
    sources: list[NormSource],
    norm_type: float,
    groups: ChunkGroups | None,
    grad_view: Callable[[ParamInfo], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The norm of order ``norm_type`` over ``sources`` (and every other rank's grads)."""
    low = store.param_dtype != torch.float32
    grad_view = grad_view or store.grad_view
    by_param: list[tuple[int, torch.Tensor]] = []
    first_device = None
    # every live grad, one norm call a device (not one a chunk: the norms are per param either way)
    on_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
    for infos, backup in sources:
        if backup is None:
            for info in infos:
                view = grad_view(info)
                first_device = first_device or view.device  # the first source's, backup or not
                indices, views = on_device.setdefault(view.device, ([], []))
                indices.append(info.slot.index)
                views.append(view)
        else:
            ahead = backup.norms.get(float(norm_type))
            first_device = first_device or (ahead[0].device if ahead else backup.grad.device)
    for indices, views in on_device.values():
        by_param.extend(zip(indices, chunk_norms(views, norm_type, low), strict=True))
    for _, backup in sources:
        if backup is not None:
            ahead = backup.norms.get(float(norm_type))
            found = ahead if ahead is not None else chunk_norms(backup.grad_views(), norm_type, low)
            by_param.extend(zip((i.slot.index for i in backup.infos), found, strict=True))
    # in registration order, as clip_grad_norm_ stacks them: a chunk's params need not be
    # neighbours in it (layout.py, [Note: past an oversize tensor]), and the sum's order is its rounding
    norms = [n for _, n in sorted(by_param, key=lambda pair: pair[0])]
    if groups is None:
        return torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in norms]), norm_type)
    return global_norm(norms, norm_type, groups)


def global_norm(norms: list[torch.Tensor], norm_type: float, groups: ChunkGroups) -> torch.Tensor:
    """The norm over every rank's grads: each owner contributes the norms of its own."""
    if norm_type == float("inf"):
        local = torch.stack([n.cpu() for n in norms]).max() if norms else torch.tensor(0.0)
        groups.comm.all_reduce(local, op=torch.distributed.ReduceOp.MAX, what="grad norm")
        return local
    local = torch.stack([n.cpu() ** norm_type for n in norms]).sum() if norms else torch.tensor(0.0)
    local = local.to(torch.float64)
    groups.comm.all_reduce(local, what="grad norm")
    return (local ** (1.0 / norm_type)).to(torch.float32)


def found_overflow(store: ChunkStore, indices: Iterable[int], backups: Mapping[int, Backup], groups: ChunkGroups | None) -> bool:
    """True if any grad (on any rank) is inf or NaN: one min/max reduction per chunk of
    ``indices`` (taken before the step for chunks stepped early, in their ``backups``)."""
    if store.compute.meta:
        return False  # no values to overflow (capacity planning)
    extremes = [torch.zeros(2)]
    for index in indices:
        chunk = store.rows[store.grad_kind][index]
        chunk.settle()  # a chunk on the disk is read back first (chunk.py)
        assert chunk.payload is not None
        # min and max see NaN, +inf and -inf, in the grads' own dtype: half the work of
        # an fp32-accumulating sum
        lo, hi = torch.aminmax(chunk.payload[: store.layout.used(index)])
        extremes.append(torch.stack([lo, hi]).float().cpu())
    # chunks stepped early in this backward: their grads' extremes, taken before the step
    extremes.extend(b.extremes.cpu() for b in backups.values() if b.extremes is not None)
    found = torch.tensor(0 if bool(torch.isfinite(torch.cat(extremes)).all()) else 1, dtype=torch.uint8)
    if groups is not None:
        groups.comm.all_reduce(found, op=torch.distributed.ReduceOp.MAX, what="fp16 overflow check")
    return bool(found)


def as_user_grad(grad: torch.Tensor, scale: float | None, clip: Clip | None) -> torch.Tensor:
    """An fp32 grad as stored -> as ``param.grad`` would show it: divided by the loss
    ``scale`` under fp16, times the clip coefficient once ``clip_grad_norm_`` has run."""
    if scale is not None:
        grad = grad / scale
    if clip is not None:
        grad = grad * clip.coef.to(grad.device)
    return grad
