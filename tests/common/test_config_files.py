"""Config files (JSON, TOML) and DeepSpeed configs read as a HybridPS Config."""

import json
import sys

import pytest

import hybridps
from hybridps import Config, ConfigError
from hybridps.common.deepspeed_config import config_from_deepspeed, translate


def test_a_config_written_to_json_reads_back_equal(tmp_path):
    config = Config(precision="bf16", devices={"cuda:0": "2GiB", "cpu": "16GiB"}, margin="64MiB", prefetch_window=3)
    config.to_file(tmp_path / "hybridps.json")
    assert Config.from_file(tmp_path / "hybridps.json") == config


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_a_toml_file_may_keep_its_fields_under_a_hybridps_table(tmp_path):
    (tmp_path / "a.toml").write_text('[hybridps]\nprecision = "fp16"\nmargin = "1GiB"\n[hybridps.devices]\n"cuda:0" = "8GiB"\n')
    config = Config.from_file(tmp_path / "a.toml")
    assert (config.precision, config.margin, dict(config.devices)) == ("fp16", 1 << 30, {"cuda:0": 8 << 30})


def test_an_unknown_field_is_refused_with_the_closest_valid_name(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"precision": "bf16", "prefetch_windw": 3}))
    with pytest.raises(ConfigError, match="unknown field 'prefetch_windw'; did you mean 'prefetch_window'"):
        Config.from_file(tmp_path / "c.json")
    with pytest.raises(ConfigError, match="use a .json or .toml file"):
        Config.from_file(_touch(tmp_path / "c.yaml"))
    with pytest.raises(ConfigError, match="precision='fp8'"):
        Config.from_dict({"precision": "fp8"})


def _touch(path):
    path.write_text("precision: bf16\n")
    return path


ZERO3_OFFLOAD = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": 1.0,
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 500,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR"},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "nvme", "nvme_path": "/local"},
        "overlap_comm": True,
    },
    "steps_per_print": 100,
}


def test_a_deepspeed_zero3_offload_config_maps_what_has_a_meaning_and_says_why_the_rest_does_not(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(ZERO3_OFFLOAD))
    result = translate(tmp_path / "ds.json", devices={"cuda:0": "8GiB"})
    c = result.config
    assert (c.precision, c.initial_loss_scale, c.loss_scale_growth_interval, c.min_loss_scale) == ("fp16", 4096.0, 500, 1.0)
    assert c.static_loss_scale is None and dict(c.devices) == {"cuda:0": 8 << 30, "nvme": None}
    assert c.nvme_path == "/local"  # offload to NVMe: the disk tier in that directory
    # the loop's settings, with Hugging Face's "auto" left out
    assert result.training == {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8}},
    }
    ignored = dict(result.ignored)
    assert set(ignored) == {
        "fp16.hysteresis",
        "scheduler",
        "zero_optimization.stage",
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.overlap_comm",
        "steps_per_print",
    }
    assert "trace" in ignored["zero_optimization.offload_optimizer.device"] and "scheduler" in result.describe()
    assert config_from_deepspeed(ZERO3_OFFLOAD) == translate(ZERO3_OFFLOAD).config


def test_deepspeed_precision_blocks():
    assert translate({"bf16": {"enabled": True}}).config.precision == "bf16"
    assert translate({}).config.precision == "fp32"
    assert translate({"fp16": {"enabled": True, "loss_scale": 128}}).config.static_loss_scale == 128.0
    with pytest.raises(ConfigError, match="both fp16 and bf16"):
        translate({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert dict(translate({"optimizer": {"type": "Lamb"}}).ignored)["optimizer.type"].startswith("Lamb")


@pytest.mark.slow
def test_hybridps_train_takes_a_config_file(tmp_path):
    import subprocess

    (tmp_path / "c.json").write_text(json.dumps({"precision": "bf16", "prefetch_window": 1}))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridps",
            "train",
            "--config",
            str(tmp_path / "c.json"),
            "--steps",
            "2",
            "--layers",
            "1",
            "--d-model",
            "32",
            "--heads",
            "2",
            "--data-bytes",
            "64KiB",
            "--json",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    summary = json.loads("\n".join(lines[lines.index("{") :]))
    assert summary["precision"] == "bf16"
    bad = subprocess.run(
        [sys.executable, "-m", "hybridps", "train", "--config", str(tmp_path / "nope.json"), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "no such file" in bad.stderr
    assert hybridps.Config.from_file(tmp_path / "c.json").prefetch_window == 1


def test_config_md_field_reference_is_what_the_dataclass_renders():
    """Each field's section, unit and meaning are written once, where it is declared; the
    reference in docs/CONFIG.md is generated from them (python -m hybridps.common.config_doc
    --write) and must not drift."""
    import dataclasses

    from hybridps.common import config_doc

    assert all(f.metadata.get("doc") and f.metadata.get("section") for f in dataclasses.fields(Config))
    rendered = config_doc.render()
    assert config_doc.current(config_doc.DOC_PATH.read_text()) == rendered, "run: python -m hybridps.common.config_doc --write"
    assert all(f"| `{f.name}` | " in rendered for f in dataclasses.fields(Config))
    assert "| `initial_loss_scale` | `65536.0` |" in rendered  # defaults are read from the dataclass


def test_a_config_pickles_to_an_equal_config():
    import pickle

    config = Config(devices={"cuda:0": "512KiB", "cpu": "2GiB"}, precision="bf16", grad_reuse=False)
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config and dict(copy.devices) == dict(config.devices)
