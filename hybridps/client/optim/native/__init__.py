"""Native CPU kernels, compiled at first use (build.py) and called through ctypes, which lets
the GIL go for the length of a call.

Owns: loading each kernel once per process (thread-safe), its C prototypes, thin wrappers
that take torch tensors and pass their pointers, and the tables the compact Adam kernel reads
(``codebook``: one map's values and its quantizers' bucket tables, laid out as the C struct
``hps_codebook``), built from the map and its rounding thresholds and checked as they are
built. Does not own the maps or the rounding rule (moment_codes.py), the arithmetic's
specification nor the choice between a kernel and torch ops (compact_adam.py), compiling
(build.py), nor threads (a caller splits a range into pieces, one call each).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from hybridps.client.optim.moment_codes import MomentRow, bit_ranges, bucket_table, qmap, round_up_thresholds
from hybridps.client.optim.native import build

#: the kernel's ABI version (``hps_abi_version`` in compact_adam.c)
ABI_VERSION = 3
#: the order of the fp32 scalars a step takes (the H_* enum in compact_adam.c)
HYPER_FIELDS = ("lr", "lr_wd", "wd", "w1", "w2", "eps", "bc1", "bc2_sqrt", "scale_floor")
FLAG_DECOUPLED = 1
FLAG_MAXIMIZE = 2

HyperArray = ctypes.c_float * len(HYPER_FIELDS)


#: the SIMD quantizer tells apart the binades of exponent fields SIMD_MIN_EXPONENT .. + 31 per
#: sign (|x| in [2**-31, 2)); every smaller magnitude falls in the first (no threshold is there)
SIMD_MIN_EXPONENT = 96
SIMD_BINADES = 32
#: the most sub-buckets the SIMD quantizer's table holds (four 128-byte register lookups)
SIMD_SUB_BUCKETS = 512


def _code_of(thresholds: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The code of each value: the number of (finite, sorted) thresholds at or below it; NaN 0."""
    return torch.where(torch.isnan(values), 0, torch.searchsorted(thresholds, values, right=True))


def _binade_sub_buckets(thresholds: torch.Tensor, sign: int, binade: int) -> tuple[int, torch.Tensor]:
    """(shift, codes): the fewest mantissa bits (23 - shift) cutting binade ``binade`` of sign
    ``sign`` into sub-buckets of at most one threshold, and each sub-bucket's lowest code."""
    exponent = SIMD_MIN_EXPONENT + binade
    for kept in range(0, 24 if binade else 1):
        shift = 23 - kept
        j = torch.arange(1 << kept, dtype=torch.int64)
        first, last = (j << shift) | (exponent << 23), (((j + 1) << shift) - 1) | (exponent << 23)
        if binade == 0:  # every exponent up to SIMD_MIN_EXPONENT
            first = torch.zeros_like(first)
        sign_bit = torch.full_like(j, sign << 31)
        lowest, highest = bit_ranges(first | sign_bit, last | sign_bit, sign_bit != 0)
        codes = _code_of(thresholds, lowest)
        if int((_code_of(thresholds, highest) - codes).max()) <= 1:
            return shift, codes
    raise RuntimeError(f"binade {exponent} (sign {sign}) cannot be cut into sub-buckets of one threshold")


def _sub_bucket_tables(thresholds: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The SIMD quantizer's tables: int32 [2, 32] by (sign, binade): first sub-bucket | shift
    << 16; uint8 [512]: each sub-bucket's lowest code."""
    binades = torch.zeros(2, SIMD_BINADES, dtype=torch.int64)
    codes: list[torch.Tensor] = []
    count = 0
    for sign in (0, 1):
        for binade in range(SIMD_BINADES):
            shift, sub = _binade_sub_buckets(thresholds, sign, binade)
            binades[sign, binade] = count | (shift << 16)
            codes.append(sub)
            count += sub.numel()
    if count > SIMD_SUB_BUCKETS:
        raise RuntimeError(
            f"the {'signed' if signed else 'unsigned'} map needs {count} sub-buckets, more than {SIMD_SUB_BUCKETS}"
        )
    table = torch.zeros(SIMD_SUB_BUCKETS, dtype=torch.uint8)
    table[:count] = torch.cat(codes).to(torch.uint8)
    return binades.int(), table


def _planes(values: torch.Tensor) -> torch.Tensor:
    """uint8 [4, 256]: byte p (little-endian) of each of 256 fp32 values."""
    return values.contiguous().view(torch.uint8).view(256, 4).t().contiguous()


@functools.cache
def codebook(signed: bool) -> torch.Tensor:
    """One map's tables for the kernel: a CPU uint8 buffer laid out as ``hps_codebook`` in
    compact_adam.c, built from the map and its rounding thresholds (moment_codes.py). A value's
    code is the number of thresholds at or below it; both quantizers find the bucket the value
    lies in, take the code of the bucket's lowest value and add one if the value reaches the
    bucket's one threshold. Raises if a bucket would hold two thresholds (one comparison would
    not be exact). NaN gets code 0 (a quiet NaN's bucket reads 0 with no threshold; the
    division that scales a value never leaves a signalling NaN, whose bucket may be infinity's)."""
    table = qmap(signed)
    thresholds = round_up_thresholds(table)
    finite = thresholds[:255]
    binades, sub_buckets = _sub_bucket_tables(finite, signed)
    parts = [
        table.view(torch.uint8),
        bucket_table(signed).view(torch.uint8),
        _planes(table).view(-1),
        _planes(thresholds).view(-1),
        binades.view(-1).view(torch.uint8),
        sub_buckets,
    ]
    return torch.cat(parts)


class CompactAdamKernel:
    """``native/compact_adam.c`` loaded: the step over whole blocks of compact rows, and the
    quantizer alone (for tests)."""

    def __init__(self, lib: ctypes.CDLL, where: str):
        self.where = where
        if lib.hps_abi_version() != ABI_VERSION:
            raise OSError(f"{where}: ABI version {lib.hps_abi_version()}, expected {ABI_VERSION}")
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._step = lib.hps_compact_adam_step
        self._step.argtypes = [p, p, p, p, p, p, i64, i64, p, p, p, ctypes.c_int]
        self._step.restype = ctypes.c_int
        self._quantize = lib.hps_quantize_scaled
        self._quantize.argtypes = [p, i64, p, p, ctypes.c_int]
        self._quantize.restype = ctypes.c_int
        self._books = {signed: codebook(signed) for signed in (True, False)}  # kept alive: the kernel reads them
        if lib.hps_codebook_bytes() != self._books[True].numel():
            raise OSError(f"{where}: a codebook of {lib.hps_codebook_bytes()} bytes, built {self._books[True].numel()}")
        #: whether whole blocks take the AVX-512 VBMI path in this build (else the portable loops)
        self.simd = bool(lib.hps_uses_avx512())

    def step(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        m: MomentRow,
        v: MomentRow,
        start: int,
        end: int,
        hyper: ctypes.Array,
        flags: int,
    ) -> None:
        """Step elements [start, end) (``start`` on a block boundary) of CPU rows; the caller
        has checked the rows' devices, dtypes, lengths and contiguity."""
        rc = self._step(
            master.data_ptr(),
            grad.data_ptr(),
            m.codes.data_ptr(),
            m.scales.data_ptr(),
            v.codes.data_ptr(),
            v.scales.data_ptr(),
            start,
            end,
            self._books[m.signed].data_ptr(),
            self._books[v.signed].data_ptr(),
            ctypes.addressof(hyper),
            flags,
        )
        if rc != 0:
            raise ValueError(f"hps_compact_adam_step refused the range [{start}, {end})")

    def quantize_scaled(self, x: torch.Tensor, signed: bool, simd: bool = False) -> torch.Tensor:
        """uint8 codes of the fp32 CPU values ``x`` (already divided by their scales), by the
        portable quantizer or (``simd``, where the build has it) the SIMD one, which takes a
        multiple of 64 values, each NaN or at most 1 in magnitude."""
        x = x.detach().to(torch.float32).contiguous().view(-1)
        codes = torch.empty(x.numel(), dtype=torch.uint8)
        rc = self._quantize(x.data_ptr(), x.numel(), self._books[signed].data_ptr(), codes.data_ptr(), int(simd))
        if rc != 0:
            raise ValueError("the SIMD quantizer takes a multiple of 64 values, in a build that has it")
        return codes


_lock = threading.Lock()
_loaded: dict[str, tuple[CompactAdamKernel | None, str]] = {}


def load_compact_adam() -> tuple[CompactAdamKernel | None, str]:
    """The compact Adam kernel (built at first use) and where it was loaded from, or None and
    why it is unavailable. Tried once per process (see ``forget``)."""
    found = _loaded.get("compact_adam")
    if found is None:
        with _lock:
            found = _loaded.get("compact_adam")
            if found is None:
                lib, reason = build.build("compact_adam")
                try:
                    found = (CompactAdamKernel(lib, reason), reason) if lib is not None else (None, reason)
                except (OSError, AttributeError, RuntimeError) as exc:
                    found = (None, f"{reason}: {exc}")
                _loaded["compact_adam"] = found
    return found


def forget() -> None:
    """Forget the loaded kernels, so the next ``load_*`` tries again (tests)."""
    with _lock:
        _loaded.clear()
