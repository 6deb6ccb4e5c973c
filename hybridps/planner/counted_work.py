"""The work of a model of no known shape, counted: its FLOPs, the shape its matmuls run at, and
what it does beyond the block the rates timed.

Owns ``CountedShape`` (what the speed model needs of any ``PlannedModel``: FLOPs by phase and
kind, the width and rows its dense matmuls run at, its attention's head size and sequence, and
its kernels outside the matmuls beyond what the rates' block holds) and ``counted_shape``, the
count on the meta device.

[Note: a model's own shape]
The speed model prices a GPT's work by formula (``6 N T + 12 L d S T``) at the rate of a GPT
block of its hidden size and tokens a micro-batch, and a transformers family by the same
formula plus its kernels outside the matmuls beyond the GPT of its shape ([Note: the work
outside the matmuls] in op_tally.py). A ``ModelFactory`` (``hybridps plan --factory``) names
no hidden size, sequence or batch, so nothing gave its step a speed. It has a forward and
backward on the meta device, as the simulation runs it, and they say all three:

- **FLOPs**, by ``torch.utils.flop_counter``'s registry, as ``OpTally`` runs them: in the
  forward by kind (``dense``: one operand is a param or a view of one, as a linear layer's;
  ``conv``: a convolution's weight is; ``activation``: none is, as attention's two products),
  and the backward's
  whole (under activation checkpointing its recomputed forward inside it, as torch's
  non-reentrant checkpoint really runs it: it stops once the saved tensors are back). The
  model's FLOPs are three times the forward's, the step's the forward's and the backward's.
- **The shape**: the dense matmuls' width (the narrower side of the param's matrix: a GPT's
  hidden size) and rows (the tokens, for a convolution the output's positions), each the
  median over the forward's dense FLOPs; the activation matmuls' head size (the narrower of
  the product's inner and outer sides) and sequence (the left operand's rows) alike.
- **The rest**: the block rate's seconds hold a GPT block's kernels outside its matmuls (the
  block calibrate.compute_tflops times alone, at that width and rows; counted as a two-layer
  GPT's less a one-layer GPT's), less its attention's, which the attention's rate holds. So the
  model's own kernels count at the timed seconds of each, less the block's per dense FLOP times
  the model's dense FLOPs (not its convolutions'), less the attention's per
  attention FLOP (a causal attention's at the model's head size and sequence) times the
  model's activation FLOPs. A model of the GPT's kernels comes to nothing beyond it.
- **Convolutions** are not matmuls: on the VM (fp32, one thread) a 3 x 3 convolution of 64
  channels on 16 images of 32 x 32 ran at 120 GFLOPS forward and backward, a matmul of its
  shape (16384 rows, 576 by 64) at 77, and a GPT block of their width 64 at 43-61; priced at the
  block rate, a net of seven such layers read 0.80-2.20x its measured step over five
  calibrations (the rate at width 64 extrapolated below the 128 timed). ``hybridps
  calibrate`` times that convolution (``conv_tflops``) and the speed model prices the
  convolutions' share of the dense FLOPs at it (in another precision at the block's speed in
  it); its rate holds no block's other kernels, so they are not subtracted for it. One shape's
  rate: 1 x 1, depthwise and strided convolutions run at their own.

[Note: narrow matmuls]
A LoRA adapter multiplies by two narrow matrices (hidden by the rank, the rank by hidden), and
a narrow matmul fills few of the cores' lanes: on an AMD VM (fp32, one thread, hidden 256, 1024
rows) an adapter's pair ran forward and backward at 17 GFLOPS at width 4, 33 at 8, 80 at 16
and 89 at 32, against 100-104 from 64 up, the block's own. A Llama of four layers at hidden
256 took 0.230 s a forward and backward with rank-8 adapters on every linear layer against
0.189 s with no adapters (its weights frozen alike): 41 ms for about 1 GFLOP of adapters,
priced at the block rate near 11. So the forward's matmuls with a param whose narrow side is
below ``NARROW_WIDTHS[-1]`` are kept by width (``forward_narrow_flops``), and the speed model
prices them at ``hybridps calibrate``'s timed adapter pair of each width (linear between the
widths timed, in proportion below the first; timed in each precision, as an adapter in bf16
ran at 95 GFLOPS at width 8 where fp32's rate at the block's bf16 speed said 141).
A narrow weight counts as trained (both grads: three times its forward, and its share
recomputed under checkpointing), as an adapter is; its rate holds no block's other kernels, so
they are not subtracted for it. Rates without the table (the shipped profiles, rates stored
before) price them at the block rate, and the prediction says so.

A mixture of experts (``HFCausalLMFamily.mixture_of_experts``: Mixtral, Qwen-MoE, OLMoE,
DeepSeek) has a GPT shape, but ``6 N T`` counts every expert where a token multiplies the few it
is routed to: a Mixtral of eight experts, two a token, four layers at hidden size 256 was
predicted at 2.08x its measured step on the VM. Its FLOPs are counted here instead, the
experts' grouped matmuls (``torch._grouped_mm``, which ``torch.utils.flop_counter`` does not
count) as each routed row by the inner and outer sides (``op_tally._grouped_mm_flops``): 1.09x,
against 1.11x for a Llama of its shape on the same rates.

The FLOPs are counted at one and two layers and extrapolated to the model's layer count, as
``op_tally.count_at_layers`` does; the medians are taken over the extrapolated counts.

[Note: what checkpointing recomputes]
A checkpointed GPT's formula recomputes its blocks' whole forward (``2 N' T + 4 L d S T``).
torch's non-reentrant checkpoint stops recomputing once the tensors the backward saved are
back, so a GPT block's last matmul (the MLP's output projection, 4 d^2 of its 12 d^2; nothing
saved is computed after it) never runs again: the count on meta of a GPT of 4 x 384 at 512
tokens recomputes 5.03 GFLOPs against the formula's 7.45 (0.68). Plain PyTorch on the VM
agreed: checkpointing added 0.040-0.049 s to a 0.18 s step, where the formula's recompute at
the block rate came to 0.063 s, and ``hybridps train --checkpointing`` read 1.165x its measured
step (the same run unchecked 0.96x). ``recomputed_flops`` counts what the backward recomputes
(its matmul FLOPs beyond twice the forward's) for any shaped model, and the speed model takes
it in place of the formula's.

Does not own the count (``op_tally``), the seconds of an op or a FLOP (``rates``) or the
prediction (``speed``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from hybridps.common.errors import ConfigError
from hybridps.planner.calibrate import BLOCK_HEAD_DIM, BLOCK_SEQ, NARROW_WIDTHS
from hybridps.planner.op_tally import MatmulTally, OpTally, Row, Tally, count_at_layers, count_model, tally_less, tally_rows
from hybridps.planner.timing import precision_dtype


@dataclasses.dataclass(frozen=True)
class CountedShape:
    """What one micro-batch of a model of no known shape does ([Note: a model's own shape])."""

    #: the forward's FLOPs in matmuls with a param operand, and in those without one
    forward_dense_flops: float
    forward_activation_flops: float
    #: the backward's FLOPs, with any forward it recomputes
    backward_flops: float
    #: the dense matmuls' median width and rows over their FLOPs (a model of convolutions
    #: alone: the convolutions')
    width: int
    rows: int
    #: the activation matmuls' median head size and sequence (0: none)
    head_dim: int
    seq_len: int
    #: (op, precision, calls, bytes, new bytes) its kernels outside the matmuls do beyond the
    #: rates' block's and attention's (rows may be negative)
    beyond_block: tuple[Row, ...] = ()
    #: of ``forward_dense_flops``, those of convolutions (at the rates' convolution rate where
    #: they timed one, else at the block rate)
    forward_conv_flops: float = 0.0
    #: of ``backward_flops``, the forward it recomputes under activation checkpointing
    #: (``recomputed_flops``); None: beyond twice the forward's
    recompute_flops: float | None = None
    #: (width, FLOPs) of the forward's matmuls with a param narrower than ``NARROW_WIDTHS[-1]``
    #: on one side, of ``forward_dense_flops`` (at the rates' narrow rates where they timed them)
    forward_narrow_flops: tuple[tuple[int, float], ...] = ()

    @property
    def narrow_step_flops(self) -> tuple[tuple[int, float], ...]:
        """(width, FLOPs a step) of the narrow matmuls: the forward, both grads (an adapter is
        trained) and the share recomputed ([Note: narrow matmuls])."""
        return tuple((w, f * (3.0 + self.recompute_share)) for w, f in self.forward_narrow_flops)

    @property
    def forward_flops(self) -> float:
        return self.forward_dense_flops + self.forward_activation_flops

    @property
    def model_flops(self) -> float:
        """Three times the forward's: what the model TFLOPS count (no recomputation)."""
        return 3.0 * self.forward_flops

    @property
    def step_flops(self) -> float:
        return self.forward_flops + self.backward_flops

    @property
    def recomputed(self) -> float:
        """The FLOPs of the forward the backward recomputes."""
        if self.recompute_flops is not None:
            return self.recompute_flops
        return max(0.0, self.backward_flops - 2.0 * self.forward_flops)

    @property
    def recompute_share(self) -> float:
        """The forward recomputed in backward, as a share of the forward (0 to 1)."""
        if not self.forward_flops:
            return 0.0
        return min(1.0, self.recomputed / self.forward_flops)

    @property
    def conv_step_flops(self) -> float:
        """The convolutions' FLOPs a step: their share of the dense matmuls' step."""
        if not self.forward_dense_flops:
            return 0.0
        dense_step = self.step_flops - self.activation_step_flops
        return dense_step * self.forward_conv_flops / self.forward_dense_flops

    @property
    def activation_step_flops(self) -> float:
        """The activation matmuls' FLOPs a step: forward, backward (twice) and their share recomputed."""
        return self.forward_activation_flops * (3.0 + self.recompute_share)


def _median(weights: dict[int, float]) -> int:
    """The value at half the total weight of ``weights`` (value -> weight)."""
    total, seen = sum(weights.values()), 0.0
    for value in sorted(weights):
        seen += weights[value]
        if seen >= total / 2:
            return value
    return 0


#: the kinds with a param operand (a convolution at its own rate where the rates timed one)
DENSE = ("dense", "conv")


def _by(matmuls: MatmulTally, kinds: tuple[str, ...], field: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, (_, flops) in matmuls.items():
        if key[0] == "forward" and key[1] in kinds and flops > 0:
            out[key[field]] = out.get(key[field], 0.0) + flops
    return out


def _flops(matmuls: MatmulTally, phase: str, kinds: tuple[str, ...] | None = None) -> float:
    return float(sum(f for k, (_, f) in matmuls.items() if k[0] == phase and (kinds is None or k[1] in kinds)))


def _calls(matmuls: MatmulTally, phase: str, kinds: tuple[str, ...]) -> int:
    return sum(c for k, (c, _) in matmuls.items() if k[0] == phase and k[1] in kinds)


def _attention_count(head_dim: int, seq: int, batch_heads: int, precision: str) -> tuple[Tally, float]:
    """A causal attention's kernels outside its matmuls over ``batch_heads`` sequences of
    ``seq`` tokens and heads of ``head_dim``, forward and backward on meta, and its forward
    FLOPs."""
    import torch.nn.functional as F

    dtype = precision_dtype(precision)
    with torch.device("meta"):
        q, k, v = (torch.empty(1, batch_heads, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    with OpTally() as tally:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        tally.phase = "backward"
        out.backward(torch.empty_like(out))
    return tally.counts, _flops(tally.matmuls, "forward")


def _block_count(width: int, rows: int, precision: str) -> tuple[Tally, float]:
    """A block's kernels outside the matmuls, less its attention's, of the GPT the rates' block
    rate timed at ``width`` and ``rows`` (calibrate.compute_tflops; a layer's count: the
    two-layer GPT's less the one-layer GPT's), and its forward dense FLOPs."""
    from hybridps.planner.model import GPTShape

    seq = max(1, min(rows, BLOCK_SEQ))
    heads, batch = max(1, width // BLOCK_HEAD_DIM), max(1, rows // seq)
    one, two = (
        count_model(GPTShape(n_layer=n, d_model=width, n_head=heads, vocab_size=256, seq_len=seq, batch_size=batch), precision)
        for n in (1, 2)
    )
    attention, _ = _attention_count(width // heads, seq, batch * heads, precision)
    layer = tally_less(two.ops, (one.ops, 1.0), (attention, 1.0))
    return layer, _flops(two.matmuls, "forward", DENSE) - _flops(one.matmuls, "forward", DENSE)


_CACHE: dict[tuple, CountedShape] = {}


def counted_shape(model: Any, precision: str) -> CountedShape:
    """The ``CountedShape`` of one micro-batch of ``model`` (a ``PlannedModel`` with
    ``with_layers``) in ``precision``; ``ConfigError`` where it cannot run on the meta device or
    multiplies nothing by a param."""
    try:  # a ModelFactory by its callables and layers: two factories may share a name
        key = (hash(model), model, precision)
    except TypeError:
        key = (json.dumps(model.describe(), sort_keys=True, default=str), precision)
    if key in _CACHE:
        return _CACHE[key]
    what = model.describe().get("family", "model")
    try:
        count = count_at_layers(model, precision)
    except Exception as exc:  # a user's module may raise anything on meta: the plan stands without a speed
        raise ConfigError(
            f"cannot count the {what}'s work on the meta device for its speed ({type(exc).__name__}: {exc})"
        ) from None
    dense = _flops(count.matmuls, "forward", DENSE)
    if dense <= 0:
        raise ConfigError(f"the {what} multiplies no param in a matmul on the meta device: no FLOPs to time its step by")
    conv = _flops(count.matmuls, "forward", ("conv",))
    shaped_by = ("dense",) if dense > conv else ("conv",)  # a model of convolutions alone: theirs
    width, rows = _median(_by(count.matmuls, shaped_by, 2)), _median(_by(count.matmuls, shaped_by, 3))
    head_dim, seq = _median(_by(count.matmuls, ("activation",), 2)), _median(_by(count.matmuls, ("activation",), 3))
    activation = _flops(count.matmuls, "forward", ("activation",))
    narrow = tuple(sorted((w, f) for w, f in _by(count.matmuls, ("dense",), 2).items() if w < NARROW_WIDTHS[-1]))
    block_ops, block_dense = _block_count(width, rows, precision)
    # a convolution's rate and a narrow matmul's hold no block's kernels
    less = [(block_ops, (dense - conv - sum(f for _, f in narrow)) / block_dense)]
    if activation > 0 and head_dim and seq:
        # two products a forward (scores, and their weights on the values) an attention
        invocations = _calls(count.matmuls, "forward", ("activation",)) / 2
        batch_heads = max(1, round(activation / (invocations * 4 * seq * seq * head_dim)))
        attention, attention_flops = _attention_count(head_dim, seq, batch_heads, precision)
        less.append((attention, activation / attention_flops))
    shape = CountedShape(
        forward_dense_flops=dense,
        forward_activation_flops=activation,
        forward_conv_flops=conv,
        forward_narrow_flops=narrow,
        backward_flops=_flops(count.matmuls, "backward"),
        width=width,
        rows=rows,
        head_dim=head_dim,
        seq_len=seq,
        beyond_block=tally_rows(tally_less(count.ops, *less)),
        recompute_flops=recomputed_flops(model, precision) if getattr(model, "checkpoint", False) else None,
    )
    _CACHE[key] = shape
    return shape


def recomputed_flops(model: Any, precision: str) -> float | None:
    """The forward FLOPs one micro-batch's backward recomputes under activation checkpointing,
    counted on meta at ``model``'s layers ([Note: what checkpointing recomputes]): its backward's
    matmul FLOPs beyond the same model's without checkpointing where the model is a dataclass
    with a ``checkpoint`` field (a frozen weight's backward is not twice its forward: LoRA's
    base weights take no weight grads), else beyond twice its forward's; None where the model
    cannot run on the meta device."""
    key = ("recomputed", json.dumps(model.describe(), sort_keys=True, default=str), precision)
    if key not in _CACHE:
        try:
            count = count_at_layers(model, precision)
            if dataclasses.is_dataclass(model) and "checkpoint" in {f.name for f in dataclasses.fields(model)}:
                plain = _flops(count_at_layers(dataclasses.replace(model, checkpoint=False), precision).matmuls, "backward")
            else:
                plain = 2.0 * _flops(count.matmuls, "forward")
        except Exception:  # noqa: BLE001 - the formula's whole forward stands in
            return None
        _CACHE[key] = max(0.0, _flops(count.matmuls, "backward") - plain)
    return _CACHE[key]
