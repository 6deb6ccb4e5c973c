"""`hybridps-manager`'s device flags (the daemon itself is tested in tests/manager/)."""

import pytest

from hybridps.cli import _manager_parser, manager_devices, manager_main
from hybridps.common.devices import DeviceSpec, available_cpu_bytes
from hybridps.common.errors import ConfigError
from hybridps.manager import server as server_mod


def test_devices_come_from_the_flags_with_simulated_gpus():
    devices = manager_devices(["cpu=64GiB", "cuda:1=8GiB", "cuda=2GiB"], simulate="always", cpu_reserve="2GiB")
    assert devices == [
        DeviceSpec(name="cpu", capacity_bytes=64 << 30),
        DeviceSpec(name="cuda:1", capacity_bytes=8 << 30, simulated=True),
        DeviceSpec(name="cuda:0", capacity_bytes=2 << 30, simulated=True),
    ]


def test_the_cpu_defaults_to_available_memory_minus_the_reserve():
    (cpu,) = manager_devices([], simulate="always", cpu_reserve="1GiB")
    assert cpu.name == "cpu" and 0 < cpu.capacity_bytes <= available_cpu_bytes() - (1 << 30) + (64 << 20)
    with pytest.raises(ConfigError, match="leaves nothing"):
        manager_devices([], simulate="always", cpu_reserve=str(available_cpu_bytes() * 2))


@pytest.mark.parametrize(
    "flags, simulate, message",
    [
        (["cuda:7=1GiB"], False, r"cuda:7 is not a visible GPU .*pass --simulate"),
        (["cuda:7"], True, r"cuda:7 is simulated .* needs a capacity: --device cuda:7=8GiB"),
        (["cpu=1GiB", "cpu=2GiB"], "always", "lists cpu twice"),
        (["tpu:0=1GiB"], "always", "unknown device 'tpu:0'"),
        (["cuda:0=lots"], "always", "cannot read 'lots' as bytes"),
    ],
)
def test_bad_device_flags_are_refused_with_the_fix(flags, simulate, message):
    with pytest.raises(ConfigError, match=message):
        manager_devices(flags, simulate=simulate, cpu_reserve="0")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--endpoint", "tcp://127.0.0.1:5555"], "every user of this machine can connect"),
        (["--endpoint", "tcp://0.0.0.0:5555", "--insecure-local-tcp"], "--insecure-local-tcp covers loopback addresses only"),
        (["--metrics-port", "0", "--metrics-host", "0.0.0.0"], "--metrics-host 0.0.0.0 can be reached from other machines"),
    ],
)
def test_the_daemon_refuses_to_open_a_port_to_others_without_a_token(flags, message, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HYBRIDPS_TOKEN", raising=False)

    def serve(*args, **kwargs):
        raise AssertionError("the daemon started serving")

    monkeypatch.setattr(server_mod, "serve_until_signalled", serve)
    argv = ["--endpoint", f"ipc://{tmp_path}/m.sock", *flags, "--device", "cpu=1GiB", "--simulate", "always"]
    assert manager_main(argv) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m.sock").exists()


def test_the_insecure_local_tcp_flag_says_what_it_allows():
    assert "every user of this machine" in " ".join(_manager_parser().format_help().split())
