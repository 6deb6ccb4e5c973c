import pytest
import torch
from torch import nn

import hybridps
from hybridps import Client, Config, ConfigError, RegistrationError, StateError, TensorState
from hybridps.client.chunks.chunk import ChunkKind
from hybridps.client.params.placeholder import ChunkedParameter


def layer_stack(n_layers=16, width=32):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n_layers)])


def lru_oracle(n_chunks, capacity_chunks, accesses):
    """Moves an LRU cache of ``capacity_chunks`` makes, chunks 0..capacity-1 resident at start."""
    resident = list(range(min(n_chunks, capacity_chunks)))  # oldest first
    to_gpu = to_cpu = 0
    for c in accesses:
        if c in resident:
            resident.remove(c)
        else:
            if len(resident) == capacity_chunks:
                resident.pop(0)
                to_cpu += 1
            to_gpu += 1
        resident.append(c)
    return to_gpu, to_cpu


def test_access_in_forward_then_reverse_order_keeps_values_and_counts_every_move():
    width, n_layers = 32, 16
    model = layer_stack(n_layers, width)
    original = [p.detach().clone() for p in model.parameters()]
    per_layer = width * width + width  # one Linear per chunk
    chunk_bytes = per_layer * 4
    capacity = 3 * chunk_bytes
    cfg = Config(devices={"cuda:0": capacity}, chunk_size=per_layer, precision="fp32", grad_reuse=False, alignment=1)
    with Client(cfg) as client:
        client.register_module(model)
        stats = client.memory_stats()
        assert stats["model_data_bytes"] >= 4 * capacity
        assert stats["moves"] == 0
        for p in model.parameters():  # placeholders while not accessed
            assert isinstance(p, ChunkedParameter)  # placeholders while not accessed

        params = list(model.parameters())
        order = params + params[::-1]
        for p, expected in zip(order, original + original[::-1], strict=True):
            t = client.access(p)
            assert t.shape == expected.shape and p.shape == expected.shape
            assert torch.equal(t, expected), "values must survive every move bitwise"
            client.release(p, TensorState.HOLD)
            assert client.memory_stats()["devices"]["cuda:0"]["used_bytes"] <= capacity

        stats = client.memory_stats()
        chunk_of = [i // 2 for i in range(2 * n_layers)]  # weight and bias share their layer's chunk
        accesses = chunk_of + chunk_of[::-1]
        to_gpu, to_cpu = lru_oracle(n_layers, 3, accesses)
        assert stats["moves"] == to_gpu + to_cpu
        assert stats["moved_bytes"] == {"cpu->cuda:0": to_gpu * chunk_bytes, "cuda:0->cpu": to_cpu * chunk_bytes}
        assert stats["devices"]["cuda:0"]["peak_bytes"] <= capacity
        assert stats["devices"]["cuda:0"]["peak_bytes"] == capacity  # the GPU was really used


def test_the_seed_example_reports_its_minimum_gpu_bytes_and_refuses_less():
    def seed_model():
        return nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])  # 4 x (16 + 4) = 80 elements

    cfg = dict(precision="fp32", chunk_size=20, grad_reuse=False)
    with Client(Config(devices={"cuda:0": "160B"}, **cfg)) as client:
        client.register_module(seed_model())
        # one layer's param + grad: 20 elements x 4 B x 2 = 160 B
        assert client.memory_stats()["min_compute_bytes"] == 160
    model = seed_model()
    before = [p.detach().clone() for p in model.parameters()]
    with Client(Config(devices={"cuda:0": "159B"}, **cfg)) as client:
        with pytest.raises(ConfigError) as e:
            client.register_module(model)
    assert "160 B" in str(e.value) and "159 B" in str(e.value)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)), "a refused model keeps its data"


def test_accesses_nest_and_the_last_release_decides_the_state():
    model = layer_stack(2, 8)
    with Client(Config(devices={"cuda:0": "1MiB"})) as client:
        client.register_module(model)
        w = model[0].weight
        client.access(w)
        client.access(w)
        client.release(w, TensorState.HOLD_AFTER_FWD)
        assert w.numel() == 64, "still accessed once"
        client.release(w, TensorState.HOLD_AFTER_BWD)
        assert isinstance(w, ChunkedParameter)
        chunk = client.rows[ChunkKind.PARAM][client.param_info(w).chunk]
        assert chunk.slot_state(client.param_info(w).slot) is TensorState.HOLD_AFTER_BWD


def test_releasing_every_tensor_of_a_chunk_to_free_drops_its_payload():
    model = nn.Linear(8, 8)
    with Client(Config(devices={"cuda:0": "1MiB"}, grad_reuse=False, chunk_size=72)) as client:
        client.register_module(model)
        used = client.memory_stats()["devices"]["cuda:0"]["used_bytes"]
        for p in model.parameters():
            client.access(p)
            client.release(p, TensorState.FREE)
        assert client.memory_stats()["devices"]["cuda:0"]["used_bytes"] == used - client.rows[ChunkKind.PARAM][0].nbytes
        assert client.rows[ChunkKind.PARAM][0].payload is None


def test_low_precision_params_are_chunked_with_an_fp32_master_copy():
    model = layer_stack(2, 8)
    original = [p.detach().clone() for p in model.parameters()]
    with Client(Config(devices={"cuda:0": "1MiB"}, precision="bf16")) as client:
        client.register_module(model)
        for p, o in zip(model.parameters(), original, strict=True):
            assert torch.equal(client.access(p), o.to(torch.bfloat16))
            client.release(p)
        info = client.param_info(model[1].weight)
        master = client.rows[ChunkKind.MASTER][info.chunk]
        assert torch.equal(master.view(info.slot).view(info.shape), original[2])
    # close() gives the params their full-precision values back
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), original, strict=True))


def test_closing_gives_every_byte_back_to_the_manager():
    model = layer_stack(4, 16)
    client = Client(Config(devices={"cuda:0": "8KiB"}))
    client.register_module(model)
    ledger = client.connection._manager.ledger
    assert ledger.device("cpu").used_bytes > 0
    client.close()
    assert ledger.device("cpu").used_bytes == 0 and ledger.device("cuda:0").used_bytes == 0
    with pytest.raises(StateError, match="closed"):
        client.register_module(nn.Linear(2, 2))


def test_a_plain_tensor_is_refused_by_register_param():
    with Client(Config(devices={"cuda:0": "1MiB"})) as client:
        with pytest.raises(TypeError, match=r"nn.Parameter.*Tensor of shape \(3, 4\)"):
            client.register_param(torch.zeros(3, 4))


def test_accessing_an_unregistered_param_names_its_shape():
    with Client(Config(devices={"cuda:0": "1MiB"})) as client:
        client.register_module(nn.Linear(2, 2))
        with pytest.raises(RegistrationError, match=r"shape \(5, 7\)"):
            client.access(nn.Parameter(torch.zeros(5, 7)))


def test_an_illegal_state_transition_raises():
    model = nn.Linear(2, 2)
    with Client(Config(devices={"cuda:0": "1MiB"})) as client:
        client.register_module(model)
        with pytest.raises(StateError, match="not accessed"):
            client.release(model.weight, TensorState.HOLD)
        client.access(model.weight)
        with pytest.raises(StateError, match="COMPUTE -> COMPUTE"):
            client.release(model.weight, TensorState.COMPUTE)
        with pytest.raises(StateError, match="not a TensorState"):
            client.release(model.weight, "hold")  # type: ignore[arg-type]


def test_an_unknown_device_and_an_unreadable_unit_are_refused_at_configuration():
    with pytest.raises(ConfigError, match="unknown device 'npu:0'"):
        Client(Config(devices={"npu:0": "1GiB"}))
    with pytest.raises(ConfigError, match="cannot read '1 gigglebyte'"):
        Config(devices={"cuda:0": "1 gigglebyte"})


def test_a_param_registered_twice_is_refused():
    model = nn.Linear(2, 2)
    with Client(Config(devices={"cuda:0": "1MiB"})) as client:
        client.register_module(model)
        with pytest.raises(RegistrationError, match="already registered"):
            client.register_param(model.weight)


def test_tied_params_are_chunked_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    with Client(Config(devices={"cuda:0": "1MiB"})) as client:
        client.register_module(model)
        assert client.memory_stats()["params"] == 1


def test_the_package_exports_the_public_surface():
    for name in ("Client", "Config", "TensorState", "ConfigError", "CapacityError", "StateError"):
        assert hasattr(hybridps, name)


def test_release_all_ends_one_access_of_each_param_and_frees_a_chunk_left_free_once():
    width = 32
    model = layer_stack(3, width)
    per_layer = width * width + width
    cfg = Config(devices={"cuda:0": 4 * per_layer * 4}, chunk_size=per_layer, precision="fp32", grad_reuse=False, alignment=1)
    with Client(cfg) as client:
        client.register_module(model)
        params = list(model.parameters())
        client.access_all(params[:4])
        client.access(params[0])  # nested: one release_all leaves it accessed
        client.release_all(params[:4], TensorState.HOLD_AFTER_FWD)
        assert [client.param_info(p).refs for p in params[:4]] == [1, 0, 0, 0]
        chunks = client.rows[ChunkKind.PARAM]
        assert [chunks[0].slot_state(client.param_info(p).slot) for p in params[:2]] == [
            TensorState.COMPUTE,
            TensorState.HOLD_AFTER_FWD,
        ]
        assert all(isinstance(p, ChunkedParameter) for p in params[1:4])
        with pytest.raises(hybridps.StateError, match="not accessed"):
            client.release_all(params[1:2])
        with pytest.raises(hybridps.StateError, match="COMPUTE -> COMPUTE"):
            client.release_all(params[:1], TensorState.COMPUTE)
        freed = []
        free = client.mover.free
        client.mover.free = lambda chunk: freed.append(chunk.index) or free(chunk)
        client.access_all(params[2:4])
        client.release_all(params[2:4], TensorState.FREE)  # both slots of chunk 1 FREE: freed once
        assert freed == [1] and chunks[1].payload is None
        client.mover.free = free
        client.release(params[0], TensorState.HOLD)


def test_access_all_brings_each_chunk_once_and_a_failure_leaves_none_of_its_params_accessed():
    """A hook unit's params are accessed together (values.py, ``access_all``): the chunks
    come once each, in the order of their first param; if one cannot come, no param of the
    call stays accessed and every slot is back in its state."""
    width = 32
    model = layer_stack(4, width)
    original = [p.detach().clone() for p in model.parameters()]
    per_layer = width * width + width  # one Linear per chunk: weight and bias share it
    cfg = Config(devices={"cuda:0": 3 * per_layer * 4}, chunk_size=per_layer, precision="fp32", grad_reuse=False, alignment=1)
    with Client(cfg) as client:
        client.register_module(model)
        params = list(model.parameters())
        brought = []
        bring = client.mover.bring
        client.mover.bring = lambda chunk, device, **kw: brought.append(chunk.index) or bring(chunk, device, **kw)
        client.access_all(params[:4], who="two layers")  # two chunks, four params
        assert brought == [0, 1]
        for p, expected in zip(params[:4], original[:4], strict=True):
            assert torch.equal(p.data, expected)
            client.release(p, TensorState.HOLD)

        client.access(params[0])  # an access already held nests, as access() does
        states = [(c.index, list(c.states)) for c in client.rows[ChunkKind.PARAM]]

        def refuse(chunk, device, **kw):
            if chunk.index == 2:
                raise hybridps.CapacityError("no room (test)")
            return bring(chunk, device, **kw)

        client.mover.bring = refuse
        with pytest.raises(hybridps.CapacityError, match="no room"):
            client.access_all(params[:6], who="three layers")
        assert [(c.index, list(c.states)) for c in client.rows[ChunkKind.PARAM]] == states
        assert [client.param_info(p).refs for p in params[:6]] == [1, 0, 0, 0, 0, 0]
        for p in params[1:6]:
            assert isinstance(p, ChunkedParameter)  # none of them holds a value
        client.mover.bring = bring
        client.release(params[0], TensorState.HOLD)
