"""Shared test set-up: GPU tests skip cleanly without CUDA; tests stay quiet and deterministic,
and none reads the machine's stored calibration (``hybridps calibrate``'s rates)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_stored_rates(tmp_path_factory, monkeypatch):
    """A stored calibration (``~/.cache/hybridps/rates.json``) would make ``hybridps plan``
    predict, and warn, differently on a developer's machine than on a fresh one: every test
    starts without one (a test that wants one sets ``HYBRIDPS_RATES`` itself)."""
    monkeypatch.setenv("HYBRIDPS_RATES", str(tmp_path_factory.getbasetemp() / "no-stored-rates.json"))
