"""The work a model does outside its matmuls and attention, counted by op and dtype.

Owns counting the element-wise, normalisation, softmax, dropout and copy kernels of one
forward and backward (``OpTally``, a torch dispatch mode: calls and bytes each op reads and
writes, by op and dtype), one planned model's count on the meta device (``tally_model``), and
what a family does there beyond the GPT of its shape (``beyond_gpt``).

[Note: the work outside the matmuls]
The speed model's compute rate is a GPT block's ([Note: the speed model] in speed.py): its
matmuls, and the element-wise work of a GPT (LayerNorm, GELU, residual adds) inside the same
seconds. Other families do more of the latter a FLOP. On the 2-vCPU VM (one thread, fp32, four
layers, hidden size 256, 8 x 128 tokens), plain PyTorch's forward and backward took 0.33-0.35
s for the GPT, 0.34 s for transformers' Llama (RMSNorm and rotary embeddings in Python ops, a
SiLU-gated MLP: 448 kernels outside the matmuls against the GPT's 153, 1.15 GB read and
written against 0.71 GB, and 4% fewer matmul FLOPs) and 0.45 s for transformers' GPT-2 (its
tanh GELU in five ops, dropout of 0.1 on three paths a layer: 1.62 GB), while the model
predicted them at the GPT's rate, within 3%. With the engine on a simulated GPU the Llama
read 0.77-0.79x its measured step and the GPT-2 0.66-0.73x, against the GPT's 0.77-0.84 on
the same rates that hour. Counted as below, they read 0.97-0.99x and 0.97-1.03x in three runs
(docs/benchmarks/2026-11-29-transformers-families.md).

So a family other than ``GPTShape`` is counted against the GPT of its shape (its layers,
hidden size, heads, vocabulary and batch: ``gpt_of``): both run one forward and backward on
the meta device under ``OpTally``, each at one and two layers (a layer's count is the
difference; the family's count at L layers is the one-layer count and L - 1 layers more),
and the speed model adds the family's count less the GPT's at the machine's timed seconds a
byte of each op and a call (``calibrate_elementwise``). The difference is the point: what the
GPT does is inside the block rate already. On meta, scaled-dot-product attention runs its math
decomposition (a softmax, the mask's ``where``), which both counts hold alike and cancel; matmuls
(``torch.utils.flop_counter``'s ops) and the attention kernels are not counted, nor are views
and allocations that write nothing.

Does not own the seconds of an op (``rates.MachineRates.elementwise_seconds``, timed by
``calibrate_elementwise``), the model families (``model``, ``hf_model``) or the prediction
(``speed``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from hybridps.common.errors import ConfigError
from hybridps.common.host_allocator import MAPPED_AFRESH_BYTES
from hybridps.planner.timing import precision_dtype
from hybridps.planner.validation import divisor_near

#: ops that alias their input though their schemas do not say so: no new memory
_UNMARKED_ALIASES = frozenset({"_unsafe_view", "lift_fresh", "detach"})
#: ops that allocate or alias without reading or writing the bytes they return
_NO_WORK = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}) | _UNMARKED_ALIASES
#: the precision each floating dtype counts in; any other dtype's bytes count in fp32's rates
_DTYPE_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

#: (op, precision) -> (calls, bytes read and written, bytes of the new tensors it returned below
#: ``MAPPED_AFRESH_BYTES``, bytes of those from it up); an op by its name less a trailing ``_``
#: (in place alike). A matmul's or an allocation's big results count in the last alone: their
#: memory, not their work ([Note: memory mapped afresh] in common/host_allocator.py)
Tally = dict[tuple[str, str], tuple[int, int, int, int]]
#: (op, precision, calls, bytes, new bytes, mapped bytes): a row of ``beyond_gpt``
Row = tuple[str, str, int, int, int, int]
#: (phase, kind, width, rows) of a matmul (``OpTally.matmuls``; in the backward "", 0, 0)
MatmulKey = tuple[str, str, int, int]
#: MatmulKey -> (calls, FLOPs)
MatmulTally = dict[MatmulKey, tuple[int, int]]


def op_name(func: Any) -> str:
    """The name an op counts under: its overload packet's, an in-place variant as the op."""
    name = func.overloadpacket.__name__
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *_: Any, **__: Any) -> int:
    """A grouped matmul's FLOPs (``torch._grouped_mm``, a mixture of experts' matmuls, which
    ``torch.utils.flop_counter`` does not count): each row of ``a`` meets one group of ``b``,
    so its rows by the inner and outer sides, whatever the groups' sizes."""
    if a.dim() == 2 and b.dim() == 3:  # tokens routed to experts: (rows, K) by (groups, K, N)
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:  # groups along the inner side: (M, K) by (K, N)
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * a.numel() * b.shape[-1]  # batched: (G, M, K) by (G, K, N)


#: matmuls beyond ``torch.utils.flop_counter``'s, by overload packet, with their FLOPs
_MORE_MATMULS = {torch.ops.aten._grouped_mm: _grouped_mm_flops}


def _flop_count(func: Any) -> Callable[..., int] | None:
    packet = func.overloadpacket
    return flop_registry.get(packet) or _MORE_MATMULS.get(packet)


def _counted(func: Any) -> bool:
    if _flop_count(func) is not None or "attention" in func.overloadpacket.__name__:
        return False  # matmuls and attention: the speed model's FLOPs
    if func.overloadpacket.__name__ in _NO_WORK:
        return False
    # a view returns an alias it does not write
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class OpTally(TorchDispatchMode):
    """Calls and bytes of every counted op run under it (``counts``): the tensors an op reads
    and those it returns (an in-place op's written self once more), and of those the new
    tensors it returned (memory it takes from the allocator), by op and by the precision of its
    largest tensor; the new tensors of ``MAPPED_AFRESH_BYTES`` or more apart, of any op (a
    matmul's logits as well: [Note: memory mapped afresh] in common/host_allocator.py). And the
    matmuls' FLOPs (``matmuls``, by ``torch.utils.flop_counter``'s registry) by phase: in the
    forward (``phase`` "forward" until the caller sets "backward"), by kind ("dense": an operand
    is one of ``params`` or a view of one; "conv": a convolution's weight is; "activation": none
    is, as attention's), width and rows ([Note: a model's own shape] in counted_work.py)."""

    def __init__(self, params: Any = ()) -> None:
        super().__init__()
        self._calls: Counter = Counter()
        self._bytes: Counter = Counter()
        self._new: Counter = Counter()
        self._mapped: Counter = Counter()
        self._params = {id(p) for p in params}
        self._matmul_calls: Counter = Counter()
        self._matmul_flops: Counter = Counter()
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        aliases = func.overloadpacket.__name__ in _UNMARKED_ALIASES or any(r.alias_info is not None for r in func._schema.returns)
        new = [] if aliases else outs  # not in place, no view
        mapped = sum(n for n in map(_nbytes, new) if n >= MAPPED_AFRESH_BYTES)
        if _flop_count(func) is not None:
            self._count_matmul(func, args, kwargs or {}, out)
        elif _counted(func):
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            tensors = ins + outs
            if tensors:
                largest = max(tensors, key=lambda t: t.numel())
                key = (op_name(func), _DTYPE_PRECISION.get(largest.dtype, "fp32"))
                self._calls[key] += 1
                self._bytes[key] += sum(_nbytes(t) for t in tensors)
                self._new[key] += sum(_nbytes(t) for t in new) - mapped
                self._mapped[key] += mapped
                return out
        if mapped:  # a matmul's, attention's or an allocation's result: its memory alone
            self._mapped[(op_name(func), _DTYPE_PRECISION.get(max(new, key=_nbytes).dtype, "fp32"))] += mapped
        return out

    def _is_param(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and (id(t) in self._params or id(getattr(t, "_base", None)) in self._params)

    def _count_matmul(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        flops = int(_flop_count(func)(*args, **kwargs, out_val=out))
        key: MatmulKey = (self.phase, "", 0, 0)
        if self.phase == "forward":
            try:
                key = ("forward", *_matmul_shape(op_name(func), args, flops, self._is_param))
            except (IndexError, ValueError):  # an op of arguments unlike a matmul's: its FLOPs, no shape
                key = ("forward", "activation", 0, 0)
        self._matmul_calls[key] += 1
        self._matmul_flops[key] += flops

    @property
    def counts(self) -> Tally:
        keys = self._calls.keys() | self._mapped.keys()
        return {k: (self._calls[k], self._bytes[k], self._new[k], self._mapped[k]) for k in keys}

    @property
    def matmuls(self) -> MatmulTally:
        return {k: (self._matmul_calls[k], self._matmul_flops[k]) for k in self._matmul_calls}


def _matmul_shape(name: str, args: tuple, flops: int, is_param: Callable[[Any], bool]) -> tuple[str, int, int]:
    """(kind, width, rows) of a forward matmul: "dense" with a param operand ("conv" a
    convolution's: its matrix's narrower side, and the rows it multiplies: FLOPs over twice its
    elements), else
    "activation" (the narrower of the product's inner and outer sides, as attention's head size,
    and the rows of the left operand, as its sequence)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]  # not a bias
    weight = next((t for t in tensors if is_param(t)), None)
    if weight is not None:
        if name == "convolution":  # (out channels, in channels x kernel)
            matrix = (weight.shape[0], weight.numel() // max(1, weight.shape[0]))
            return "conv", int(min(matrix)), flops // max(1, 2 * weight.numel())
        return "dense", int(min(weight.shape[-2:])), flops // max(1, 2 * weight.numel())
    if "attention" in name:  # a fused kernel's (batch, heads, sequence, head size) query
        q = tensors[0]
        return "activation", int(q.shape[-1]), int(q.shape[-2])
    a, b = tensors[-2:]
    return "activation", int(min(a.shape[-1], b.shape[-1])), int(a.shape[-2] if a.dim() >= 2 else 1)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclasses.dataclass(frozen=True)
class ModelCount:
    """One forward and backward of a planned model on the meta device: the ops outside its
    matmuls (``ops``) and its matmuls' FLOPs (``matmuls``), as ``OpTally`` counts them."""

    ops: Tally
    matmuls: MatmulTally


def count_model(model: Any, precision: str) -> ModelCount:
    """The count of one forward and backward of ``model`` (a ``PlannedModel``) built on the
    meta device, its params in ``precision``, fed its planned batch."""
    with torch.device("meta"):
        module = model.build()
    dtype = precision_dtype(precision)
    if dtype != torch.float32:
        module = module.to(dtype)
    inputs = model.inputs(torch.device("meta"))
    simulating = getattr(model, "simulating", None)
    with simulating() if simulating is not None else contextlib.nullcontext(), OpTally(module.parameters()) as tally:
        out = module(**inputs) if isinstance(inputs, dict) else module(*inputs)
        tally.phase = "backward"
        model.loss(out).backward()
    return ModelCount(tally.counts, tally.matmuls)


def tally_model(model: Any, precision: str) -> Tally:
    """The ops outside the matmuls of ``count_model``."""
    return count_model(model, precision).ops


def _extrapolated(one: dict, two: dict, more: int) -> dict:
    """A count at one layer and ``more`` layers more, from the counts at one and two layers."""
    out = {}
    for key in one.keys() | two.keys():
        a, b = one.get(key), two.get(key)
        width = len(a if a is not None else b)
        a, b = a or (0,) * width, b or (0,) * width
        out[key] = tuple(x + more * (y - x) for x, y in zip(a, b, strict=True))
    return out


def count_at_layers(model: Any, precision: str) -> ModelCount:
    """``model``'s count at its own layer count, from its members of one and two layers."""
    one, two = (count_model(model.with_layers(n), precision) for n in (1, 2))
    more = model.n_layer - 1
    return ModelCount(_extrapolated(one.ops, two.ops, more), _extrapolated(one.matmuls, two.matmuls, more))


def _at_layers(model: Any, precision: str) -> Tally:
    return count_at_layers(model, precision).ops


def tally_less(ops: Tally, *less: tuple[Tally, float]) -> Tally:
    """``ops`` less each tally times its factor (rounded to whole calls and bytes)."""
    out = {}
    for key in ops.keys() | {k for tally, _ in less for k in tally}:
        values = list(ops.get(key, (0, 0, 0, 0)))
        for tally, factor in less:
            values = [v - factor * w for v, w in zip(values, tally.get(key, (0, 0, 0, 0)), strict=True)]
        out[key] = tuple(int(round(v)) for v in values)
    return out


def tally_rows(ops: Tally) -> tuple[Row, ...]:
    """``ops`` as rows (op, precision, calls, bytes, new bytes, mapped bytes), by key, none all zero."""
    return tuple((*key, *ops[key]) for key in sorted(ops) if any(ops[key]))


def gpt_of(model: Any):
    """The ``GPTShape`` of ``model``'s shape: its layers, hidden size, heads (of its head size,
    as near as divides the hidden size), vocabulary, batch and checkpointing."""
    from hybridps.planner.model import GPTShape

    d = int(model.d_model)
    head_dim = int(getattr(model, "head_dim", 0) or 0) or 64
    return GPTShape(
        n_layer=model.n_layer,
        d_model=d,
        n_head=divisor_near(d, max(1, d // head_dim)),
        vocab_size=int(getattr(model, "vocab_size", 0) or 50304),
        seq_len=model.seq_len,
        batch_size=model.batch_size,
        checkpoint=bool(getattr(model, "checkpoint", False)),
    )


_CACHE: dict[tuple[str, str], tuple[Row, ...]] = {}
_GPT_COUNTS: dict[tuple[str, str], Tally] = {}


def _gpt_count(gpt: Any, precision: str) -> Tally:
    key = (json.dumps(dataclasses.asdict(gpt), sort_keys=True), precision)
    if key not in _GPT_COUNTS:
        _GPT_COUNTS[key] = _at_layers(gpt, precision)
    return _GPT_COUNTS[key]


def mapped_bytes(model: Any, precision: str) -> int:
    """The bytes of the new tensors of ``MAPPED_AFRESH_BYTES`` or more in one forward and
    backward of the GPT of ``model``'s shape (a ``GPTShape``: itself), which the C library maps
    afresh every step ([Note: memory mapped afresh] in common/host_allocator.py): a head's logits
    and their loss's tensors, a large block's activations. Neither the block rates nor the head's
    time a logit hold them (``hybridps calibrate`` takes them out of the head's); a family's own
    beyond the GPT's are in ``beyond_gpt``."""
    from hybridps.planner.model import GPTShape

    gpt = model if isinstance(model, GPTShape) else gpt_of(model)
    return sum(counts[3] for counts in _gpt_count(gpt, precision).values())


def beyond_gpt(model: Any, precision: str) -> tuple[Row, ...]:
    """(op, precision, calls, bytes, new bytes, mapped bytes) of one forward and backward of ``model`` less those of the
    GPT of its shape ([Note: the work outside the matmuls]); () for a ``GPTShape``, whose work
    the block rates hold. Rows may be negative (work the GPT does and the family does not)."""
    from hybridps.planner.model import GPTShape

    if isinstance(model, GPTShape):
        return ()
    key = (json.dumps(model.describe(), sort_keys=True, default=str), precision)
    if key not in _CACHE:
        try:
            family, gpt = _at_layers(model, precision), _gpt_count(gpt_of(model), precision)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"cannot count the {model.describe().get('family', 'model')}'s work outside its matmuls on the meta "
                f"device ({type(exc).__name__}: {exc})"
            ) from None
        _CACHE[key] = tally_rows(tally_less(family, (gpt, 1.0)))
    return _CACHE[key]
