"""torch.compile under HybridPS: the blocks the hooks wrap run compiled, the chunk swaps stay
eager at their edges ([Note: compiled blocks] in hybridps/client/params/compiled_blocks.py).

Tolerance: a compiled graph reorders and fuses float ops, so plain torch.compile's losses
differ from eager's in the last bits. HybridPS compiled must stay within that: its losses
against HybridPS eager differ by at most twice plain compiled's own difference against
plain eager, and never more than 1e-5 relative (fp32)."""

import copy
import logging

import pytest
import torch

import hybridps
from hybridps.models import GPT, GPTConfig
from hybridps.models.data import arithmetic_batch

CFG = GPTConfig(n_layer=3, d_model=64, n_head=4, seq_len=32, vocab_size=64)
STEPS = 4


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _reset() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _train(model, how: str, steps: int = STEPS, graphs_after: list | None = None) -> list[float]:
    """Losses of ``steps`` AdamW steps; ``how``: plain, plain_compiled, hps, hps_config, hps_torch_compile, hps_method."""
    _reset()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine = None
    call = model
    if how == "plain_compiled":
        call = torch.compile(model)
    elif how.startswith("hps"):
        config = hybridps.Config(devices={"cuda:0": CFG.n_params * 32}, precision="fp32", compile=how == "hps_config")
        engine = hybridps.initialize(model, optimizer, config)
        if how == "hps_torch_compile":
            call = torch.compile(model)
        elif how == "hps_method":
            model.compile()
    losses = []
    for step in range(steps):
        x, y = arithmetic_batch(step, 2, CFG.seq_len, CFG.vocab_size)
        _, loss = call(x, y)
        if engine is not None:
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if graphs_after is not None:
            graphs_after.append(_graphs())
    if engine is not None:
        COMPILED.update(engine.compiled.stats())
        engine.close()
    return losses


#: the compiled blocks' stats of the last HybridPS run of _train
COMPILED: dict = {}


def _within_plain_compile_tolerance(got, eager, plain_compiled, plain_eager) -> None:
    own = max(abs(a - b) for a, b in zip(plain_compiled, plain_eager, strict=True))
    for a, b in zip(got, eager, strict=True):
        assert abs(a - b) <= max(2 * own, 1e-7 * abs(b)) and abs(a - b) <= 1e-5 * abs(b), (got, eager, own)


@pytest.fixture(scope="module")
def references():
    return {how: _train(_gpt(), how) for how in ("plain", "plain_compiled", "hps")}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["hps_config", "hps_torch_compile", "hps_method"])
def test_compiled_blocks_train_within_plain_compiles_tolerance_and_compile_once(references, how):
    """Config(compile=True), torch.compile(model) and model.compile() after initialize: the
    losses stay within plain compile's own tolerance against eager, and no graph is compiled
    after the first step (the layers share one)."""
    assert references["hps"] == references["plain"]  # eager HybridPS is exact
    graphs: list[int] = []
    got = _train(_gpt(), how, graphs_after=graphs)
    _within_plain_compile_tolerance(got, references["hps"], references["plain_compiled"], references["plain"])
    # no recompiles after the second step (torch.compile(model) traces its first call module by module)
    assert graphs[0] >= 1 and graphs[-1] == graphs[2], graphs
    assert COMPILED == {"compiled": True, "blocks": CFG.n_layer, "fallen_back": None}


@pytest.mark.slow
def test_config_compile_builds_one_graph_for_all_layers():
    model = _gpt()
    graphs: list[int] = []
    _train(model, "hps_config", steps=2, graphs_after=graphs)
    assert graphs == [1, 1]  # three layers, one graph
    assert all("forward" not in vars(block) for block in model.blocks)  # close gave the blocks their forwards back


@pytest.mark.slow
def test_a_block_the_compiler_cannot_take_runs_eagerly_with_one_warning(caplog, monkeypatch):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("this backend compiles nothing")

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=broken_backend))
    expected = _train(_gpt(), "plain")
    with caplog.at_level(logging.WARNING, logger="hybridps.client.params.compiled_blocks"):
        got = _train(_gpt(), "hps_config")
    assert got == expected  # eager after the failure: exact
    warnings = [r for r in caplog.records if "run eagerly" in r.getMessage()]
    assert len(warnings) == 1 and "this backend compiles nothing" in warnings[0].getMessage()


def test_a_deep_copy_of_a_compiled_model_runs_its_own_weights_eagerly():
    model = _gpt()
    engine = hybridps.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), hybridps.Config(devices={"cuda:0": "64MiB"}, compile=True)
    )
    assert all("forward" in vars(block) for block in model.blocks)
    twin = copy.deepcopy(model)
    for block in twin.blocks:
        assert block.forward.__self__ is block and block.forward.__func__ is type(block).forward
    engine.close()
    assert all("forward" not in vars(block) for block in model.blocks)


def test_blocks_become_units_where_the_warm_up_shows_they_fit():
    """hook_units='auto': after the warm-up each layer is one unit where the model's chunks fit
    beside the warm-up's activations; where they do not, every module stays a unit unless the
    blocks are to be compiled, and then only blocks whose own chunks take at most a quarter;
    'module': every module is a unit."""
    from hybridps.client.params.hook_units import BLOCK_SHARE

    def engine(model, **config):
        return hybridps.initialize(model, torch.optim.AdamW(model.parameters()), hybridps.Config(**config))

    # fp16: grads are never loose (the overflow check reads their rows), so the model does not
    # become one unit ([Note: the model as one unit])
    roomy = engine(_gpt(), devices={"cuda:0": "64MiB"}, hook_units="auto", precision="fp16")
    assert roomy.hooks.units.blocks == []  # the warm-up runs module by module
    for step in range(3):
        x, y = arithmetic_batch(step, 2, CFG.seq_len, CFG.vocab_size)
        roomy.backward(roomy(x, y)[1])
        roomy.step()
        roomy.zero_grad()
        assert len(roomy.hooks.units.blocks) == (0 if step == 0 else CFG.n_layer)
    assert roomy.tracer.retraces == 0 and roomy.tracer.has_trace  # traced anew without a departure
    assert roomy.tracer.labels[1] == ("fwd", "transformer.wte") or ("fwd", "blocks.0") in roomy.tracer.labels
    assert ("fwd", "blocks.0.ln1") not in roomy.tracer.labels
    assert not roomy.hooks.units.whole
    roomy.close()
    model = _gpt()
    tight = engine(model, devices={"cuda:0": CFG.n_params * 7}, chunk_size=2**14, hook_units="auto")
    layer_bytes = tight.client.store.param_chunk_bytes(p for p in model.blocks[0].parameters())
    assert layer_bytes > BLOCK_SHARE * CFG.n_params * 4  # one layer: over a quarter of a GPU a quarter this size
    for step in range(2):
        x, y = arithmetic_batch(step, 2, CFG.seq_len, CFG.vocab_size)
        tight.backward(tight(x, y)[1])
        tight.step()
        tight.zero_grad()
    assert tight.hooks.units.blocks == []  # the chunks did not fit beside the activations
    tight.close()
    model = _gpt()
    compiled = engine(model, devices={"cuda:0": CFG.n_params * 8}, compile=True)
    assert compiled.hooks.units.blocks == list(model.blocks)  # each layer alone takes under a quarter
    compiled.close()
    per_module = engine(_gpt(), devices={"cuda:0": "64MiB"})  # the default
    assert per_module.hooks.units.blocks == [] and len(per_module.hooks.own) == len(list(per_module.module.modules()))
    per_module.close()


@pytest.mark.slow
def test_a_hugging_face_llama_trains_compiled_within_plain_compiles_tolerance():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,  # a KV cache's per-layer state is a guard: one graph per layer
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)

    def run(how):
        _reset()
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        engine, call = None, model
        if how == "plain_compiled":
            call = torch.compile(model)
        elif how.startswith("hps"):
            config = hybridps.Config(devices={"cuda:0": "64MiB"}, compile=how == "hps_compiled")
            engine = hybridps.initialize(model, optimizer, config)
        g = torch.Generator().manual_seed(1)
        losses, graphs = [], []
        for _ in range(3):
            x = torch.randint(0, 128, (2, 16), generator=g)
            loss = call(input_ids=x, labels=x).loss
            (engine.backward if engine else torch.Tensor.backward)(loss)
            (engine or optimizer).step()
            (engine or optimizer).zero_grad()
            losses.append(loss.item())
            graphs.append(_graphs())
        if engine:
            engine.close()
        return losses, graphs

    plain, _ = run("plain")
    plain_compiled, _ = run("plain_compiled")
    eager, _ = run("hps")
    compiled, graphs = run("hps_compiled")
    assert eager == plain
    _within_plain_compile_tolerance(compiled, eager, plain_compiled, plain)
    assert graphs == [1, 1, 1]
