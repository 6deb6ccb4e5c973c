"""The measured rates of a machine that the speed model turns bytes and FLOPs into seconds.

Owns ``MachineRates`` (the rates and where each came from), its JSON form, the named
profiles shipped with the package (``profiles/h100.json``, ``profiles/h200.json``: rates
taken from the figures recorded in docs/BENCHMARKS.md), where a calibration is stored
(``stored_rates_path``: ``$HYBRIDPS_RATES`` or ``~/.cache/hybridps/rates.json``) and how a
``--rates`` argument is resolved (``load_rates``).

[Note: a rate between token counts]
``hybridps calibrate`` times a block at 128 and 1024 tokens (a micro-batch's rows). A step of
a block takes a fixed time (its weights read, their grads written, each kernel's launch) and
a time a token, so its rate ``n / (a + b n)`` rises steeply over the first hundreds of tokens
and then flattens; a line in log(n) between the two ends reads it low in between. On the VM
(fp32, one thread) a block of hidden size 1024 ran 102-105 GFLOPS at 128 tokens, 149 at 512
and 149-153 at 1024: the line gave 134 at 512, the affine time 140. A 3 x 768 GPT at 512
tokens read 1.156x its step, 1.125x between token counts so; a 768-wide ``hybridps train``
run 1.10-1.15x. Between the hidden sizes the rates stay linear in log(hidden).

Does not own measuring the rates (``calibrate``) or the prediction (``speed``). Imports no
torch: the ``hybridps`` command line builds its parsers without it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from hybridps.common.errors import ConfigError
from hybridps.planner.defaults import PRECISION_NAMES
from hybridps.planner.optimizers import ADAM_KERNEL_OPTIMIZERS, MATMUL_OPTIMIZERS, OPTIMIZER_NAMES

#: the environment variable naming the stored calibration's file
RATES_ENV = "HYBRIDPS_RATES"
#: the profiles shipped in ``hybridps/planner/profiles/``
PROFILE_NAMES = ("h100", "h200")
#: ``--rates`` name of the stored calibration
THIS_MACHINE = "this-machine"
#: the op whose seconds a byte an op the rates did not time costs (a copy); ``hybridps
#: calibrate`` always times it (calibrate_elementwise.py)
FALLBACK_OP = "clone"
#: the fields that map a precision or an optimizer to its rows (a JSON object of lists)
KEYED_TABLES = (
    "precision_speed",
    "precision_head_speed",
    "attention_tflops",
    "attention_forward_share",
    "optimizer_speed",
    "elementwise_s_per_byte",
)
#: the version of the JSON layout
RATES_FORMAT = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class MachineRates:
    """What one machine does per second, for the speed model (``speed.predict_speed``).

    GB/s are 1e9 B/s; params/s count fp32 params of an optimizer row."""

    name: str
    #: the machine in words (GPU, host cores)
    device: str
    #: True: the "GPU" is simulated (its chunks in host memory, its compute the CPU's), so
    #: compute, copies, Python and the CPU step share the host's cores and add up
    simulated_gpu: bool
    #: (hidden size, TFLOPS) ascending: the rate a training step's compute reaches at that
    #: hidden size, FLOPs counted as ``speed.step_flops`` counts them (recompute included)
    compute_tflops: tuple[tuple[int, float], ...]
    #: (hidden size, tokens a micro-batch, TFLOPS): the same rate at several token counts
    #: (a small micro-batch gives every matmul few rows and runs slower a FLOP); () where
    #: not measured (the shipped profiles): ``compute_tflops`` at any token count
    compute_tflops_by_tokens: tuple[tuple[int, int, float], ...] = ()
    #: the precision ``compute_tflops``, ``compute_tflops_by_tokens`` and ``head_s_per_logit``
    #: were timed in; "" (rates stored before it was recorded): what ``hybridps calibrate``
    #: timed then, bf16 on a real GPU and fp32 on a simulated one
    compute_precision: str = ""
    #: precision -> ((hidden size, tokens a micro-batch, speed), ...): how much faster the same
    #: one-block step computes in that precision than in ``compute_precision`` ([Note: compute
    #: by precision] in speed.py); a precision not here was not timed, and computes at
    #: ``compute_precision``'s rates
    precision_speed: Mapping[str, tuple[tuple[int, int, float], ...]] = dataclasses.field(default_factory=dict)
    #: precision -> ((hidden size, tokens a micro-batch, speed), ...): the same for the head
    #: (``head_s_per_logit``); rows of (hidden size, speed), stored before the tokens were
    #: timed, hold at any token count
    precision_head_speed: Mapping[str, tuple[tuple[int, int, float], ...]] = dataclasses.field(default_factory=dict)
    #: precision -> ((head size, sequence, TFLOPS), ...): causal attention's forward and
    #: backward, timed apart ([Note: attention apart] in calibrate_attention.py). Where the
    #: rates' own precision is here, the compute tables above are the blocks' rates *without*
    #: their attention (``6 N T`` FLOPs), and the speed model adds the attention at these
    #: rates; empty (the shipped profiles, rates stored before it was timed): the compute
    #: tables include it, at the sequence they were timed at
    attention_tflops: Mapping[str, tuple[tuple[int, int, float], ...]] = dataclasses.field(default_factory=dict)
    #: precision -> ((head size, sequence, share), ...): the attention's forward alone over its
    #: forward and backward, in seconds (what checkpointing recomputes); not here: a third (its
    #: FLOPs' share)
    attention_forward_share: Mapping[str, tuple[tuple[int, int, float], ...]] = dataclasses.field(default_factory=dict)
    #: host -> GPU and GPU -> host over pinned memory (simulated GPU: a host memcpy)
    h2d_gbps: float
    d2h_gbps: float
    #: torch's fused AdamW over fp32 rows on the host's cores
    cpu_adam_params_per_s: float
    #: the compact (int8 moments) step, ``compact_adam_``
    cpu_compact_adam_params_per_s: float
    #: the two dtype copies of a 16-bit CPU step (grads to fp32, the master back), per param
    cpu_cast_params_per_s: float
    #: a chunk's optimizer step on the GPU (fused AdamW, its casts included)
    gpu_adam_params_per_s: float
    #: optimizer name (``optimizers.OPTIMIZER_NAMES``, not the chunked Adam's) -> ((side of the
    #: square matrices timed, its CPU step's speed over ``cpu_adam_params_per_s``), ...)
    #: ([Note: every optimizer's step] in calibrate_optimizers.py; read by
    #: ``optimizer_speed_at``); an optimizer not here steps at fused AdamW's rate and the
    #: prediction says so
    optimizer_speed: Mapping[str, tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=dict)
    #: precision -> ((op, seconds a byte it reads and writes), ...): the kernels outside the
    #: matmuls, each timed alone ([Note: the work outside the matmuls] in op_tally.py); read
    #: for what a family other than the GPT does there beyond the GPT of its shape
    #: (``elementwise_seconds``); empty (the shipped profiles, rates stored before): not counted
    elementwise_s_per_byte: Mapping[str, tuple[tuple[str, float], ...]] = dataclasses.field(default_factory=dict)
    #: a kernel's fixed seconds beyond its bytes (launch and dispatch)
    elementwise_s_per_call: float = 0.0
    #: a 3 x 3 convolution's TFLOPS, forward and backward, in ``compute_precision``: a model's
    #: convolutions ([Note: a model's own shape] in counted_work.py); None (the shipped
    #: profiles, rates stored before): at the block rate, and the prediction says so
    conv_tflops: float | None = None
    #: precision -> ((width, TFLOPS), ...) of a LoRA adapter's pair of matmuls (hidden -> width
    #: -> hidden), forward and backward, at the widths timed: a model's narrow matmuls ([Note:
    #: narrow matmuls] in counted_work.py); empty (the shipped profiles, rates stored before):
    #: at the block rate, and the prediction says so
    narrow_tflops: Mapping[str, tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=dict)
    #: seconds a byte of a new tensor costs beyond the op's own: memory the allocator maps
    #: afresh, each page faulted in and zeroed on its first write (a CPU's; a GPU's caching
    #: allocator hands out memory it holds: nothing)
    elementwise_new_s_per_byte: float = 0.0
    #: the share of a step's new tensors' bytes the allocator does take afresh (pages faulted
    #: in), measured on a small GPT's steps ([Note: a step's fresh memory] in
    #: calibrate_elementwise.py); 1.0 (rates stored before): every byte
    elementwise_new_fresh_share: float = 1.0
    #: host time per param tensor per micro-batch: HybridPS's hooks, chunk accesses and the
    #: op launches of forward and backward (on a real GPU it runs beside the GPU's kernels)
    host_s_per_tensor: float
    #: host time per hook unit beyond the first per micro-batch: the hooks' calls, the tracer's
    #: tick, the accesses and releases of a unit ([Note: host time by hook unit] in speed.py);
    #: 0 where not measured (the shipped profiles, rates stored before)
    host_s_per_unit: float = 0.0
    #: Python per chunk stepped on the CPU (taking its rows, the kernel calls)
    cpu_step_s_per_chunk: float = 0.0
    #: (hidden size, vocabulary, seconds per logit): a language model outside its blocks
    #: (embedding, final norm, tied projection to the vocabulary, fp32 cross-entropy), forward
    #: and backward, per token and vocabulary entry; () where not measured (the shipped
    #: profiles): the head's FLOPs then count at ``compute_tflops`` ([Note: the head apart] in
    #: speed.py)
    head_s_per_logit: tuple[tuple[int, int, float], ...] = ()
    #: the disk tier's sustained read and write; None: not measured (the node's figures apply)
    disk_read_gbps: float | None = None
    disk_write_gbps: float | None = None
    #: the collectives between the ranks of one node, per rank: the bytes a rank sends in a
    #: ring all-gather (``(S - 1) / S`` of the gathered tensor) or reduce-scatter over their
    #: seconds (NCCL's "bus bandwidth"), through the transport the engine uses there (NCCL
    #: between GPUs; between the CPU tensors of a simulated GPU, the shared-memory link);
    #: None: not measured (one GPU, or the shipped profiles): a multi-rank prediction then
    #: needs ``hybridps plan --node-gbps``
    node_gather_gbps: float | None = None
    node_reduce_gbps: float | None = None
    #: a collective's fixed time among a node's ranks beyond its bytes (the wake-ups and
    #: hand-offs of a small chunk's collective)
    node_collective_s: float = 0.0
    #: the same between nodes (the slowest link a ring crossing nodes takes); one node cannot
    #: measure it: ``hybridps plan --network-gbps`` gives it
    network_gbps: float | None = None
    #: copies between the GPU and pageable host memory (a chunk on the CPU outside the arena's
    #: page-locked slots: beyond its cap, an optimizer row the forward pushes down), each way;
    #: such a copy runs on the calling thread. None: not measured (the move's bytes then count
    #: at the pinned rates, with the others)
    pageable_h2d_gbps: float | None = None
    pageable_d2h_gbps: float | None = None
    #: seconds a GiB of host arena segment takes to map and page-lock (``mmap``, first touch,
    #: ``cudaHostRegister``), and to unpin and let go (``cudaHostUnregister``, ``munmap``), on
    #: the calling thread; None: not measured (nothing counted)
    arena_grow_s_per_gib: float | None = None
    arena_release_s_per_gib: float | None = None
    #: torch's intra-op threads when measured: on a simulated GPU the compute, the copies and
    #: the CPU step all ran on them (None: not recorded, as in the shipped GPU profiles)
    host_threads: int | None = None
    #: when and how the rates were measured
    measured: str = ""
    #: field -> where its value comes from (a command, a figure of docs/BENCHMARKS.md)
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        table = tuple(sorted((int(h), float(t)) for h, t in self.compute_tflops))
        if not table or any(h < 1 or not t > 0 for h, t in table):
            raise ConfigError(f"rates {self.name!r}: compute_tflops needs (hidden size, TFLOPS > 0) pairs, got {table!r}")
        object.__setattr__(self, "compute_tflops", table)
        for f, what in (("compute_tflops_by_tokens", "tokens, TFLOPS"), ("head_s_per_logit", "vocabulary, seconds")):
            rows = getattr(self, f)
            grid = _grid(rows, 3) if rows else ()
            if grid is None:
                raise ConfigError(f"rates {self.name!r}: {f} needs (hidden size, {what} > 0) triples, got {rows!r}")
            object.__setattr__(self, f, grid)
        self._check_tables()
        for f in (
            "h2d_gbps",
            "d2h_gbps",
            "cpu_adam_params_per_s",
            "cpu_compact_adam_params_per_s",
            "cpu_cast_params_per_s",
            "gpu_adam_params_per_s",
        ):
            _check_positive(self.name, f, getattr(self, f))
        for f in (
            "host_s_per_tensor",
            "host_s_per_unit",
            "cpu_step_s_per_chunk",
            "node_collective_s",
            "elementwise_s_per_call",
            "elementwise_new_s_per_byte",
            "elementwise_new_fresh_share",
        ):
            value = getattr(self, f)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ConfigError(f"rates {self.name!r}: {f}={value!r} must be seconds >= 0")
        for f in (
            "disk_read_gbps",
            "disk_write_gbps",
            "node_gather_gbps",
            "node_reduce_gbps",
            "network_gbps",
            "pageable_h2d_gbps",
            "pageable_d2h_gbps",
            "conv_tflops",
            "arena_grow_s_per_gib",
            "arena_release_s_per_gib",
        ):
            if getattr(self, f) is not None:
                _check_positive(self.name, f, getattr(self, f))

    def _check_tables(self) -> None:
        """The rates' own precision, and every table keyed by a precision or an optimizer."""
        base = self.compute_precision or ("fp32" if self.simulated_gpu else "bf16")
        if base not in PRECISION_NAMES:
            raise ConfigError(f"rates {self.name!r}: compute_precision={base!r}; use one of {', '.join(PRECISION_NAMES)}")
        object.__setattr__(self, "compute_precision", base)
        legacy = {  # head rows stored before the tokens were timed, (hidden size, speed): at any count
            k: [(row[0], 1, row[1]) for row in rows] if rows and all(len(row) == 2 for row in rows) else rows
            for k, rows in dict(self.precision_head_speed).items()
        }
        object.__setattr__(self, "precision_head_speed", legacy)
        others = tuple(n for n in OPTIMIZER_NAMES if n not in ADAM_KERNEL_OPTIMIZERS)
        for f, keys, what, parse in (
            ("precision_speed", PRECISION_NAMES, "(hidden size, tokens, speed > 0)", lambda rows: _grid(rows, 3)),
            ("precision_head_speed", PRECISION_NAMES, "(hidden size, tokens, speed > 0)", lambda rows: _grid(rows, 3)),
            ("attention_tflops", PRECISION_NAMES, "(head size, sequence, TFLOPS > 0)", lambda rows: _grid(rows, 3)),
            ("attention_forward_share", PRECISION_NAMES, "(head size, sequence, share in (0, 1])", _share_grid),
            ("optimizer_speed", others, "(matrix side, speed > 0)", lambda rows: _grid(rows, 2)),
            ("elementwise_s_per_byte", PRECISION_NAMES, "(op, seconds a byte >= 0)", _op_table),
            ("narrow_tflops", PRECISION_NAMES, "(width, TFLOPS > 0)", lambda rows: _grid(rows, 2)),
        ):
            tables = self._keyed_tables(f, keys, what, parse)
            if f.startswith("precision_"):  # the precision timed needs no speed over itself
                tables.pop(base, None)
            object.__setattr__(self, f, tables)

    def _keyed_tables(self, field: str, keys: tuple[str, ...], what: str, parse: Any) -> dict[str, tuple]:
        """``field``'s mapping of a key of ``keys`` to its rows as ``parse`` reads them (None:
        not ``what`` rows); a ``ConfigError`` naming the field otherwise."""
        tables = {}
        for key, rows in dict(getattr(self, field)).items():
            table = parse(rows)
            if key not in keys or table is None:
                raise ConfigError(
                    f"rates {self.name!r}: {field}[{key!r}] needs one of {', '.join(keys)} and {what} rows, got {rows!r}"
                )
            tables[key] = table
        return tables

    def optimizer_speed_at(self, optimizer: str, hidden: int) -> float | None:
        """``optimizer``'s CPU step speed over fused AdamW's for a model of ``hidden``: 1 for the
        chunked Adam's; another's timed speed, linear in log(side) between the sides timed,
        flat below them and beyond the largest, but for Muon falling in proportion to
        ``hidden`` beyond the largest where several were timed (its FLOPs an element grow with
        the side, its matmuls' rate no more); None where the rates did not time it."""
        if optimizer in ADAM_KERNEL_OPTIMIZERS:
            return 1.0
        rows = self.optimizer_speed.get(optimizer)
        if rows is None:
            return None
        if len(rows) > 1 and hidden > rows[-1][0] and optimizer in MATMUL_OPTIMIZERS:
            return rows[-1][1] * rows[-1][0] / hidden
        return _log_interpolate(rows, hidden, below="flat")

    def conv_tflops_at(self, hidden: int, precision: str | None = None) -> float | None:
        """The convolutions' rate in ``precision`` (the timed one at the block's speed in it, at
        width ``hidden``); None where the rates timed none."""
        if self.conv_tflops is None:
            return None
        return self.conv_tflops * self.speed_in(precision, hidden)[0]

    def narrow_tflops_at(self, width: int, hidden: int, precision: str | None = None) -> float | None:
        """A matmul of ``width`` (the narrow side of its weight) in ``precision``: linear in the
        width between the widths timed, in proportion to it below the first (a narrower matmul
        fills fewer of the cores' lanes), as timed in ``precision`` or else in
        ``compute_precision`` at the block's speed in ``precision`` at width ``hidden``; None
        from the widest timed on (the block rate's, as a model's other matmuls) or where the
        rates timed none ([Note: narrow matmuls] in counted_work.py)."""
        rows = self.narrow_tflops.get(precision or self.compute_precision)
        speed = 1.0
        if rows is None:
            rows = self.narrow_tflops.get(self.compute_precision)
            speed = self.speed_in(precision, hidden)[0]
        if not rows or width >= rows[-1][0]:
            return None
        if width <= rows[0][0]:
            return rows[0][1] * max(1, width) / rows[0][0] * speed
        return _log_interpolate(rows, width, between=_linear) * speed

    def elementwise_seconds(self, rows: tuple[tuple[str, str, int, int, int, int], ...]) -> float | None:
        """The seconds of ``rows`` of (op, precision, calls, bytes, new bytes, mapped bytes)
        (``op_tally.beyond_gpt``): each op's bytes at its timed seconds a byte in that precision
        (a precision not timed: the rates' own; an op not timed: a copy's, ``FALLBACK_OP``), its
        new tensors' bytes at ``elementwise_new_s_per_byte`` for the share the allocator takes
        afresh (``elementwise_new_fresh_share``) and its mapped bytes, taken afresh every time,
        at all of it ([Note: memory mapped afresh] in common/host_allocator.py), each call at
        ``elementwise_s_per_call``; None where the rates timed no op."""
        if not self.elementwise_s_per_byte:
            return None
        total = 0.0
        for op, precision, calls, nbytes, new_bytes, mapped_bytes in rows:
            own = self._in_precision(self.elementwise_s_per_byte, precision)
            table = dict(own or next(iter(self.elementwise_s_per_byte.values())))
            per_byte = table.get(op, table.get(FALLBACK_OP, max(table.values())))
            fresh = (new_bytes * self.elementwise_new_fresh_share + mapped_bytes) * self.elementwise_new_s_per_byte
            total += calls * self.elementwise_s_per_call + nbytes * per_byte + fresh
        return total

    def measured_in(self, precision: str) -> bool:
        """Whether the rates timed compute in ``precision`` (or relate it to the one they timed)."""
        return precision == self.compute_precision or precision in self.precision_speed

    def speed_in(self, precision: str | None, hidden: int, tokens: int | None = None) -> tuple[float, float]:
        """(the blocks', the head's) compute speed in ``precision`` over ``compute_precision``'s
        at ``hidden`` and ``tokens`` a micro-batch (None: the most timed): linear in the
        logarithms between the sizes timed, flat beyond; (1, 1) for the precision timed, for
        None and for a precision not timed."""
        grid = self.precision_speed.get(precision or self.compute_precision)
        blocks = head = 1.0
        if grid:
            at = tokens if tokens is not None else max(n for _, n, _ in grid)
            blocks = _log_interpolate(_by_hidden_at(grid, at), hidden, below="flat")
        rows = self.precision_head_speed.get(precision or self.compute_precision)
        if rows:
            at = tokens if tokens is not None else max(n for _, n, _ in rows)
            head = _log_interpolate(_by_hidden_at(rows, at), hidden, below="flat")
        return blocks, head

    def tflops_at(self, hidden: int, tokens: int | None = None, precision: str | None = None) -> float:
        """The compute rate at ``hidden`` (and ``tokens`` a micro-batch, where the rates were
        measured at several) in ``precision`` (None: ``compute_precision``): linear in the
        logarithms between hidden sizes, between token counts as a step of a fixed time and a
        time a token takes (``_affine_time``), flat above the ends and falling below them
        (``_log_interpolate``)."""
        table = self.compute_tflops
        if tokens is not None and self.compute_tflops_by_tokens:
            table = _by_hidden_at(self.compute_tflops_by_tokens, tokens, below="fall", between=_affine_time)
        return _log_interpolate(table, hidden) * self.speed_in(precision, hidden, tokens)[0]

    @property
    def attention_apart(self) -> bool:
        """Whether the compute tables exclude the attention, timed apart (``attention_tflops``)."""
        return self.compute_precision in self.attention_tflops

    def attention_tflops_at(self, head_dim: int, seq: int, precision: str | None = None) -> float | None:
        """The attention's rate at ``head_dim`` (0: unknown, the smallest timed) and ``seq`` in
        ``precision`` (one not timed: the rates' own): linear in the logarithms between the
        sizes timed, flat above them and falling below them (``_log_interpolate``: a shorter
        sequence or a smaller head gives the matmuls less to fill the lanes with); None where
        the rates did not time it apart (``attention_apart``)."""
        if not self.attention_apart:
            return None
        grid = self._in_precision(self.attention_tflops, precision)
        head_dim = head_dim or grid[0][0]  # unknown: the smallest timed
        return _log_interpolate(_by_hidden_at(grid, seq, below="fall"), head_dim, below="fall")

    def attention_forward_share_at(self, head_dim: int, seq: int, precision: str | None = None) -> float:
        """The attention's forward's share of its seconds at ``head_dim`` and ``seq`` in
        ``precision``, read as ``attention_tflops_at`` reads the rate (flat beyond the sizes
        timed); a third (its FLOPs' share) where not timed."""
        grid = self._in_precision(self.attention_forward_share, precision)
        if not grid:
            return 1 / 3
        head_dim = head_dim or grid[0][0]  # unknown: the smallest timed
        return _log_interpolate(_by_hidden_at(grid, seq), head_dim, below="flat")

    def _in_precision(self, tables: Mapping[str, tuple], precision: str | None) -> tuple:
        """``tables``' rows for ``precision`` (None, or one not timed: the rates' own; () where
        neither is there)."""
        return tables.get(precision or self.compute_precision) or tables.get(self.compute_precision, ())

    def head_s_at(self, hidden: int, vocab: int, precision: str | None = None, tokens: int | None = None) -> float | None:
        """Seconds per logit of the head at ``hidden`` and ``vocab``: linear in log(vocab)
        between the vocabularies timed (flat beyond), then linear in the hidden size between
        the table's entries and along its end segments beyond them (the projection's work
        grows with it, the cross-entropy's does not); one hidden size timed scales in
        proportion; in ``precision`` at its head's speed (``speed_in``, at ``tokens`` a
        micro-batch). None where the head was not measured."""
        if not self.head_s_per_logit:
            return None
        table = _by_hidden_at(self.head_s_per_logit, vocab)
        speed = self.speed_in(precision, hidden, tokens)[1]
        if len(table) == 1:
            return table[0][1] * hidden / table[0][0] / speed
        segment = next((pair for pair in zip(table, table[1:], strict=False) if hidden <= pair[1][0]), table[-2:])
        (h0, s0), (h1, s1) = segment
        value = s0 + (hidden - h0) * (s1 - s0) / (h1 - h0)
        # a table whose ends fall (noise) must not extrapolate to nothing
        return max(value, min(s for _, s in table) * min(1.0, hidden / table[0][0])) / speed

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["compute_tflops"] = [list(p) for p in self.compute_tflops]
        out["compute_tflops_by_tokens"] = [list(p) for p in self.compute_tflops_by_tokens]
        out["head_s_per_logit"] = [list(p) for p in self.head_s_per_logit]
        for f in KEYED_TABLES:
            out[f] = {k: [list(p) for p in rows] for k, rows in getattr(self, f).items()}
        out["sources"] = dict(self.sources)
        return {"format": RATES_FORMAT, **out}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "rates") -> MachineRates:
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in known}
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in fields and _required(f))
        if missing:
            raise ConfigError(f"{where}: missing {', '.join(missing)}; run `hybridps calibrate` again")
        fields["compute_tflops"] = tuple(tuple(p) for p in fields["compute_tflops"])
        fields["head_s_per_logit"] = tuple(tuple(p) for p in fields.get("head_s_per_logit", ()))
        fields["compute_tflops_by_tokens"] = tuple(tuple(p) for p in fields.get("compute_tflops_by_tokens", ()))
        for f in KEYED_TABLES:
            speeds = fields.get(f, {})
            if not isinstance(speeds, Mapping):
                raise ConfigError(f"{where}: {f} must map a precision to its rows")
        return cls(**fields)

    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)
        return path


#: below the smallest size a table timed, a rate falls along its first segment's slope in
#: log(size) to at most this factor of the smallest's
FALL_BELOW_FLOOR = 0.5


def _log_interpolate(
    table: tuple[tuple[int, float], ...], x: int, *, below: str = "fall", between: Callable[..., float] | None = None
) -> float:
    """``table``'s value at ``x`` (its keys ascending): linear in log(x) between entries (or
    ``between(x, x0, y0, x1, y1)``), flat above the last; below the first, ``below="fall"`` follows the first segment's
    slope where it rises (a smaller matmul fills fewer of the cores' lanes: on the VM, fp32,
    one thread, a block ran 116 GFLOPS at hidden size 128 and 75 at 64 against 124 at 256),
    no lower than ``FALL_BELOW_FLOOR`` of the first value; ``"flat"``: the first value."""
    if x < table[0][0] and below == "fall" and len(table) > 1:
        (x0, y0), (x1, y1) = table[0], table[1]
        slope = max(0.0, (y1 - y0) / math.log(x1 / x0))
        return max(y0 - slope * math.log(x0 / x), FALL_BELOW_FLOOR * y0)
    if x <= table[0][0]:
        return table[0][1]
    if x >= table[-1][0]:
        return table[-1][1]
    for (x0, y0), (x1, y1) in zip(table, table[1:], strict=False):
        if x0 <= x <= x1:
            if between is not None:
                return between(x, x0, y0, x1, y1)
            return y0 + math.log(x / x0) / math.log(x1 / x0) * (y1 - y0)
    raise AssertionError("unreachable: the table is sorted")


def _linear(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    """The value at ``x`` on the line through (``x0``, ``y0``) and (``x1``, ``y1``)."""
    return y0 + (x - x0) / (x1 - x0) * (y1 - y0)


def _affine_time(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    """The rate at ``x`` tokens between rates ``y0`` at ``x0`` and ``y1`` at ``x1``, where a step's
    time is a fixed part and a part a token (``x / rate`` linear in ``x``): [Note: a rate
    between token counts]."""
    t0, t1 = x0 / y0, x1 / y1
    return x / (t0 + (x - x0) * (t1 - t0) / (x1 - x0))


def _by_hidden_at(
    grid: tuple[tuple[int, int, float], ...], x: int, *, below: str = "flat", between: Callable[..., float] | None = None
) -> tuple[tuple[int, float], ...]:
    """A (hidden size, key, value) grid, sorted, read at key ``x``: each hidden size's value
    there (``_log_interpolate`` over its keys, ``below`` its first as it says, ``between`` two
    keys as it says)."""
    rows: dict[int, list[tuple[int, float]]] = {}
    for h, key, value in grid:
        rows.setdefault(h, []).append((key, value))
    return tuple((h, _log_interpolate(tuple(row), x, below=below, between=between)) for h, row in rows.items())


def _grid(rows: Any, width: int) -> tuple[tuple, ...] | None:
    """``rows`` as a sorted grid of ``width``-long rows of sizes >= 1 and a last value > 0
    (finite); None where they are not that, or none."""
    try:
        grid = tuple(sorted(tuple(int(k) for k in row[:-1]) + (float(row[-1]),) for row in rows if len(row) == width))
        if not grid or len(grid) != len(rows):
            return None
    except (TypeError, ValueError):
        return None
    if any(min(row[:-1]) < 1 or not (row[-1] > 0 and math.isfinite(row[-1])) for row in grid):
        return None
    return grid


def _share_grid(rows: Any) -> tuple[tuple, ...] | None:
    """``rows`` as a ``_grid`` of three whose shares are at most 1; None otherwise."""
    grid = _grid(rows, 3)
    return grid if grid is not None and max(row[-1] for row in grid) <= 1.0 else None


def _op_table(rows: Any) -> tuple[tuple[str, float], ...] | None:
    """``rows`` as sorted (op, seconds >= 0) pairs (finite); None where they are not that, or none."""
    try:
        table = tuple(sorted((str(op), float(v)) for op, v in rows))
    except (TypeError, ValueError):
        return None
    return table if table and all(v >= 0 and math.isfinite(v) for _, v in table) else None


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _check_positive(name: str, field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"rates {name!r}: {field}={value!r} must be a positive number")


def stored_rates_path() -> Path:
    """Where ``hybridps calibrate`` stores this machine's rates: ``$HYBRIDPS_RATES``, else
    ``~/.cache/hybridps/rates.json``."""
    env = os.environ.get(RATES_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hybridps" / "rates.json"


def read_rates_file(path: Path) -> MachineRates:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"rates file {str(path)!r} cannot be read ({exc}); run `hybridps calibrate --out FILE`") from None
    return MachineRates.from_dict(data, where=str(path))


def threads_mismatch(rates: MachineRates, threads_now: int) -> str | None:
    """A warning where a simulated GPU's rates were measured on another number of torch
    threads than ``threads_now``, the ones the training will run on; else None."""
    if not rates.simulated_gpu or rates.host_threads is None or rates.host_threads == threads_now:
        return None
    return (
        f"the rates {rates.name!r} were measured on {rates.host_threads} torch threads and this process has "
        f"{threads_now}: on a simulated GPU every rate scales with them, so the predicted step is off by about "
        f"that ratio; run `hybridps calibrate` under the same OMP_NUM_THREADS as the training"
    )


def with_collective_rates(
    rates: MachineRates | None, *, node_gbps: float | None = None, network_gbps: float | None = None
) -> MachineRates | None:
    """``rates`` with the collectives' rates given on the command line in place of their own
    (``hybridps plan --node-gbps / --network-gbps``)."""
    if rates is None or (node_gbps is None and network_gbps is None):
        return rates
    changes: dict[str, Any] = {}
    sources = dict(rates.sources)
    if node_gbps is not None:
        changes.update(node_gather_gbps=node_gbps, node_reduce_gbps=node_gbps)
        sources["node_gather_gbps"] = sources["node_reduce_gbps"] = "given: hybridps plan --node-gbps"
    if network_gbps is not None:
        changes["network_gbps"] = network_gbps
        sources["network_gbps"] = "given: hybridps plan --network-gbps"
    return dataclasses.replace(rates, sources=sources, **changes)


def profile(name: str) -> MachineRates:
    """A shipped profile by name (``PROFILE_NAMES``)."""
    if name not in PROFILE_NAMES:
        raise ConfigError(f"no shipped rates profile {name!r}; shipped: {', '.join(PROFILE_NAMES)}")
    text = resources.files("hybridps.planner").joinpath("profiles", f"{name}.json").read_text()
    return MachineRates.from_dict(json.loads(text), where=f"profile {name}")


def load_rates(spec: str | None) -> MachineRates | None:
    """The rates a ``--rates`` argument names: a shipped profile (``h100``, ``h200``),
    ``this-machine`` (the stored calibration; an error when there is none), or a JSON file.
    None (no ``--rates``): the stored calibration if there is one, else None (no prediction)."""
    if spec is None:
        path = stored_rates_path()
        return read_rates_file(path) if path.is_file() else None
    if spec.lower() in PROFILE_NAMES:
        return profile(spec.lower())
    if spec == THIS_MACHINE:
        path = stored_rates_path()
        if not path.is_file():
            raise ConfigError(f"--rates {THIS_MACHINE}: no calibration at {path}; run `hybridps calibrate` first")
        return read_rates_file(path)
    if Path(spec).expanduser().is_file():
        return read_rates_file(Path(spec).expanduser())
    raise ConfigError(f"--rates {spec!r} is neither a shipped profile ({', '.join(PROFILE_NAMES)}), {THIS_MACHINE!r} nor a file")
