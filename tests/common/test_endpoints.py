import os
import stat
from pathlib import Path

import pytest

from hybridps.common.endpoints import (
    check_private_dir,
    check_socket_owner,
    default_endpoint,
    ensure_private_dir,
    is_loopback_host,
    parse_endpoint,
    resolve_endpoint,
    runtime_dir,
    token_from_env,
)
from hybridps.common.errors import ConfigError


def test_the_default_endpoint_lives_in_the_session_runtime_directory_or_a_per_user_tmp_one(tmp_path):
    assert default_endpoint({"XDG_RUNTIME_DIR": str(tmp_path)}) == f"ipc://{tmp_path}/hybridps/manager.sock"
    fallback = runtime_dir({})
    assert fallback.name == f"hybridps-{os.getuid()}"
    assert runtime_dir({"XDG_RUNTIME_DIR": str(tmp_path / "missing")}) == fallback
    assert resolve_endpoint("auto", {"XDG_RUNTIME_DIR": str(tmp_path)}) == default_endpoint({"XDG_RUNTIME_DIR": str(tmp_path)})
    assert resolve_endpoint(None, {}) == default_endpoint({})
    assert resolve_endpoint("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"


@pytest.mark.parametrize(
    "endpoint, loopback",
    [
        ("ipc:///tmp/x.sock", True),
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.8.0.1:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.1.2.3:5555", False),
        ("tcp://eth0:5555", False),
    ],
)
def test_only_ipc_and_loopback_tcp_count_as_private(endpoint, loopback):
    assert parse_endpoint(endpoint).is_loopback is loopback


@pytest.mark.parametrize(
    "endpoint, message",
    [
        ("http://x", "not understood"),
        ("ipc://", "no socket path"),
        ("tcp://127.0.0.1", "needs a host and a port"),
        ("tcp://127.0.0.1:70000", "needs a host and a port"),
        ("ipc:///" + "d" * 120, "at most 107"),
    ],
)
def test_a_bad_endpoint_is_refused_with_the_accepted_forms(endpoint, message):
    with pytest.raises(ConfigError, match=message):
        parse_endpoint(endpoint)


def test_the_runtime_directory_is_created_private_and_an_open_one_is_refused(tmp_path):
    d = tmp_path / "rt"
    ensure_private_dir(d)
    assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    ensure_private_dir(d)  # an existing private directory is fine
    os.chmod(d, 0o755)
    with pytest.raises(ConfigError, match=f"chmod 700 {d}"):
        ensure_private_dir(d)
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        check_private_dir(f)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to create a directory owned by someone else")
def test_a_runtime_directory_owned_by_someone_else_is_refused(tmp_path):
    d = Path(tmp_path / "theirs")
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        ensure_private_dir(d)


def test_the_token_comes_from_the_argument_else_the_environment():
    assert token_from_env("a", {"HYBRIDPS_TOKEN": "b"}) == "a"
    assert token_from_env(None, {"HYBRIDPS_TOKEN": "b"}) == "b"
    assert token_from_env(None, {}) == ""


def test_missing_parent_directories_are_created_private_and_existing_ones_left_alone(tmp_path):
    os.chmod(tmp_path, 0o755)
    d = tmp_path / "a" / "b" / "c"
    ensure_private_dir(d)
    for level in (tmp_path / "a", tmp_path / "a" / "b", d):
        assert stat.S_IMODE(os.lstat(level).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(tmp_path).st_mode) == 0o755


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("", False),
        ("*", False),
        ("10.0.0.1", False),
    ],
)
def test_a_host_is_loopback_only_when_no_other_machine_can_reach_it(host, loopback):
    assert is_loopback_host(host) is loopback


def test_a_socket_file_of_our_own_passes_the_owner_check(tmp_path):
    f = tmp_path / "s"
    f.write_text("")
    check_socket_owner(f)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to create a file owned by someone else")
def test_a_socket_file_of_another_user_is_refused(tmp_path):
    f = tmp_path / "s"
    f.write_text("")
    os.chown(f, 65534, 65534)
    with pytest.raises(ConfigError, match=f"belongs to uid 65534, not to you .*remove {f}"):
        check_socket_owner(f)
