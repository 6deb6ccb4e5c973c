import pytest
import torch

from hybridps.common.devices import DeviceInventory, DeviceSpec, canonical_device_name
from hybridps.common.errors import ConfigError


def test_device_names_are_canonicalised():
    assert canonical_device_name("cuda") == "cuda:0"
    assert canonical_device_name("CUDA:3") == "cuda:3"
    assert canonical_device_name("cpu") == "cpu"


@pytest.mark.parametrize("bad", ["tpu:0", "gpu", "cuda:x", "cuda:-1", "cpu:1", ""])
def test_an_unknown_device_name_is_refused_with_the_accepted_forms(bad):
    with pytest.raises(ConfigError) as e:
        canonical_device_name(bad)
    assert repr(bad) in str(e.value) or "cpu" in str(e.value)


def test_missing_gpus_are_simulated_in_cpu_memory_with_their_stated_capacity():
    inv = DeviceInventory.build({"cuda:0": 1 << 20, "cuda:1": 2 << 20}, simulate=True, cuda_capacities={})
    assert inv.names == ["cpu", "cuda:0", "cuda:1"]
    assert inv["cuda:1"].simulated and inv["cuda:1"].capacity_bytes == 2 << 20
    assert inv["cuda:0"].torch_device == torch.device("cpu")
    assert inv.compute_device.name == "cuda:0"
    assert inv.cpu.capacity_bytes > 0


def test_a_visible_gpu_is_used_for_real_unless_simulation_is_forced():
    caps = {"cuda:0": 10 << 30}
    real = DeviceInventory.build({"cuda:0": 1 << 30}, simulate=True, cuda_capacities=caps)
    assert not real["cuda:0"].simulated and real["cuda:0"].torch_device == torch.device("cuda:0")
    forced = DeviceInventory.build({"cuda:0": 1 << 30}, simulate="always", cuda_capacities=caps)
    assert forced["cuda:0"].simulated


def test_a_missing_gpu_without_simulation_is_refused_naming_the_visible_ones():
    with pytest.raises(ConfigError, match=r"cuda:1 is not a visible GPU \(visible: cuda:0\)"):
        DeviceInventory.build({"cuda:1": 1 << 20}, simulate=False, cuda_capacities={"cuda:0": 1 << 30})


def test_a_simulated_gpu_needs_a_capacity():
    with pytest.raises(ConfigError, match="needs a capacity"):
        DeviceInventory.build({"cuda:0": None}, simulate=True, cuda_capacities={})


def test_a_capacity_beyond_the_real_gpu_is_refused():
    with pytest.raises(ConfigError, match="more than"):
        DeviceInventory.build({"cuda:0": 11 << 30}, simulate=True, cuda_capacities={"cuda:0": 10 << 30})


def test_asking_for_an_unknown_device_names_the_known_ones():
    inv = DeviceInventory.build({"cuda:0": 1 << 20}, simulate=True, cuda_capacities={})
    with pytest.raises(ConfigError, match="this client has: cpu, cuda:0"):
        inv["cuda:4"]


def test_the_cpu_cannot_be_simulated():
    with pytest.raises(ConfigError):
        DeviceSpec(name="cpu", capacity_bytes=1, simulated=True)
