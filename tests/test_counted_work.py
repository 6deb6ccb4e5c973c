"""A model of no GPT shape (``ModelFactory``) gets a speed from its own count on the meta device
([Note: a model's own shape] in hybridps/planner/counted_work.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import hybridps
from hybridps.common.errors import ConfigError
from hybridps.models.gpt import GPT, Block, GPTConfig
from hybridps.planner.counted_work import CountedShape, counted_shape
from hybridps.planner.model import GPTShape, ModelFactory
from hybridps.planner.op_tally import OpTally
from hybridps.planner.rates import read_rates_file
from hybridps.planner.speed import StepWork, part_seconds, predict_work
from tests.synthetic_rates import synthetic_rates

CPU = 1 << 30


def _gpt_factory(shape: GPTShape, name: str = "my-gpt") -> ModelFactory:
    return ModelFactory(
        build_fn=lambda n: GPT(shape.with_layers(n).gpt_config),
        inputs_fn=shape.inputs,
        loss_fn=shape.loss,
        n_layer=shape.n_layer,
        name=name,
    )


def _blocks_factory(n_layer: int, d: int, heads: int, seq: int, batch: int, **config) -> ModelFactory:
    cfg = GPTConfig(d_model=d, n_head=heads, seq_len=seq, **config)
    return ModelFactory(
        build_fn=lambda n: nn.Sequential(*(Block(cfg) for _ in range(n))),
        # as a GPT's first block is fed: an embedding's output, which takes a grad
        inputs_fn=lambda device: (torch.randn(batch, seq, d, device=device, requires_grad=True),),
        n_layer=n_layer,
        name=f"blocks-{d}-{seq}-{batch}",
    )


def test_the_tally_keys_forward_matmuls_by_kind_width_and_rows_and_the_backward_whole():
    linear = nn.Linear(64, 192)
    conv = nn.Conv2d(8, 16, 3, padding=1)
    x = torch.randn(10, 64, requires_grad=True)
    with OpTally([*linear.parameters(), *conv.parameters()]) as tally:
        y = linear(x)  # addmm(bias, x, weight.t()): the bias is no matrix; the weight's view is a param's
        scores = torch.bmm(torch.randn(4, 32, 16), torch.randn(4, 16, 32))  # no param: attention's kind
        c = conv(torch.randn(2, 8, 5, 5))
        tally.phase = "backward"
        y.sum().backward()
    m = tally.matmuls
    assert m[("forward", "dense", 64, 10)] == (1, 2 * 10 * 64 * 192)
    assert m[("forward", "activation", 16, 32)] == (1, 2 * 4 * 32 * 16 * 32)
    # a convolution: its matrix is (out channels, in channels x kernel), its rows the output's positions
    assert m[("forward", "conv", 16, 2 * 5 * 5)] == (1, 2 * 2 * 5 * 5 * 16 * 8 * 9)
    assert m[("backward", "", 0, 0)][1] == 2 * 2 * 10 * 64 * 192  # the grads of the input and the weight
    assert scores.shape == (4, 32, 32) and c.shape == (2, 16, 5, 5)


def test_a_gpt_given_as_a_factory_counts_its_formula_flops_and_shape():
    shape = GPTShape(n_layer=3, d_model=128, n_head=2, vocab_size=512, seq_len=64, batch_size=2)
    c = counted_shape(_gpt_factory(shape), "fp32")
    t, d, s, L = 128, 128, 64, 3
    # the blocks' and the tied head's matmuls (the lookups multiply nothing), at three layers
    # from counts at one and two
    assert c.forward_dense_flops == 2 * t * (12 * d * d * L + 512 * d)
    assert c.forward_activation_flops == 4 * L * d * s * t  # scores and their weights on the values
    assert c.model_flops == 3 * c.forward_flops and c.backward_flops == 2 * c.forward_flops
    assert (c.width, c.rows, c.head_dim, c.seq_len) == (128, 128, 64, 64)
    assert c.recompute_share == 0.0
    # checkpointed: the backward recomputes the blocks' forward (torch stops once the saved
    # tensors are back: not all of it)
    ckpt = counted_shape(_gpt_factory(dataclasses.replace(shape, checkpoint=True), "my-gpt-ckpt"), "fp32")
    assert ckpt.model_flops == c.model_flops and 0.3 < ckpt.recompute_share < 1.0
    assert ckpt.step_flops > c.step_flops


def test_a_checkpointed_gpt_shape_recomputes_what_torch_reruns_not_its_whole_forward():
    """torch's non-reentrant checkpoint stops once the saved tensors are back: a GPT block's
    MLP output projection (4 d^2 of its 12 d^2) never runs again, its attention does."""
    from hybridps.planner.counted_work import recomputed_flops
    from hybridps.planner.simulation import simulate
    from hybridps.planner.speed import step_work

    shape = GPTShape(n_layer=3, d_model=128, n_head=2, vocab_size=512, seq_len=64, batch_size=2, checkpoint=True)
    t, d, s, L = 128, 128, 64, 3
    assert recomputed_flops(shape, "fp32") == 2 * t * 8 * d * d * L + 4 * L * d * s * t
    assert recomputed_flops(dataclasses.replace(shape, checkpoint=False), "fp32") == 0.0
    work = step_work(simulate(shape, gpu_bytes=1 << 30, cpu_bytes=1 << 30, precision="fp32"), shape)
    whole = dataclasses.replace(work, recompute_flops=None)  # the formula: the blocks' whole forward
    assert work.step_flops == work.model_flops + recomputed_flops(shape, "fp32")
    # the projection the backward never reruns, and the params no matmul multiplies the formula counts
    assert whole.step_flops - work.step_flops == pytest.approx(2 * t * 4 * d * d * L, rel=0.05)


def test_the_blocks_the_rate_timed_come_to_nothing_beyond_it():
    rows = dict((op, nbytes) for op, _, _, nbytes, *_ in counted_shape(_blocks_factory(3, 128, 2, 64, 2), "fp32").beyond_block)
    # the block's LayerNorms, GELU, residual adds and its attention's softmax: inside the rates
    for op in ("gelu", "gelu_backward", "native_layer_norm", "native_layer_norm_backward", "add", "_safe_softmax"):
        assert abs(rows.get(op, 0)) <= 64, (op, rows.get(op))
    # another block's own kernels are its own: a ReLU MLP has no GELU and does a ReLU
    relu = ModelFactory(
        build_fn=lambda n: nn.Sequential(*(m for _ in range(n) for m in (nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 128)))),
        inputs_fn=lambda device: (torch.randn(256, 128, device=device),),
        n_layer=2,
        name="relu-mlp",
    )
    ops = {op: nbytes for op, _, _, nbytes, *_ in counted_shape(relu, "fp32").beyond_block}
    assert ops["relu"] > 0 and ops["gelu"] < 0


def test_a_model_that_multiplies_no_param_or_fails_on_meta_says_so():
    lookup = ModelFactory(
        build_fn=lambda n: nn.Embedding(100, 8),
        inputs_fn=lambda device: (torch.zeros(4, dtype=torch.long, device=device),),
        n_layer=1,
    )
    with pytest.raises(ConfigError, match="multiplies no param"):
        counted_shape(lookup, "fp32")

    class Real(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).item() * torch.ones(1, requires_grad=True)  # data on meta: none

    failing = ModelFactory(
        build_fn=lambda n: Real(), inputs_fn=lambda device: (torch.ones(2, 4, device=device),), n_layer=1, name="failing-model"
    )
    with pytest.raises(ConfigError, match="cannot count the failing-model's work on the meta device"):
        counted_shape(failing, "fp32")

    class Lookup(nn.Module):  # any error of the user's own code on meta
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * {"scale": 1.0}[str(x.device)]

    odd = ModelFactory(build_fn=lambda n: Lookup(), inputs_fn=lambda device: (torch.ones(2, 4, device=device),), n_layer=1)
    with pytest.raises(ConfigError, match=r"KeyError: 'meta'"):  # a ConfigError: a plan's speed says why
        counted_shape(odd, "fp32")


def test_a_factory_plan_gets_a_speed_from_its_count_near_its_gpt_shapes():
    shape = GPTShape(n_layer=2, d_model=128, n_head=2, vocab_size=512, seq_len=64, batch_size=4)
    rates = synthetic_rates(compute_tflops=((128, 1.0), (1024, 4.0)), simulated_gpu=True)
    by_shape = hybridps.plan(shape, gpus="1x64MiB", cpu=CPU, rates=rates, simulated_gpus=True, search_largest=False)
    counted = hybridps.plan(_gpt_factory(shape), gpus="1x64MiB", cpu=CPU, rates=rates, simulated_gpus=True, search_largest=False)
    a, b = by_shape.speed, counted.speed
    assert b is not None, counted.speed_note
    # the formula's 6 N T counts every param; the count, the ones a matmul multiplies: not the
    # position embedding's 64 x 128, the norms' 5 x 2 x 128 or the biases' 2 x 9 x 128
    not_multiplied = 64 * 128 + 5 * 2 * 128 + 2 * 9 * 128
    assert b.tokens_per_step == 256
    assert b.model_flops_per_step == pytest.approx(a.model_flops_per_step - 6 * not_multiplied * 256, rel=1e-9)
    assert b.predicted_step_seconds == pytest.approx(a.predicted_step_seconds, rel=0.05)
    assert any("FLOPs counted on meta" in c for c in b.caveats) and not any("FLOPs counted on meta" in c for c in a.caveats)


def test_counted_work_stands_in_for_the_formulas():
    c = CountedShape(
        forward_dense_flops=4e12,
        forward_activation_flops=1e12,
        backward_flops=11e12,  # twice the forward and a fifth of it recomputed
        width=1024,
        rows=4096,
        head_dim=128,
        seq_len=2048,
    )
    work = StepWork(n_params=10**9, n_layer=8, d_model=1024, seq_len=2048, batch_size=2, micro_batches=2, counted=c)
    assert work.micro_batch_tokens == 4096 and work.tokens == 8192
    assert work.model_flops == 2 * 15e12 and work.step_flops == 2 * 16e12
    assert c.recompute_share == pytest.approx(0.2)
    assert work.attention_pass_flops == 2 * 3e12 and work.attention_flops == pytest.approx(2 * 3.2e12)
    assert work.lookup_flops == 0 and work.head_flops == 0
    rates = synthetic_rates(compute_tflops=((1024, 100.0),))
    # the dense FLOPs and the attention's at the block rate where no attention was timed apart
    assert part_seconds(work, rates)["compute"] == pytest.approx(2 * 16e12 / 100e12)
    assert predict_work(work, rates).tokens_per_second == pytest.approx(8192 / predict_work(work, rates).predicted_step_seconds)


def _convnet(n_layer: int = 3) -> ModelFactory:
    return ModelFactory(
        build_fn=lambda n: nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), *(m for _ in range(n) for m in (nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()))
        ),
        inputs_fn=lambda device: (torch.randn(4, 3, 8, 8, device=device),),
        n_layer=n_layer,
        name="convnet",
    )


def test_convolutions_count_at_the_convolution_rate_where_the_rates_timed_one():
    c = counted_shape(_convnet(), "fp32")
    per_layer = 2 * 4 * 8 * 8 * 16 * 16 * 9
    assert c.forward_conv_flops == c.forward_dense_flops == 3 * per_layer + 2 * 4 * 8 * 8 * 16 * 3 * 9
    assert (c.width, c.rows) == (16, 4 * 8 * 8)  # the narrower side of (16, 16 x 9), the output's positions
    # the stem's input takes no grad: the step is less than three forwards
    assert c.conv_step_flops == c.step_flops < 3 * c.forward_flops
    # no block's kernels subtracted for a convolution: its ReLU is its own
    assert {op for op, *_ in c.beyond_block} >= {"relu", "threshold_backward"}
    assert all(nbytes > 0 for op, _, _, nbytes, *_ in c.beyond_block if op in ("relu", "threshold_backward"))
    work = StepWork(n_params=10, n_layer=3, d_model=16, seq_len=256, batch_size=1, counted=c)
    timed = synthetic_rates(compute_tflops=((16, 1.0),), conv_tflops=2.0)
    untimed = synthetic_rates(compute_tflops=((16, 1.0),))
    assert part_seconds(work, timed)["compute"] == pytest.approx(c.step_flops / 2e12)
    assert part_seconds(work, untimed)["compute"] == pytest.approx(c.step_flops / 1e12)
    assert any("timed no convolution" in x for x in predict_work(work, untimed).caveats)
    assert any("3 x 3 convolution" in x for x in predict_work(work, timed).caveats)
    # in another precision than the one timed at the block's speed in it
    fp16 = synthetic_rates(compute_tflops=((16, 1.0),), conv_tflops=2.0, precision_speed={"fp16": ((16, 1024, 3.0),)})
    assert fp16.conv_tflops_at(16, "fp16") == pytest.approx(6.0) and fp16.conv_tflops_at(16) == 2.0


class _Adapted(nn.Module):
    """A frozen linear layer of 64 with an adapter of ``rank`` beside it, as LoRA's."""

    def __init__(self, rank: int):
        super().__init__()
        self.base = nn.Linear(64, 64, bias=False).requires_grad_(False)
        self.down, self.up = nn.Linear(64, rank, bias=False), nn.Linear(rank, 64, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def _adapted(rank: int, n_layer: int = 2) -> ModelFactory:
    return ModelFactory(
        build_fn=lambda n: nn.Sequential(*(_Adapted(rank) for _ in range(n))),
        inputs_fn=lambda device: (torch.randn(32, 64, device=device, requires_grad=True),),
        n_layer=n_layer,
        name=f"adapted-{rank}",
    )


def test_narrow_matmuls_count_at_an_adapters_timed_rate_by_width(tmp_path):
    """[Note: narrow matmuls] in counted_work.py: an adapter's matmuls are kept by width and
    priced at the rates' timed rate of that width (linear between widths, in proportion below
    the first, the block rate from the widest timed on)."""
    c = counted_shape(_adapted(8), "fp32")
    adapters = 2 * (2 * 32 * 64 * 8) * 2  # down and up a layer, two layers
    assert c.forward_narrow_flops == ((8, adapters),)
    assert c.width == 64  # the frozen base weights' side: most of the FLOPs
    assert c.narrow_step_flops == ((8, 3 * adapters),)  # trained: both grads
    assert counted_shape(_adapted(64), "fp32").forward_narrow_flops == ()  # as wide as the widest timed
    work = StepWork(n_params=10, n_layer=2, d_model=64, seq_len=32, batch_size=1, counted=c)
    block = synthetic_rates(compute_tflops=((64, 1.0),))
    narrow = synthetic_rates(compute_tflops=((64, 1.0),), narrow_tflops={"bf16": ((4, 0.1), (16, 0.4), (64, 1.0))})
    assert narrow.narrow_tflops_at(8, 64) == pytest.approx(0.2)  # between 4 and 16
    assert narrow.narrow_tflops_at(2, 64) == pytest.approx(0.05)  # in proportion below the first
    assert narrow.narrow_tflops_at(64, 64) is None and block.narrow_tflops_at(8, 64) is None
    rest = c.step_flops - 3 * adapters
    assert part_seconds(work, block)["compute"] == pytest.approx(c.step_flops / 1e12)
    assert part_seconds(work, narrow)["compute"] == pytest.approx(rest / 1e12 + 3 * adapters / 0.2e12)
    assert any("timed no narrow matmul" in x for x in predict_work(work, block).caveats)
    assert any("adapter's timed rate" in x for x in predict_work(work, narrow).caveats)
    # another precision: as timed in it, else the rates' own at the block's speed in it
    speeds = {"fp16": ((64, 1024, 3.0),), "fp32": ((64, 1024, 0.5),)}
    timed = synthetic_rates(
        compute_tflops=((64, 1.0),),
        narrow_tflops={"bf16": ((4, 0.1), (64, 1.0)), "fp16": ((4, 0.5), (64, 2.0))},
        precision_speed=speeds,
    )
    assert timed.narrow_tflops_at(4, 64, "fp16") == pytest.approx(0.5)
    assert timed.narrow_tflops_at(4, 64, "fp32") == pytest.approx(0.05)
    assert read_rates_file(timed.save(tmp_path / "r.json")) == timed  # stored and read back
    for bad in ({"bf16": ((8, -1.0),)}, {"int4": ((8, 1.0),)}, {"bf16": ((8, 16, 1.0),)}):
        with pytest.raises(ConfigError, match="narrow_tflops"):
            synthetic_rates(compute_tflops=((64, 1.0),), narrow_tflops=bad)


def _mixtral(**overrides):
    transformers = pytest.importorskip("transformers")
    from hybridps.planner.hf_model import HFCausalLMFamily

    fields = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    config = transformers.MixtralConfig(**{**fields, **overrides})
    return HFCausalLMFamily(config=config, n_layer=config.num_hidden_layers, seq_len=32, batch_size=2)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_a_mixture_of_experts_plans_in_every_precision_and_counts_only_the_experts_a_token_takes(precision):
    family = _mixtral()
    assert family.mixture_of_experts and not _mixtral(num_local_experts=1).mixture_of_experts
    rates = synthetic_rates(compute_tflops=((64, 1.0), (1024, 4.0)), simulated_gpu=True)
    # transformers' grouped expert matmuls: their meta kernel takes bf16 alone
    report = hybridps.plan(
        family, gpus="1x64MiB", cpu=CPU, precision=precision, rates=rates, simulated_gpus=True, search_largest=False
    )
    assert report.speed is not None, report.speed_note
    t, d, f, kv, L = 64, 64, 96, 2 * 16, 2
    projections, experts, router = 2 * t * (d * d + 2 * d * kv + d * d), 2 * t * 2 * 3 * d * f, 2 * t * d * 4
    scores_and_values = 4 * t * 32 * d  # the attention's two products over sequences of 32
    forward = L * (projections + experts + router + scores_and_values) + 2 * t * d * 256  # and the untied head
    assert report.speed.model_flops_per_step == pytest.approx(3 * forward)
    # 6 N T would count every expert: four where a token takes two
    assert 6 * report.n_params * t > 1.5 * report.speed.model_flops_per_step
    assert any("FLOPs counted on meta" in c for c in report.speed.caveats)
