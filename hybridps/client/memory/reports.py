"""The mover's sentences: no room on a device, out of memory (activations, or CUDA after
evicting), the memory report.

Owns: the wording of what a full device says, built from plain figures (bytes, counts, names),
so the sentences can be read and tested without a mover. Does not own: the figures themselves
(the mover counts its chunks; the trace gives the non-model bytes) or when to raise (the mover).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence, Sized

from hybridps.common.units import format_bytes


@dataclasses.dataclass(frozen=True)
class DeviceLine:
    """One device's line of the memory report."""

    name: str
    capacity_bytes: int
    chunks: int
    computing: int
    used_bytes: int
    non_model_bytes: int


def memory_report(lines: Sequence[DeviceLine]) -> str:
    out = ["memory report:"]
    for d in lines:
        out.append(
            f"  {d.name:8s} capacity {format_bytes(d.capacity_bytes):>11s}  chunks {d.chunks:4d} "
            f"({d.computing} COMPUTE) {format_bytes(d.used_bytes):>11s}  non-model "
            f"{format_bytes(d.non_model_bytes):>11s}"
        )
    return "\n".join(out)


def no_room_message(
    device: str,
    *,
    size_bytes: int,
    budget_bytes: int,
    who: object,
    used_bytes: int,
    parts: Sequence[tuple[Sized, str]],
    capacity_bytes: int,
    non_model_bytes: int,
    margin_bytes: int,
    report: str,
) -> str:
    """A device has no room for ``size_bytes`` more even after evicting what may go; ``parts``
    are the chunks that may not go, each with what holds them."""

    def part(chunks, what: str) -> str:
        return f"{len(chunks)} {what}, {format_bytes(sum(c.nbytes for c in chunks))}"

    where = f" for {who}" if who else ""
    return (
        f"{device} has no room{where}: needs {format_bytes(size_bytes)} ({size_bytes} B) more, chunks in use there hold "
        f"{format_bytes(used_bytes)} ({'; '.join(part(chunks, what) for chunks, what in parts)}), budget now "
        f"{format_bytes(budget_bytes)} = capacity {format_bytes(capacity_bytes)} - non-model {format_bytes(non_model_bytes)}"
        f" - margin {format_bytes(margin_bytes)}. Raise the capacity of {device}, lower chunk_size, or "
        f"reduce activations (smaller batch, activation checkpointing).\n{report}"
    )


def out_of_memory_message(
    device: str,
    *,
    who: str,
    staying_bytes: int,
    non_model_bytes: int,
    computing: int,
    held: int,
    capacity_bytes: int,
    report: str,
) -> str:
    """The activations of a moment do not fit beside the chunks that must stay on ``device``."""
    total_bytes = staying_bytes + non_model_bytes
    return (
        f"{device} is out of memory: no room for {who}. The activations saved for backward (non-model memory) "
        f"would hold {format_bytes(non_model_bytes)} ({non_model_bytes} B) while the chunks that must stay there "
        f"({computing} in COMPUTE, {held} under a collective) hold {format_bytes(staying_bytes)} ({staying_bytes} B): "
        f"{format_bytes(total_bytes)} ({total_bytes} B) in all, over the capacity of {device}, "
        f"{format_bytes(capacity_bytes)} ({capacity_bytes} B), even with every other chunk evicted; on a "
        f"GPU of that size this is a CUDA out-of-memory error. Give {device} more capacity, use a smaller batch or "
        f"shorter sequences, or checkpoint activations (torch.utils.checkpoint) so fewer of them are kept for "
        f"backward.\n{report}"
    )


def cuda_out_of_memory_message(device: str, *, what: str, error: BaseException, report: str) -> str:
    """CUDA ran out of memory on ``device`` for ``what`` (other processes, fragmentation,
    activations beyond the trace) and again after every chunk not in use was evicted."""
    return f"CUDA out of memory on {device} for {what} even after evicting every chunk not in use. {error}\n{report}"
