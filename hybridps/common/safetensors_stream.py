"""A safetensors file written one tensor at a time.

Owns the file's layout as it is written: the tensors' bytes in the order given, each written
as it is added, and the header (names, dtypes, shapes, offsets, metadata) written last into
room kept for it at the file's start. Does not own what is written or where from (the
checkpoint, checkpoint.py) nor reading (safetensors' own ``safe_open``).

[Note: a checkpoint streamed]
safetensors' ``save_file`` takes every tensor at once. A checkpoint of the model the host
holds at its edge cannot gather that: the largest GPT for one H200 (17.23 B params) keeps
119 GB of chunks in 125 GiB of host memory, and its fp32 weights (69 GB) and Adam states (138
GB) gathered beside them would take the process down, losing the run a checkpoint is meant
to keep. The library has no writer that takes tensors one by one, so this one does, in the
format its reader checks: an 8-byte little-endian header length, the header (JSON: each
tensor's dtype, shape and ``data_offsets`` into the buffer, ``__metadata__``) padded with
spaces, then the buffer, the tensors back to back in offset order. The header's room is kept
from an estimate given up front (``header_room``); a header that outgrows it is written to a
new file, followed by the buffer copied over in blocks, which then takes the file's name. The
host holds one tensor at a time, never the file's content.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from hybridps.common.errors import ConfigError

#: torch dtype -> safetensors' name for it
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
#: header bytes kept per tensor by default: its name and its entry (dtype, shape, offsets)
ROOM_PER_TENSOR = 160
#: the block a header that outgrew its room moves the buffer by
COPY_BLOCK_BYTES = 64 << 20


def header_room(names: int, name_bytes: int, metadata: dict[str, str] | None = None) -> int:
    """Header bytes to keep for ``names`` tensors whose names take ``name_bytes`` together."""
    meta = len(json.dumps(metadata or {})) + 32
    return 8 * ((names * ROOM_PER_TENSOR + name_bytes + meta + 7) // 8)


class SafetensorsWriter:
    """One safetensors file, its tensors written as they are added (``add``), its header at
    ``close``. Names are unique; the buffer's order is the order of ``add``."""

    def __init__(self, path: str | os.PathLike, *, room_bytes: int, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.room_bytes = int(room_bytes)
        self.metadata = dict(metadata or {})
        #: name -> its header entry, in the order added
        self.entries: dict[str, dict] = {}
        self.nbytes = 0  # the buffer's bytes so far
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close(), which the caller reaches in a finally)
        self._file.seek(8 + self.room_bytes)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (any device; copied to the host if it is not there) as ``name``."""
        if name in self.entries:
            raise ConfigError(f"{self.path.name}: tensor {name!r} written twice")
        dtype = DTYPES.get(tensor.dtype)
        if dtype is None:
            held = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
            raise ConfigError(
                f"{self.path.name}: tensor {name!r} is {tensor.dtype}, which safetensors files here do not hold; "
                f"keep it as one of {held}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self.entries[name] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [self.nbytes, self.nbytes + data.nbytes],
        }
        self.nbytes += data.nbytes

    def close(self) -> None:
        """Write the header into its room (or, where it outgrew it, a new file ahead of the
        buffer); the file is complete and its bytes on their way to the disk (not fsynced)."""
        header = json.dumps({"__metadata__": self.metadata, **self.entries}, separators=(",", ":")).encode()
        if len(header) <= self.room_bytes:
            self._file.seek(0)
            self._file.write(struct.pack("<Q", self.room_bytes) + header + b" " * (self.room_bytes - len(header)))
            self._file.close()
            return
        self._file.close()
        room = 8 * ((len(header) + 7) // 8)
        moved = self.path.with_name(self.path.name + ".header")
        with open(self.path, "rb") as src, open(moved, "wb") as dst:
            dst.write(struct.pack("<Q", room) + header + b" " * (room - len(header)))
            src.seek(8 + self.room_bytes)
            while block := src.read(COPY_BLOCK_BYTES):
                dst.write(block)
        os.replace(moved, self.path)

    def abandon(self) -> None:
        """Close the file unfinished (a save that failed: the file is not a checkpoint's)."""
        self._file.close()
