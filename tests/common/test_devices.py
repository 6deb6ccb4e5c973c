import pytest
import torch

from hybridps.common import devices as devices_mod
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


# -- container limits: a fake cgroup tree (root and /proc/self/cgroup are injectable) ------

MiB = 1 << 20


def _cgroup_tree(tmp_path, proc_line, files):
    root = tmp_path / "sys_fs_cgroup"
    for rel, content in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(content)
    root.mkdir(exist_ok=True)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(proc_line)
    return str(root), str(proc)


def test_cgroup_v2_limit_caps_the_default_cpu_capacity(tmp_path, monkeypatch):
    root, proc = _cgroup_tree(
        tmp_path,
        "0::/job.slice/step_0\n",
        {
            "job.slice/step_0/memory.max": f"{900 * MiB}\n",
            "job.slice/step_0/memory.current": f"{100 * MiB}\n",
        },
    )
    monkeypatch.setattr(devices_mod, "host_available_bytes", lambda: 23 << 30)
    fig = devices_mod.available_cpu_memory(cgroup_root=root, proc_self_cgroup=proc)
    assert fig.bytes == 800 * MiB
    assert fig.source == f"cgroup v2 {root}/job.slice/step_0/memory.max"


def test_cgroup_v2_max_means_no_limit_and_the_host_figure_is_used(tmp_path, monkeypatch):
    root, proc = _cgroup_tree(
        tmp_path,
        "0::/user.slice\n",
        {
            "user.slice/memory.max": "max\n",
            "user.slice/memory.current": "12345\n",
        },
    )
    monkeypatch.setattr(devices_mod, "host_available_bytes", lambda: 4 << 30)
    assert devices_mod.cgroup_memory_room(root=root, proc_self_cgroup=proc) is None
    fig = devices_mod.available_cpu_memory(cgroup_root=root, proc_self_cgroup=proc)
    assert (fig.bytes, fig.source) == (4 << 30, "host available memory")


def test_a_nested_cgroup_is_limited_by_its_tightest_ancestor(tmp_path, monkeypatch):
    # the job's own cgroup says "max"; its parent (the Slurm job) holds the limit
    root, proc = _cgroup_tree(
        tmp_path,
        "0::/slurm/job_7/step_0/task_1\n",
        {
            "slurm/job_7/memory.max": f"{2048 * MiB}",
            "slurm/job_7/memory.current": f"{1500 * MiB}",
            "slurm/job_7/step_0/memory.max": "max",
            "slurm/job_7/step_0/memory.current": f"{1400 * MiB}",
            "slurm/job_7/step_0/task_1/memory.max": f"{1024 * MiB}",
            "slurm/job_7/step_0/task_1/memory.current": f"{200 * MiB}",
        },
    )
    monkeypatch.setattr(devices_mod, "host_available_bytes", lambda: 64 << 30)
    fig = devices_mod.cgroup_memory_room(root=root, proc_self_cgroup=proc)
    assert fig.bytes == 548 * MiB and fig.source.endswith("slurm/job_7/memory.max")


def test_cgroup_v1_limit_and_unlimited(tmp_path, monkeypatch):
    root, proc = _cgroup_tree(
        tmp_path,
        "12:cpu,cpuacct:/docker/abc\n9:memory:/docker/abc\n",
        {
            "memory/docker/abc/memory.limit_in_bytes": f"{900 * MiB}\n",
            "memory/docker/abc/memory.usage_in_bytes": f"{300 * MiB}\n",
            "memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
            "memory/memory.usage_in_bytes": f"{5000 * MiB}\n",
        },
    )
    monkeypatch.setattr(devices_mod, "host_available_bytes", lambda: 23 << 30)
    fig = devices_mod.available_cpu_memory(cgroup_root=root, proc_self_cgroup=proc)
    assert fig.bytes == 600 * MiB and fig.source == f"cgroup v1 {root}/memory/docker/abc/memory.limit_in_bytes"


def test_a_container_whose_mount_is_its_own_cgroup_reads_the_mount(tmp_path, monkeypatch):
    # cgroup namespace: /proc/self/cgroup says "0::/" (or a path absent from the mount)
    root, proc = _cgroup_tree(tmp_path, "0::/\n", {"memory.max": f"{900 * MiB}", "memory.current": f"{50 * MiB}"})
    monkeypatch.setattr(devices_mod, "host_available_bytes", lambda: 23 << 30)
    assert devices_mod.available_cpu_memory(cgroup_root=root, proc_self_cgroup=proc).bytes == 850 * MiB


def test_the_inventory_and_the_daemon_default_cpu_capacity_come_from_the_cgroup(tmp_path, monkeypatch):
    root, proc = _cgroup_tree(tmp_path, "0::/c\n", {"c/memory.max": f"{900 * MiB}", "c/memory.current": f"{100 * MiB}"})
    monkeypatch.setattr(devices_mod, "CGROUP_ROOT", root)
    monkeypatch.setattr(devices_mod, "PROC_SELF_CGROUP", proc)
    monkeypatch.setattr(devices_mod, "host_available_bytes", lambda: 23 << 30)
    inv = DeviceInventory.build({"cuda:0": MiB}, simulate=True, cuda_capacities={})
    # the room the cgroup leaves (800 MiB) less what the process itself needs (half, at this size)
    assert inv.cpu.capacity_bytes == 800 * MiB - devices_mod.default_cpu_reserve(800 * MiB) == 400 * MiB
    assert inv.cpu.capacity_source.startswith("cgroup v2 ")
    assert inv["cuda:0"].capacity_source == "config"
    assert DeviceInventory.build({"cpu": 5 * MiB}, simulate=True, cuda_capacities={}).cpu.capacity_source == "config"

    from hybridps.cli import format_status, manager_devices
    from hybridps.manager.service import ManagerService

    cpu = manager_devices(["cuda:1=64MiB"], simulate="always", cpu_reserve="100MiB")[0]
    assert cpu.capacity_bytes == 700 * MiB and "cgroup v2" in cpu.capacity_source and "--cpu-reserve" in cpu.capacity_source
    status = ManagerService(manager_devices(["cuda:1=64MiB"], simulate="always", cpu_reserve="100MiB")).status()
    assert status["devices"]["cpu"]["capacity_source"] == cpu.capacity_source
    assert status["devices"]["cuda:1"]["capacity_source"] == "config"
    assert f"cpu: {cpu.capacity_source}" in format_status(status)


def test_a_default_cpu_capacity_leaves_the_process_a_tenth_of_the_available_memory(monkeypatch):
    # booking all available memory for chunks leaves nothing for the process (CUDA context,
    # staging buffers, activations): the OOM killer ends such a run instead of a CapacityError
    monkeypatch.setattr(devices_mod, "available_cpu_memory", lambda: devices_mod.MemoryFigure(125 << 30, "host available memory"))
    cpu = DeviceInventory.build({"cuda:0": MiB}, simulate=True, cuda_capacities={}).cpu
    assert cpu.capacity_bytes == (125 << 30) - int((125 << 30) * 0.10)
    assert "less 10%" in cpu.capacity_source
    assert devices_mod.default_cpu_reserve(8 << 30) == 2 << 30  # at least 2 GiB
    assert devices_mod.default_cpu_reserve(1 << 30) == 512 << 20  # never all of it


def test_expandable_segments_keep_a_users_allocator_settings(monkeypatch):
    import torch

    from hybridps.common import devices

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    assert "kept" in devices.use_expandable_segments() and calls == []
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert devices.use_expandable_segments() == "expandable segments on"
    assert calls == ["expandable_segments:True"]
