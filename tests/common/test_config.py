import dataclasses

import pytest

from hybridps import Config, ConfigError


def test_capacities_in_human_units_become_bytes():
    cfg = Config(devices={"cuda": "2MiB", "cpu": "1GiB"})
    assert dict(cfg.devices) == {"cuda:0": 2 * 2**20, "cpu": 2**30}


def test_a_config_is_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.precision = "fp16"  # type: ignore[misc]


def test_a_capacity_smaller_than_one_chunk_is_refused_naming_both_sizes():
    with pytest.raises(ConfigError) as e:
        Config(devices={"cuda:0": "1KiB"}, chunk_size=1024, precision="fp32")
    msg = str(e.value)
    assert "1024 B" in msg and "4096 B" in msg and "chunk_size" in msg


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"precision": "fp8"}, "precision='fp8'"),
        ({"devices": {"tpu:0": "1GiB"}}, "'tpu:0'"),
        ({"devices": {"cuda:0": "lots"}}, "'lots'"),
        ({"chunk_size": 0}, "chunk_size=0"),
        ({"chunk_size": 1.5}, "chunk_size=1.5"),
        ({"simulate": "maybe"}, "simulate='maybe'"),
        ({"eviction": "random"}, "eviction='random'"),
        ({"margin": "-1MiB"}, "margin"),
        ({"loss_scale_backoff_factor": 2.0}, "loss_scale_backoff_factor"),
        ({"devices": {"cuda": "1MiB", "cuda:0": "2MiB"}}, "twice"),
    ],
)
def test_bad_config_values_are_refused_naming_the_value(kwargs, fragment):
    with pytest.raises(ConfigError) as e:
        Config(**kwargs)
    assert fragment in str(e.value)
