"""Hugging Face safetensors weights stream into a model under HybridPS: values equal
``from_pretrained``'s, training from them equals plain PyTorch's, on one rank or several."""

from __future__ import annotations

import json

import pytest
import torch

import hybridps
from hybridps import ConfigError
from tests.dist import run_ranks
from tests.training import train_hf_both

transformers = pytest.importorskip("transformers")
CFG = hybridps.Config(devices={"cuda:0": "64MiB"})


def _config() -> transformers.GPT2Config:
    return transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def _pretrained(tmp_path, shard: str | None = None, dtype=None):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config())
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path / "pretrained", **kwargs)
    return tmp_path / "pretrained"


def _fresh(seed: int = 1):
    torch.manual_seed(seed)  # other values than the pretrained ones
    return transformers.GPT2LMHeadModel(_config())


def _engine(model, **kw):
    return hybridps.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), hybridps.Config(devices={"cuda:0": "64MiB"}, **kw)
    )


@pytest.mark.slow
@pytest.mark.parametrize("shard", [None, "40KB"], ids=["one-file", "sharded"])
def test_streamed_weights_equal_from_pretrained_and_train_alike(tmp_path, shard):
    path = _pretrained(tmp_path, shard)
    if shard:
        assert len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    plain = transformers.GPT2LMHeadModel.from_pretrained(path)
    model = _fresh()
    engine = _engine(model)
    report = engine.load_pretrained(path)
    assert report.loaded_params == len(engine.client.params) and report.missing == []
    expected = plain.state_dict()
    got = model.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    train_hf_both(plain, opt, engine, [x, x, x])


def test_base_model_weights_load_across_the_prefix_and_bf16_files_widen(tmp_path):
    torch.manual_seed(0)
    base = transformers.GPT2Model(_config()).to(torch.bfloat16)
    base.save_pretrained(tmp_path / "base")
    model = _fresh()
    engine = _engine(model, precision="bf16")
    engine.load_pretrained(tmp_path / "base")
    got = engine.state_dict()  # the fp32 masters
    for key, value in base.state_dict().items():
        if f"transformer.{key}" in got:
            assert torch.equal(got[f"transformer.{key}"], value.float()), key
    assert torch.equal(got["lm_head.weight"], base.state_dict()["wte.weight"].float()), "tied head follows wte"


def test_a_mismatch_is_refused_before_anything_is_written(tmp_path):
    path = _pretrained(tmp_path)
    cfg = _config()
    cfg.n_embd = 64
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(cfg)
    engine = _engine(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"(?s)nothing was loaded.*wte.weight: shape \(64, 32\).*more"):
        engine.load_pretrained(path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ConfigError, match="no safetensors weights"):
        engine.load_pretrained(tmp_path)


def test_missing_params_are_an_error_unless_not_strict(tmp_path):
    path = _pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors.pop("transformer.ln_f.weight")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    model = _fresh()
    engine = _engine(model)
    with pytest.raises(ConfigError, match="ln_f.weight"):
        engine.load_pretrained(path)
    report = engine.load_pretrained(path, strict=False)
    assert report.missing == ["transformer.ln_f.weight"]


def _load_on_ranks(rank, world, path):
    model = _fresh()
    engine = hybridps.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        hybridps.Config(devices={"cuda:0": "64MiB"}, collective_timeout_s=60.0),
    )
    report = engine.load_pretrained(path)
    return report.read_bytes, engine.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_reads_only_the_tensors_of_its_own_chunks(tmp_path, world):
    path = _pretrained(tmp_path, "40KB")
    expected = transformers.GPT2LMHeadModel.from_pretrained(path).state_dict()
    results = run_ranks(_load_on_ranks, world, str(path))
    total = sum(v.numel() * v.element_size() for k, v in expected.items() if k != "lm_head.weight")
    assert sum(r[0] for r in results) == total, "every tensor read once, by its owner"
    assert all(0 < r[0] < total for r in results)
    for _, state in results:
        assert all(torch.equal(state[k], expected[k]) for k in expected)
