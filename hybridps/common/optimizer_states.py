"""How the optimizer's moments are stored: exact fp32, or compact 8-bit rows (``Config.optimizer_states``).

Owns the names of the formats, the byte arithmetic of a moment row in each (what the chunk
store allocates, the registration's fit check, the planner and the figures count) and the
layout rule the compact format needs of the chunks (slot offsets on block boundaries). Does
not own the codes themselves, quantizing or the step over them (client/optim/moment_codes.py,
client/optim/compact_adam.py), nor where rows lie (the mover).

[Note: a compact moment row]
Under ``optimizer_states="int8"`` a chunk's momentum and its variance are each one row of
``uint8``: a code per element (an index into a 256-value map: a signed dynamic map for the
momentum, an unsigned one for the variance, as bitsandbytes' and torchao's 8-bit Adam), then
one fp32 scale per block of ``BLOCK_ELEMENTS`` elements (the block's largest magnitude),
padded to ``ROW_ALIGN_BYTES``. Every tensor starts on a block boundary (the layout aligns
slots to ``BLOCK_ELEMENTS``), so a block never mixes two tensors: a tensor's blocks are its
own, as they are under those libraries, and reading or writing one tensor's state touches
no other's. 2 x (1 + 4/256) B a param instead of 8: model data of mixed precision with grad
reuse goes from 14 B/param to 6 + 2.03 = 8.03 B/param.
"""

from __future__ import annotations

import enum
import math

from hybridps.common.units import align_up


class OptimizerStates(enum.Enum):
    """The storage of Adam's momentum and variance."""

    FP32 = "fp32"  # exact: the same bits as torch's Adam
    INT8 = "int8"  # blockwise 8-bit codes with a per-block scale (see [Note: a compact moment row])

    __hash__ = object.__hash__

    @property
    def compact(self) -> bool:
        return self is OptimizerStates.INT8


#: the names ``Config.optimizer_states`` takes
OPTIMIZER_STATES = tuple(s.value for s in OptimizerStates)
#: elements sharing one scale in a compact row (torchao's and bitsandbytes' block size)
BLOCK_ELEMENTS = 256
#: bytes of one block's scale (fp32)
SCALE_BYTES = 4
#: a compact row's bytes are a multiple of this (cache lines)
ROW_ALIGN_BYTES = 64


def parse_optimizer_states(value: object) -> OptimizerStates:
    """``value`` (a name or the enum) as an ``OptimizerStates``; a ValueError naming the choices."""
    if isinstance(value, OptimizerStates):
        return value
    for states in OptimizerStates:
        if value == states.value:
            return states
    raise ValueError(f"optimizer_states={value!r}; use one of {', '.join(repr(v) for v in OPTIMIZER_STATES)}")


def block_count(elements: int) -> int:
    """Blocks (scales) of a compact row of ``elements`` elements."""
    return -(-elements // BLOCK_ELEMENTS)


def compact_row_bytes(elements: int) -> int:
    """Bytes of one compact moment row of ``elements`` elements: a code per element (to a
    whole block), a scale per block, padded to ``ROW_ALIGN_BYTES``."""
    blocks = block_count(elements)
    return align_up(blocks * BLOCK_ELEMENTS + blocks * SCALE_BYTES, ROW_ALIGN_BYTES)


def layout_alignment(alignment: int, states: OptimizerStates) -> int:
    """The offsets the chunk layout puts tensors at: ``alignment``, and under compact states
    a whole block as well (see [Note: a compact moment row])."""
    return math.lcm(alignment, BLOCK_ELEMENTS) if states.compact else alignment
