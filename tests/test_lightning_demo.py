"""Lightning's own demo, ``lightning.pytorch.demos.transformer.LightningTransformer`` (an
``nn.Transformer`` encoder-decoder with dropout, stepped by plain ``torch.optim.SGD``), trained
unchanged under ``Trainer(strategy="hybridps")`` with part of the model on a simulated GPU:
per-step losses and final weights bit-equal to plain Lightning on the same seed and data.

The demo reads WikiText2, which it downloads; here its data hooks read fixed random tokens
instead, batches of the (inputs, target) shape its ``Transformer`` takes."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.demos.transformer import LightningTransformer  # noqa: E402

import hybridps  # noqa: E402
from hybridps.integrations.lightning import HybridPSStrategy  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 64, 16, 2, 5
#: the simulated GPU's bytes: fewer than the model's fp32 params alone (1.3 M, 5 MiB; 10 MiB with
#: their grads), so it holds part of the model and chunks move
SIMULATED_GPU = 3 * 2**20


class LocalDemo(LightningTransformer):
    """The demo with local data and each training loss recorded; its model, step and
    optimizer are the demo's own."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(vocab_size=VOCAB)
        self.losses: list[float] = []
        self.trained_in_train_mode: list[bool] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        self.trained_in_train_mode.append(self.training)  # dropout draws from the RNG
        return loss

    def prepare_data(self):
        pass  # the demo downloads WikiText2 here

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ + 1), generator=g)
        return DataLoader(TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), batch_size=BATCH)


class _Moves(pl.Callback):
    moves = 0

    def on_train_end(self, trainer, module):
        engine = getattr(trainer.strategy, "engine", None)
        self.moves = engine.memory_stats()["moves"] if engine is not None else 0


def _fit(strategy) -> tuple[LocalDemo, int]:
    model, moves = LocalDemo(), _Moves()
    t = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[moves],
    )
    torch.manual_seed(2)  # the dropout masks: the same stream for both runs
    t.fit(model)
    return model, moves.moves


def test_lightnings_transformer_demo_trains_bit_equal_to_plain_lightning():
    plain, _ = _fit("auto")
    config = hybridps.Config(devices={"cuda:0": SIMULATED_GPU}, simulate="always")
    ours, moves = _fit(HybridPSStrategy(config))
    dropouts = [m.p for m in ours.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and min(dropouts) > 0 and all(ours.trained_in_train_mode)
    assert sum(p.numel() for p in ours.parameters()) * 4 > SIMULATED_GPU
    assert moves > 0  # the simulated GPU held part of the model: chunks moved
    assert len(ours.losses) == STEPS and ours.losses == plain.losses
    assert ours.losses[-1] < ours.losses[0]
    # after fit the module holds its trained weights again, plain Lightning's bit for bit
    reference = plain.state_dict()
    assert reference.keys() == ours.state_dict().keys()
    assert all(torch.equal(v, reference[k]) for k, v in ours.state_dict().items())
