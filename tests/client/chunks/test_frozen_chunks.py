"""Frozen chunks: params no optimizer steps (a LoRA model's base weights, frozen layers) fill
chunks of their own, which keep the param chunk and nothing else (no grad, no optimizer
state, no master unless the param chunk's dtype would round the value); training stays
bit-equal to plain PyTorch ([Note: frozen chunks] in layout.py)."""

import copy

import pytest
import torch

import hybridps
from hybridps import HybridPSError
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.layout import ChunkLayout
from hybridps.models.gpt import GPT
from tests.training import SMALL_GPT, LoraNet, model_data_bytes, tokens, trained_adamw


def test_frozen_tensors_fill_chunks_of_their_own_in_registration_order():
    layout = ChunkLayout(100)
    a = layout.add(40)
    f1 = layout.add(70, frozen=True)
    b = layout.add(40)
    f2 = layout.add(20, frozen=True)
    big = layout.add(150, frozen=True)  # an oversize frozen tensor: a chunk of its own size
    c = layout.add(30)
    assert a.chunk == b.chunk and f1.chunk == f2.chunk and a.chunk != f1.chunk
    assert c.chunk != a.chunk  # 40 + 40 + 30 > 100
    assert [layout.frozen(i) for i in range(layout.num_chunks)] == [False, True, True, False]
    assert big.chunk == 2 and layout.capacity(2) == 150
    assert (f1.offset, f2.offset) == (0, 70)
    clone = layout.copy()  # the oversize tensor closed the frozen stream's open chunk
    assert clone.add(10, frozen=True).chunk == layout.num_chunks and layout.add(10).chunk == c.chunk
    kept = ChunkLayout(100, fill_past_oversize=True)
    first = kept.add(70, frozen=True)
    kept.add(150, frozen=True)
    assert kept.add(20, frozen=True).chunk == first.chunk and not kept.frozen(kept.add(5).chunk)


def _run_both(make, config, steps=4, data=None):
    torch.manual_seed(0)
    plain = make()
    wrapped = copy.deepcopy(plain)
    popt = trained_adamw(plain)
    engine = hybridps.initialize(wrapped, trained_adamw(wrapped), config)
    data = data or [torch.randn(8, 256, generator=torch.Generator().manual_seed(s)) for s in range(steps)]
    ours, theirs = [], []
    for x in data:
        popt.zero_grad()
        loss = plain(x)
        loss.backward()
        popt.step()
        theirs.append(loss.item())
        loss = wrapped(x)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        ours.append(loss.item())
    return plain, wrapped, engine, ours, theirs


def _kind_bytes(engine, kind):
    return engine.memory_stats()["kinds"].get(kind, {}).get("bytes", 0)


@pytest.mark.parametrize("devices", [{}, {"cuda:0": "3MiB"}], ids=["cpu", "tight-gpu"])
def test_a_lora_model_trains_bit_equal_and_keeps_no_rows_for_its_base_weights(devices):
    config = hybridps.Config(devices=devices, chunk_size=1 << 16)
    plain, wrapped, engine, ours, theirs = _run_both(LoraNet, config)
    assert ours == theirs
    ps, ws = plain.state_dict(), wrapped.state_dict()
    assert all(torch.equal(ps[k], ws[k]) for k in ps)
    store = engine.client.store
    frozen = [i for i in range(store.num_chunks) if store.layout.frozen(i)]
    assert frozen and all(info.frozen == (not info.param.requires_grad) for info in store.params)
    stepped = [i for i in range(store.num_chunks) if i not in frozen]
    # momentum and variance rows for the trained params' chunks alone
    assert _kind_bytes(engine, "momentum") == 4 * sum(store.layout.capacity(i) for i in stepped)
    for i in frozen:
        assert all(
            not store.rows[k][i].slots and store.rows[k][i].payload is None for k in store.rows if k is not ChunkKind.PARAM
        )
    per_row = len([k for k in store.rows if engine.memory_stats()["kinds"].get(k.value, {}).get("bytes")])
    expected = 4 * sum(store.layout.capacity(i) for i in frozen) + per_row * 4 * sum(store.layout.capacity(i) for i in stepped)
    assert engine.memory_stats()["model_data_bytes"] == expected


def _partly_frozen_gpt():
    model = GPT(SMALL_GPT)
    for module in (model.wte, model.wpe, model.blocks[0], model.blocks[1]):
        module.requires_grad_(False)
    return model


def test_frozen_layers_of_a_gpt_on_a_tight_gpu_train_bit_equal_and_save_load_exactly(tmp_path):
    cfg = SMALL_GPT
    config = hybridps.Config(devices={"cuda:0": int(model_data_bytes(cfg) * 0.3)})

    def make():
        model = _partly_frozen_gpt()
        model.forward_loss = model.forward
        return model

    torch.manual_seed(0)
    plain = make()
    wrapped = copy.deepcopy(plain)
    popt, opt = trained_adamw(plain), trained_adamw(wrapped)
    engine = hybridps.initialize(wrapped, opt, config)
    for step in range(3):
        x, y = tokens(step, 2, cfg.seq_len)
        popt.zero_grad()
        _, loss = plain(x, y)
        loss.backward()
        popt.step()
        _, got = wrapped(x, y)
        engine.backward(got)
        engine.step()
        engine.zero_grad()
        assert got.item() == loss.item()
    assert any(engine.client.store.layout.frozen(i) for i in range(engine.client.store.num_chunks))
    engine.save_checkpoint(tmp_path / "ck")
    torch.manual_seed(5)
    other_model = make()
    other = hybridps.initialize(other_model, trained_adamw(other_model), config)
    other.load_checkpoint(tmp_path / "ck")
    x, y = tokens(3, 2, cfg.seq_len)
    _, a = wrapped(x, y)
    _, b = other_model(x, y)
    assert a.item() == b.item()
    ps, os_ = plain.state_dict(), other_model.state_dict()
    assert all(torch.equal(ps[k], os_[k]) for k in ps)


def test_a_frozen_fp32_param_under_bf16_keeps_its_exact_value_and_a_bf16_one_keeps_no_master():
    torch.manual_seed(0)
    model = LoraNet(d=64, layers=2)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    engine = hybridps.initialize(model, trained_adamw(model), hybridps.Config(precision="bf16", chunk_size=1 << 14))
    store = engine.client.store
    frozen = [info for info in store.params if info.frozen]
    assert frozen and all(store.value_kind(info) is ChunkKind.MASTER for info in frozen)
    got = model.state_dict()
    assert all(torch.equal(got[k], original[k]) for k in original)  # not rounded to bf16

    torch.manual_seed(0)
    model16 = LoraNet(d=64, layers=2).to(torch.bfloat16)
    engine16 = hybridps.initialize(model16, trained_adamw(model16), hybridps.Config(precision="bf16", chunk_size=1 << 14))
    store16 = engine16.client.store
    frozen16 = [info for info in store16.params if info.frozen]
    assert frozen16 and all(store16.value_kind(info) is ChunkKind.PARAM for info in frozen16)
    assert all(not store16.rows[ChunkKind.MASTER][info.chunk].slots for info in frozen16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    engine16.backward(model16(x))
    engine16.step()
    engine16.zero_grad()
    assert model16.state_dict()["layers.0.base.weight"].dtype is torch.bfloat16


def test_frozen_params_the_optimizer_holds_stay_among_the_stepped_and_can_be_unfrozen():
    torch.manual_seed(0)
    model = LoraNet(d=64, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # the frozen ones too
    engine = hybridps.initialize(model, opt, hybridps.Config(chunk_size=1 << 14))
    store = engine.client.store
    assert not any(store.layout.frozen(i) for i in range(store.num_chunks))
    model.layers[0].base.requires_grad_(True)  # unfreezing later: it has its rows
    engine.backward(model(torch.randn(4, 64)))
    engine.step()
    engine.zero_grad()


def test_unfreezing_a_param_laid_out_frozen_is_refused_with_the_fix():
    torch.manual_seed(0)
    model = LoraNet(d=64, layers=2)
    engine = hybridps.initialize(model, trained_adamw(model), hybridps.Config(chunk_size=1 << 14))
    model.layers[1].base.weight.requires_grad_(True)
    with pytest.raises(HybridPSError, match="no param group"):
        engine.backward(model(torch.randn(4, 64)))


@pytest.mark.parametrize(
    ("precision", "orig", "master"),
    [
        ("fp32", torch.float32, False),
        ("fp32", torch.bfloat16, False),  # fp32 holds a bf16 value exactly
        ("bf16", torch.float32, True),
        ("bf16", torch.bfloat16, False),
        ("fp16", torch.bfloat16, True),  # fp16 would round a bf16 value
    ],
)
def test_a_frozen_param_keeps_a_master_only_where_its_param_chunk_would_round_it(precision, orig, master):
    torch.manual_seed(0)
    model = LoraNet(d=64, layers=1).to(orig)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    config = hybridps.Config(devices={"cuda:0": "64MiB"}, precision=precision, chunk_size=1 << 14)
    engine = hybridps.initialize(model, trained_adamw(model), config)
    store = engine.client.store
    frozen = [info for info in store.params if info.frozen]
    assert frozen and all((store.value_kind(info) is ChunkKind.MASTER) == master for info in frozen)
    got = model.state_dict()
    assert all(torch.equal(got[k], original[k]) and got[k].dtype == orig for k in original if "base" in k)


def test_an_optimizer_holding_params_laid_out_frozen_is_refused_with_the_fix():
    """``register_module(..., optimizer_follows=a)`` lays out the params ``a`` does not hold as
    frozen; registering another optimizer that holds them would step params without rows."""
    torch.manual_seed(0)
    model = LoraNet(d=64, layers=1)
    with hybridps.Client(hybridps.Config(chunk_size=1 << 14)) as client:
        client.register_module(model, optimizer_follows=trained_adamw(model))
        assert any(client.param_info(p).frozen for p in model.parameters())
        with pytest.raises(HybridPSError, match="laid out frozen.*optimizer_follows"):
            client.register_optim(torch.optim.AdamW(model.parameters(), lr=1e-2))


@pytest.mark.parametrize(
    ("config", "exact"),
    [
        (dict(devices={"cuda:0": "3MiB"}, overlap_step=True), True),  # steps during backward
        (dict(devices={"cuda:0": "4MiB"}, grad_reuse=False), True),  # grads in chunks of their own
        (dict(devices={"cuda:0": "3MiB", "cpu": "3MiB", "nvme": "64MiB"}), True),  # a disk tier
        (dict(devices={"cuda:0": "3MiB"}, optimizer_states="int8"), False),
        (dict(devices={"cuda:0": "3MiB"}, precision="bf16"), False),
        (dict(devices={"cuda:0": "3MiB"}, precision="fp16"), False),  # a loss scale
    ],
    ids=["overlap-step", "no-grad-reuse", "disk", "int8-states", "bf16", "fp16"],
)
def test_frozen_chunks_change_the_memory_not_the_numbers_under_every_mode(config, exact, tmp_path):
    """The same LoRA model with the optimizer over its adapters (frozen chunks) and over every
    param (Adam skips those without grads; the layout of before): the same losses in every
    mode, and in fp32 plain PyTorch's bit for bit; less model data."""
    if "nvme" in config["devices"]:
        config = {**config, "nvme_path": str(tmp_path)}
    accumulate = config.get("grad_reuse") is False  # two micro-batches a step where grads have chunks
    torch.manual_seed(0)
    plain = LoraNet()
    models = [copy.deepcopy(plain), copy.deepcopy(plain)]
    optimizers = [trained_adamw(models[0]), torch.optim.AdamW(models[1].parameters(), lr=1e-2, weight_decay=0.1, fused=True)]
    engines = [
        hybridps.initialize(m, o, hybridps.Config(chunk_size=1 << 16, **config))
        for m, o, config in zip(models, optimizers, (config, {**config, "nvme_path": str(tmp_path / "b")}), strict=True)
    ]
    layouts = [e.client.store.layout for e in engines]
    assert [any(lay.frozen(i) for i in range(lay.num_chunks)) for lay in layouts] == [True, False]
    popt = trained_adamw(plain)
    for step in range(4):
        batches = [torch.randn(8, 256, generator=torch.Generator().manual_seed(10 * step + k)) for k in range(1 + accumulate)]
        popt.zero_grad()
        losses = []
        for x in batches:
            expected = plain(x)
            expected.backward()
            losses = []
            for model, engine in zip(models, engines, strict=True):
                got = model(x)
                engine.backward(got)
                losses.append(got.item())
        popt.step()
        for engine in engines:
            engine.step()
            engine.zero_grad()
        assert losses[0] == losses[1]
        if exact:
            assert losses[0] == expected.item()
    stats = [e.memory_stats()["model_data_bytes"] for e in engines]
    assert stats[0] < 0.6 * stats[1]  # 16-bit keeps the fp32 weights' masters; int8 moments are small
    for engine in engines:
        engine.close()
