"""Compact (int8) optimizer states in chunks (Config.optimizer_states="int8"): the chunked step
equals the same 8-bit algorithm stepped per param, every byte count counts the compact rows,
and the states go in and out (state dicts, checkpoints, a switch at resume) without a loss."""

from __future__ import annotations

import pytest
import torch

import hybridps
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.optim.compact_adam import compact_adam_
from hybridps.client.optim.moment_codes import MomentRow
from hybridps.common.errors import ConfigError
from hybridps.common.optimizer_states import BLOCK_ELEMENTS, compact_row_bytes
from hybridps.models import GPT, GPTConfig
from tests.training import SMALL_GPT, gpt_pair, model_data_bytes, tokens, train_engine

MODEL_BYTES = model_data_bytes(SMALL_GPT)


class Int8AdamW(torch.optim.Optimizer):
    """The same 8-bit AdamW per param, outside HybridPS: each param's moments in a compact row
    of its own (its blocks are its own, as in a chunk), stepped by the same kernel."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    n = p.numel()
                    state["step"] = 0
                    state["m"] = MomentRow(torch.zeros(compact_row_bytes(n), dtype=torch.uint8), n, signed=True)
                    state["v"] = MomentRow(torch.zeros(compact_row_bytes(n), dtype=torch.uint8), n, signed=False)
                state["step"] += 1
                beta1, beta2 = group["betas"]
                compact_adam_(
                    p.view(-1), p.grad.view(-1), state["m"], state["v"], 0, p.numel(),
                    lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                    step=state["step"], decoupled_weight_decay=True,
                )  # fmt: skip


def train_reference(model, optimizer, steps, batch=2):
    losses = []
    for step in range(steps):
        x, y = tokens(step, batch, model.cfg.seq_len)
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def int8_config(**extra) -> hybridps.Config:
    return hybridps.Config(devices={"cuda:0": int(MODEL_BYTES * 0.5)}, optimizer_states="int8", **extra)


def test_an_unknown_optimizer_states_value_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="'fp32', 'int8'"):
        hybridps.Config(optimizer_states="int4")


def test_the_chunked_int8_step_equals_the_same_algorithm_per_param_bit_for_bit():
    plain, model = gpt_pair()
    expected = train_reference(plain, Int8AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1), 6)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), int8_config())
    got = train_engine(engine, 6, clip=None)
    assert got == expected
    for name, p in plain.named_parameters():
        assert torch.equal(engine.client.read_param(dict(model.named_parameters())[name]), p.detach()), name
    engine.close()


def test_compact_rows_are_counted_as_bytes_everywhere():
    _, model = gpt_pair()
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), int8_config(precision="bf16"))
    store = engine.client.store
    for info in store.params:
        assert info.slot.offset % BLOCK_ELEMENTS == 0  # a tensor's blocks are its own
    stats = engine.memory_stats()
    assert stats["optimizer_states"] == "int8"
    for kind in (ChunkKind.MOMENTUM, ChunkKind.VARIANCE):
        for chunk, param in zip(store.rows[kind], store.rows[ChunkKind.PARAM], strict=True):
            assert chunk.dtype == torch.uint8 and chunk.nbytes == compact_row_bytes(param.capacity)
        assert stats["kinds"][kind.value]["bytes"] == sum(compact_row_bytes(c.capacity) for c in store.rows[ChunkKind.PARAM])
    assert stats["model_data_bytes"] == sum(c.nbytes for c in store.all_chunks())
    engine.close()


def test_a_100m_model_keeps_under_8_3_bytes_a_param_with_bf16_and_int8_states():
    cfg = GPTConfig(n_layer=16, d_model=768, n_head=12, seq_len=64)
    with torch.device("meta"):
        model = GPT(cfg)
    config = hybridps.Config(
        devices={"cuda:0": "4GiB", "cpu": "8GiB"}, precision="bf16", optimizer_states="int8", simulate="meta"
    )
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    n = sum(p.numel() for p in model.parameters())
    assert n > 100e6
    per_param = engine.memory_stats()["model_data_bytes"] / n
    assert per_param <= 8.3, per_param
    engine.client.close(restore=False)


def test_optimizer_state_shows_dequantized_moments_and_a_plain_state_dict_loads_quantized():
    plain, model = gpt_pair()
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    x, y = tokens(0)
    plain(x, y)[1].backward()
    reference.step()
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), int8_config())
    engine.optimizer.load_state_dict(reference.state_dict())
    for name, p in plain.named_parameters():
        mine = dict(model.named_parameters())[name]
        state, want = engine.optimizer.state[mine], reference.state[p]
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].shape == p.shape
        for key in ("exp_avg", "exp_avg_sq"):
            # within half a step of the map at the block's scale (the map's widest step is about 1/16 of it)
            scale = want[key].abs().max()
            assert torch.allclose(state[key], want[key], atol=float(scale) * 0.07), (name, key)
    saved = engine.optimizer.state_dict()
    assert set(saved["state"][0]) >= {"step", "exp_avg", "exp_avg_sq"}
    engine.close()


def _trained(config_extra: dict, steps: int, tmp_path=None, resume=None, save=None):
    _, model = gpt_pair()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = hybridps.Config(devices={"cuda:0": int(MODEL_BYTES * 0.5)}, **config_extra)
    engine = hybridps.initialize(model, optimizer, config)
    start = 0
    if resume is not None:
        engine.load_checkpoint(resume)
        start = engine.global_step
    losses = train_engine(engine, steps, start=start)
    if save is not None:
        engine.save_checkpoint(save)
    return engine, losses


def test_a_checkpoint_keeps_the_codes_and_resumes_bit_equal(tmp_path):
    straight, expected = _trained({"optimizer_states": "int8"}, 6)
    straight.close()
    first, _ = _trained({"optimizer_states": "int8"}, 3, save=tmp_path / "ckpt")
    first.close()
    resumed, losses = _trained({"optimizer_states": "int8"}, 3, resume=tmp_path / "ckpt")
    assert losses == expected[3:]
    resumed.close()


def test_switching_between_exact_and_int8_states_at_a_resume(tmp_path):
    exact, _ = _trained({}, 3, save=tmp_path / "exact")
    exact_states = {i.name: exact.optimizer.state_of(i) for i in exact.client.params}
    exact.close()
    compact, losses = _trained({"optimizer_states": "int8"}, 0, resume=tmp_path / "exact", save=tmp_path / "compact")
    for info in compact.client.params:  # fp32 moments quantized into the compact rows
        got, want = compact.optimizer.state_of(info), exact_states[info.name]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(got[key], want[key], atol=float(want[key].abs().max()) * 0.07), (info.name, key)
    compact.close()
    back, _ = _trained({}, 0, resume=tmp_path / "compact")  # codes dequantized into an exact run
    for info in back.client.params:
        got, want = back.optimizer.state_of(info), exact_states[info.name]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(got[key], want[key], atol=float(want[key].abs().max()) * 0.07), (info.name, key)
    assert train_engine(back, 2, start=3)  # and it trains on
    back.close()


def test_early_steps_and_their_roll_back_keep_compact_rows_exact():
    """Speculative early steps (overlap_step=True) back the compact rows up whole: with the
    clip rolling them back every iteration the run equals the one without early steps."""
    _, losses_plain = _trained({"optimizer_states": "int8", "overlap_step": False}, 4)
    _, losses_early = _trained({"optimizer_states": "int8", "overlap_step": True}, 4)
    assert losses_early == losses_plain


def test_an_eight_bit_optimizer_of_another_library_is_refused_with_the_fix():
    torchao_optim = pytest.importorskip("torchao.optim")
    _, model = gpt_pair()
    with pytest.raises(ConfigError, match=r"Config\(optimizer_states='int8'\)"):
        hybridps.initialize(model, torchao_optim.AdamW8bit(model.parameters(), lr=1e-3), int8_config())


def _codes_after_two_rank_save(rank, world, path):
    """Two ranks train with compact states and save; each returns the codes of its params."""
    _, model = gpt_pair()
    config = hybridps.Config(devices={"cuda:0": int(MODEL_BYTES * 0.5)}, optimizer_states="int8", collective_timeout_s=60)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    train_engine(engine, 3, batch=4, rank=rank, world=world)
    engine.save_checkpoint(path)
    return {
        i.name: [c.tolist() for c in engine.optimizer._read_codes(ChunkKind.MOMENTUM, i)]
        for i in engine.client.params
        if engine.client.owns(i.chunk)
    }


@pytest.mark.slow  # spawns ranks
def test_compact_states_saved_by_two_ranks_load_on_one_with_every_code_and_scale(tmp_path):
    from tests.dist import run_ranks

    path = str(tmp_path / "ck")
    shares = run_ranks(_codes_after_two_rank_save, 2, path, timeout_s=120)
    saved = {**shares[0], **shares[1]}
    _, model = gpt_pair(seed=5)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), int8_config())
    engine.load_checkpoint(path)
    assert set(saved) == {i.name for i in engine.client.params}
    for info in engine.client.params:
        assert [c.tolist() for c in engine.optimizer._read_codes(ChunkKind.MOMENTUM, info)] == saved[info.name], info.name
    engine.close()


def test_compact_rows_on_the_disk_tier_train_as_they_do_in_memory(tmp_path):
    _, in_memory = _trained({"optimizer_states": "int8"}, 4)
    _, model = gpt_pair()
    config = hybridps.Config(
        devices={"cuda:0": int(MODEL_BYTES * 0.3), "cpu": int(MODEL_BYTES * 0.2), "nvme": 2 * MODEL_BYTES},
        nvme_path=str(tmp_path / "nvme"),
        optimizer_states="int8",
    )
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    assert train_engine(engine, 4) == in_memory
    stats = engine.memory_stats()
    assert stats["moved_bytes"]["cpu->nvme"] > 0 and stats["moved_bytes"]["nvme->cpu"] > 0
    engine.close()
