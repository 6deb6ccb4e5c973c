"""Values read of meta tensors while the planner simulates another optimizer than Adam.

Owns ``stand_in_meta_values()``, a dispatch mode in which reading a meta tensor's value (its
``.item()``, a Python ``float()`` or ``bool()`` of it: ATen's ``_local_scalar_dense``) gives
a stand-in value instead of raising; ``simulation.simulate`` enters it around the simulated
iterations of an optimizer the chunked Adam's kernels do not step. Nothing outside that block
or in other threads is changed, and every other op runs as it would.

[Note: values read during a simulated step]
Most of torch's optimizers step with tensor ops alone, but some read a value into Python
within their step: Adafactor the norm of the param (``param.norm(2).item()``), ASGD its
``eta`` and ``mu`` states, NAdam its ``mu_product`` (``torch.optim.optimizer._get_value``),
each a tensor on the param's device, which under ``simulate="meta"`` is the meta device, whose
tensors have no values. The step's memory does not depend on those values (the chunk rows
are laid out before it runs, and its temporaries are shaped like its params whatever their
values), so the simulation gives the step a stand-in: 0.5 for a floating value (no 0 to
divide by, no 1 to take from 1 and divide by: NAdam's ``1 - mu_product``), 1 for an
integer, False for a truth value. The stand-in feeds only Python arithmetic the simulated
step does, whose results land in meta tensors again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READ = torch.ops.aten._local_scalar_dense.default


def _stand_in(t: torch.Tensor) -> bool | int | float | complex:
    """The value a read of meta tensor ``t`` gives (see [Note: values read during a simulated step])."""
    if t.dtype is torch.bool:
        return False
    if t.dtype.is_complex:
        return complex(0.5)
    if t.dtype.is_floating_point:
        return 0.5
    return 1


class _StandInMetaValues(TorchDispatchMode):
    """The dispatch mode of ``stand_in_meta_values``."""

    def __init__(self) -> None:
        super().__init__()
        #: the meta values read so far
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _READ and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            self.reads += 1
            return _stand_in(args[0])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def stand_in_meta_values() -> Iterator[_StandInMetaValues]:
    """Within this block (in this thread), reading a meta tensor's value gives a stand-in
    instead of raising (see [Note: values read during a simulated step])."""
    mode = _StandInMetaValues()
    with mode:
        yield mode
