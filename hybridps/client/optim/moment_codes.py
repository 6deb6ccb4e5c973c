"""The format of one compact (8-bit, blockwise quantized) Adam moment row, and its codes.

Owns: the 256-value maps (bitsandbytes' dynamic map, signed for the momentum, unsigned for
the variance), the byte layout of a row (``row_bytes``, ``MomentRow``: a code per element to
a whole block, then an fp32 scale per block), quantizing and dequantizing a row's blocks in
torch ops (any device; ``dequantize_codes`` for codes held outside a row), the rounding rule's thresholds (``round_up_thresholds``: the code
of a value is the number of thresholds at or below it) and the bucket table built from them
(``bucket_table``: a code in one lookup and one comparison), from which the native
kernel's tables are built too (native/__init__.py). Does not own the Adam step over rows
(compact_adam.py, native/compact_adam.c), nor where rows lie or how many bytes a chunk gives
them (the chunk store).

Codes and scales are exactly those of torchao's ``OptimState8bit`` (``quantize_8bit_with_qmap``
after ``scale_tensor``): a block's scale is its largest magnitude clipped to at least 1e-12,
``x = value / scale``, the code is the largest ``c`` with ``x >= qmap[c]`` (0 if none), then
rounded up to ``c + 1`` (at most 255) when ``x - qmap[c] >= (qmap[c + 1] - qmap[c]) * 0.5``.
"""

from __future__ import annotations

import threading

import torch

from hybridps.common.optimizer_states import BLOCK_ELEMENTS, SCALE_BYTES, block_count, compact_row_bytes
from hybridps.common.units import align_up

#: elements quantized or dequantized per round of torch ops (bounds the temporaries)
TILE_ELEMENTS = 1 << 20
#: the smallest scale (torchao's ``scale_tensor`` clips the block's absmax to this)
SCALE_FLOOR = 1e-12
#: blocks (and so scales) of a row of ``elements`` elements
scale_count = block_count
#: bytes of a compact row (common/optimizer_states.py, [Note: a compact moment row])
row_bytes = compact_row_bytes


def dynamic_map(signed: bool) -> list[float]:
    """The 256 values of bitsandbytes' dynamic quantization map (``max_exponent_bits=7``,
    ``total_bits=8``), sorted: fp32 values as Python floats.

    Reused, not designed here: bitsandbytes' ``create_dynamic_map``
    (https://github.com/TimDettmers/bitsandbytes/blob/dada530149212d64d4b69534716202659ef37ec8/bitsandbytes/functional.py#L339-L391)
    as torchao carries it (``torchao/optim/quant_utils.py``, BSD-3-Clause), down to its fp32
    ``linspace`` and means, so the values are the same bits. With 8 bits and 7 exponent bits
    the library's "additional items" are none, so that branch is left out."""
    max_exponent_bits, non_sign_bits = 7, 7  # torchao: total_bits - (1 if signed else 1)
    data: list[float] = []
    for i in range(max_exponent_bits):
        exponent = i + non_sign_bits - max_exponent_bits
        fraction_items = 2**exponent + 1 if signed else 2 ** (exponent + 1) + 1
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        decade = 10 ** (-(max_exponent_bits - 1) + i)
        data += (decade * means).tolist()
        if signed:
            data += (-decade * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    return sorted(data)


_qmaps: dict[tuple[bool, torch.device], torch.Tensor] = {}
_qmaps_lock = threading.Lock()


def _canonical(device: torch.device | str | None) -> torch.device:
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def qmap(signed: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """The map as an fp32 tensor on ``device`` (cached per map and device; do not write it)."""
    key = (bool(signed), _canonical(device))
    table = _qmaps.get(key)
    if table is None:
        with _qmaps_lock:
            table = _qmaps.get(key)
            if table is None:
                table = torch.tensor(dynamic_map(signed), dtype=torch.float32, device=key[1])
                _qmaps[key] = table
    return table


def quantize_scaled(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """uint8 codes of the fp32 values ``x`` (already divided by their scale) under the map
    ``table``: torchao's ``quantize_8bit_with_qmap`` written out (floor code, then its rounding
    rule), with one ``searchsorted`` in place of its 8-pass binary search (the same floor: the
    map's values are distinct and sorted). NaN gets code 0, as there. The rule as stated, for
    checks; rows quantize with ``quantize_bucketed``, the same codes in one lookup."""
    shape = x.shape
    x = x.reshape(-1)
    floor = torch.searchsorted(table, x, right=True).sub_(1).clamp_(min=0)
    floor.masked_fill_(torch.isnan(x), 0)
    up = (floor + 1).clamp_(max=255)
    val_down = table.index_select(0, floor)
    val_up = table.index_select(0, up)
    codes = torch.where((x - val_down) >= (val_up - val_down) * 0.5, up, floor)
    return codes.to(torch.uint8).view(shape)


def quantize_blocks(values: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of fp32 ``values`` whose length is a multiple of ``BLOCK_ELEMENTS``:
    torchao's ``scale_tensor`` then ``quantize_8bit_with_qmap`` (by ``quantize_bucketed``)."""
    blocks = values.view(-1, BLOCK_ELEMENTS)
    scales = blocks.abs().amax(-1).clip(SCALE_FLOOR)
    return quantize_bucketed(blocks / scales.view(-1, 1), signed).view(-1), scales


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, *, signed: bool) -> torch.Tensor:
    """fp32 values of loose ``codes`` (uint8, 1-D, block after block; the last block may be cut
    short) under their blocks' ``scales`` (fp32, one a block): ``qmap[code] * scale``, on the
    codes' device. What a row's ``dequantize`` computes, for codes held outside a row (a
    checkpoint's)."""
    if codes.dim() != 1 or scales.dim() != 1 or scale_count(codes.numel()) != scales.numel():
        raise ValueError(f"{codes.numel()} codes take {scale_count(codes.numel())} block scales, not {scales.numel()}")
    n = codes.numel()
    if n % BLOCK_ELEMENTS:
        codes = torch.cat([codes, codes.new_zeros(align_up(n, BLOCK_ELEMENTS) - n)])
    table = qmap(signed, codes.device)
    values = table.index_select(0, codes.int()).view(-1, BLOCK_ELEMENTS) * scales.to(codes.device, torch.float32).view(-1, 1)
    return values.view(-1)[:n]


class MomentRow:
    """A view of one compact moment row over a 1-D uint8 ``payload`` of ``row_bytes(elements)``
    bytes, on any device: ``codes`` (a uint8 per element, to a whole block), then ``scales``
    (an fp32 per block) at byte offset ``align_up(elements, BLOCK_ELEMENTS)``, then padding.
    ``signed`` picks the map: True for the momentum, False for the variance. An all-zero
    payload reads as all zeros (every scale 0)."""

    __slots__ = ("payload", "elements", "signed", "codes", "scales")

    def __init__(self, payload: torch.Tensor, elements: int, signed: bool):
        if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
            raise ValueError(
                f"a moment row's payload is a contiguous 1-D uint8 tensor, not {payload.dtype} {tuple(payload.shape)}"
            )
        if payload.numel() != row_bytes(elements):
            raise ValueError(f"a row of {elements} elements takes {row_bytes(elements)} bytes, the payload has {payload.numel()}")
        code_bytes = align_up(elements, BLOCK_ELEMENTS)
        if (payload.storage_offset() + code_bytes) % SCALE_BYTES:
            raise ValueError("a moment row's payload must start 4-byte aligned (its scales are fp32)")
        self.payload = payload
        self.elements = elements
        self.signed = bool(signed)
        self.codes = payload[:code_bytes]
        self.scales = payload[code_bytes : code_bytes + SCALE_BYTES * scale_count(elements)].view(torch.float32)

    @property
    def device(self) -> torch.device:
        return self.payload.device

    def qmap(self) -> torch.Tensor:
        return qmap(self.signed, self.payload.device)

    def _check_range(self, start: int, end: int) -> None:
        if start % BLOCK_ELEMENTS or not 0 <= start <= end <= self.elements:
            raise ValueError(
                f"range [{start}, {end}) of a {self.elements}-element row: start on a block boundary ({BLOCK_ELEMENTS}), inside the row"
            )

    def dequantize(self, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 values of elements [start, end) (``start`` on a block boundary): ``qmap[code] *
        scale``, into ``out`` if given."""
        self._check_range(start, end)
        if out is None:
            out = torch.empty(end - start, dtype=torch.float32, device=self.payload.device)
        table = self.qmap()
        for s in range(start, end, TILE_ELEMENTS):
            e = min(s + TILE_ELEMENTS, end)
            e_full = align_up(e, BLOCK_ELEMENTS)
            codes = self.codes[s:e_full].view(-1, BLOCK_ELEMENTS)
            scales = self.scales[s // BLOCK_ELEMENTS : e_full // BLOCK_ELEMENTS]
            values = table.index_select(0, codes.reshape(-1).int()).view(-1, BLOCK_ELEMENTS) * scales.view(-1, 1)
            out[s - start : e - start].copy_(values.view(-1)[: e - s])
        return out

    def quantize_into(self, start: int, values: torch.Tensor) -> None:
        """Write the fp32 ``values`` as elements [start, start + len) (``start`` on a block
        boundary). The blocks they cover are rewritten whole: elements of the last block
        beyond them become exact zeros, and its scale covers the given values only."""
        end = start + values.numel()
        self._check_range(start, end)
        values = values.reshape(-1)
        for s in range(start, end, TILE_ELEMENTS):
            e = min(s + TILE_ELEMENTS, end)
            e_full = align_up(e, BLOCK_ELEMENTS)
            tile = values[s - start : e - start]
            if e_full != e:
                tile = torch.cat([tile, tile.new_zeros(e_full - e)])
            codes, scales = quantize_blocks(tile.float(), self.signed)
            self.codes[s:e_full].copy_(codes)
            self.scales[s // BLOCK_ELEMENTS : e_full // BLOCK_ELEMENTS].copy_(scales)


def _sort_keys(bits: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering fp32 bit patterns (int32) as their values order (-0.0 and 0.0 alike)."""
    b = bits.long()
    return torch.where(b < 0, -(b & 0x7FFFFFFF), b)


def _from_keys(keys: torch.Tensor) -> torch.Tensor:
    bits = torch.where(keys < 0, (-keys) | (1 << 31), keys)
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).int().view(torch.float32)


def round_up_thresholds(table: torch.Tensor) -> torch.Tensor:
    """fp32 ``t[k]`` for k < 255: the smallest float ``x`` whose code is above ``k``, under the
    rounding rule in fp32 (``x - qmap[k] >= (qmap[k+1] - qmap[k]) * 0.5``), found by bisection
    over the floats. The rule is monotone in ``x``, so the code of ``x`` is the number of
    thresholds at most ``x`` (NaN: none, code 0). ``t[255]`` is NaN (no code above 255)."""
    low, high = table[:-1], table[1:]
    half = (high - low) * 0.5
    lo_key, hi_key = _sort_keys(low.view(torch.int32)), _sort_keys(high.view(torch.int32))
    while bool((hi_key - lo_key > 1).any()):  # invariant: rule false at lo, true at hi
        mid = (lo_key + hi_key) // 2
        ok = (_from_keys(mid) - low) >= half
        hi_key = torch.where(ok, mid, hi_key)
        lo_key = torch.where(ok, lo_key, mid)
    return torch.cat([_from_keys(hi_key), torch.tensor([float("nan")])])


def _as_float(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values of uint32 bit patterns held in int64."""
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).int().view(torch.float32)


def bit_ranges(bits_a: torch.Tensor, bits_b: torch.Tensor, negative: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lowest, highest) values of the floats whose bits (uint32 in int64) run from a to b: a
    negative range's lowest value is its largest bits."""
    a, b = _as_float(bits_a), _as_float(bits_b)
    return torch.where(negative, b, a), torch.where(negative, a, b)


_bucket_tables: dict[tuple[bool, torch.device], torch.Tensor] = {}
_bucket_tables_lock = threading.RLock()  # a device's table is the CPU's, built under the same lock


def bucket_table(signed: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """The map's codes by bucket, for quantizing in one lookup: 2**16 int32 indexed by a float's
    top 16 bits (sign, exponent, 7 mantissa bits). The low byte is the code of the bucket's
    lowest value; the bits above are the key (low 16 bits, reversed for negatives, so keys order
    as values do) of the one threshold inside the bucket, 0x10000 if none. A value's code is the
    low byte, plus one if its key reaches the threshold's (``quantize_bucketed``). A quiet NaN's
    bucket reads code 0 and no threshold (dividing by a scale never leaves a signalling NaN,
    whose bucket may be infinity's). Raises if a bucket would hold two thresholds: one
    comparison would then not be exact. Cached per map and device; do not write it."""
    key = (bool(signed), _canonical(device))
    table = _bucket_tables.get(key)
    if table is None:
        with _bucket_tables_lock:
            if key not in _bucket_tables:
                cpu = _bucket_table(signed) if key[1].type == "cpu" else bucket_table(signed)
                _bucket_tables[key] = cpu.to(key[1])
            table = _bucket_tables[key]
    return table


def _bucket_table(signed: bool) -> torch.Tensor:
    thresholds = round_up_thresholds(qmap(signed))[:255]
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    lowest, highest = bit_ranges(top, top | 0xFFFF, top >= 1 << 31)
    code_low = torch.where(torch.isnan(lowest), 0, torch.searchsorted(thresholds, lowest, right=True))
    code_high = torch.where(torch.isnan(highest), 0, torch.searchsorted(thresholds, highest, right=True))
    spread = torch.where(torch.isnan(lowest) | torch.isnan(highest), 0, code_high - code_low)
    if int(spread.max()) > 1:
        raise RuntimeError(
            f"bucket {int(spread.argmax()):#06x} of the {'signed' if signed else 'unsigned'} map holds two thresholds"
        )
    inside = thresholds[code_low.clamp(max=254)].view(torch.int32).long() & 0xFFFFFFFF
    threshold_key = torch.where((inside >> 31) == 1, (inside & 0xFFFF) ^ 0xFFFF, inside & 0xFFFF)
    return (code_low | (torch.where(spread == 1, threshold_key, 0x10000) << 8)).int()


def quantize_bucketed(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 codes of the fp32 values ``x`` (already divided by their scale), as
    ``quantize_scaled`` gives them (torchao's), by one lookup in ``bucket_table`` and one
    comparison: several times faster on the CPU, where ``searchsorted`` is slow."""
    bits = x.reshape(-1).view(torch.int32)
    entry = bucket_table(signed, x.device).index_select(0, (bits >> 16) & 0xFFFF)
    low = bits & 0xFFFF
    key = torch.where(bits < 0, low ^ 0xFFFF, low)
    codes = (entry & 0xFF) + (key >= (entry >> 8))
    return codes.to(torch.uint8).view(x.shape)
