"""Hook units: which modules of a model the engine's hooks wrap, and whose params each one
accesses.

A *unit* is a module whose forward pre-hook accesses a set of params, whose forward hook
releases them and whose backward pre-hook accesses them again (params/hooks.py). Every param
belongs to exactly one unit: the innermost unit above the module that holds it.

[Note: blocks as units]
Wrapping every module costs a tick of the tracer, a prefetch check and a backward hook per
module per pass, and a transformer block has eight or more modules. A *block* - an element
of an ``nn.ModuleList`` or ``nn.Sequential`` that has submodules - is one unit instead, as
FSDP2's ``fully_shard`` of each layer makes it one gather: its modules run with no hook of
their own, all the block's params are accessed when it starts and released when it ends.
The chunks a block touches must then sit on the compute device together, beside whatever
activations are live when it runs, which nobody knows before the warm-up. With
``Config(hook_units="auto")`` the warm-up iteration therefore runs with every module a
unit; once its trace exists, blocks become units if the chunks of an iteration on the device -
those the model computes with, and the optimizer rows of the chunks whose master lies there
(they step there) - fit beside the warm-up's non-model peak (``blocks_fit``) - where they
stay on the device anyway and per-module units would only add hook calls - and the next
iteration traces again with the new moments. A model that only fits module by module keeps
every module a unit, and so does one whose params fit but not beside the rows stepping on the
device: a block accessed whole changes what the placement evicts for them, and the planner
simulates every module a unit (a 4 x 384 GPT in bf16 whose params fit a 60 MB simulated GPU
beside its activations, its rows moving through 60 MB of host memory and a disk tier: blocks
as units moved 39.5 MB each way to and from the disk a step, 3.4x its plan, 0.150 s a step;
every module a unit, the plan's 11.6 MB and 0.114 s). On the CPU (no device to fit) blocks are units from the start. With
``Config(compile=True)``, which needs blocks, they are units from the start whatever
``hook_units`` says, each while its own param chunks take at most ``BLOCK_SHARE`` of the
device (a larger block is split into its modules and its own blocks). ``"auto"`` is the
default: where the model fits, the per-module moments order nothing (no chunk moves) and
only cost hook calls (measured: a 6-layer GPT's step on the VM, 1.18x plain PyTorch's with
every module a unit, 1.15x with blocks, docs/BENCHMARKS.md). ``Config(hook_units="module")``
keeps every module a unit always: the finest moments for the trace and the placement that
follows it. Every module outside the blocks (the root, embeddings, the final norm and head)
stays a unit of its own.

[Note: the model as one unit]
Where the whole iteration fits the compute device - its grads stay loose until the step
(optim/loose_grads.py), which one rank decides after a warm-up from the trace: the chunks, the
non-model peak and every grad fit - and every param chunk is on that device after the
warm-up, nothing moves within an iteration, and even a block's hooks only cost calls: a tick,
an access and a release of its params, a backward hook on its output, a re-access in
backward. The model is then one unit: its own hooks access every param when its forward
starts, release them when it returns, access them again when its backward starts, and the
end of backward releases them; no other module has a hook, so a step makes four such calls,
not four per block. On the 2-vCPU VM (a 6-layer GPT, 512 tokens a step, everything fitting)
the block units' hooks took about 3.5 ms of a 170 ms step. Nothing else changes: the hooks
are the same hooks, the tracer's moments are fewer (the next iteration traces them again),
and where the grads stop being loose (a later warm-up finds no room) the units go back to
what they were. Every param stays accessed for the whole forward, so activations that outgrow
the trace cannot make room by evicting the params of modules not running: on a GPU (the
simulated one included), an iteration whose inputs are larger than any before (a longer
sequence, a larger batch) starts with its units back and grads not loose, and traces anew; the
decision after it makes the model one unit again if everything still fits. ``"auto"`` only: ``"module"`` keeps every module a unit, and
``compile=True`` keeps blocks.

Blocks as units are also what ``torch.compile`` needs: a compiled block's submodules may
not run the engine's Python hooks inside the compiled graph.

Owns the choice of units and their params. Does not own what the hooks do (params/hooks.py),
nor the chunks (chunks/store.py).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable

from torch import nn


class HookUnits(enum.Enum):
    """``Config.hook_units``: what the hooks wrap."""

    AUTO = "auto"  # the default: blocks once the warm-up shows they fit (from the start when compiled, or on the CPU)
    MODULE = "module"  # every module


class UnitLayout(enum.Enum):
    """What the units are now (``Units.layout``); the hooks move between them between
    iterations (params/hooks.py)."""

    MODULES = "modules"  # every module is a unit
    BLOCKS = "blocks"  # each block that fits BLOCK_SHARE is one unit, every other module its own
    MODEL = "model"  # the model is the one unit ([Note: the model as one unit])


#: the largest share of the compute device's capacity the param chunks of one block may take
#: for the block to be one unit (the rest stays for activations, grads and the chunks coming next)
BLOCK_SHARE = 0.25

_CONTAINERS = (nn.ModuleList, nn.Sequential)


@dataclasses.dataclass
class Units:
    """The units of a model: each with the params it accesses, in module order; and which of
    them are blocks (whole subtrees as one unit)."""

    params: dict[nn.Module, list[nn.Parameter]]
    blocks: list[nn.Module]
    layout: UnitLayout

    @property
    def whole(self) -> bool:
        """The model is the one unit ([Note: the model as one unit])."""
        return self.layout is UnitLayout.MODEL


def choose_units(
    model: nn.Module,
    *,
    layout: UnitLayout,
    is_registered: Callable[[nn.Parameter], bool],
    chunk_bytes_of: Callable[[Iterable[nn.Parameter]], int],
    capacity_bytes: int | None,
) -> Units:
    """The units of ``model`` in ``layout``, in module order, each with the registered params
    it accesses (a param once per unit; a param tied between units is in each, as each
    module's own params are when every module is a unit). Under ``BLOCKS`` a block is a unit
    while the param chunks it touches (``chunk_bytes_of``) take at most ``BLOCK_SHARE`` of the
    compute device's ``capacity_bytes`` (None: no limit, computing on the CPU); under
    ``MODEL`` the model is the one unit, with every registered param once."""
    if layout is UnitLayout.MODEL:
        return Units({model: _registered(model, is_registered)}, [], layout)
    found: set[nn.Module] = set()
    if layout is UnitLayout.BLOCKS:
        limit = None if capacity_bytes is None else int(capacity_bytes * BLOCK_SHARE)
        _find_blocks(model, found, chunk_bytes_of, limit, is_registered)
    units: dict[nn.Module, list[nn.Parameter]] = {}
    _assign(model, model, found, units, {}, is_registered)
    return Units(units, [m for m in units if m in found], layout)


def blocks_fit(*, chunk_bytes: int, non_model_peak_bytes: int, capacity_bytes: int, margin_bytes: int) -> bool:
    """After the warm-up, with ``Config(hook_units="auto")``: whether the chunks the model
    computes with (``chunk_bytes``: its params, and its grads where they have chunks of their
    own) fit the compute device beside the warm-up's non-model peak, so blocks as units can
    never ask for more than the device holds."""
    return chunk_bytes + non_model_peak_bytes <= capacity_bytes - margin_bytes


def _registered(model: nn.Module, is_registered) -> list[nn.Parameter]:
    return [p for p in model.parameters() if is_registered(p)]


def _find_blocks(module, blocks, chunk_bytes_of, limit, is_registered) -> None:
    """Walk down from ``module``: an element of a container with submodules is a block when
    its param chunks fit ``limit``; otherwise look inside it."""
    for child in module.children():
        if isinstance(module, _CONTAINERS) and not isinstance(child, _CONTAINERS) and any(True for _ in child.children()):
            params = _registered(child, is_registered)
            if params and (limit is None or chunk_bytes_of(params) <= limit):
                blocks.add(child)
                continue
        _find_blocks(child, blocks, chunk_bytes_of, limit, is_registered)


def _assign(module, unit, blocks, units, seen_by_unit, is_registered) -> None:
    """Give ``module``'s own params to ``unit`` (itself when it is a unit), then recurse."""
    if module is unit or module in blocks or unit not in blocks:
        unit = module  # outside a block every module is a unit; a block is one
    own = units.setdefault(unit, [])
    seen = seen_by_unit.setdefault(unit, set())
    for p in module.parameters(recurse=False):
        if is_registered(p) and id(p) not in seen:
            seen.add(id(p))
            own.append(p)
    for child in module.children():
        _assign(child, unit, blocks, units, seen_by_unit, is_registered)
