"""Several ranks' predicted speed: a rank's work from the derived share, its collectives' bytes
and seconds, the rates of the node and the network, and ``hybridps calibrate``'s collectives
between ranks of this host (CPU only, no wall-clock assertions)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from hybridps.common.errors import ConfigError
from hybridps.planner.model import GPTShape
from hybridps.planner.rank_speed import collective_bytes
from hybridps.planner.rates import MachineRates, with_collective_rates
from hybridps.planner.search import plan
from hybridps.planner.speed import StepWork, predict_work

SHAPE = GPTShape(n_layer=2, d_model=128, n_head=2, vocab_size=512, seq_len=64, batch_size=2)


def _rates(**kw) -> MachineRates:
    base = dict(
        name="test",
        device="synthetic",
        simulated_gpu=True,
        compute_tflops=((128, 0.05), (1024, 0.1)),
        h2d_gbps=5.0,
        d2h_gbps=5.0,
        cpu_adam_params_per_s=1e9,
        cpu_compact_adam_params_per_s=5e8,
        cpu_cast_params_per_s=2e9,
        gpu_adam_params_per_s=1e9,
        host_s_per_tensor=1e-4,
        node_gather_gbps=2.0,
        node_reduce_gbps=1.0,
        node_collective_s=1e-4,
    )
    return MachineRates(**{**base, **kw})


def _plan(gpus: str, **kw):
    kw.setdefault("rates", _rates())
    return plan(SHAPE, gpus=gpus, cpu="2GiB", simulated_gpus=True, precision="fp32", search_largest=False, **kw)


def test_collectives_cost_their_bytes_at_the_node_rates_plus_a_fixed_time_each():
    work = StepWork(
        n_params=10**6, n_layer=2, d_model=128, seq_len=64, batch_size=2, micro_batches=3,
        node_gather_bytes=4 * 10**9, node_reduce_bytes=10**9, node_collectives=10,
    )  # fmt: skip
    parts = predict_work(work, _rates()).parts
    assert parts["collectives"] == pytest.approx(3 * (4e9 / 2e9 + 1e9 / 1e9 + 10 * 1e-4))
    real = predict_work(work, _rates(simulated_gpu=False))
    # a real GPU's collectives run on streams of their own, beside compute: a max, not a sum
    assert real.predicted_step_seconds == pytest.approx(max(real.parts[k] for k in ("compute", "host", "link", "collectives")))
    assert real.bound_by == "collectives"
    sim = predict_work(work, _rates())
    assert sim.predicted_step_seconds == pytest.approx(sum(sim.parts.values()))
    assert sim.node_collective_bytes_per_step == 3 * 5 * 10**9


def test_the_ranks_of_a_node_share_its_disk_tier():
    work = StepWork(
        n_params=10**6, n_layer=2, d_model=128, seq_len=64, batch_size=2,
        disk_read_bytes=2 * 10**9, disk_write_bytes=10**9,
    )  # fmt: skip
    rates = _rates(disk_read_gbps=2.0, disk_write_gbps=1.0)
    alone = predict_work(work, rates).parts["disk"]
    assert alone == pytest.approx(2.0)
    assert predict_work(dataclasses.replace(work, disk_sharing_ranks=2), rates).parts["disk"] == pytest.approx(2 * alone)
    # a rank's work says how many ranks its node's disk serves: the ranks of its node, not the job's
    from hybridps.planner.rank_speed import rank_step_work
    from hybridps.planner.simulation import simulate

    sim = simulate(SHAPE, gpu_bytes=1 << 30, cpu_bytes=1 << 30, precision="fp32")
    for gpus, nodes, per_node in (("2x64MiB", 1, 2), ("2x64MiB", 2, 2), ("1x64MiB", 2, 1)):
        share = _plan(gpus, nodes=nodes, rates=_rates(network_gbps=1.0)).hybridps.rank_share
        assert rank_step_work(sim, SHAPE, share, gpu_bytes=64 << 20).disk_sharing_ranks == per_node


def test_collectives_without_their_rates_are_refused_with_the_flag_that_gives_them():
    work = StepWork(n_params=10**6, n_layer=2, d_model=128, seq_len=64, batch_size=2, node_gather_bytes=10**6)
    with pytest.raises(ConfigError, match="--node-gbps"):
        predict_work(work, _rates(node_gather_gbps=None))
    with pytest.raises(ConfigError, match="--network-gbps"):
        predict_work(dataclasses.replace(work, network_bytes=1), _rates())
    given = with_collective_rates(_rates(node_gather_gbps=None, node_reduce_gbps=None), node_gbps=3.0, network_gbps=1.5)
    assert (given.node_gather_gbps, given.node_reduce_gbps, given.network_gbps) == (3.0, 3.0, 1.5)
    assert "--node-gbps" in given.sources["node_gather_gbps"]
    assert with_collective_rates(None, node_gbps=1.0) is None


def test_rates_keep_the_collectives_through_their_file(tmp_path):
    from hybridps.planner.rates import read_rates_file

    r = _rates(network_gbps=12.5)
    back = read_rates_file(r.save(tmp_path / "r.json"))
    assert (back.node_gather_gbps, back.node_reduce_gbps, back.node_collective_s, back.network_gbps) == (2.0, 1.0, 1e-4, 12.5)
    with pytest.raises(ConfigError, match="node_gather_gbps"):
        _rates(node_gather_gbps=0)
    with pytest.raises(ConfigError, match="node_collective_s"):
        _rates(node_collective_s=-1.0)
    # an older calibration without them still loads, and predicts one rank
    data = {k: v for k, v in r.to_dict().items() if not k.startswith(("node_", "network"))}
    assert MachineRates.from_dict(data).node_gather_gbps is None


def test_two_ranks_predict_a_step_with_the_collectives_of_their_share():
    one = _plan("1x64MiB").speed
    report = _plan("2x64MiB")
    two, share = report.speed, report.hybridps.rank_share
    assert one is not None and two is not None, report.speed_note
    assert one.parts["collectives"] == 0.0 and one.node_collective_bytes_per_step == 0
    assert two.parts["collectives"] > 0
    # every rank computes the whole model on its own micro-batch; it steps its own rows only
    assert two.parts["compute"] == pytest.approx(one.parts["compute"])
    assert two.cpu_step_params + two.gpu_step_params < one.cpu_step_params + one.gpu_step_params
    # the share fits its GPU: the forward's last whole groups within a tenth of it stay gathered
    p, g = share.communication.params_bytes, share.group_bytes
    kept = min(p, (64 << 20) // 10 // g * g)
    assert two.node_collective_bytes_per_step == math.ceil((2 * p - kept) / 2) + math.ceil(p / 2)
    assert "one rank of 2" in report.speed_note


def test_a_share_that_spills_to_the_cpu_gathers_every_group_again_for_backward():
    from hybridps.planner.simulation import simulate

    big = _plan("2x64MiB").hybridps.rank_share
    full = simulate(SHAPE, gpu_bytes=1 << 30, cpu_bytes=1 << 30, precision="fp32")
    report = _plan(f"2x{int(full.model_data_bytes / 4 + full.non_model_peak_bytes)}B")  # half the share on the GPU
    share = report.hybridps.rank_share
    assert share.cpu_bytes > 0 and big.cpu_bytes == 0
    p = share.communication.params_bytes
    assert report.speed.node_collective_bytes_per_step == 2 * math.ceil(p / 2) + math.ceil(p / 2)
    assert report.speed.cpu_step_params > 0


def test_more_ranks_send_more_of_each_group_and_nodes_use_the_network():
    two = _plan("2x64MiB").speed.node_collective_bytes_per_step
    four = _plan("4x64MiB").speed.node_collective_bytes_per_step
    assert four > two  # (S - 1) / S of each group: 3/4 against 1/2
    refused = _plan("2x64MiB", nodes=2)  # shard groups of a node, replicas across the two
    assert refused.speed is None and "--network-gbps" in refused.speed_note
    crossed = _plan("2x64MiB", nodes=2, rates=_rates(network_gbps=1.0))
    assert crossed.speed.network_bytes_per_step > 0 and crossed.speed.parts["collectives"] > 0
    world = _plan("2x64MiB", nodes=2, rates=_rates(network_gbps=1.0), shard_group_size="world")
    assert world.speed.node_collective_bytes_per_step == 0  # the ring crosses nodes: all of it at the network's rate
    assert world.speed.network_bytes_per_step > crossed.speed.network_bytes_per_step


def test_collective_bytes_follow_the_shard_and_replica_sizes():
    share = _plan("2x64MiB", nodes=2, rates=_rates(network_gbps=1.0)).hybridps.rank_share
    p, s = share.communication.params_bytes, share.sharding.shard_size
    assert (s, share.sharding.replicas) == (2, 2)
    nothing_kept = collective_bytes(share, kept_gathered_bytes=0)
    assert nothing_kept.node_gather_bytes == math.ceil(2 * p * (s - 1) / s)
    assert nothing_kept.node_reduce_bytes == math.ceil(p * (s - 1) / s)
    assert nothing_kept.network_bytes == math.ceil(2 * p / s * 1 / 2)  # the replicas' all-reduce of a shard
    assert nothing_kept.node_collectives == 3 * share.chunk_groups
    all_kept = collective_bytes(share, kept_gathered_bytes=10 * p)
    assert all_kept.node_gather_bytes == math.ceil(p * (s - 1) / s) and all_kept.node_collectives == 2 * share.chunk_groups


def test_plan_json_predicts_two_ranks_with_the_node_rate_given(capsys, tmp_path):
    from hybridps.planner.cli import main

    rates = tmp_path / "r.json"
    _rates(node_gather_gbps=None, node_reduce_gbps=None).save(rates)
    args = ["--layers", "2", "--hidden", "128", "--heads", "2", "--vocab", "512", "--seq-len", "64", "--batch", "2"]
    args += ["--gpus", "2x64MiB", "--cpu", "1GiB", "--simulated-gpus", "--no-search", "--json", "--rates", str(rates)]
    assert main(args) == 0
    speed = json.loads(capsys.readouterr().out)["speed"]
    assert not speed["predicted"] and "--node-gbps" in speed["note"]
    assert main([*args, "--node-gbps", "2"]) == 0
    speed = json.loads(capsys.readouterr().out)["speed"]
    assert speed["predicted"] and speed["parts"]["collectives"] > 0 and speed["node_collective_bytes_per_step"] > 0


@pytest.mark.slow
def test_calibrate_times_the_collectives_between_two_ranks_of_this_host():
    from hybridps.planner.calibrate_collectives import node_collective_gbps

    measured = node_collective_gbps("cpu", repeats=2, chunk_kib=(16, 256))
    assert measured is not None and measured.gather_gbps > 0 and measured.reduce_gbps > 0
    assert measured.seconds_each >= 0
    assert "2 ranks" in measured.how and "gloo" in measured.how


def test_ranks_that_cannot_run_leave_the_calibration_without_collectives_and_say_why(monkeypatch):
    from hybridps.planner import calibrate_collectives

    def fails(*args, **kwargs):
        raise RuntimeError("process 1 terminated with exit code 1\nRuntimeError: the store refused the connection")

    monkeypatch.setattr(calibrate_collectives, "node_collective_gbps", fails)
    measured, why = calibrate_collectives.measured_or_why("cpu")
    assert measured is None and "RuntimeError" in why and "store refused" in why
    monkeypatch.setattr(calibrate_collectives, "node_collective_gbps", lambda *a, **k: None)
    assert calibrate_collectives.measured_or_why("cuda") == (None, "not measured: one GPU on this host")


def test_a_plan_that_does_not_fit_says_why_it_predicts_no_speed():
    report = _plan("1x256KiB")  # not even the activations of one module
    assert not report.fits and report.speed is None
    assert "no steady step to time" in report.speed_note and "Error" in report.speed_note, report.speed_note
