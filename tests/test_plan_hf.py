"""``hybridps plan --model-config`` / ``--model``: a Hugging Face causal LM's config planned as
a family of layer counts, built as ``hybridps train --model-config`` builds it."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hybridps
from hybridps.common.errors import ConfigError
from hybridps.planner import HFCausalLMFamily, main
from hybridps.planner.attention import meta_attention_as_flash
from hybridps.planner.hf_model import config_with_layers
from hybridps.planner.simulation import simulate
from tests.dist import run_ranks

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "hf_configs"
TINY = CONFIGS / "tiny-llama.json"
#: the published configs and their parameter counts (embeddings and head untied)
PUBLISHED = {"llama-3-8b": 8_030_261_248, "qwen2-7b": 7_615_616_512, "mistral-7b-v0.1": 7_241_732_096}
#: the two machines of the acceptance: one consumer GPU, and an 8-GPU node
MACHINES = {"1x24GiB+128GiB": ["--gpus", "1x24GiB", "--cpu", "128GiB"], "8x80GiB+1TiB": ["--gpus", "8x80GiB", "--cpu", "1TiB"]}


def plan_json(capsys, *argv: str) -> dict:
    assert main([*map(str, argv), "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def plan_error(capsys, *argv: str) -> str:
    assert main([*map(str, argv), "--no-search"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridps plan: error: ") and "Traceback" not in err, err
    return err


def _tiny_qwen2(tmp_path: Path, **extra) -> Path:
    config = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
        vocab_size=256, max_position_embeddings=128, tie_word_embeddings=True, **extra,
    )  # fmt: skip
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(tmp_path / "qwen2")
    return tmp_path / "qwen2" / "config.json"


def _train_for_real(
    config_path: Path, gpu: int, *, precision: str, steps: int = 2, lora_rank: int | None = None
) -> tuple[hybridps.Engine, dict]:
    """A few steps of the model ``hybridps train --model-config`` builds (``HFCausalLM``: on meta
    under ``meta_init``, its init replayed into the chunks), real tensors on a simulated GPU."""
    from hybridps.hf_task import HFCausalLM

    task = HFCausalLM(model_path=None, config_path=config_path, lora_rank=lora_rank, seq_len=32)
    model = task.build()
    config = hybridps.Config(devices={"cuda:0": gpu, "cpu": 2**32}, simulate=True, precision=precision)
    engine = hybridps.initialize(model, torch.optim.AdamW(task.param_groups(model)), config)
    for _ in range(steps):
        x = torch.zeros(2, 32, dtype=torch.long)  # 32 tokens a row, as planned
        engine.backward(task.loss(engine, x, x.clone()))
        engine.step()
        engine.zero_grad()
    return engine, engine.memory_stats()


def _module_chunks(engine, model) -> tuple:
    client = engine.client
    out = []
    for name, mod in model.named_modules():
        own = list(mod.parameters(recurse=False))
        chunks = tuple(sorted({client.param_info(p).slot.chunk for p in own if client.is_registered(p)}))
        if chunks:
            out.append((name or type(model).__name__, chunks))
    return tuple(out)


@pytest.mark.parametrize("which", ["tiny-llama", "tiny-qwen2-tied", "tiny-llama-lora"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_planned_layout_is_the_clients_for_the_same_config(which, precision, tmp_path):
    """The planner's chunk layout (chunk size, each chunk's capacity, each param's place,
    every module's chunks) and model data are those of a real client training the model
    `hybridps train --model-config` builds from the same config; so are the peaks, since the
    GPU is roomy (nothing moves) and the batch is the planned one. With LoRA (``--lora``) the
    base weights are frozen: their chunks keep the param row alone, in the plan as in the run."""
    path = TINY if which.startswith("tiny-llama") else _tiny_qwen2(tmp_path)
    lora = 4 if which.endswith("lora") else None
    gpu = 2**30
    sim = simulate(
        HFCausalLMFamily.from_path(path, seq_len=32, batch_size=2, lora_rank=lora),
        gpu_bytes=gpu,
        cpu_bytes=2**32,
        precision=precision,
    )
    assert sim.completed, sim.failure
    engine, stats = _train_for_real(path, gpu, precision=precision, lora_rank=lora)
    frozen = [i for i in range(engine.client.store.num_chunks) if engine.client.store.layout.frozen(i)]
    assert bool(frozen) == (lora is not None)
    try:
        client, layout = engine.client, engine.client.layout
        assert sim.chunk_size_elements == layout.chunk_size == stats["chunk_size"]
        assert sim.chunk_capacities == tuple(layout.capacity(i) for i in range(layout.num_chunks))
        assert sim.param_numels == tuple(info.slot.numel for info in client.params)
        assert sim.module_chunks == _module_chunks(engine, engine.module)
        assert sim.n_params == sum({id(p): p.numel() for p in engine.module.parameters()}.values())
        assert sim.model_data_bytes == stats["model_data_bytes"]
        gpu_stats = stats["devices"]["cuda:0"]
        assert sim.gpu.peak_bytes == gpu_stats["peak_bytes"]
        assert sim.non_model_peak_bytes == gpu_stats["non_model_peak_bytes"]
    finally:
        engine.close()


@pytest.mark.slow
def test_a_tight_gpu_plans_the_peaks_and_the_verdict_of_the_real_run():
    """With a GPU of the activations plus a third of the model data, chunks move every step:
    the planned peaks are the real run's, within 5%; below the smallest working set both refuse."""
    roomy = simulate(
        HFCausalLMFamily.from_path(TINY, seq_len=32, batch_size=2), gpu_bytes=2**30, cpu_bytes=2**32, precision="fp32"
    )
    gpu = roomy.non_model_peak_bytes + roomy.model_data_bytes // 3
    sim = simulate(HFCausalLMFamily.from_path(TINY, seq_len=32, batch_size=2), gpu_bytes=gpu, cpu_bytes=2**32, precision="fp32")
    engine, stats = _train_for_real(TINY, gpu, precision="fp32", steps=3)
    engine.close()
    assert sim.completed and sum(sim.moved_bytes_per_step.values()) > 0
    for device, figures in (("cuda:0", sim.gpu), ("cpu", sim.cpu)):
        measured = stats["devices"][device]["peak_bytes"]
        assert abs(figures.peak_bytes - measured) <= 0.05 * measured, (device, figures.peak_bytes, measured)
    small = roomy.min_compute_bytes // 2
    refused = simulate(
        HFCausalLMFamily.from_path(TINY, seq_len=32, batch_size=2), gpu_bytes=small, cpu_bytes=2**32, precision="fp32"
    )
    assert not refused.completed and refused.failure.startswith("ConfigError at initialize")
    with pytest.raises(ConfigError):
        _train_for_real(TINY, small, precision="fp32")


@pytest.mark.parametrize("name", list(PUBLISHED))
@pytest.mark.parametrize("machine", list(MACHINES))
def test_the_published_configs_plan_on_both_machines(name, machine, capsys):
    """Llama-3-8B, Qwen2-7B and Mistral-7B shapes (their published config.json) on one 24 GiB
    GPU with 128 GiB of CPU memory, and on 8 x 80 GiB GPUs with 1 TiB: a plan with every section."""
    out = plan_json(capsys, "--model-config", CONFIGS / f"{name}.json", *MACHINES[machine], "--precision", "bf16",
                    "--no-search", "--rates", "h100")  # fmt: skip
    assert out["model"]["n_params"] == PUBLISHED[name]
    assert out["model"]["family"] == f"hf:{json.loads((CONFIGS / f'{name}.json').read_text())['model_type']}"
    assert out["model"]["n_layer"] == json.loads((CONFIGS / f"{name}.json").read_text())["num_hidden_layers"]
    h = out["hybridps"]
    assert out["fits"] is True and h["fits"] is True
    ranks = out["node"]["world_size"]
    assert h["gpu_need_bytes"] > 0 and h["cpu_node_bytes"] >= 0 and ranks * h["model_data_bytes"] > 14 * PUBLISHED[name]
    assert [p["name"] for p in out["peers"]] == ["deepspeed-zero-offload", "deepspeed-zero3-offload"]
    if machine.startswith("1x"):
        assert out["speed"]["predicted"] is True and out["speed"]["tokens_per_second"] > 0
    else:
        assert out["node"]["world_size"] == 8 and h["derived"] is True


#: the 8-GPU search's machine: smaller than MACHINES' (whose ~370-layer candidates take a
#: minute to simulate), the same 8-rank derived search
SEARCH_8X = {"8x16GiB+192GiB": ["--gpus", "8x16GiB", "--cpu", "192GiB"]}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "machine"),
    # every config on the small machine (seconds each); the 8-GPU search once, on a machine of
    # 16 GiB GPUs (the published configs plan on 8 x 80 GiB in the test above)
    [*((name, next(iter(MACHINES))) for name in PUBLISHED), (next(iter(PUBLISHED)), next(iter(SEARCH_8X)))],
)
def test_the_published_configs_have_a_largest_member_on_both_machines(name, machine, capsys):
    out = plan_json(
        capsys, "--model-config", CONFIGS / f"{name}.json", *{**MACHINES, **SEARCH_8X}[machine], "--precision", "bf16"
    )
    largest = out["hybridps"]["largest"]
    layers = json.loads((CONFIGS / f"{name}.json").read_text())["num_hidden_layers"]
    assert largest["confirmed"] and largest["n_layer"] > layers and largest["n_params"] > PUBLISHED[name]
    if machine.startswith("8x"):
        assert out["node"]["world_size"] == 8
        assert largest["n_layer"] > 2 * layers  # 128 GiB of GPU and 192 GiB of CPU hold two 8 B models
    for peer in out["peers"]:
        assert peer["largest"]["n_layer"] < largest["n_layer"]


# `python -m hybridps.planner ARGS`, then the process's own peak RSS on stderr's last line
# (VmHWM, the peak of this process's own memory map: ru_maxrss would carry over the forking
# parent's peak, a test runner's of several GiB, across exec)
_PLAN_AND_PEAK = (
    "import runpy, sys\n"
    "sys.argv = ['hybridps plan', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('hybridps.planner', run_name='__main__')\n"
    "finally:\n"
    "    hwm = [line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM:')]\n"
    "    print('max_rss_kib', hwm[0], file=sys.stderr)\n"
)


@pytest.mark.slow
def test_an_8b_plan_runs_in_seconds_and_allocates_no_model_memory():
    """The meta device holds the 8 B params: the command (torch and transformers imported
    included) stays well under a GiB of memory, and its plan takes seconds."""
    args = ["--model-config", str(CONFIGS / "llama-3-8b.json"), "--gpus", "1x24GiB", "--cpu", "128GiB", "--precision", "bf16",
            "--json"]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _PLAN_AND_PEAK, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["hybridps"]["largest"]["confirmed"]
    assert out["seconds"]["total"] < 60, out["seconds"]  # about 4 s on a 2-core VM, search included
    peak_kib = int(done.stderr.strip().splitlines()[-1].split()[-1])
    assert peak_kib < 2**20, f"{peak_kib / 2**10:.0f} MiB"  # about 390 MiB


def test_a_model_folder_is_read_for_its_config_only(tmp_path, capsys):
    """``--model FOLDER``: its config.json, nothing else (weights that are not even a
    safetensors file are never opened); the plan is the config file's."""
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(TINY, folder / "config.json")
    (folder / "model.safetensors").write_bytes(b"not weights")
    common = ["--seq-len", "32", "--batch", "2", "--gpus", "1x1MiB", "--cpu", "1GiB", "--no-search"]
    by_folder = plan_json(capsys, "--model", folder, *common)
    by_file = plan_json(capsys, "--model-config", TINY, *common)
    for key in ("fits", "hybridps"):
        if key == "hybridps":
            by_folder[key].pop("warnings"), by_file[key].pop("warnings")
        assert by_folder[key] == by_file[key], key
    assert by_folder["model"]["source"] == str(folder)


def test_every_plan_option_applies_to_a_hugging_face_family(capsys):
    common = ["--model-config", TINY, "--seq-len", "64", "--batch", "2", "--cpu", "1GiB", "--no-search"]
    base = plan_json(capsys, *common, "--gpus", "1x64MiB")
    checkpointed = plan_json(capsys, *common, "--gpus", "1x64MiB", "--checkpoint")
    assert checkpointed["model"]["checkpoint"] is True
    assert checkpointed["hybridps"]["non_model_peak_bytes"] < base["hybridps"]["non_model_peak_bytes"]
    layers = plan_json(capsys, *common, "--gpus", "1x64MiB", "--layers", "5")
    assert layers["model"]["n_layer"] == 5 and layers["model"]["n_params"] > base["model"]["n_params"]
    compact = plan_json(capsys, *common, "--gpus", "1x64MiB", "--optimizer-states", "int8", "--precision", "bf16")
    assert compact["training"]["optimizer_states"] == "int8"
    assert compact["hybridps"]["model_data_bytes_per_param"] < 9
    disk = plan_json(capsys, *common, "--gpus", "1x2MiB", "--cpu", "1MiB", "--nvme", "1GiB", "--simulated-gpus")
    assert disk["hybridps"]["fits"] and disk["hybridps"]["nvme"]["peak_bytes"] > 0
    ranks = plan_json(capsys, *common, "--gpus", "4x64MiB")
    assert ranks["node"]["world_size"] == 4 and ranks["hybridps"]["sharding"]["shard_size"] == 4
    compared = plan_json(capsys, *common, "--gpus", "4x64MiB", "--nodes", "1,2")
    assert [row["sharding"]["nodes"] for row in compared["comparison"]["layouts"]] == [1, 2]
    speed = plan_json(capsys, *common, "--gpus", "1x64MiB", "--rates", "h100", "--micro-batches", "2")
    assert speed["speed"]["predicted"] and speed["speed"]["tokens_per_step"] == 2 * 2 * 64


def test_the_family_grows_by_num_hidden_layers_with_the_largest_search(capsys):
    out = plan_json(capsys, "--model-config", TINY, "--seq-len", "32", "--batch", "2", "--gpus", "1x8MiB", "--cpu", "16MiB")
    largest = out["hybridps"]["largest"]
    assert largest["confirmed"] and largest["n_layer"] > 3
    table_args = ["--model-config", str(TINY), "--seq-len", "32", "--gpus", "1x8MiB", "--cpu", "16MiB", "--no-search"]
    assert main(table_args) == 0
    table = capsys.readouterr().out
    assert "family=hf:llama" in table and "HybridPS (simulated)" in table and "predicted speed" in table


def test_per_layer_settings_follow_the_layer_count(tmp_path):
    """``layer_types`` (full or sliding attention per layer) is given again for every size:
    derived as the config class derives it, else the config's own pattern repeated."""
    qwen = transformers.AutoConfig.from_pretrained(_tiny_qwen2(tmp_path, use_sliding_window=True, max_window_layers=2))
    assert qwen.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    grown = config_with_layers(qwen, 6)
    assert grown.num_hidden_layers == 6 and grown.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 4
    assert qwen.num_hidden_layers == 4 and len(qwen.layer_types) == 4  # the family's own config is untouched
    custom = transformers.Qwen2Config(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"])
    pattern = ["sliding_attention", "full_attention", "full_attention"]
    assert config_with_layers(custom, 5).layer_types == pattern + pattern[:2]
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256)
    assert config_with_layers(gpt2, 7).n_layer == 7


def test_grouped_query_attention_on_meta_saves_what_the_fused_kernel_saves():
    """Fewer key/value heads (``enable_gqa``, as transformers calls it without a mask): q, k
    and v of their own heads, the output and the log-sum-exp are saved, not a (seq x seq)
    matrix; backward gives k and v their own shapes."""
    b, h, kv, s, d = 2, 8, 2, 256, 16
    q = torch.empty(b, h, s, d, device="meta", requires_grad=True)
    k = torch.empty(b, kv, s, d, device="meta", requires_grad=True)
    v = torch.empty(b, kv, s, d, device="meta", requires_grad=True)
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with meta_attention_as_flash(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.sum().backward()
    assert out.shape == (b, h, s, d) and k.grad.shape == k.shape and v.grad.shape == v.shape
    qkv_out_lse = 4 * (2 * b * h * s * d + 2 * b * kv * s * d + b * h * s)
    assert sum(saved) == qkv_out_lse, (sum(saved), qkv_out_lse)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model-config", "/nonexistent/config.json"], r"--model-config /nonexistent/config.json: no such file or folder"),
        (["--model", "/nonexistent/folder"], r"--model /nonexistent/folder: no such file or folder"),
        (["--model-config", CONFIGS / "bert-base-uncased.json"], r"architectures \['BertForMaskedLM'\] are not causal LMs"),
        (["--model-config", TINY, "--hidden", "64"], r"--hidden describes a GPT shape; with --model-config the config gives"),
        (["--model-config", TINY, "--model", CONFIGS], r"--model-config and --model each name the model"),
        (["--model-config", TINY], r"seq_len=1024 is longer than the config's max_position_embeddings=256"),
    ],
)
def test_bad_hugging_face_sources_exit_2_with_one_clear_line(argv, message, capsys):
    import re

    err = plan_error(capsys, *argv)
    assert re.search(message, err), err


@pytest.mark.parametrize(
    "content, message",
    [
        (
            {"model_type": "llama-from-the-future", "hidden_size": 64},
            "model_type 'llama-from-the-future' is not known to transformers",
        ),
        ({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}, "model_type 't5' is not a causal LM"),
        ({"hidden_size": 64}, "the config names no model_type"),
        ("{not json", "cannot read it as a JSON config"),
        ([1, 2], "a config is a JSON object"),
    ],
)
def test_configs_that_are_not_causal_lms_transformers_knows_are_refused(content, message, tmp_path, capsys):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    assert message in plan_error(capsys, "--model", folder)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "the folder has no config.json" in plan_error(capsys, "--model", empty)


def test_hybridps_train_refuses_the_same_configs_with_the_same_messages(tmp_path):
    """The config is read and checked by the code training uses (``hybridps.models.hf``)."""
    from hybridps.hf_task import HFCausalLM

    with pytest.raises(ConfigError, match=r"architectures \['BertForMaskedLM'\] are not causal LMs"):
        HFCausalLM(model_path=None, config_path=CONFIGS / "bert-base-uncased.json", lora_rank=None, seq_len=32)
    with pytest.raises(ConfigError, match="no such file or folder"):
        HFCausalLM(model_path=None, config_path=tmp_path / "missing.json", lora_rank=None, seq_len=32)


def test_a_lora_plan_keeps_the_frozen_weights_param_row_alone_and_says_so(capsys):
    """``--lora R``: the base weights are frozen, so their chunks keep the param row alone (fp32:
    4 bytes a param against about 16 trained); the note says so, and what the peers' rules count."""
    args = ("--model-config", TINY, "--gpus", "1x64MiB", "--cpu", "1GiB", "--seq-len", "32", "--batch", "2", "--rates", "h100")
    full = plan_json(capsys, *args, "--precision", "fp32", "--no-search")
    lora = plan_json(capsys, *args, "--precision", "fp32", "--no-search", "--lora", "4")
    assert lora["model"]["lora_rank"] == 4 and "lora_rank" not in full["model"]
    assert lora["hybridps"]["model_data_bytes_per_param"] < 0.5 * full["hybridps"]["model_data_bytes_per_param"]
    assert any("frozen" in n and "DeepSpeed rules count every param" in n for n in lora["notes"])
    assert not any("frozen" in n for n in full["notes"])
    # no weight grads for the base, and only the adapters stepped
    assert lora["speed"]["flops_per_step"] < 0.8 * full["speed"]["flops_per_step"]
    stepped = lora["speed"]["cpu_step_params"] + lora["speed"]["gpu_step_params"]
    assert 0 < stepped < 0.2 * (full["speed"]["cpu_step_params"] + full["speed"]["gpu_step_params"])
    err = plan_error(capsys, "--layers", "2", "--hidden", "64", "--gpus", "1x1GiB", "--cpu", "1GiB", "--lora", "4")
    assert "--lora" in err and "--model-config" in err


def test_hybridps_train_checkpointing_recomputes_a_hugging_face_models_layers_as_planned():
    """``hybridps train --model-config ... --checkpointing`` builds the model the plan of
    ``--checkpoint`` builds: its decoder layers recomputed in backward (it trained them whole
    before, while its plan counted the recompute)."""
    from hybridps.hf_task import HFCausalLM

    for checkpoint in (False, True):
        task = HFCausalLM(model_path=None, config_path=TINY, lora_rank=4, seq_len=32, checkpoint=checkpoint)
        model = task.build()
        planned = HFCausalLMFamily.from_path(TINY, seq_len=32, checkpoint=checkpoint, lora_rank=4)
        with torch.device("meta"):
            plan_model = planned.build()
        assert model.is_gradient_checkpointing == plan_model.is_gradient_checkpointing == checkpoint
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        assert names == [n for n, p in plan_model.named_parameters() if p.requires_grad] and names
        assert all("lora_" in n for n in names)


def test_a_checkpointed_lora_counts_what_its_backward_recomputes_against_its_own_backward():
    """A frozen weight's backward is not twice its forward (no weight grad), so what a
    checkpointed LoRA recomputes is its backward less the same model's unchecked backward,
    not its backward less twice its forward (which read nothing recomputed)."""
    from hybridps.planner.counted_work import counted_shape

    lora = HFCausalLMFamily.from_path(TINY, seq_len=32, batch_size=2, lora_rank=4)
    plain = counted_shape(lora, "fp32")
    ckpt = counted_shape(dataclasses.replace(lora, checkpoint=True), "fp32")
    assert plain.backward_flops < 1.5 * plain.forward_flops  # the base weights take no weight grads
    assert ckpt.recompute_flops == pytest.approx(ckpt.backward_flops - plain.backward_flops)
    assert 0.5 * ckpt.forward_flops < ckpt.recomputed <= ckpt.forward_flops
    assert ckpt.recompute_share == pytest.approx(ckpt.recomputed / ckpt.forward_flops)


def _lora_rank(rank, world, precision):
    """One rank of a LoRA run of the tiny Llama: its model data and the grads it received."""
    from hybridps.hf_task import HFCausalLM

    task = HFCausalLM(model_path=None, config_path=TINY, lora_rank=4, seq_len=32)
    model = task.build()
    config = hybridps.Config(
        devices={"cuda:0": 2**30, "cpu": 2**32}, simulate=True, precision=precision, collective_timeout_s=60.0
    )
    engine = hybridps.initialize(model, torch.optim.AdamW(task.param_groups(model)), config)
    x = torch.zeros(1, 32, dtype=torch.long)
    engine.backward(task.loss(engine, x, x.clone()))
    engine.step()
    engine.zero_grad()
    stats = engine.memory_stats()
    received = stats["dist"]["bytes_received"]
    return {
        "model_data_bytes": stats["model_data_bytes"],
        "reduced": received.get("reduce_scatter", 0) + received.get("reduce", 0),
    }


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_lora_plan_of_two_ranks_derives_what_each_real_rank_keeps_and_reduces(precision):
    """With several ranks the base weights sit in chunk groups of their own (never reduced):
    the plan's derived share is what the busiest real rank keeps, and the grads it plans to
    reduce are the adapters' groups alone."""
    from hybridps.planner import NodeSpec
    from hybridps.planner.ranks import derive_rank_share

    sims = {
        lora: simulate(
            HFCausalLMFamily.from_path(TINY, seq_len=32, batch_size=2, lora_rank=lora),
            gpu_bytes=2**30,
            cpu_bytes=2**32,
            precision=precision,
        )
        for lora in (4, None)
    }
    node = NodeSpec.parse("2x1GiB", "4GiB")
    share, whole = derive_rank_share(sims[4], node), derive_rank_share(sims[None], node)
    ranks = run_ranks(_lora_rank, 2, precision, timeout_s=120)
    assert max(r["model_data_bytes"] for r in ranks) == share.owned_bytes
    assert share.owned_bytes < 0.6 * whole.owned_bytes
    comm = share.communication
    assert comm.reduced_bytes < 0.5 * comm.params_bytes and share.reduced_groups < share.chunk_groups
    # each rank receives its half of every reduced group's grads (ring: (S - 1) / S of them)
    assert sum(r["reduced"] for r in ranks) == comm.reduced_bytes
