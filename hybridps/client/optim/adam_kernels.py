"""The kernels of a chunk's Adam step: which one steps each run of params, with what
arguments, and the calls themselves.

Owns the choice of kernel per param group (torch's fused, foreach or for-loop Adam, as the
user's optimizer would run it, see [Note: exactness]; or the step over compact 8-bit moments
under ``Config.optimizer_states="int8"``, compact_adam.py), the calls' arguments worked out on
the calling thread (hyperparameters as the group holds them now, and the tensors they take
beside the rows, kept in ``StepTensors``: step counts, divisors, clip coefficients), and
running a call over one chunk's rows. Does not own when a chunk steps, what it takes or gives
back (chunk_step.py), how its rows are cut into runs (step_plan.py), nor the arithmetic of the
compact step (compact_adam.py).

[Note: exactness]
Elementwise kernels give the same bits for an element wherever it sits in a tensor, so
stepping a run of params as one flat view of a chunk reproduces the per-param step exactly.
Each param group steps with the kernel the user's optimizer would have run (``adam_kernel``):
``fused=True`` the fused kernel, ``foreach=True`` the foreach kernel, ``fused=False`` or
``foreach=False`` the for-loop kernel, and neither given (torch's default) what torch picks for
the tensors at hand: foreach for CUDA tensors, the for-loop kernel on the CPU. So a chunk steps
bit for bit as the same torch optimizer would over the same values on the same device. The
kernels differ in their last bits from each other (fused vs for-loop: at most a few ulp per
step); the fused one is several times faster on the CPU, so an offloaded run wants
``fused=True`` (``hybridps train`` and the benchmarks ask for it). The global norm for
clipping is computed as ``torch.nn.utils.clip_grad_norm_`` does (per-param norms, then the
norm of those).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.optim.adam as torch_adam
from torch.optim.optimizer import _default_to_fused_or_foreach

from hybridps.client.optim.compact_adam import compact_adam_
from hybridps.client.optim.moment_codes import MomentRow
from hybridps.client.optim.step_plan import StepPlan


def adam_kernel(group: dict, params: list[torch.Tensor]) -> tuple[bool, bool]:
    """(fused, foreach): the kernel torch's Adam/AdamW runs for ``group`` over ``params``, as
    ``torch.optim.adam.adam`` resolves it (see [Note: exactness])."""
    fused, foreach = group.get("fused"), group.get("foreach")
    if fused is None and foreach is None:
        _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
        if foreach and isinstance(group["lr"], torch.Tensor):
            foreach = False  # torch's own rule: a tensor lr runs the for-loop kernel unless capturable
    return bool(fused), bool(foreach)


#: step tensors of the fused kernel kept at most (by count and device; a few steps' worth)
STEP_TENSORS_KEPT = 64


class StepTensors:
    """The tensors the kernels of a chunk's step take besides its rows, made on the calling
    thread and kept: step counts (for every step), ``found_inf`` zeros (for good) and the
    grads' divisors and clip coefficients (for one step, ``end_step`` forgets them). A step
    on the worker keeps those it was given even once they are forgotten here."""

    def __init__(self) -> None:
        self._steps: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._zeros: dict[torch.device, torch.Tensor] = {}
        self._per_step: dict[tuple, torch.Tensor] = {}

    def step(self, count: int, device: torch.device) -> torch.Tensor:
        """A float32 scalar holding step count ``count`` on ``device``, made once (read-only:
        only the fused kernel, which never writes its step tensors, takes these)."""
        key = (device, count)
        tensor = self._steps.get(key)
        if tensor is None:
            if len(self._steps) > STEP_TENSORS_KEPT:
                self._steps.clear()
            tensor = self._steps[key] = torch.tensor(float(count), dtype=torch.float32, device=device)
        return tensor

    def zero(self, device: torch.device) -> torch.Tensor:
        """The fused kernel's ``found_inf`` where a scale is folded in: never an overflow here
        (a step with one is skipped before it starts)."""
        zero = self._zeros.get(device)
        if zero is None:
            zero = self._zeros[device] = torch.zeros((), dtype=torch.float32, device=device)
        return zero

    def divisor(self, inv_scale: float | None, clip_coef: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """What the grads are divided by: 1 / (inv_scale x clip_coef) in float32, on
        ``device``; made once per step and device."""
        if inv_scale is None and clip_coef is None:
            return None
        key = ("divisor", inv_scale, id(clip_coef), device)
        divisor = self._per_step.get(key)
        if divisor is None:
            factor = torch.tensor(1.0 if inv_scale is None else inv_scale, dtype=torch.float32)
            if clip_coef is not None:
                factor = factor * clip_coef.cpu()
            divisor = self._per_step[key] = (1.0 / factor).to(device)
        return divisor

    def on_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` (this step's clip coefficient) on ``device``, copied once per step."""
        key = ("on_device", id(tensor), device)
        copy = self._per_step.get(key)
        if copy is None:
            copy = self._per_step[key] = tensor.to(device)
        return copy

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` (a tensor lr) made once per step: what the step's kernels read
        even when the owner changes it in place meanwhile."""
        key = ("copy", id(tensor))
        copy = self._per_step.get(key)
        if copy is None:
            copy = self._per_step[key] = tensor.clone()
        return copy

    def end_step(self) -> None:
        """The step is over: its divisors and coefficients are not made for the next."""
        self._per_step.clear()


@dataclasses.dataclass(eq=False)
class AdamCall:
    """One kernel call of a chunk's step, worked out on the calling thread."""

    #: which pieces of each row it takes (step_plan.py)
    pieces: tuple[int, ...]
    #: a step tensor per piece
    steps: list[torch.Tensor]
    fused: bool
    foreach: bool
    decoupled_weight_decay: bool
    #: lr, beta1, beta2, weight_decay, eps, maximize: the param group's when the step was taken
    hyper: dict
    #: the fused kernel's found_inf where a scale is folded in
    found_inf: torch.Tensor | None = None
    #: the param group whose runs it takes (calls of one group may join: resident_step.py)
    group: int = -1


def _scalar(x):
    """A hyperparameter as torch's fused Adam takes it (``torch.optim.optimizer._to_scalar``):
    a 1-element tensor of more dimensions becomes 0-dimensional."""
    return x.squeeze() if isinstance(x, torch.Tensor) and x.dim() != 0 else x


def adam_calls(
    plan: StepPlan, base_step: int, master: torch.Tensor, param_groups: list[dict], tensors: StepTensors, *, compact: bool
) -> list[AdamCall | CompactCall]:
    """The kernel calls of one chunk's step: per param group, the kernel its optimizer
    would run (see [Note: exactness]), its hyperparameters now, and its step tensors; over
    ``compact`` moment rows, the compact step's calls instead."""
    device = master.device
    calls = []
    for group_index in dict.fromkeys([call.group for call in plan.by_group]):
        group = param_groups[group_index]
        fused, foreach = (False, False) if compact else adam_kernel(group, [master])
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        if fused:  # as torch.optim.adam's _fused_adam passes them
            beta1, beta2 = _scalar(beta1), _scalar(beta2)
            if isinstance(lr, torch.Tensor) and lr.device.type != "cpu" and lr.device != device:
                lr = lr.to(device=device, non_blocking=True)
        if isinstance(lr, torch.Tensor) and lr is group["lr"]:
            lr = tensors.copy_of(lr)  # a scheduler fills the group's tensor in place, maybe before the worker reads it
        if compact:
            calls.extend(_compact_calls(plan, base_step, group_index, group, lr))
            continue
        hyper = {
            "lr": lr,
            "beta1": beta1,
            "beta2": beta2,
            "weight_decay": group["weight_decay"],
            "eps": group["eps"],
            "maximize": group.get("maximize", False),
        }
        if fused:
            # the fused kernel reads a step per tensor and counts none: one tensor per count
            # (after this step) and device serves every run and chunk
            call = next(c for c in plan.by_group if c.group == group_index)
            steps = [tensors.step(base_step + plan.runs[k].step_offset + 1, device) for k in call.runs]
            decoupled = group["decoupled_weight_decay"]
            calls.append(AdamCall(call.pieces, steps, True, False, decoupled, hyper, tensors.zero(device), group=group_index))
            continue
        for call in plan.by_step:  # these kernels add 1 to their step tensors: new ones each time
            if call.group == group_index:
                assert call.step_offset is not None
                step = float(base_step + call.step_offset)
                steps = [torch.tensor(step, dtype=torch.float32) for _ in call.runs]
                calls.append(AdamCall(call.pieces, steps, False, foreach, group["decoupled_weight_decay"], hyper))
    return calls


def run_adam(call: AdamCall, rows: tuple[tuple[torch.Tensor, ...], ...], divisor: torch.Tensor | None) -> None:
    """Adam over the runs ``call`` takes of one chunk's ``rows`` (master, grads,
    momentum, variance, each cut by its plan); ``divisor`` scales the grads down first
    (folded into the fused kernel)."""
    pieces = call.pieces
    # map over a tuple's __getitem__: picking the pieces runs no Python frame
    params = list(map(rows[0].__getitem__, pieces))
    grads = list(map(rows[1].__getitem__, pieces))
    exp_avgs = list(map(rows[2].__getitem__, pieces))
    exp_avg_sqs = list(map(rows[3].__getitem__, pieces))
    hyper = call.hyper
    if call.fused:
        # torch.optim.adam's _fused_adam without its per-call Python (grouping by device,
        # adding 1 to each step tensor): the same kernel on the same arguments
        kernel = torch._fused_adamw_ if call.decoupled_weight_decay else torch._fused_adam_
        kernel(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            call.steps,
            amsgrad=False,
            grad_scale=divisor,
            found_inf=None if divisor is None else call.found_inf,
            **hyper,
        )
        return
    if divisor is not None:  # the for-loop and foreach kernels take no scale: one pass
        for g in grads:
            g.div_(divisor)
    torch_adam.adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        call.steps,
        foreach=call.foreach,
        capturable=False,
        differentiable=False,
        fused=False,
        grad_scale=None,
        found_inf=None,
        has_complex=False,
        decoupled_weight_decay=call.decoupled_weight_decay,
        amsgrad=False,
        **hyper,
    )


@dataclasses.dataclass(eq=False)
class CompactCall:
    """One call of the compact step (compact 8-bit moments): the runs of one param group at
    one step count."""

    #: which pieces of the grads row it takes (to divide them by the grad divisor)
    pieces: tuple[int, ...]
    #: [start, end) of each run in the chunk
    ranges: tuple[tuple[int, int], ...]
    #: the step count after this step
    step: int
    decoupled_weight_decay: bool
    #: lr, beta1, beta2, weight_decay, eps, maximize: the param group's when the step was taken
    hyper: dict


def _compact_calls(plan: StepPlan, base_step: int, group_index: int, group: dict, lr) -> list[CompactCall]:
    """The compact step's calls for one param group: one per step count, as the for-loop
    kernel's (the step count enters the bias corrections)."""
    beta1, beta2 = group["betas"]
    hyper = {
        "lr": lr,
        "beta1": float(beta1),
        "beta2": float(beta2),
        "weight_decay": float(group["weight_decay"]),
        "eps": float(group["eps"]),
        "maximize": bool(group.get("maximize", False)),
    }
    calls = []
    for call in plan.by_step:
        if call.group == group_index:
            assert call.step_offset is not None
            ranges = tuple((plan.runs[k].start, plan.runs[k].end) for k in call.runs)
            step = base_step + call.step_offset + 1
            calls.append(CompactCall(call.pieces, ranges, step, group["decoupled_weight_decay"], hyper))
    return calls


def run_compact(
    call: CompactCall,
    master: torch.Tensor,
    grads: torch.Tensor,
    momentum: MomentRow,
    variance: MomentRow,
    grad_pieces: tuple[torch.Tensor, ...],
    divisor: torch.Tensor | None,
) -> None:
    """The compact step over the runs ``call`` takes: ``master`` and ``grads`` whole rows
    (``grad_pieces`` the grads cut by the plan), the moments compact rows; ``divisor`` scales
    the grads down first. On the meta device (the planner's simulations) there are no values
    to step."""
    if master.is_meta:
        return
    if divisor is not None:
        for g in map(grad_pieces.__getitem__, call.pieces):
            g.div_(divisor)
    hyper = call.hyper
    for start, end in call.ranges:
        compact_adam_(
            master,
            grads,
            momentum,
            variance,
            start,
            end,
            step=call.step,
            decoupled_weight_decay=call.decoupled_weight_decay,
            **hyper,
        )
