"""The speed of a ``hybridps train`` run: the plan's predicted steady step for the run as it
is set up, and the measured steady step beside it.

Before the first step, rank 0 plans the run it is about to make: the same model (the
byte-level GPT's shape, or the Hugging Face config's family), the devices the engine was
given (their capacities as ``memory_stats`` reports them, a simulated GPU as simulated), the
ranks of the node, the precision, the optimizer and its states, at the rates ``hybridps
calibrate`` stored (or ``--rates``). It prints the predicted step, and the summary sets it
beside the median step after the warm-up, so the user who sized a machine by ``hybridps plan``
sees whether it went that fast.

Owns: the plan request of a run, the ``speed`` entry of the run's summary and its text line.
Does not own: the speed model (``planner/speed.py``), the rates (``planner/rates.py``), the
plan itself (``planner/search.py``), the loop and its timing (``train.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Any

from hybridps.common.errors import ConfigError

#: steps left out of the steady step: the first traces memory and places the chunks, the
#: second still settles the pools (``benchmarks/plan_speed.py`` leaves out as many)
WARMUP_STEPS = 2


@dataclasses.dataclass(frozen=True)
class RunPrediction:
    """The plan's prediction for the run, or why there is none (``speed`` None, ``note``)."""

    speed: Any = None  # planner.speed.SpeedPrediction
    note: str = ""
    warning: str | None = None

    def describe(self) -> str:
        if self.speed is None:
            return f"predicted speed: none ({self.note})"
        return f"predicted speed: {self.speed.describe()}"


def planned_model(args: argparse.Namespace, micro: int):
    """The planner's model of the run: the byte-level GPT's ``GPTShape`` (vocabulary 256), or
    the family of ``--model`` / ``--model-config`` at its own layers; ``micro`` rows a rank."""
    if args.model is not None or args.model_config is not None:
        from hybridps.planner.hf_model import HFCausalLMFamily

        flag, source = ("--model", args.model) if args.model is not None else ("--model-config", args.model_config)
        return HFCausalLMFamily.from_path(
            source,
            flag=flag,
            n_layer=None,
            seq_len=args.seq,
            batch_size=micro,
            checkpoint=args.checkpointing,
            lora_rank=args.lora or None,
        )
    from hybridps.planner.model import GPTShape

    return GPTShape(
        n_layer=args.layers,
        d_model=args.d_model,
        n_head=args.heads,
        vocab_size=256,
        seq_len=args.seq,
        batch_size=micro,
        checkpoint=args.checkpointing,
    )


def run_rates(args: argparse.Namespace):
    """The rates ``--rates`` names (None: the stored calibration, None where there is none);
    a ``ConfigError`` for a name that is neither a profile, ``this-machine`` nor a file, before
    anything is built."""
    from hybridps.planner.rates import load_rates

    return load_rates(args.rates) if args.predict else None


def predict_run(args: argparse.Namespace, engine, rates, *, micro: int, local_world: int, nodes: int) -> RunPrediction:
    """The plan of the run ``engine`` was set up for (``local_world`` ranks on each of ``nodes``
    nodes, ``micro`` rows a rank), at ``rates`` (``run_rates``)."""
    import torch

    from hybridps.planner.rates import threads_mismatch
    from hybridps.planner.search import plan

    if rates is None:
        return RunPrediction(note="no rates: run `hybridps calibrate` once, or give --rates h100|h200|FILE")
    try:
        devices = engine.memory_stats()["devices"]
        compute = engine.client.compute
        gpu = devices.get(compute.name)
        if gpu is None or not compute.is_gpu:
            return RunPrediction(note="the run computes on the CPU: the plan predicts a GPU's step")
        # the node's host memory: every rank of the node sees the same CPU, which the node's
        # manager shares among them (each keeps to its share, cpu_spill.py), as a plan's --cpu is
        cpu = devices["cpu"]["capacity_bytes"]
        nvme = devices.get("nvme", {}).get("capacity_bytes")
        config = engine.config
        report = plan(
            planned_model(args, micro),
            gpus=f"{local_world}x{gpu['capacity_bytes']}B",
            cpu=cpu,
            nodes=nodes,
            nvme=f"{nvme}B" if nvme else None,
            simulated_gpus=bool(gpu.get("simulated")),
            precision=config.precision,
            grad_reuse=bool(config.grad_reuse),
            optimizer_states=config.optimizer_states,
            optimizer=args.optimizer,
            chunk_size=config.chunk_size,
            casts_on_gpu=config.casts_on_gpu,
            shard_group_size=config.shard_group_size,
            rates=rates,
            search_largest=False,
        )
    except ConfigError as exc:
        return RunPrediction(note=str(exc))
    if report.speed is None:
        return RunPrediction(note=report.speed_note or "the plan has no speed for this run")
    return RunPrediction(speed=report.speed, warning=threads_mismatch(rates, torch.get_num_threads()))


def steady_step_seconds(step_seconds: list[float]) -> float | None:
    """The median step after ``WARMUP_STEPS`` (all steps when there are no more); None for none."""
    steady = step_seconds[WARMUP_STEPS:] or step_seconds
    return statistics.median(steady) if steady else None


#: the prediction of a run told not to plan (``--no-predict``)
NOT_PREDICTED = RunPrediction(note="not predicted (--no-predict)")


def speed_summary(prediction: RunPrediction, step_seconds: list[float], tokens_per_step: int) -> dict:
    """The summary's ``speed``: the measured steady step, and the prediction beside it."""
    measured = steady_step_seconds(step_seconds)
    out: dict[str, Any] = {
        "measured_step_s": None if measured is None else round(measured, 6),
        "measured_tokens_per_s": None if not measured else round(tokens_per_step / measured, 1),
        "steady_steps": max(0, len(step_seconds) - WARMUP_STEPS) or len(step_seconds),
    }
    s = prediction.speed
    if s is None:
        return out | {"predicted_step_s": None, "note": prediction.note}
    return out | {
        "predicted_step_s": round(s.predicted_step_seconds, 6),
        "predicted_tokens_per_s": round(s.tokens_per_second, 1),
        "predicted_over_measured": round(s.predicted_step_seconds / measured, 3) if measured else None,
        "bound_by": s.bound_by,
        "rates": s.rates,
        "parts": {k: round(v, 4) for k, v in s.parts.items()},
        "caveats": list(s.caveats),
    }


def speed_text(speed: dict) -> str:
    """One line of the summary: the steady step, and the prediction beside it."""
    measured = speed["measured_step_s"]
    line = f"steady step {measured:.3f} s (median of {speed['steady_steps']})" if measured else "no steady step"
    if speed.get("predicted_step_s") is None:
        return f"{line}; predicted: none ({speed['note']})"
    ratio = speed.get("predicted_over_measured")
    return (
        f"{line}; predicted {speed['predicted_step_s']:.3f} s"
        + (f" ({ratio:.2f}x the measured)" if ratio else "")
        + f", bound by {speed['bound_by']} ({speed['rates']})"
    )
