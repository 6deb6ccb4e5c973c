"""Chunk groups (sharding/groups.py, gathers.py, reductions.py) driven in the test process.

The Client builds ChunkGroups only when the world has more than one rank (client.py), so a
process group of one rank would test nothing of them. Two ranks run instead as two threads
of this process over torch's threaded process group (``multi_threaded_pg``: real
``torch.distributed`` calls, each rank's default group thread-local, collectives met in
memory), each with its own Client built through the ordinary registration path
(``register_module``, ``register_optim``), its own ChunkGroups and its own Collectives. The
tests hand forward and backward in through the client as the engine's hooks would (access,
release, store_grad, end_backward), with no autograd, and read the groups' state between the
moves. Averaging two ranks' grads is one exact addition and a halving, so steps compare with
torch's fused AdamW bit for bit.
"""

from __future__ import annotations

import threading
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup,
    _install_threaded_pg,
    _uninstall_threaded_pg,
)

from hybridps import Client, Config, TensorState
from hybridps.client import rank_parts
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.ownership import assign_owners
from hybridps.client.sharding import group_phase
from hybridps.client.sharding.group_phase import GroupMove, GroupPhase
from hybridps.client.sharding.reductions import ReductionPhase
from hybridps.common.errors import StateError

WORLD = 2
#: chunks of 64 elements: 35 + 20 share chunk 0, 36 + 4 chunk 1, 50 takes chunk 2, chunk 3 is
#: padding to whole groups. Group 0 is chunks 0 and 1 (params 0-3), group 1 chunks 2 and 3
#: (param 4).
SHAPES = [(5, 7), (20,), (6, 6), (4,), (50,)]
GROUP_OF_PARAM = [0, 0, 0, 0, 1]
#: assign_owners takes the most uneven group first: group 1 (50 elements against padding)
#: gives chunk 2 to rank 0 and the padding to rank 1; then in group 0 the heavier chunk 0 goes
#: to the less loaded rank 1 and chunk 1 to rank 0
OWNER_OF = [1, 0, 0, 1]
#: per rank, its owned chunks that hold params (the padding chunk holds none)
OWNED_WITH_PARAMS = [{1, 2}, {0}]
HYPER = {"lr": 1e-2, "weight_decay": 0.1, "fused": True}
#: bytes of one gathered group (two fp32 chunks of 64 elements)
GROUP_BYTES = 2 * 64 * 4
_S = TensorState

_opened = threading.local()


@pytest.fixture
def ranks(monkeypatch):
    """``ranks(fn, *args)`` runs ``fn(rank, *args)`` on two threads, each a rank of a fresh
    threaded process group, and returns their results; a rank's failure fails the test with
    its traceback. The process group and every client a rank opened are gone afterwards."""
    # Each client's collectives keep watchdog records under a store prefix numbered by the
    # clients made so far in the process (topology._collectives_prefix): two ranks in one
    # process would number theirs apart. Every run here is a fresh job with a fresh store,
    # as every process of a real job counts only its own clients.
    monkeypatch.setattr(rank_parts, "_collectives_prefix", lambda group: "hybridps/unit")

    def run(fn, *args):
        store = dist.HashStore()
        results: list = [None] * WORLD
        errors: list[tuple[int, str, BaseException]] = []

        def worker(rank: int) -> None:
            _opened.clients = []
            dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
            try:
                results[rank] = fn(rank, *args)
            except BaseException as exc:  # the peer stuck in a collective is woken and exits
                errors.append((rank, traceback.format_exc(), exc))
                ProcessLocalGroup.exception_handle(exc)
            finally:
                try:
                    for client in _opened.clients:  # without restoring the params: no collective
                        client.close(restore=False)
                finally:
                    dist.destroy_process_group()

        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        _install_threaded_pg()
        try:
            threads = [threading.Thread(target=worker, args=(r,), name=f"rank {r}") for r in range(WORLD)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads), "a rank did not finish within 60 s"
        finally:
            ProcessLocalGroup.reset()
            _uninstall_threaded_pg()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
        first = [e for e in errors if not isinstance(e[2], SystemExit)] or errors
        if first:
            rank, trace, _ = first[0]
            pytest.fail(f"rank {rank} failed:\n{trace}", pytrace=False)
        assert not dist.is_initialized(), "no process group is left to the tests that follow"
        return results

    return run


# -- what each rank runs ---------------------------------------------------------------------


def _registered(**config):
    """A Client of this rank over a tiny model and its ChunkedAdam; a plain copy of the
    model's params (equal on every rank) with torch's fused AdamW over them."""
    model = nn.ParameterList(
        [nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i))) for i, s in enumerate(SHAPES)]
    )
    reference = [nn.Parameter(p.detach().clone()) for p in model]
    client = Client(
        Config(
            **{
                "precision": "fp32",
                "chunk_size": 64,
                "devices": {"cuda:0": "1MiB"},
                "shard_group_size": "world",
                "collective_timeout_s": 30.0,
                **config,
            }
        )
    )
    _opened.clients.append(client)
    assert client.groups is not None and client.world_size == WORLD
    client.register_module(model)
    optimizer = client.register_optim(torch.optim.AdamW(model.parameters(), **HYPER))
    return client, optimizer, list(model), reference, torch.optim.AdamW(reference, **HYPER)


def _grads(step: int, rank: int) -> list[torch.Tensor]:
    """This rank's local grads of one step (each rank's differ)."""
    return [torch.randn(s, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + i)) for i, s in enumerate(SHAPES)]


def _mean_grads(step: int) -> list[torch.Tensor]:
    """What the reduce-scatter leaves with the owner: the sum of the two ranks' grads, halved."""
    return [(a + b) / 2 for a, b in zip(_grads(step, 0), _grads(step, 1), strict=True)]


def _forward(client: Client, params, read=None) -> None:
    """What forward's hooks do: access each param, use it, release it to HOLD_AFTER_FWD."""
    client.begin_forward()
    for p in params:
        client.access(p)
        if read is not None:
            read(p)
        client.release(p, _S.HOLD_AFTER_FWD)
    client.end_forward()


def _grad_in(client: Client, p: nn.Parameter, grad: torch.Tensor) -> None:
    """What backward's hooks do with one param: access it, hand its local grad in, release it."""
    client.access(p)
    client.store_grad(p, grad)
    client.release(p, _S.HOLD_AFTER_BWD)


def _backward(client: Client, params, grads) -> None:
    with client.backward_running():
        for p, g in reversed(list(zip(params, grads, strict=True))):
            _grad_in(client, p, g)
    client.end_backward()


def _record_landed(client: Client, optimizer) -> list[set[int]]:
    """What ``end_backward`` hands the optimizer (``ChunkedAdam.grads_landed``), per call."""
    seen: list[set[int]] = []
    original = optimizer.grads_landed
    optimizer.grads_landed = lambda indices: (seen.append(set(indices)), original(indices))[1]
    return seen


def _row(client: Client, kind: ChunkKind, p: nn.Parameter) -> torch.Tensor:
    info = client.param_info(p)
    return client.store.rows[kind][info.chunk].view(info.slot).view(info.shape)


def _assert_same_params(client: Client, params, reference, what: str) -> None:
    """Owned params: master and param slot equal the reference. Every param: its value in a
    forward (the owner's, all-gathered for the others) equals the reference."""
    for p, ref in zip(params, reference, strict=True):
        if client.owns(client.param_info(p).chunk):
            assert torch.equal(_row(client, client.store.master_kind, p), ref.detach()), f"{what}: master of {p.shape}"
            assert torch.equal(_row(client, ChunkKind.PARAM, p), ref.detach()), f"{what}: param slot of {p.shape}"
    seen = []
    _forward(client, params, read=lambda p: seen.append(p.data.clone()))
    for value, ref in zip(seen, reference, strict=True):
        assert torch.equal(value, ref.detach()), f"{what}: value of {ref.shape} in a forward"


def _foreign(client: Client, g: int):
    """The chunk of group ``g`` this rank does not own."""
    return next(client.store.rows[ChunkKind.PARAM][i] for i in client.groups.members(g) if not client.owns(i))


# -- the phase table -------------------------------------------------------------------------

#: the legal moves of a group's foreign copies (group_phase._TABLE, written out)
LEGAL = {
    (GroupPhase.DROPPED, GroupMove.GATHER_ISSUED): GroupPhase.GATHERED,
    (GroupPhase.DROPPED, GroupMove.PREFETCH_ISSUED): GroupPhase.ARRIVING,
    (GroupPhase.ARRIVING, GroupMove.LANDED): GroupPhase.GATHERED,
    (GroupPhase.GATHERED, GroupMove.LANDED): GroupPhase.GATHERED,
    (GroupPhase.RETAINED, GroupMove.LANDED): GroupPhase.RETAINED,
    (GroupPhase.GATHERED, GroupMove.USED_AGAIN): GroupPhase.GATHERED,
    (GroupPhase.RETAINED, GroupMove.USED_AGAIN): GroupPhase.GATHERED,
    (GroupPhase.GATHERED, GroupMove.FORWARD_DONE): GroupPhase.RETAINED,
    (GroupPhase.RETAINED, GroupMove.FORWARD_DONE): GroupPhase.RETAINED,
    (GroupPhase.DROPPED, GroupMove.DROPPED): GroupPhase.DROPPED,
    (GroupPhase.ARRIVING, GroupMove.DROPPED): GroupPhase.DROPPED,
    (GroupPhase.GATHERED, GroupMove.DROPPED): GroupPhase.DROPPED,
    (GroupPhase.RETAINED, GroupMove.DROPPED): GroupPhase.DROPPED,
}


def test_the_phase_table_allows_its_moves_and_refuses_every_other_naming_the_group():
    for phase in GroupPhase:
        for move in GroupMove:
            if (phase, move) in LEGAL:
                assert group_phase.apply(phase, move, 7) is LEGAL[(phase, move)], (phase, move)
                continue
            # e.g. a gather while the copies are here (a second collective), a use or the
            # forward's end of copies that are not here, a use of copies still arriving
            with pytest.raises(StateError, match=rf"chunk group 7: {move.value} while {phase.value}; .*bookkeeping is broken"):
                group_phase.apply(phase, move, 7)
    assert [p for p in GroupPhase if p.here] == [GroupPhase.ARRIVING, GroupPhase.GATHERED, GroupPhase.RETAINED]


# -- forward and backward: the phase moves of a group's copies --------------------------------


def _phases_through_an_iteration(rank: int) -> dict:
    # nothing kept gathered after the forward: each group drops once its last slot is done
    client, optimizer, params, _, _ = _registered(live_gathered_bytes=0)
    groups = client.groups
    gathers, reductions = groups.gathers, groups.reductions
    landed = _record_landed(client, optimizer)
    assert gathers.gathered == [] and gathers.issued == 0

    client.begin_forward()
    for i, p in enumerate(params):
        g = GROUP_OF_PARAM[i]
        client.access(p)
        assert gathers.phase.get(g) is GroupPhase.GATHERED, f"param {i}: its group is gathered before it is used"
        assert _foreign(client, g).payload is not None
        client.release(p, _S.HOLD_AFTER_FWD)
        last_of_group = i + 1 == len(params) or GROUP_OF_PARAM[i + 1] != g
        if last_of_group:  # every slot of the group reached HOLD_AFTER_FWD: the copies go
            assert not gathers.is_here(g) and g not in gathers.phase, f"group {g} dropped after its last param"
            assert _foreign(client, g).payload is None, "the foreign chunk's memory is freed"
        else:
            assert gathers.phase.get(g) is GroupPhase.GATHERED, f"group {g} kept while param {i + 1} is to come"
    client.end_forward()
    assert gathers.gathered == [] and gathers.issued == 2
    own = [client.store.rows[ChunkKind.PARAM][i] for i in range(4) if client.owns(i)]
    assert all(c.payload is not None for c in own), "a rank's own chunks stay when the copies go"

    trail, phases = [], []
    with client.backward_running():
        for i in reversed(range(len(params))):
            g = GROUP_OF_PARAM[i]
            client.access(params[i])
            assert gathers.phase.get(g) is GroupPhase.GATHERED, f"group {g} gathered again for backward"
            client.store_grad(params[i], _grads(0, rank)[i])
            client.release(params[i], _S.HOLD_AFTER_BWD)
            trail.append((i, reductions.collecting(), reductions.in_flight(), gathers.gathered))
            phases.append([red.phase for red in reductions.records])
    assert gathers.issued == 4, "each group gathered once more, for backward"
    assert trail == [
        # param 4 is group 1's only slot: its grads are final, its reduction starts at once
        (4, [], [1], [1]),
        # group 0 waits for the grads of all four of its params
        (3, [0], [1], [0, 1]),
        (2, [0], [1], [0, 1]),
        (1, [0], [1], [0, 1]),
        # its reduction starts; one reduction in flight at a time lands group 1's, which drops it
        (0, [], [0], [0]),
    ]
    _I, _C, _F, _L = ReductionPhase.IDLE, ReductionPhase.COLLECTING, ReductionPhase.IN_FLIGHT, ReductionPhase.LANDED
    assert phases == [[_I, _F], [_C, _F], [_C, _F], [_C, _F], [_F, _L]], "each group's reduction, by its phase"
    assert reductions.landings == {"window": 1}
    client.end_backward()
    assert reductions.in_flight() == [] and reductions.collecting() == [] and gathers.gathered == []
    assert all(red.phase is ReductionPhase.IDLE for red in reductions.records), "no record carries over"
    assert reductions.landings == {"window": 1, "end of backward": 1}
    for p in params:  # owners hold the reduced grads; the others none
        assert client.param_info(p).has_grad == client.owns(client.param_info(p).chunk)
    optimizer.step()
    optimizer.zero_grad()
    return {"landed": landed, "reduces": reductions.reduces}


def test_a_groups_copies_are_gathered_for_use_dropped_after_the_forward_gathered_again_and_reduced(ranks):
    for rank, result in enumerate(ranks(_phases_through_an_iteration)):
        # end_backward hands the optimizer the owned chunks whose slots took reduced grads
        assert result["landed"] == [OWNED_WITH_PARAMS[rank]]
        assert result["reduces"] == 2


def _kept_for_backward(rank: int, live_bytes: int | None) -> dict:
    client, optimizer, params, _, _ = _registered(live_gathered_bytes=live_bytes)
    groups = client.groups
    _forward(client, params)
    phases = {g: groups.gathers.phase.get(g) for g in range(groups.num_groups)}
    retained = list(groups.gathers.retained)
    gathers = groups.gathers.issued
    _backward(client, params, _grads(0, rank))
    optimizer.step()
    optimizer.zero_grad()
    return {"phases": phases, "retained": retained, "backward_gathers": groups.gathers.issued - gathers}


@pytest.mark.parametrize(
    ("live_bytes", "phases", "backward_gathers"),
    [
        # room for both groups: both kept, backward gathers nothing
        (None, {0: GroupPhase.RETAINED, 1: GroupPhase.RETAINED}, 0),
        # room for one: the oldest (group 0) is dropped, backward gathers it again
        (GROUP_BYTES, {0: None, 1: GroupPhase.RETAINED}, 1),
        # none: both dropped, backward gathers both
        (0, {0: None, 1: None}, 2),
    ],
)
def test_groups_the_forward_is_done_with_are_retained_for_backward_within_live_gathered_bytes(
    ranks, live_bytes, phases, backward_gathers
):
    for result in ranks(_kept_for_backward, live_bytes):
        assert result["phases"] == phases
        assert result["retained"] == [g for g, p in phases.items() if p is not None]
        assert result["backward_gathers"] == backward_gathers


# -- end_backward and the steps after it -------------------------------------------------------


def _train(rank: int, grad_reuse: bool) -> list:
    client, optimizer, params, reference, ref_opt = _registered(grad_reuse=grad_reuse)
    landed = _record_landed(client, optimizer)
    for step in range(2):
        for ref, g in zip(reference, _mean_grads(step), strict=True):
            ref.grad = g
        _forward(client, params)
        _backward(client, params, _grads(step, rank))
        ref_opt.step()
        optimizer.step()
        optimizer.zero_grad()
        _assert_same_params(client, params, reference, f"rank {rank}, step {step}")
    assert optimizer.steps == [2 if client.owns(client.param_info(p).chunk) else 0 for p in params]
    return landed


@pytest.mark.parametrize("grad_reuse", [True, False])
def test_steps_after_end_backward_train_bit_equal_to_fused_adamw_on_the_mean_grads(ranks, grad_reuse):
    for rank, landed in enumerate(ranks(_train, grad_reuse)):
        # under grad reuse the reduced grads land in the param slots, which the step writes
        # back from the master copy; without it they land in grad chunks and nothing is handed
        assert landed == ([OWNED_WITH_PARAMS[rank]] if grad_reuse else [set()]) * 2


def _grads_for_one_group(rank: int) -> dict:
    client, optimizer, params, reference, ref_opt = _registered()
    groups = client.groups
    _forward(client, params)
    assert groups.gathers.retained.keys() == {0, 1}, "both groups kept for backward"
    grad = _grads(0, rank)[4]
    with client.backward_running():  # only param 4 (group 1) takes part in the loss
        _grad_in(client, params[4], grad)
    client.end_backward()
    # group 1 dropped by its reduction; group 0, kept for a backward that gave it no grads,
    # by the end of backward
    assert groups.gathers.gathered == [] and groups.gathers.retained == {} and groups.reductions.in_flight() == []
    assert _foreign(client, 0).payload is None
    has_grad = [client.param_info(p).has_grad for p in params]
    reference[4].grad = _mean_grads(0)[4]
    ref_opt.step()  # params without a grad are left alone
    optimizer.step()
    optimizer.zero_grad()
    _assert_same_params(client, params, reference, f"rank {rank}")
    return has_grad


def test_end_of_backward_drops_a_group_kept_for_backward_that_took_no_grads_and_steps_only_what_did(ranks):
    has_grad = ranks(_grads_for_one_group)
    assert has_grad == [[False] * 4 + [True], [False] * 5], "only the owner of param 4's chunk holds its grad"


# -- early steps after the landings (Config.overlap_step) --------------------------------------


def _early_steps(rank: int) -> dict:
    # driven through the client alone (no engine hooks): every landing's chunk is taken at the
    # end of backward, where Client.end_backward steps what take_ready hands out
    client, optimizer, params, reference, ref_opt = _registered(overlap_step=True)
    groups = client.groups
    landed = _record_landed(client, optimizer)
    taken: list[list[int]] = []
    take = groups.take_ready
    groups.take_ready = lambda: (taken.append(ready := take()), ready)[1]
    stepped: list[list[int]] = []  # per backward, the chunks reported stepped (note_early_step)
    note = groups.note_early_step
    groups.note_early_step = lambda index: (stepped[-1].append(index), note(index))[1]
    order_checks = []
    for step in range(2):
        for ref, g in zip(reference, _mean_grads(step), strict=True):
            ref.grad = g
        _forward(client, params)
        checks = groups.comm.stats()["order_checks"]
        stepped.append([])
        _backward(client, params, _grads(step, rank))
        order_checks.append(groups.comm.stats()["order_checks"] - checks)
        assert all(red.phase is ReductionPhase.IDLE and not red.stepped_early for red in groups.reductions.records)
        ref_opt.step()
        optimizer.step()
        optimizer.zero_grad()
        _assert_same_params(client, params, reference, f"rank {rank}, step {step}")
    return {"landed": landed, "taken": taken, "stepped": stepped, "order_checks": order_checks}


def test_owned_chunks_made_final_by_a_landing_step_early_and_train_bit_equal_to_fused_adamw(ranks):
    for rank, result in enumerate(ranks(_early_steps)):
        # group 1 lands first (the window), group 0 at the end of backward: the rank's owned
        # chunk of each, in landing order (rank 1's of group 1 is padding, which nothing steps)
        own = [next(i for i in (2 * g, 2 * g + 1) if OWNER_OF[i] == rank) for g in (1, 0)]
        assert own == ([2, 1] if rank == 0 else [3, 0])
        assert result["taken"] == [own, own]
        assert result["stepped"] == [[i for i in own if i in OWNED_WITH_PARAMS[rank]]] * 2
        # the end of backward's order check, then one per landing before its early step
        assert result["order_checks"] == [3, 3]
        # a chunk stepped early has its params written back: none is left to the step's write-back
        assert result["landed"] == [set(), set()]


# -- ownership -------------------------------------------------------------------------------


def _ownership(rank: int) -> dict:
    client, _, params, _, _ = _registered()
    store, groups = client.store, client.groups
    assert groups.ownership is store.ownership, "one table, read by the store and the groups"
    table = store.ownership
    for i in range(store.num_chunks):
        assert groups.owner(i) == table.owner(i)
        assert groups.owns(i) == client.owns(i) == (table.owner(i) == rank)
        assert store.rows[ChunkKind.PARAM][i].owned == groups.owns(i)
        # the owner alone keeps the fp32 master and Adam's states
        for kind in (store.master_kind, ChunkKind.MOMENTUM, ChunkKind.VARIANCE):
            chunk = store.rows[kind][i]
            assert (chunk.payload is not None) == (groups.owns(i) and bool(chunk.slots)), (kind, i)
    return {
        "owner_of": list(table.owner_of),
        "ranked": [groups.ranked(g) for g in range(groups.num_groups)],
        "members": [list(groups.members(g)) for g in range(groups.num_groups)],
        "chunks": [client.param_info(p).chunk for p in params],
        "own_param_chunk": [groups.ranked(g)[rank] for g in range(groups.num_groups)],
    }


def test_each_chunk_has_one_owner_in_the_table_the_store_and_the_groups_share(ranks):
    results = ranks(_ownership)
    assert results[0] == {**results[1], "own_param_chunk": results[0]["own_param_chunk"]}, "the ranks agree"
    for rank, result in enumerate(results):
        assert result["chunks"] == [0, 0, 1, 1, 2]
        assert result["owner_of"] == OWNER_OF
        assert result["members"] == [[0, 1], [2, 3]]
        assert result["ranked"] == [[1, 0], [2, 3]], "each group's chunks in the order of their owners' ranks"
        assert result["own_param_chunk"] == [i for i, r in enumerate(OWNER_OF) if r == rank]
    # the same rule by hand: equal chunks give rank r member r of every group
    assert assign_owners([8] * 6, WORLD) == ([0, 1, 0, 1, 0, 1], [[0, 1], [2, 3], [4, 5]])


# -- a backward that raised partway -------------------------------------------------------------


def _abandoned(rank: int, grads_in: int) -> dict:
    client, optimizer, params, reference, ref_opt = _registered()
    groups = client.groups
    returned: list[set[int]] = []
    abandon = groups.abandon_backward
    groups.abandon_backward = lambda: (returned.append(set(landed := abandon())), landed)[1]

    _forward(client, params)
    with client.backward_running():  # backward raises after ``grads_in`` grads (on every rank)
        for i in list(reversed(range(len(params))))[:grads_in]:
            _grad_in(client, params[i], _grads(0, rank)[i])
    abandoned = {GROUP_OF_PARAM[i] for i in list(reversed(range(len(params))))[:grads_in]}
    assert groups.backward_unfinished()
    landed_before = dict(groups.reductions.landings)
    with pytest.raises(StateError, match=r"a forward after a backward that raised partway.*zero_grad\(\)"):
        client.begin_forward()
    with pytest.raises(StateError, match=r"the optimizer step after a backward that raised partway.*zero_grad\(\)"):
        optimizer.step()

    optimizer.zero_grad()  # drops the backward
    assert not groups.backward_unfinished()
    gathers, reductions = groups.gathers, groups.reductions
    assert reductions.in_flight() == [] and reductions.collecting() == []
    assert gathers.gathered == [] and gathers.retained == {}
    # every group that took a grad is ABANDONED (the others IDLE), with nothing carried over
    phases = [red.phase for red in reductions.records]
    assert phases == [ReductionPhase.ABANDONED if g in abandoned else ReductionPhase.IDLE for g in range(groups.num_groups)]
    assert all(red.grads_seen == 0 and not red.stepped_early and not red.params_hold_grads for red in reductions.records)
    assert not reductions.local_flags.any() and not reductions.untaken
    assert reductions.staging.chunks == {}
    assert not any(client.param_info(p).has_grad for p in params)
    for p, ref in zip(params, reference, strict=True):
        info = client.param_info(p)
        if client.owns(info.chunk):  # a slot that held a grad holds the param again
            assert torch.equal(_row(client, ChunkKind.PARAM, p), ref.detach())
            assert client.store.rows[ChunkKind.PARAM][info.chunk].slot_state(info.slot) is not _S.HOLD_AFTER_BWD

    # the next iteration trains as if the failed one never ran
    for ref, g in zip(reference, _mean_grads(1), strict=True):
        ref.grad = g
    _forward(client, params)
    _backward(client, params, _grads(1, rank))
    ref_opt.step()
    optimizer.step()
    optimizer.zero_grad()
    _assert_same_params(client, params, reference, f"rank {rank}, after the abandoned backward")
    return {"returned": returned, "landed_before": landed_before, "landed": dict(groups.reductions.landings)}


@pytest.mark.parametrize(
    ("grads_in", "returned", "landed_before"),
    [
        # param 4's grad: group 1's reduction in flight; rank 1 owns only its padding chunk
        (1, [{2}, set()], {}),
        # and three of group 0's four: group 0 holds local grads, not yet reduced
        (4, [{1, 2}, {0}], {}),
        # every grad, but no end of backward: group 1's reduction landed (its reduced grads in
        # rank 0's chunk 2), group 0's in flight
        (5, [{1, 2}, {0}], {"window": 1}),
    ],
)
def test_a_backward_that_raised_partway_is_abandoned_by_zero_grad_and_the_next_iteration_is_exact(
    ranks, grads_in, returned, landed_before
):
    for rank, result in enumerate(ranks(_abandoned, grads_in)):
        # abandon_backward hands zero_grad the owned chunks whose slots took local or reduced
        # grads, to restore from the master copy; then a complete backward drops nothing
        assert result["returned"] == [returned[rank], set()]
        assert result["landed_before"] == landed_before
        assert result["landed"] == {
            **landed_before,
            "abandoned": 1,
            "window": landed_before.get("window", 0) + 1,
            "end of backward": 1,
        }
