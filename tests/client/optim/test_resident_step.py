"""The step of every resident chunk at once ([Note: one step for resident chunks] in
hybridps/client/optim/resident_step.py): taken where the model fits, bit for bit plain
PyTorch's AdamW, and left to the chunk-by-chunk loop wherever anything would differ."""

import pytest
import torch

import hybridps
from hybridps.client.memory.activity import ChunkListener
from tests.training import adamw_groups, engine_for, gpt_pair, train_engine, train_plain


def _resident(engine):
    return engine.optimizer.iteration.resident


class _Steps(ChunkListener):
    """Every chunk step's start and end, in order."""

    hears_steps = True

    def __init__(self, activity):
        self.heard: list[tuple[str, int]] = []
        activity.join(self)

    def stepped(self, phase: str, index: int) -> None:
        self.heard.append((phase, index))


@pytest.mark.parametrize(
    "where",
    [
        pytest.param({}, id="cpu"),  # computing on the CPU: no grad reuse, the params are the master
        pytest.param({"gpu": 2.0}, id="simulated-gpu"),  # grad reuse: a master apart, written back in one copy
    ],
)
def test_every_chunk_steps_at_once_where_the_model_fits_bitwise_as_plain_adamw(where):
    model, plain = gpt_pair()
    make = lambda m: adamw_groups(m, lr=1e-3, fused=True)  # noqa: E731  two groups: two kernel calls
    if "gpu" in where:
        engine = engine_for(model, make(model), where["gpu"])
    else:
        engine = hybridps.initialize(model, make(model), hybridps.Config())
    try:
        expected = train_plain(plain, make(plain), 5)
        heard = _Steps(engine.client.mover.activity)
        assert train_engine(engine, 5) == expected
        resident = _resident(engine)
        assert resident.taken >= 3  # every step after the warm-up's decision
        chunks = {index for _, index in heard.heard}
        assert len(chunks) >= 2 and len(heard.heard) == 2 * len(chunks) * 5  # each chunk once a step
        # each chunk started and ended once a step, every start before every end of a joint step
        last = heard.heard[-2 * len(chunks) :]
        assert [p for p, _ in last] == ["start"] * len(chunks) + ["end"] * len(chunks)
        with engine.gathered_parameters():
            for mine, theirs in zip(model.parameters(), plain.parameters(), strict=True):
                assert torch.equal(mine.detach().cpu(), theirs.detach())
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("fraction", "config"),
    [
        pytest.param(0.6, {}, id="chunks-move"),  # a tight GPU: the rows are not all resident
        pytest.param(2.0, {"precision": "bf16"}, id="bf16"),  # loose grads, cast into a buffer a chunk at a time
    ],
)
def test_the_chunk_by_chunk_loop_steps_wherever_something_differs(fraction, config):
    model, plain = gpt_pair()
    engine = engine_for(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), fraction, **config)
    try:
        losses = train_engine(engine, 4)
        assert _resident(engine).taken == 0
        if not config:
            assert losses == train_plain(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True), 4)
    finally:
        engine.close()


def test_the_for_loop_kernel_of_a_plain_adamw_is_left_to_the_chunk_by_chunk_loop():
    model, plain = gpt_pair()
    engine = engine_for(model, torch.optim.AdamW(model.parameters(), lr=1e-3), 2.0)  # fused=None: torch's default kernel
    try:
        assert train_engine(engine, 4) == train_plain(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), 4)
        assert _resident(engine).taken == 0
    finally:
        engine.close()
