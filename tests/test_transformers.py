"""Hugging Face models built from small configs (no downloads) train with loss parity."""

import copy

import pytest
import torch

import hybridps

transformers = pytest.importorskip("transformers")


def _tokens(step, vocab=256, batch=2, seq=32):
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, vocab, (batch, 1), generator=g) + 7 * torch.arange(seq)) % vocab


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=256,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_transformers_models_train_20_steps_like_plain_pytorch(make, tmp_path):
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    n_params = sum(p.numel() for p in model.parameters())
    engine = hybridps.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        hybridps.Config(devices={"cuda:0": n_params * 16 * 3 // 10 + 2**20}),  # 30% of model data + room for activations
    )
    for step in range(20):
        x = _tokens(step)
        expected = reference(input_ids=x, labels=x).loss
        ref_opt.zero_grad()
        expected.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        out = engine(input_ids=x, labels=x)
        assert isinstance(out, transformers.utils.ModelOutput)
        engine.backward(out.loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        assert out.loss.item() == expected.item(), step
    assert engine.memory_stats()["moves"] > 0
    # the checkpoint is a transformers checkpoint too
    engine.save_checkpoint(tmp_path / "ck")
    model.config.save_pretrained(tmp_path / "ck")
    loaded = type(model).from_pretrained(tmp_path / "ck")
    x = _tokens(99)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, reference(input_ids=x).logits, rtol=0, atol=0)


# realistic widths of published checkpoints, few layers (the layout repeats per layer)
_SHAPES = {
    "llama-2-7b": lambda: transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_hidden_layers=4, vocab_size=32000
    ),
    "llama-3-8b": lambda: transformers.LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=4,
        vocab_size=128256,
    ),
    "llama-3.2-1b": lambda: transformers.LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=4,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "qwen2-7b": lambda: transformers.Qwen2Config(
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        num_hidden_layers=4,
        vocab_size=152064,
    ),
    "qwen2-1.5b": lambda: transformers.Qwen2Config(
        hidden_size=1536,
        intermediate_size=8960,
        num_attention_heads=12,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "mistral-7b": lambda: transformers.MistralConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=4,
        vocab_size=32000,
    ),
    # weights past the 64 Mi-element bound, or chunks that hold them padding much
    "llama-2-13b": lambda: transformers.LlamaConfig(
        hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_hidden_layers=4, vocab_size=32000
    ),
    "llama-3-70b": lambda: transformers.LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_hidden_layers=4,
        vocab_size=128256,
    ),
    "qwen2.5-3b": lambda: transformers.Qwen2Config(
        hidden_size=2048,
        intermediate_size=11008,
        num_attention_heads=16,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-32b": lambda: transformers.Qwen2Config(
        hidden_size=5120,
        intermediate_size=27648,
        num_attention_heads=40,
        num_key_value_heads=8,
        num_hidden_layers=4,
        vocab_size=152064,
    ),
    "phi-3-mini": lambda: transformers.Phi3Config(
        hidden_size=3072, intermediate_size=8192, num_attention_heads=32, num_hidden_layers=4, vocab_size=32064
    ),
    "gemma-2b": lambda: transformers.GemmaConfig(
        hidden_size=2048,
        intermediate_size=16384,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        num_hidden_layers=4,
        vocab_size=256000,
    ),
}


@pytest.mark.parametrize("name", sorted(_SHAPES))
def test_llama_qwen2_mistral_phi3_and_gemma_shapes_are_laid_out_with_at_most_3_percent_padding(name):
    from hybridps.client.chunks.layout import auto_layout
    from hybridps.common.devices import DeviceSpec

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_SHAPES[name]())
    numels = [p.numel() for p in {id(p): p for p in model.parameters()}.values()]  # as a client registers them
    config = hybridps.Config(precision="bf16")
    layout = auto_layout(numels, config, DeviceSpec(name="cuda:0", capacity_bytes=80 << 30), 1)  # as a client lays them out
    for n in numels:
        layout.add(n)
    assert 1 - layout.tensor_elements / layout.total_elements <= 0.03
