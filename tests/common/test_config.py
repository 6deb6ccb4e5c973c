import copy
import dataclasses
import typing

import pytest

from hybridps import Config, ConfigError
from hybridps.common.config import EVICTIONS, PLACEMENTS, PRECISIONS
from hybridps.common.devices import SIMULATE_MODES


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


def _literal_values(hint: object) -> set:
    """The values a field's type admits: a Literal's, and True and False for bool."""
    if hint is bool:
        return {True, False}
    if typing.get_origin(hint) is typing.Literal:
        return set(typing.get_args(hint))
    return set().union(*(_literal_values(arg) for arg in typing.get_args(hint)))


#: what Config.__post_init__ checks each of these fields against
_ACCEPTED = {
    "precision": set(PRECISIONS),
    "eviction": set(EVICTIONS),
    "placement": set(PLACEMENTS),
    "overlap_step": {True, False, "auto"},
    "simulate": set(SIMULATE_MODES),
}


@pytest.mark.parametrize("name", sorted(_ACCEPTED))
def test_a_fields_literal_type_names_exactly_the_values_its_validation_accepts(name):
    values = _literal_values(typing.get_type_hints(Config)[name])
    assert values == _ACCEPTED[name]
    for value in values:
        assert getattr(Config(**{name: value}), name) == value  # the value itself, a plain str or bool
    with pytest.raises(ConfigError, match=f"{name}='nonsense'"):
        Config(**{name: "nonsense"})


def test_the_fp16_fields_read_as_one_loss_scale_config_that_builds_the_scaler():
    """``Config.loss_scale`` groups the flat fp16 keywords users pass; the engine's scaler is
    built from it."""
    from hybridps import LossScaleConfig
    from hybridps.client.assembly import loss_scaler

    dynamic = Config(precision="fp16", initial_loss_scale=1024.0, loss_scale_growth_interval=7, min_loss_scale=2.0)
    assert dynamic.loss_scale == LossScaleConfig(
        scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=7, min_scale=2.0, dynamic=True
    )
    static = Config(precision="fp16", static_loss_scale=128.0, initial_loss_scale=1024.0)
    assert static.loss_scale.scale == 128.0 and not static.loss_scale.dynamic
    scaler = loss_scaler(static)
    assert (scaler.scale, scaler.dynamic, scaler.growth_interval) == (128.0, False, 2000)
    scaler.update(True)
    assert scaler.scale == 128.0 and scaler.skipped_steps == 1  # static: skipped, never scaled down
    assert loss_scaler(Config(precision="bf16")) is None


def test_grad_reuse_auto_is_off_only_where_one_rank_trains_fp32_on_the_cpu():
    assert Config().grad_reuse == "auto"
    assert Config(precision="fp32").for_compute(on_gpu=False, ranks=1).grad_reuse is False
    assert Config(precision="bf16").for_compute(on_gpu=False, ranks=1).grad_reuse is True  # 14 B/param instead of 16
    assert Config(precision="fp32").for_compute(on_gpu=True, ranks=1).grad_reuse is True  # no GPU room for grads in backward
    assert Config(precision="fp32").for_compute(on_gpu=False, ranks=2).grad_reuse is True  # no grad chunks to reduce
    explicit = Config(precision="fp32", grad_reuse=True)
    assert explicit.for_compute(on_gpu=False, ranks=1) is explicit
    with pytest.raises(ConfigError, match="grad_reuse"):
        Config(grad_reuse="yes")


def test_an_fp32_engine_on_the_cpu_steps_its_params_as_the_master_and_accumulates():
    import torch

    import hybridps
    from hybridps.client.chunks.chunk import ChunkKind

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), fused=True), Config(precision="fp32"))
    plain_opt = torch.optim.AdamW(plain.parameters(), fused=True)
    try:
        assert engine.config.grad_reuse is False and engine.client.config.grad_reuse is False
        assert engine.client.store.master_kind is ChunkKind.PARAM  # no master apart, no write-back
        for step in range(3):
            for micro in range(2):  # accumulation, which grad reuse refuses
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro))
                engine.backward(engine(x).square().mean())
                plain(x).square().mean().backward()
            engine.step()
            engine.zero_grad()
            plain_opt.step()
            plain_opt.zero_grad()
        with engine.gathered_parameters():
            for mine, theirs in zip(model.parameters(), plain.parameters(), strict=True):
                assert torch.equal(mine.detach().cpu(), theirs.detach())
    finally:
        engine.close()
