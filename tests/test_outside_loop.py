"""A wrapped model keeps the PyTorch contract outside the engine's verbs.

Each pattern runs on the same model, seed and data in plain PyTorch and under HybridPS, and
either matches bit for bit (fp32, fused AdamW) or raises a HybridPSError naming the param and
the fix. Never a silently wrong number or a lost weight.
"""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridps
from hybridps import Config, HybridPSError, StateError
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.params.placeholder import ChunkedParameter, ReadOnlyGrad
from tests.training import train_hf_both

CFG = Config(devices={"cuda:0": "64MiB"})


class Net(nn.Module):
    """Three linears; ``detach_use`` also multiplies by fc.weight through ``.detach()``, before fc."""

    def __init__(self, detach_use: bool = False):
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.fc = nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)
        self.detach_use = detach_use

    def forward(self, x):
        x = self.pre(x)
        if self.detach_use:  # backward reaches this use after fc.weight's grad is final
            x = x + torch.tanh(x @ self.fc.weight.detach())
        h = self.fc(x)
        return self.out(torch.tanh(h)).mean()


class TiedHead(nn.Module):
    """The head is the embedding's weight, used in the parent's forward (not by its module)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mid = nn.Linear(16, 16)

    def forward(self, x):
        h = torch.tanh(self.mid(self.emb(x)))
        return F.cross_entropy(F.linear(h, self.emb.weight).reshape(-1, 50), x.reshape(-1))


class Encoder(nn.Module):
    """Stock nn.TransformerEncoderLayer: MultiheadAttention reads out_proj.weight without calling out_proj."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.layer(x)).mean()


def vec(step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(step))


def seq(step: int) -> torch.Tensor:
    return torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(step))


def ids(step: int) -> torch.Tensor:
    return torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(step))


def pair(make, seed: int = 0):
    torch.manual_seed(seed)
    plain = make()
    return plain, copy.deepcopy(plain)


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def plain_step(model, opt, x) -> float:
    loss = model(x)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def engine_step(engine, x) -> float:
    loss = engine(x)
    engine.backward(loss)
    engine.step()
    engine.zero_grad()
    return loss.item()


def same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def train_both(make, batch, steps=3, config=CFG, **engine_kwargs):
    plain, wrapped = pair(make)
    opt = adamw(plain)
    engine = hybridps.initialize(wrapped, adamw(wrapped), config)
    expected = [plain_step(plain, opt, batch(i)) for i in range(steps)]
    got = [engine_step(engine, batch(i)) for i in range(steps)]
    return plain, wrapped, opt, engine, expected, got


# -- 1. no silent placeholder -------------------------------------------------------------


@pytest.mark.parametrize("make,batch", [(TiedHead, ids), (Encoder, seq)], ids=["tied-head-in-parent", "TransformerEncoderLayer"])
def test_params_used_outside_their_module_are_served_and_join_the_trace(make, batch):
    plain, wrapped, opt, engine, expected, got = train_both(make, batch, steps=4)
    assert got == expected
    assert same_state(plain, wrapped)
    calls = []
    original = ChunkedParameter.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        calls.append(func)
        return original(cls, func, types, args, kwargs)

    ChunkedParameter.__torch_function__ = classmethod(counting)
    try:  # after the first iteration, the borrowed params are accessed up front like own ones
        assert engine_step(engine, batch(10)) == plain_step(plain, opt, batch(10))
    finally:
        ChunkedParameter.__torch_function__ = classmethod(original)
    assert [c for c in calls if getattr(c, "__name__", "") not in ("__get__", "__set__", "requires_grad_")] == []


def test_multihead_attention_eval_fast_path_matches():
    plain, wrapped, opt, engine, expected, got = train_both(Encoder, seq, steps=2)
    plain.eval()
    engine.eval()
    with torch.no_grad():
        assert torch.equal(plain(seq(7)), engine(seq(7)))


def test_metadata_answers_without_materializing():
    plain, wrapped = pair(Net)
    engine = hybridps.initialize(wrapped, adamw(wrapped), CFG)
    w = wrapped.fc.weight
    assert isinstance(w, ChunkedParameter) and isinstance(w, nn.Parameter)
    assert w.shape == (16, 16) and w.size() == (16, 16) and w.numel() == 256 and w.dim() == 2 and w.ndim == 2
    assert sum(p.numel() for p in wrapped.parameters()) == sum(p.numel() for p in plain.parameters())
    assert w.requires_grad and w.dtype == torch.float32
    assert "fc.weight" in repr(w)
    assert engine.memory_stats()["moves"] == 0


def test_data_outside_forward_raises_with_the_fix():
    _, wrapped = pair(Net)
    hybridps.initialize(wrapped, adamw(wrapped), CFG)
    with pytest.raises(HybridPSError, match=r"fc\.weight.*gathered_parameters"):
        wrapped.fc.weight.data.clamp_(-1, 1)
    with pytest.raises(HybridPSError, match=r"fc\.weight.*\.data"):
        wrapped.fc.weight.data = torch.zeros(16, 16)


# -- 2. state dicts -----------------------------------------------------------------------


def test_state_dict_after_training_equals_plain_and_round_trips_through_torch_save(tmp_path):
    plain, wrapped, opt, engine, expected, got = train_both(Net, vec, steps=3)
    assert got == expected
    assert same_state(plain, wrapped)
    torch.save(wrapped.state_dict(), tmp_path / "sd.pt")
    loaded = torch.load(tmp_path / "sd.pt")
    assert all(torch.equal(loaded[k], v) for k, v in plain.state_dict().items())
    assert all(v.shape != (0,) for v in loaded.values())


def test_load_state_dict_writes_through_to_the_master_copies():
    plain, wrapped, opt, engine, _, _ = train_both(Net, vec, steps=2)
    torch.manual_seed(5)
    fresh = Net().state_dict()
    plain.load_state_dict(fresh)
    wrapped.load_state_dict(fresh)
    assert same_state(plain, wrapped)
    # the next steps start from the loaded values (fp32 master included), as in plain PyTorch
    assert [engine_step(engine, vec(i)) for i in range(5, 8)] == [plain_step(plain, opt, vec(i)) for i in range(5, 8)]
    with pytest.raises(RuntimeError, match="size mismatch"):  # torch's own check sees the real shape
        wrapped.load_state_dict({**fresh, "fc.weight": torch.zeros(3, 3)})


def test_bf16_state_dict_holds_the_fp32_masters():
    _, wrapped = pair(Net)
    engine = hybridps.initialize(wrapped, adamw(wrapped), Config(devices={"cuda:0": "64MiB"}, precision="bf16"))
    engine_step(engine, vec(0))
    sd = wrapped.state_dict()
    master = {k: v for k, v in engine.state_dict().items()}
    assert all(sd[k].dtype == torch.float32 and torch.equal(sd[k], master[k]) for k in sd)


def test_state_dict_streams_without_extra_chunks():
    """Saving reads each param from its master copy into its own output tensor: no chunk moves
    or allocations on any device, and nothing held beyond the returned values."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    n_bytes = sum(p.numel() for p in model.parameters()) * 4
    engine = hybridps.initialize(model, adamw(model), Config(devices={"cuda:0": n_bytes // 2}, chunk_size=64 * 65, alignment=1))
    engine.backward(engine(torch.randn(4, 64)).pow(2).mean())
    engine.step()
    before = engine.memory_stats()
    sd = model.state_dict()
    after = engine.memory_stats()
    assert after["moves"] == before["moves"]
    for name, dev in after["devices"].items():
        assert dev["peak_bytes"] == before["devices"][name]["peak_bytes"], name
        assert dev["used_bytes"] == before["devices"][name]["used_bytes"], name
    assert sum(v.numel() * v.element_size() for v in sd.values()) == n_bytes
    assert engine.client.mover.pool.stats() == before["pool"]


def test_hf_save_pretrained_round_trips_bit_for_bit_with_tied_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=1,
        n_head=2,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(cfg)
    wrapped = copy.deepcopy(plain)
    opt = adamw(plain)
    engine = hybridps.initialize(wrapped, adamw(wrapped), CFG)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    train_hf_both(plain, opt, engine, [x, x])
    assert wrapped.num_parameters() == plain.num_parameters()
    wrapped.save_pretrained(tmp_path / "hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert same_state(loaded, plain)


# -- 3. editing weights outside forward ---------------------------------------------------


def test_in_place_edits_between_steps_write_through():
    plain, wrapped, opt, engine, _, _ = train_both(Net, vec, steps=2)
    with torch.no_grad():
        for model in (plain, wrapped):
            for p in model.parameters():
                p.clamp_(-0.05, 0.05)  # WGAN weight clipping
    for init in (nn.init.xavier_uniform_, nn.init.normal_, nn.init.kaiming_uniform_, nn.init.trunc_normal_):
        # normal_, kaiming_uniform_, trunc_normal_ reach __torch_function__ with keywords only
        for model in (plain, wrapped):
            torch.manual_seed(3)
            init(model.out.weight)
        assert same_state(plain, wrapped), init.__name__
    assert [engine_step(engine, vec(i)) for i in range(3)] == [plain_step(plain, opt, vec(i)) for i in range(3)]
    with pytest.raises(HybridPSError, match="requires grad.*torch.no_grad"):
        wrapped.fc.weight.mul_(2)  # plain PyTorch refuses a leaf's in-place edit under grad too


def test_gathered_parameters_edits_and_guards():
    plain, wrapped, opt, engine, _, _ = train_both(Net, vec, steps=2)
    with torch.no_grad():
        for p in plain.parameters():
            p.data.mul_(0.5)
    with engine.gathered_parameters(modify=True):
        for p in wrapped.parameters():
            p.data.mul_(0.5)
    assert same_state(plain, wrapped)
    assert [engine_step(engine, vec(i)) for i in range(2)] == [plain_step(plain, opt, vec(i)) for i in range(2)]
    with pytest.raises(StateError, match="modify=True"):
        with engine.gathered_parameters([wrapped.fc.weight]):
            wrapped.fc.weight.data.zero_()
    assert same_state(plain, wrapped), "a refused edit is not kept"
    with engine.gathered_parameters(wrapped.out):  # reading: ordinary tensors
        assert torch.equal(wrapped.out.weight, plain.out.weight)
        assert type(wrapped.out.weight) is nn.Parameter


def test_ema_by_deepcopy_and_averaged_model_match_plain():
    plain, wrapped, opt, engine, _, _ = train_both(Net, vec, steps=1)
    ema_fn = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    ema_plain = torch.optim.swa_utils.AveragedModel(plain, multi_avg_fn=ema_fn)
    ema_wrapped = torch.optim.swa_utils.AveragedModel(wrapped, multi_avg_fn=ema_fn)
    assert all(type(p) is nn.Parameter for p in ema_wrapped.parameters())
    for i in range(3):
        plain_step(plain, opt, vec(i))
        engine_step(engine, vec(i))
        ema_plain.update_parameters(plain)
        ema_wrapped.update_parameters(wrapped)
    assert same_state(ema_plain, ema_wrapped)
    assert torch.equal(ema_wrapped(vec(9)), ema_plain(vec(9)))  # the copy is an ordinary model


def test_pickling_the_model_refuses_with_the_fix():
    _, wrapped = pair(Net)
    hybridps.initialize(wrapped, adamw(wrapped), CFG)
    with pytest.raises(HybridPSError, match="state_dict"):
        pickle.dumps(wrapped)


def test_reads_with_grad_outside_forward_keep_their_gradient():
    """A penalty on the weights computed in the training loop (outside forward) still sends
    its grad to the params."""
    plain, wrapped = pair(Net)
    opt = adamw(plain)
    engine = hybridps.initialize(wrapped, adamw(wrapped), Config(devices={"cuda:0": "64MiB"}, grad_reuse=False))
    for i in range(3):
        loss = plain(vec(i)) + 0.1 * plain.fc.weight.pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        got = engine(vec(i)) + 0.1 * wrapped.fc.weight.pow(2).sum()
        engine.backward(got)
        engine.step()
        engine.zero_grad()
        assert got.item() == pytest.approx(loss.item(), rel=1e-6)
    for a, b in zip(plain.parameters(), wrapped.state_dict().values(), strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)


# -- 4. gradients and clipping ------------------------------------------------------------


def test_torch_clip_grad_norm_refuses_and_engine_clip_is_idempotent():
    plain, wrapped = pair(Net)
    opt = adamw(plain)
    engine = hybridps.initialize(wrapped, adamw(wrapped), CFG)
    for i in range(3):
        loss = plain(vec(i)) * 100
        opt.zero_grad()
        loss.backward()
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
        opt.step()
        got = engine(vec(i)) * 100
        engine.backward(got)
        grad = wrapped.fc.weight.grad
        assert isinstance(grad, ReadOnlyGrad) and grad.shape == (16, 16)
        with pytest.raises(HybridPSError, match=r"grad of param '\w+\.weight'.*engine\.clip_grad_norm_"):
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 0.1)
        norm = engine.clip_grad_norm_(0.1)
        assert torch.equal(engine.clip_grad_norm_(0.1), norm), "a second clip returns the first norm"
        with pytest.raises(StateError, match="(?i)clip once"):
            engine.clip_grad_norm_(0.5)
        assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
        assert torch.equal(wrapped.out.bias.grad, plain.out.bias.grad), "param.grad shows the clipped grad"
        engine.step()
        if i == 1:
            wrapped.zero_grad(set_to_none=False)  # zeroing in place drops the grads as well
        else:
            wrapped.zero_grad()  # model.zero_grad() drops HybridPS grads too
        assert wrapped.fc.weight.grad is None
        assert same_state(plain, wrapped)


def test_grads_left_before_initialize_are_dropped_with_a_warning(caplog):
    plain, wrapped = pair(Net)
    wrapped(vec(100)).backward()  # a sanity backward before wrapping
    opt = adamw(plain)
    with caplog.at_level(logging.WARNING):
        engine = hybridps.initialize(wrapped, adamw(wrapped), CFG)
    assert "dropping the .grad" in caplog.text and "fc.weight" in caplog.text
    assert [engine_step(engine, vec(i)) for i in range(3)] == [plain_step(plain, opt, vec(i)) for i in range(3)]
    assert same_state(plain, wrapped)


def test_unfreezing_after_initialize_trains_like_plain():
    plain, wrapped = pair(Net)
    for model in (plain, wrapped):
        model.fc.weight.requires_grad_(False)
    opt = adamw(plain)
    engine = hybridps.initialize(wrapped, adamw(wrapped), CFG)
    expected, got = [], []
    for i in range(4):
        if i == 2:
            plain.fc.weight.requires_grad_(True)
            wrapped.fc.weight.requires_grad = True
        expected.append(plain_step(plain, opt, vec(i)))
        got.append(engine_step(engine, vec(i)))
    assert got == expected
    assert same_state(plain, wrapped)


def test_unfreezing_a_param_the_optimizer_lacks_is_refused():
    _, wrapped = pair(Net)
    wrapped.fc.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], fused=True)
    engine = hybridps.initialize(wrapped, opt, CFG)
    wrapped.fc.weight.requires_grad_(True)
    with pytest.raises(HybridPSError, match=r"fc\.weight.*no param group"):
        engine(vec(0))


def test_bare_loss_backward_works_in_fp32_and_is_refused_in_fp16():
    plain, wrapped = pair(Net)
    opt = adamw(plain)
    engine = hybridps.initialize(wrapped, adamw(wrapped), CFG)
    for i in range(3):
        expected = plain_step(plain, opt, vec(i))
        loss = engine(vec(i))
        loss.backward()
        engine.step()
        engine.zero_grad()
        assert loss.item() == expected
    _, wrapped = pair(Net)
    engine = hybridps.initialize(wrapped, adamw(wrapped), Config(devices={"cuda:0": "64MiB"}, precision="fp16"))
    engine(vec(0)).backward()
    with pytest.raises(StateError, match=r"loss\.backward\(\).*engine\.backward\(loss\)"):
        engine.step()


def test_trainer_style_optimizer_step_with_a_scheduler():
    plain, wrapped = pair(Net)
    opt = adamw(plain)
    engine = hybridps.initialize(wrapped, adamw(wrapped), CFG)
    sched_plain = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, 1, 0.5)
    for i in range(3):
        expected = plain(vec(i))
        expected.backward()
        opt.step()
        sched_plain.step()
        opt.zero_grad()
        loss = engine(vec(i))
        engine.backward(loss)
        engine.optimizer.step()
        sched.step()
        engine.optimizer.zero_grad()
        assert loss.item() == expected.item()
    assert engine.global_step == 3


# -- 5. grad reuse is safe ----------------------------------------------------------------


def test_grad_reuse_keeps_a_grad_out_of_a_slot_autograd_still_needs():
    plain, wrapped, opt, engine, expected, got = train_both(lambda: Net(detach_use=True), vec, steps=4)
    assert engine.config.grad_reuse
    assert got == expected
    assert same_state(plain, wrapped)


def test_grad_reuse_with_the_model_called_directly_keeps_the_grad_out_of_the_slot_too():
    """Called directly (not through engine(...)), the model's forward is the engine's: the same
    saved-tensor count keeps the grad out of a slot autograd still needs, and training is exact."""
    plain, wrapped = pair(lambda: Net(detach_use=True))
    opt = adamw(plain)
    engine = hybridps.initialize(wrapped, adamw(wrapped), CFG)
    for i in range(4):
        expected = plain_step(plain, opt, vec(i))
        loss = wrapped(vec(i))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        assert loss.item() == expected
    assert same_state(plain, wrapped)


def test_reentrant_checkpoint_of_a_shared_block_names_the_cause():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Linear(16, 16)

        def forward(self, x):
            x = x.requires_grad_()
            for _ in range(2):
                x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True)
            return x.mean()

    _, wrapped = pair(Shared)
    engine = hybridps.initialize(wrapped, adamw(wrapped), CFG)
    with pytest.raises(StateError, match="during backward.*holds its grad.*reentrant.*use_reentrant=False"):
        engine.backward(engine(vec(0)))


# -- 7. initialize twice, compiled models -------------------------------------------------


@pytest.mark.slow
def test_initialize_twice_and_compiled_models_are_refused():
    _, wrapped = pair(Net)
    engine = hybridps.initialize(wrapped, adamw(wrapped), CFG)
    with pytest.raises(HybridPSError, match="initialize called twice"):
        hybridps.initialize(wrapped, adamw(wrapped), CFG)
    assert engine_step(engine, vec(0)) is not None  # the first engine is untouched
    engine.close()
    assert all(type(p) is nn.Parameter and p.numel() for p in wrapped.parameters())
    other = hybridps.initialize(wrapped, adamw(wrapped), CFG)  # after close, again
    other.close()
    with pytest.raises(HybridPSError, match="_orig_mod"):
        hybridps.initialize(torch.compile(Net()), adamw(wrapped), CFG)


def test_a_closed_engine_without_restore_leaves_params_that_refuse_ops():
    _, wrapped = pair(Net)
    engine = hybridps.initialize(wrapped, adamw(wrapped), CFG)
    engine.client.close(restore=False)
    with pytest.raises(StateError, match="restore=False"):
        wrapped.fc.weight.sum()


def test_managed_tensors_read_and_write_through():
    with hybridps.Client(Config(devices={"cuda:0": "1MiB"})) as client:
        client.register_module(nn.Linear(4, 4))
        managed = client.allreduce(torch.arange(6.0).reshape(2, 3))
        assert torch.equal(managed.detach(), torch.arange(6.0).reshape(2, 3))
        with torch.no_grad():
            managed.add_(1)
        assert torch.equal(managed.sum(), torch.tensor(21.0))
        assert client.rows[ChunkKind.BUFFER][0].payload is not None


# -- several ranks ------------------------------------------------------------------------


def _outside_loop_on_ranks(rank, world):
    torch.manual_seed(0)
    model = TiedHead()
    engine = hybridps.initialize(model, adamw(model), Config(devices={"cuda:0": "64MiB"}, collective_timeout_s=60.0))
    losses = []
    for i in range(3):
        loss = engine(ids(i)[rank::world])
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    refused = ""
    if world > 1:
        try:
            model.state_dict()
        except HybridPSError as exc:
            refused = str(exc)
    with engine.gathered_parameters(model.mid, modify=True):
        if rank == 0:  # rank 0's edits are the ones kept
            model.mid.weight.data.mul_(0.5)
    return losses, refused, engine.state_dict()


@pytest.mark.slow
def test_several_ranks_serve_borrowed_params_and_edit_collectively():
    from tests.dist import run_ranks

    ((one_losses, _, one_state),) = [_outside_loop_on_ranks(0, 1)]
    results = run_ranks(_outside_loop_on_ranks, 2)
    for losses, refused, state in results:
        assert losses == pytest.approx(one_losses, rel=1e-5)
        assert "engine.state_dict()" in refused and "ranks" in refused
        for key, value in one_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-6)


def test_peft_lora_trains_saves_adapters_and_merges_inside_gathered_parameters(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=1,
        n_head=2,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    wrapped = peft.get_peft_model(
        transformers.GPT2LMHeadModel(cfg), peft.LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0)
    )
    plain = copy.deepcopy(wrapped)
    opt = adamw(plain)
    engine = hybridps.initialize(wrapped, adamw(wrapped), CFG)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    train_hf_both(plain, opt, engine, [x, x, x])
    expected = peft.get_peft_model_state_dict(plain)
    got = peft.get_peft_model_state_dict(wrapped)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    wrapped.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    with pytest.raises(HybridPSError, match=r"base_layer\.weight.*gathered_parameters"):
        wrapped.merge_and_unload()  # merging edits .data in place
    with engine.gathered_parameters(modify=True):
        merged = wrapped.merge_and_unload()
    assert same_state(merged, plain.merge_and_unload())


def test_deberta_v2_reads_its_relative_embeddings_outside_their_module():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DebertaV2Config(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        relative_attention=True,
        position_buckets=8,
        pos_att_type=["p2c", "c2p"],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    plain = transformers.DebertaV2ForMaskedLM(cfg)
    wrapped = copy.deepcopy(plain)
    opt = adamw(plain)
    engine = hybridps.initialize(wrapped, adamw(wrapped), CFG)
    train_hf_both(
        plain, opt, engine, [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    )
    assert same_state(plain, wrapped)


def test_a_state_dict_cut_short_leaves_no_stale_copies():
    plain, wrapped, opt, engine, _, _ = train_both(Net, vec, steps=1)

    def boom(module, state_dict, prefix, local_metadata):
        raise RuntimeError("disk full")

    handle = wrapped.out.register_state_dict_post_hook(boom)
    with pytest.raises(RuntimeError, match="disk full"):
        wrapped.state_dict()
    handle.remove()
    assert engine_step(engine, vec(1)) == plain_step(plain, opt, vec(1))
    assert torch.equal(wrapped.fc.weight.detach(), plain.fc.weight.detach()), "the value after the step, not a cached one"
