"""Data-parallel training over chunk groups (gloo, CPU, simulated GPUs): every piece of model
data kept on one rank, losses equal to single-rank training on the same global batch."""

import math

import pytest
import torch

import hybridps
from hybridps.client.chunks.chunk import ChunkKind
from tests.dist import run_ranks
from tests.training import SMALL_GPT, gpt_pair, model_data_bytes, tokens, train_plain

GLOBAL_BATCH = 4


def _config(gpu_fraction: float = 0.3, **kw):
    kw.setdefault("collective_timeout_s", 60.0)
    return hybridps.Config(devices={"cuda:0": int(model_data_bytes(SMALL_GPT) * gpu_fraction)}, **kw)


def _train_ranks(rank, world, steps, kw):
    model, _ = gpt_pair()
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), _config(**kw))
    losses = []
    for step in range(steps):
        x, y = tokens(step, batch=GLOBAL_BATCH)
        _, loss = engine(x[rank::world], y[rank::world])
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    stats = engine.memory_stats()
    state = engine.state_dict()  # collective: every rank gathers, rank 0 reports
    return {
        "losses": losses,
        "model_data_bytes": stats["model_data_bytes"],
        "peak_bytes": stats["peak_model_data_bytes"],
        "max_group_bytes": max(
            sum(engine.client.rows[ChunkKind.PARAM][i].nbytes for i in engine.client.groups.members(g))
            for g in range(engine.client.groups.num_groups)
        ),
        "gpu_peak": stats["devices"]["cuda:0"]["peak_bytes"],
        "gpu_capacity": stats["devices"]["cuda:0"]["capacity_bytes"],
        "dist": stats["dist"],
        "chunk_size": stats["chunk_size"],
        "state": state if rank == 0 else None,
    }


@pytest.fixture(scope="module")
def single_rank():
    model, _ = gpt_pair()
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), _config())
    losses = []
    for step in range(6):
        x, y = tokens(step, batch=GLOBAL_BATCH)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "model_data_bytes": engine.memory_stats()["model_data_bytes"], "state": engine.state_dict()}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_train_like_one_rank_with_each_chunk_stored_once(world, single_rank):
    results = run_ranks(_train_ranks, world, 6, {}, timeout_s=90)
    for r in results:
        for got, want in zip(r["losses"], single_rank["losses"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], single_rank["losses"])
    # The trained weights agree too (gathered on rank 0). Averaging grads over ranks rounds
    # differently from one big batch, and Adam divides by sqrt(v): where a grad is nearly 0
    # that rounding can move an element by up to ~lr per step, so the bound is lr / 10.
    for key, value in single_rank["state"].items():
        torch.testing.assert_close(results[0]["state"][key], value, rtol=1e-4, atol=1e-4)
    total = sum(r["model_data_bytes"] for r in results)
    assert total <= 1.10 * single_rank["model_data_bytes"], "padding to whole chunk groups stays small"
    for r in results:
        share = r["model_data_bytes"]
        assert abs(share - total / world) <= 0.10 * total / world, (share, total / world)
        # What a rank holds at most: its share plus the gathered working set: the group in
        # use, its neighbour (a module can straddle two groups), and the tied embedding's
        # group, whose grad accumulates from the head's backward (first) to the embedding's
        # (last).
        bound = share + 3 * r["max_group_bytes"]
        assert r["peak_bytes"] <= bound, (r["peak_bytes"], share, r["max_group_bytes"])
        assert r["gpu_peak"] <= r["gpu_capacity"]
    # Communication per rank and step: params gathered for forward and backward, grads
    # reduce-scattered once (3 x params x (W-1)/W), plus padding and the tied embedding's
    # group gathered again for the head. Uneven groups (an oversize chunk) use one
    # broadcast/reduce per member, so ranks differ: take the mean.
    ops = ("all_gather", "broadcast", "reduce_scatter", "reduce")
    received = sum(r["dist"]["bytes_received"].get(op, 0) for r in results for op in ops) / world / 6
    params_bytes = SMALL_GPT.n_params * 4 * (world - 1) / world
    assert 3 * params_bytes <= received <= 4 * params_bytes, received / params_bytes


def _accumulate(rank, world, kw):
    model, _ = gpt_pair()
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), _config(**kw))
    losses = []
    for step in range(4):
        x, y = tokens(step, batch=GLOBAL_BATCH)
        x, y = x[rank::world], y[rank::world]
        total = torch.zeros(())
        for micro in range(2):
            _, loss = engine(x[micro::2], y[micro::2])
            engine.backward(loss / 2)
            total += loss.detach() / 2
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


@pytest.mark.slow
def test_accumulated_micro_batches_without_grad_reuse_match_one_rank(single_rank):
    results = run_ranks(_accumulate, 2, {"grad_reuse": False}, timeout_s=90)
    for losses in results:
        for got, want in zip(losses, single_rank["losses"][: len(losses)], strict=True):  # its first steps
            assert abs(got - want) <= 1e-5 * abs(want)


def _overflow_on_one_rank(rank, world):
    model, _ = gpt_pair()
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _config(precision="fp16"))
    out = []
    for step in range(3):
        x, y = tokens(step, batch=GLOBAL_BATCH)
        _, loss = engine(x[rank::world], y[rank::world])
        if step == 2 and rank == 1:
            loss = loss * float("inf")  # only rank 1 overflows
        engine.backward(loss)
        norm = engine.clip_grad_norm_(1.0)
        scale = engine.scaler.scale
        engine.step()
        engine.zero_grad()
        out.append((scale, engine.scaler.scale, math.isfinite(norm.item())))
    return out, engine.memory_stats()["skipped_steps"]


@pytest.mark.slow
def test_an_fp16_overflow_on_one_rank_makes_every_rank_skip_the_step():
    (a, skipped_a), (b, skipped_b) = run_ranks(_overflow_on_one_rank, 2, timeout_s=90)
    assert a == b, "ranks must agree on norms, skips and scales"
    before, after, finite = a[2]
    assert after == before / 2 and not finite
    assert skipped_a == skipped_b >= 1


def _managed_collectives(rank, world):
    client = hybridps.Client(hybridps.Config(devices={"cuda:0": "1MiB"}, chunk_size=1000))
    client.register_module(torch.nn.Linear(40, 40))
    local = torch.arange(2500, dtype=torch.float32) * (rank + 1)
    before = client.groups.comm.calls["all_reduce"]
    reduced = client.allreduce(local, op="sum")
    broadcast = client.broadcast(torch.full((3, 5), float(rank)), src=1)
    values = client.access(reduced).clone(), client.access(broadcast).clone()
    kinds = client.memory_stats()["kinds"]
    client.release(reduced)
    client.release(broadcast)
    calls = client.groups.comm.calls["all_reduce"] - before
    client.close()
    return values, kinds["buffer"]["chunks"], calls


@pytest.mark.slow
def test_allreduce_and_broadcast_return_tensors_managed_in_chunks():
    results = run_ranks(_managed_collectives, 2, timeout_s=90)
    for (reduced, broadcast), n_chunks, calls in results:
        assert torch.equal(reduced, torch.arange(2500, dtype=torch.float32) * 3)
        assert torch.equal(broadcast, torch.ones(3, 5))
        assert n_chunks == 2  # a tensor never straddles chunks: 2500 elements get a chunk of their own
        assert calls == 3  # one collective per chunk-sized piece (chunk_size=1000)


def test_one_rank_owns_every_chunk_and_model_data_matches_the_layout():
    model, _ = gpt_pair()
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters()), _config())
    client = engine.client
    assert client.groups is None and all(c.owned for c in client.all_chunks())
    assert len(client.rows[ChunkKind.MOMENTUM]) == len(client.rows[ChunkKind.PARAM])


@pytest.mark.slow
def test_plain_pytorch_agrees_with_the_single_rank_reference(single_rank):
    _, reference = gpt_pair()
    expected = train_plain(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True), 6, batch=GLOBAL_BATCH)
    assert expected == single_rank["losses"]


def _bare_or_engine_backward(rank, world, bare):
    model, _ = gpt_pair()
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), _config())
    out = []
    for step in range(4):
        x, y = tokens(step, batch=GLOBAL_BATCH)
        _, loss = engine(x[rank::world], y[rank::world])
        if bare:
            loss.backward()  # as Trainer-style loops (accelerate) run it
        else:
            engine.backward(loss)
        norm = engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        out.append((loss.item(), norm.item()))
    return out


@pytest.mark.slow
def test_a_bare_loss_backward_on_two_ranks_trains_like_engine_backward():
    # without the end-of-backward callback the grads reached clip_grad_norm_ unreduced: the
    # norm read 0.0 and the steps went wrong without an error
    bare = run_ranks(_bare_or_engine_backward, 2, True, timeout_s=90)
    reference = run_ranks(_bare_or_engine_backward, 2, False, timeout_s=90)
    assert bare == reference
    assert all(norm > 0 for _, norm in bare[0])


def _overlap_losses(rank, world, overlap_step):
    model, _ = gpt_pair()
    config = _config(overlap_step=overlap_step)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config)
    losses, stepped_early = [], []
    for step in range(4):
        x, y = tokens(step, batch=GLOBAL_BATCH)
        _, loss = engine(x[rank::world], y[rank::world])
        engine.backward(loss)  # with overlap_step each group steps once its grads are reduced
        stepped_early.append(len(engine.optimizer.iteration.early.stepped))
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    state = engine.state_dict()
    return losses, state if rank == 0 else None, stepped_early


@pytest.mark.slow
def test_early_steps_on_two_ranks_train_like_the_step_after_backward():
    plain = run_ranks(_overlap_losses, 2, False, timeout_s=120)
    early = run_ranks(_overlap_losses, 2, True, timeout_s=120)
    assert all(n == 0 for r in plain for n in r[2]) and all(n > 0 for r in early for n in r[2])
    assert [r[0] for r in early] == [r[0] for r in plain]  # every rank's losses, bit for bit
    assert all(torch.equal(early[0][1][k], plain[0][1][k]) for k in plain[0][1])


class _ReusedBlock(torch.nn.Module):
    """A block used first and last in forward, with other blocks between: its grads (summed
    over both uses by autograd) arrive late in backward, while the groups after it in
    backward have their reductions in flight."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(48, 48)
        self.head = torch.nn.Linear(48, 8)
        self.middle = torch.nn.ModuleList(torch.nn.Linear(48, 48) for _ in range(4))

    def forward(self, x):
        h = torch.tanh(self.shared(x))
        for block in self.middle:
            h = torch.tanh(block(h))
        return self.head(torch.tanh(self.shared(h)))


def _reused_block_losses(rank, world, grad_reuse):
    torch.manual_seed(0)
    model = _ReusedBlock()
    config = hybridps.Config(devices={"cuda:0": "64KiB"}, chunk_size=2400, grad_reuse=grad_reuse, collective_timeout_s=60.0)
    engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), config)
    losses = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(8, 48, generator=g), torch.randn(8, 8, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x[rank::world]), target[rank::world])
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    landed = engine.memory_stats()["dist"]["reductions_landed"] if world > 1 else {}
    return losses, landed


@pytest.mark.slow
@pytest.mark.parametrize("grad_reuse", [True, False])
def test_reductions_run_beside_backward_and_train_like_one_rank(grad_reuse):
    (one, _), *_ = run_ranks(_reused_block_losses, 1, grad_reuse, timeout_s=60)
    results = run_ranks(_reused_block_losses, 2, grad_reuse, timeout_s=90)
    for losses, landed in results:
        for got, want in zip(losses, one, strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (losses, one)
        # backward went on while reductions ran: a later group's reduction landed the earlier
        assert landed.get("window", 0) > 0, landed
        assert landed == results[0][1], "every rank lands the same reductions at the same points"


@pytest.mark.slow
def test_short_of_gpu_room_a_rank_waits_for_the_collectives_holding_chunks_instead_of_failing(single_rank):
    # At 12% of the model data the chunks that asynchronous collectives held (prefetched
    # gathers, reductions in flight) were all that could leave: the mover raised a
    # CapacityError in backward. It now waits for those collectives and evicts.
    results = run_ranks(_train_ranks, 2, 3, {"gpu_fraction": 0.12}, timeout_s=90)
    for r in results:
        for got, want in zip(r["losses"], single_rank["losses"][:3], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], single_rank["losses"])
        assert r["dist"]["reductions_landed"].get("waited for room", 0) > 0, r["dist"]


def _losses_around_a_failed_backward(rank, world, fail_at, grad_reuse):
    """Train 5 steps; at ``fail_at`` a hook raises inside backward (on every rank) and the loop
    drops that iteration with zero_grad, as a loop that skips bad batches would. ``fail_at``
    -1: that batch is skipped before its forward instead (the reference)."""
    model, _ = gpt_pair()
    engine = hybridps.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), _config(grad_reuse=grad_reuse)
    )
    failing = {"now": False}

    def raise_in_backward(module, args, out):
        if failing["now"]:
            out.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("bad batch")))

    model.blocks[0].register_forward_hook(raise_in_backward)  # its grad comes late in backward
    losses, refused = [], []
    for step in range(5):
        if step == 2 and fail_at == -1:
            continue
        failing["now"] = step == fail_at
        x, y = tokens(step, batch=GLOBAL_BATCH)
        _, loss = engine(x[rank::world], y[rank::world])
        try:
            engine.backward(loss)
        except RuntimeError as exc:
            assert "bad batch" in str(exc)
            with pytest.raises(hybridps.StateError, match=r"zero_grad\(\)"):
                engine(x[rank::world], y[rank::world])
            refused.append(True)
            with pytest.raises(hybridps.StateError, match=r"zero_grad\(\)"):
                engine.step()
            refused.append(True)
            engine.zero_grad()
            continue
        engine.step()
        engine.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    landed = engine.memory_stats()["dist"]["reductions_landed"]
    return losses, refused, landed


@pytest.mark.slow
@pytest.mark.parametrize("grad_reuse", [True, False])
def test_a_backward_that_raised_partway_on_every_rank_is_dropped_by_zero_grad_and_training_goes_on_exactly(grad_reuse):
    # Before, a reduction still in flight landed in the next iteration (into a param chunk)
    # and the half-counted groups were reduced early: the losses after drifted silently.
    want = run_ranks(_losses_around_a_failed_backward, 2, -1, grad_reuse, timeout_s=90)
    got = run_ranks(_losses_around_a_failed_backward, 2, 2, grad_reuse, timeout_s=90)
    for (losses, refused, landed), (ref_losses, *_) in zip(got, want, strict=True):
        assert losses == ref_losses, (losses, ref_losses)
        assert refused == [True, True], "a forward and a step before zero_grad are refused"
        assert landed.get("abandoned", 0) >= 1, landed


@pytest.mark.slow
def test_the_shared_memory_link_trains_bit_equal_to_gloo_and_is_used():
    """Two ranks on this host: the chunk collectives go through the shared-memory link by
    default, and training is bit-equal to the same ranks on gloo alone."""
    linked = run_ranks(_train_ranks, 2, 3, {}, timeout_s=90)
    gloo = run_ranks(_train_ranks, 2, 3, {"node_shared_memory": False}, timeout_s=90)
    for a, b in zip(linked, gloo, strict=True):
        assert a["losses"] == b["losses"]
        link = a["dist"]["shared_memory_link"]
        assert link["state"] == "open" and link["collectives"] > 0 and link["pieces"] >= link["collectives"]
        assert b["dist"]["shared_memory_link"] is None
    for key, value in gloo[0]["state"].items():
        assert torch.equal(linked[0]["state"][key], value), key


def test_node_shared_memory_takes_auto_true_or_false():
    for value in ("auto", True, False):
        assert hybridps.Config(node_shared_memory=value).node_shared_memory == value
    with pytest.raises(hybridps.ConfigError, match="node_shared_memory='yes'"):
        hybridps.Config(node_shared_memory="yes")
