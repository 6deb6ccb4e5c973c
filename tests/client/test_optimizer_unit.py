"""ChunkedAdam driven alone: a chunk store and a mover built by hand, no Client, no engine.

The optimizer takes its collaborators in its constructor (store, mover, placement policy, the
grads' owner's ``set_has_grad``),
so it can be checked against torch's fused AdamW on a hand-made layout.
"""

import torch
from torch import nn

from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.chunks.layout import ChunkLayout
from hybridps.client.chunks.states import TensorState
from hybridps.client.chunks.store import ChunkStore, ParamInfo
from hybridps.client.memory.mover import ChunkMover
from hybridps.client.memory.placement import PlacementPolicy
from hybridps.client.optim.adam import ChunkedAdam
from hybridps.client.params.grads import set_has_grad
from hybridps.common.config import Config
from hybridps.common.devices import DeviceInventory
from hybridps.common.protocol import ClientInfo
from hybridps.manager.embedded import EmbeddedManager


def _store(params: list[nn.Parameter], config: Config) -> tuple[ChunkStore, ChunkMover, PlacementPolicy]:
    """Lay ``params`` out in chunks of 64 elements (param + master rows), as a client would."""
    inventory = DeviceInventory.build({"cuda:0": 1 << 20, "cpu": 1 << 24}, simulate=True)
    mover = ChunkMover(inventory, EmbeddedManager(inventory).connect(ClientInfo(devices=tuple(inventory.names))))
    store = ChunkStore(config, inventory.compute_device, rank=0, world_size=1)
    policy = PlacementPolicy(inventory.compute_device)
    store.layout = ChunkLayout(64, config.alignment)
    for i, p in enumerate(params):
        slot = store.layout.add(p.numel())
        while store.num_chunks <= slot.chunk:
            index = store.num_chunks
            for kind in store.kinds:
                chunk = store.new_chunk(kind, index, store.layout.capacity(index))
                store.rows[kind].append(chunk)
                mover.place(chunk, policy.home(kind))
        info = ParamInfo(param=p, name=f"p{i}", slot=slot, shape=p.shape, orig_dtype=p.dtype)
        for kind in store.kinds:
            chunk = store.rows[kind][slot.chunk]
            chunk.add_slot(slot)
            chunk.view(slot).copy_(p.detach().reshape(-1))
            chunk.set_slot_state(slot, TensorState.HOLD, info)
        store.add(info)
    for kind in (ChunkKind.MOMENTUM, ChunkKind.VARIANCE):  # what register_optim lays out
        store.rows[kind] = []
        for index, param_chunk in enumerate(store.rows[ChunkKind.PARAM]):
            chunk = store.new_chunk(kind, index, param_chunk.capacity)
            for slot in param_chunk.slots:
                chunk.add_slot(slot)
            mover.place(chunk, policy.home(kind, master_device=store.rows[ChunkKind.MASTER][index].device))
            chunk.set_all_states(TensorState.HOLD, kind.value)
            store.rows[kind].append(chunk)
    return store, mover, policy


def test_chunked_adam_on_a_hand_made_store_matches_fused_adamw():
    torch.manual_seed(0)
    shapes = [(5, 7), (30,), (6, 6), (50,)]  # 35 + 30 fill chunk 0; 36 and 50 take chunks of their own
    reference = [nn.Parameter(torch.randn(s)) for s in shapes]
    chunked = [nn.Parameter(p.detach().clone()) for p in reference]
    config = Config(precision="fp32", grad_reuse=True)
    store, mover, policy = _store(chunked, config)
    ref_opt = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, fused=True)
    opt = ChunkedAdam(
        store,
        mover,
        torch.optim.AdamW(chunked, lr=1e-2, weight_decay=0.1, fused=True),
        placement=policy,
        set_has_grad=set_has_grad,
    )
    for step in range(3):
        grads = [torch.randn(s, generator=torch.Generator().manual_seed(10 * step + i)) for i, s in enumerate(shapes)]
        for p, g in zip(reference, grads, strict=True):
            p.grad = g.clone()
        for info, g in zip(store.params, grads, strict=True):  # grad reuse: the grad sits in the param slot
            store.rows[ChunkKind.PARAM][info.chunk].view(info.slot).copy_(g.reshape(-1))
            set_has_grad(info, True)
        ref_opt.step()
        opt.step()
        for info, p in zip(store.params, reference, strict=True):
            master = store.rows[ChunkKind.MASTER][info.chunk].view(info.slot).view(info.shape)
            assert torch.equal(master, p.detach()), f"step {step}: {info}"
            # the param slot holds the param again after the step
            assert torch.equal(store.rows[ChunkKind.PARAM][info.chunk].view(info.slot).view(info.shape), p.detach())
    assert [store.rows[k][0].device for k in (ChunkKind.MASTER, ChunkKind.MOMENTUM)] == ["cpu", "cpu"]
