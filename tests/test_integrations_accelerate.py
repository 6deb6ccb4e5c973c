"""An accelerate loop with HybridPS owning model and optimizer (the Accelerator keeps launch,
data loaders and printing) against plain accelerate with the model prepared: same model, seed
and data, fp32 with fused AdamW, an LR scheduler, clipping and gradient accumulation."""

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

import hybridps  # noqa: E402
from hybridps.integrations.accelerate import initialize  # noqa: E402
from tests.accelerate_job import model_and_optimizer, train, train_on_ranks  # noqa: E402
from tests.dist import run_ranks  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    # accelerate keeps one AcceleratorState per process and refuses a second configuration
    # (mixed precision) in it; its own tests reset it between cases the same way
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


@pytest.mark.slow
def test_one_rank_loop_is_bit_equal_to_plain_accelerate():
    plain = train("plain")
    ours = train("hybridps")
    assert len(ours["loss"]) == 8 and ours["loss"] == plain["loss"]
    assert ours["moves"] > 0  # the simulated GPU was smaller than the model data: chunks moved


@pytest.mark.slow
def test_two_ranks_loop_is_within_1e_5_of_plain_accelerate_ddp():
    ranks = run_ranks(train_on_ranks, 2, timeout_s=240)
    for out in ranks:
        plain, ours = out["plain"]["loss"], out["hybridps"]["loss"]
        assert len(ours) == len(plain) == 4
        for got, want in zip(ours, plain, strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (ours, plain)
    assert ranks[0]["plain"] != ranks[1]["plain"]  # each rank trained on its own shard of the data


def test_mixed_precision_of_the_accelerator_must_be_the_configs():
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    model, optimizer = model_and_optimizer()
    with pytest.raises(hybridps.HybridPSError, match="Config\\(precision='bf16'\\)"):
        initialize(accelerator, model, optimizer)  # would train in fp32: nothing autocasts an unprepared model
    engine = initialize(accelerator, model, optimizer, hybridps.Config(precision="bf16"))
    assert engine.client.param_dtype == torch.bfloat16
    engine.close()
