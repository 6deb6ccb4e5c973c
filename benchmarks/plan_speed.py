"""The speed model against runs on this machine's simulated GPU: the planner's predicted step beside the measured one.

``hybridps plan``'s predicted step (``hybridps.planner.speed``) beside the measured steady
step.

For each shape: simulate it on the meta device as ``hybridps plan --simulated-gpus`` does
(the same GPU and CPU capacities), predict its step with the rates of ``--rates`` (a file,
a profile, or ``this-machine``), then train it for real with the engine on a simulated GPU of
that capacity and take the median of the steps after ``--warmup``. Prints one JSON object (and
each shape's row on stderr as it is measured).

With ``--ranks N`` (N > 1) each shape is planned for N ranks on one node of N simulated GPUs
(``hybridps.planner.plan``: the derived share, its collectives at the rates' node GB/s) and
trained by N spawned ranks on gloo (the shared-memory link between them), the step the
slowest rank's median; each simulated GPU holds ``frac`` of the model data over N.

    OMP_NUM_THREADS=1 python -m benchmarks plan_speed --rates this-machine --steps 6
    OMP_NUM_THREADS=1 python -m benchmarks plan_speed --rates this-machine --ranks 2

One rank also trains as a script would beyond the defaults, each shape planned the same way
(``hybridps.planner.plan``): ``--precision bf16`` (the rates' speed in that precision),
``--micro-batches 4`` (gradient accumulation, so no grad reuse), ``--optimizer-states int8``
(the compact step), ``--optimizer NAME`` (another optimizer than AdamW, as ``hybridps plan
--optimizer`` names it) and ``--cpu-fraction 0.6 --disk-bytes 1G`` (a CPU of 60% of the model
data and a disk tier beside it, in a temp directory).

    OMP_NUM_THREADS=1 python -m benchmarks plan_speed --micro-batches 4 --optimizer-states int8

``--hf`` plans and trains transformers' own families (``HF_SHAPES``: Llama, GPT-2, Qwen2 of a few
layers, built from their configs as ``hybridps plan --model-config`` builds them), after the
GPT of the first one's shape: the speed model counts their work outside the matmuls against
that GPT's ([Note: the work outside the matmuls] in hybridps/planner/op_tally.py); then
Mixtral, and the first Llama with LoRA adapters (``HF_LORA_RANK``), checkpointed and not.

``--factory`` plans and trains models given as ``hybridps.planner.ModelFactory`` (``FACTORIES``:
the same GPT, torch's ``nn.TransformerEncoder``, an MLP with no attention, a convolutional
net), after the GPT by its shape: no hidden size, sequence or batch for the speed model to
read, their FLOPs, shape and other kernels counted on the meta device ([Note: a model's own
shape] in hybridps/planner/counted_work.py).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

import hybridps
from benchmarks import harness
from hybridps.models.hf import causal_lm_loss
from hybridps.planner.model import GPTShape, ModelFactory
from hybridps.planner.optimizers import OPTIMIZER_NAMES, build_optimizer
from hybridps.planner.rates import load_rates, threads_mismatch
from hybridps.planner.search import plan
from hybridps.planner.simulation import simulate

NAME = "plan_speed"
#: (layers, d_model, heads, seq, batch, GPU capacity as a fraction of the model data, its
#: own vocabulary or None for ``--vocab``); the last one spends most of its step in the head
SHAPES = (
    (4, 256, 4, 128, 8, 0.5, None),
    (6, 384, 6, 128, 8, 0.5, None),
    (6, 512, 8, 64, 2, 0.3, None),
    (2, 256, 4, 128, 4, 0.5, 32768),
)
#: ``--wide``: (layers, d_model, heads, seq, batch, GPU fraction, vocabulary, precision,
#: activation checkpointing): precisions, checkpointing, GPU shares from 0.2 to fitting, thin
#: and wide hidden sizes, short and long sequences
WIDE_SHAPES = (
    (4, 256, 4, 128, 8, 0.5, 8192, "bf16", False),
    (6, 384, 6, 128, 8, 0.2, 8192, "fp32", False),
    (4, 384, 6, 128, 8, 0.5, 8192, "fp32", True),
    (4, 256, 4, 128, 8, 1.5, 8192, "fp32", False),
    (8, 256, 4, 128, 4, 0.3, 8192, "bf16", True),
    (4, 512, 8, 64, 4, 0.5, 8192, "fp16", False),
    (3, 768, 12, 128, 4, 0.4, 8192, "fp32", False),
    (12, 128, 4, 256, 4, 0.5, 4096, "fp32", False),
    (4, 512, 4, 512, 2, 0.5, 8192, "bf16", False),
    (6, 256, 2, 64, 16, 0.5, 8192, "bf16", False),
)
#: ``--hf``: (transformers model type, its config's fields, seq, batch, GPU fraction,
#: precision): transformers' own decoder families (RMSNorm and rotary embeddings, a gated MLP,
#: grouped-query heads, an untied or tied head; GPT-2's tanh GELU and dropout), each after the
#: GPT of the first one's shape, whose work outside the matmuls the rates' block holds
HF_SHAPES = (
    (
        "llama",
        dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
        128,
        8,
        0.5,
        "fp32",
    ),
    ("gpt2", dict(n_embd=256, n_head=4, n_positions=1024), 128, 8, 0.5, "fp32"),
    (
        "qwen2",
        dict(hidden_size=384, intermediate_size=1024, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True),
        128,
        8,
        0.5,
        "fp32",
    ),
    (
        "llama",
        dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
        256,
        4,
        0.3,
        "bf16",
    ),
)
HF_LAYERS, HF_VOCAB = 4, 8192
#: ``--hf``'s mixture of experts: Mixtral's, eight experts of which a token takes two (its
#: FLOPs counted on meta: ``6 N T`` would count all eight)
HF_MOE = (
    "mixtral",
    dict(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    128,
    8,
    0.5,
    "fp32",
)

#: ``--hf``'s LoRA: the first Llama with rank-8 adapters on every linear layer, its own
#: weights frozen (``hybridps plan --lora``), checkpointed or not
HF_LORA_RANK = 8


def _gpt_factory() -> ModelFactory:
    """The GPT of ``HF_SHAPES``' first shape, given as a ``ModelFactory``: the count against the formula."""
    shape = GPTShape(n_layer=HF_LAYERS, d_model=256, n_head=4, seq_len=128, batch_size=8, vocab_size=HF_VOCAB)
    return shape_factory(shape)


def shape_factory(shape: GPTShape) -> ModelFactory:
    """``shape``'s GPT given as a ``ModelFactory``: no GPT shape for the speed model to read."""
    return ModelFactory(
        build_fn=lambda n: shape.with_layers(n).build(),
        inputs_fn=shape.inputs,
        n_layer=shape.n_layer,
        loss_fn=shape.loss,
        name="gpt (factory)",
    )


def _encoder_factory() -> ModelFactory:
    """torch's own ``nn.TransformerEncoder``: pre-norm layers of four heads, a ReLU MLP, 8 x 128 tokens."""

    def build(n: int) -> torch.nn.Module:
        layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True, norm_first=True)
        return torch.nn.TransformerEncoder(layer, n, enable_nested_tensor=False)

    return ModelFactory(
        build_fn=build,
        inputs_fn=lambda device: (torch.randn(8, 128, 256, device=device),),
        n_layer=4,
        name="nn.TransformerEncoder",
    )


def _mlp_factory() -> ModelFactory:
    """No attention: six residual-free MLP layers of width 512 (4x wide inside, GELU, LayerNorm) on 1024 rows."""

    def build(n: int) -> torch.nn.Module:
        layers = (
            (torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512), torch.nn.LayerNorm(512)) for _ in range(n)
        )
        return torch.nn.Sequential(*(m for layer in layers for m in layer))

    return ModelFactory(build_fn=build, inputs_fn=lambda device: (torch.randn(1024, 512, device=device),), n_layer=6, name="mlp")


def _conv_factory() -> ModelFactory:
    """Convolutions, no matmul: 3 x 3 layers of 64 channels with BatchNorm and ReLU on 16 images of 32 x 32."""

    def build(n: int) -> torch.nn.Module:
        stem = [torch.nn.Conv2d(3, 64, 3, padding=1)]
        body = [m for _ in range(n) for m in (torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU())]
        return torch.nn.Sequential(*stem, *body)

    return ModelFactory(
        build_fn=build, inputs_fn=lambda device: (torch.randn(16, 3, 32, 32, device=device),), n_layer=6, name="convnet"
    )


#: ``--factory``: models given as ``hybridps.planner.ModelFactory`` (no GPT shape: the speed
#: model counts their work on meta, [Note: a model's own shape] in hybridps/planner/counted_work.py),
#: each on a simulated GPU of half its model data, fp32
FACTORIES = (_gpt_factory, _encoder_factory, _mlp_factory, _conv_factory)
CPU_BYTES = 8 << 30
#: the lr every optimizer but AdamW trains at: at torch's defaults (RMSprop's 1e-2) the GPT
#: diverged, its softmax underflowed to denormal floats, and the CPU's matmuls in backward ran
#: 1.5x slower (the 6 x 512 shape's forward and backward 0.30 s against 0.22 s at 1e-4, as with
#: AdamW): a step's time then measured the divergence, not the optimizer
QUIET_LR = 1e-4


@dataclasses.dataclass(frozen=True)
class Training:
    """How one rank trains each shape, beyond its GPU: what ``Config`` and the loop take."""

    precision: str = "fp32"
    micro_batches: int = 1
    optimizer_states: str = "fp32"
    #: the CPU's capacity as a fraction of the model data (None: ``CPU_BYTES``)
    cpu_fraction: float | None = None
    #: a disk tier of this many bytes (0: none)
    disk_bytes: int = 0
    #: the optimizer, by its plan's name (``hybridps.planner.optimizers``)
    optimizer: str = "adamw"

    @property
    def grad_reuse(self) -> bool:
        return self.micro_batches == 1  # accumulation keeps grads apart (Config.grad_reuse)


def hf_family(model_type: str, fields: dict, seq: int, batch: int, **family):
    """The ``HFCausalLMFamily`` of a transformers config of ``model_type`` with ``fields``, at
    ``HF_LAYERS`` layers and ``HF_VOCAB`` entries, trained on ``batch`` x ``seq`` tokens
    (``family``: its other fields, ``lora_rank`` or ``checkpoint``)."""
    import transformers

    from hybridps.planner.hf_model import HFCausalLMFamily

    layers = {"n_layer": HF_LAYERS} if model_type == "gpt2" else {"num_hidden_layers": HF_LAYERS}
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=HF_VOCAB, max_position_embeddings=max(seq, 1024), **layers, **fields
    )
    return HFCausalLMFamily(
        config=config, n_layer=HF_LAYERS, seq_len=seq, batch_size=batch, source=f"{model_type} (bench)", **family
    )


def _batch(shape) -> tuple:
    """One micro-batch for ``shape``: its tokens, or a factory's own inputs."""
    if isinstance(shape, ModelFactory):
        return shape.inputs(torch.device("cpu"))
    return (torch.randint(0, shape.vocab_size, (shape.batch_size, shape.seq_len)),)


def _loss(shape, model, batch: tuple) -> torch.Tensor:
    """One micro-batch's loss of ``model`` (the engine or a module) on ``batch``, as ``shape``'s family is fed."""
    if isinstance(shape, ModelFactory):
        return shape.loss(model(*batch))
    (x,) = batch
    if isinstance(shape, GPTShape):
        return model(x, x)[1]
    # as `hybridps train` feeds it and its family plans it: no cache, the loss beside the model
    return causal_lm_loss(model(input_ids=x, use_cache=False).logits, x)


def measure(shape, gpu_bytes: int, cpu_bytes: int, steps: int, warmup: int, training: Training) -> list[float]:
    torch.manual_seed(0)
    model = shape.build()
    if training.optimizer == "adamw":  # over the trained params, as the plan's (a LoRA's adapters)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
    else:  # as the plan builds it (muon: Muon for the matrices, AdamW for the rest), at a small lr
        opt = build_optimizer(training.optimizer, model)
        for optimizer in opt if isinstance(opt, list) else [opt]:
            for group in optimizer.param_groups:
                group["lr"] = QUIET_LR
    with tempfile.TemporaryDirectory() as disk:
        devices = {"cuda:0": gpu_bytes, "cpu": cpu_bytes, **({"nvme": training.disk_bytes} if training.disk_bytes else {})}
        config = hybridps.Config(
            devices=devices,
            precision=training.precision,
            grad_reuse=training.grad_reuse,
            optimizer_states=training.optimizer_states,
            nvme_path=disk if training.disk_bytes else None,
        )
        engine = hybridps.initialize(model, opt, config)
        batch = _batch(shape)
        times = []
        try:
            for _ in range(warmup + steps):
                t0 = time.perf_counter()
                for _ in range(training.micro_batches):
                    engine.backward(_loss(shape, engine, batch))
                engine.step()
                engine.zero_grad()
                times.append(time.perf_counter() - t0)
        finally:
            engine.close()
    return times[warmup:]


def predict_one(shape, gpu_bytes: int, cpu_bytes: int, training: Training, rates):
    """The plan's prediction for one rank on a simulated GPU of ``gpu_bytes``, trained as ``training`` says."""
    report = plan(
        shape,
        gpus=f"1x{gpu_bytes}B",
        cpu=cpu_bytes,
        nvme=f"{training.disk_bytes}B" if training.disk_bytes else None,
        simulated_gpus=True,
        precision=training.precision,
        grad_reuse=training.grad_reuse,
        optimizer_states=training.optimizer_states,
        optimizer=training.optimizer,
        rates=rates,
        search_largest=False,
        micro_batches=training.micro_batches,
    )
    return report  # without a speed where the plan refuses the shape (its note says why)


def _rank_worker(rank, world, port, shape, gpu_bytes, steps, warmup, precision, threads, outdir):
    harness.rank_environment(rank, world, port)
    torch.set_num_threads(threads)
    hybridps.init_distributed(backend="gloo")
    torch.manual_seed(0)
    model = shape.build()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    config = hybridps.Config(devices={"cuda:0": gpu_bytes, "cpu": CPU_BYTES}, precision=precision)
    engine = hybridps.initialize(model, opt, config)
    gen = torch.Generator().manual_seed(rank)
    times = []

    def received() -> collections.Counter:  # every byte the engine's collectives brought this rank, by kind
        return collections.Counter(engine.memory_stats().get("dist", {}).get("bytes_received", {}))

    try:
        for i in range(warmup + steps):
            if i == warmup:
                before = received()
            x = torch.randint(0, shape.vocab_size, (shape.batch_size, shape.seq_len), generator=gen)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            engine.backward(engine(x, x)[1])
            engine.step()
            engine.zero_grad()
            times.append(time.perf_counter() - t0)
        link = engine.memory_stats().get("dist", {}).get("shared_memory_link")
        by_kind = {k: v / steps for k, v in (received() - before).items()}
    finally:
        engine.close()
        torch.distributed.destroy_process_group()
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump({"times": times[warmup:], "link": bool(link), "bytes": by_kind}, f)


def measure_ranks(shape: GPTShape, ranks: int, gpu_bytes: int, steps: int, warmup: int, precision: str):
    """Each step's seconds on the slowest rank of ``ranks`` spawned ranks, whether their
    chunk collectives went through the shared-memory link, and the bytes a rank's
    collectives received a step (the mean over ranks)."""
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as outdir:
        args = (ranks, harness.free_port(), shape, gpu_bytes, steps, warmup, precision, threads, outdir)
        mp.start_processes(_rank_worker, args=args, nprocs=ranks, start_method="spawn")
        results = [json.load(open(os.path.join(outdir, f"{r}.json"))) for r in range(ranks)]
    steps_s = [max(ts) for ts in zip(*(r["times"] for r in results), strict=True)]
    by_kind = {k: round(statistics.fmean(r["bytes"].get(k, 0) for r in results)) for k in results[0]["bytes"]}
    return steps_s, all(r["link"] for r in results), by_kind


def predict_ranks(shape: GPTShape, ranks: int, gpu_bytes: int, precision: str, rates):
    """The plan's prediction for ``ranks`` ranks on one node of simulated GPUs of ``gpu_bytes``."""
    report = plan(
        shape,
        gpus=f"{ranks}x{gpu_bytes}B",
        cpu=CPU_BYTES * ranks,
        simulated_gpus=True,
        precision=precision,
        rates=rates,
        search_largest=False,
    )
    if report.speed is None:
        raise SystemExit(f"no prediction for {shape.describe()} at {ranks} ranks: {report.speed_note}")
    return report


def _cases(args, training: Training) -> list[tuple]:
    """(shape, GPU fraction, how it trains) of each shape the flags select: ``--shapes`` of
    ``SHAPES`` as ``training`` says, ``--wide``'s each in its own precision and checkpointing,
    or ``--hf``'s transformers families after a GPT."""
    if args.factory:  # after the GPT by its shape, which the first factory gives as a factory
        gpt = GPTShape(n_layer=HF_LAYERS, d_model=256, n_head=4, seq_len=128, batch_size=8, vocab_size=HF_VOCAB)
        return [(gpt, 0.5, training)] + [(factory(), 0.5, training) for factory in FACTORIES]
    if args.hf:
        first = HF_SHAPES[0]
        gpt = (
            GPTShape(n_layer=HF_LAYERS, d_model=256, n_head=4, seq_len=first[2], batch_size=first[3], vocab_size=HF_VOCAB),
            first[4],
            Training(first[5]),
        )
        t, f, s, b, frac, p = first
        lora = [(hf_family(t, f, s, b, lora_rank=HF_LORA_RANK, checkpoint=ckpt), frac, Training(p)) for ckpt in (False, True)]
        return [gpt] + [(hf_family(t, f, s, b), frac, Training(p)) for t, f, s, b, frac, p in (*HF_SHAPES, HF_MOE)] + lora
    if args.wide:
        return [
            (
                GPTShape(n_layer=L, d_model=d, n_head=h, seq_len=s, batch_size=b, vocab_size=v, checkpoint=ckpt),
                frac,
                dataclasses.replace(training, precision=precision),
            )
            for L, d, h, s, b, frac, v, precision, ckpt in WIDE_SHAPES
        ]
    return [
        (GPTShape(n_layer=L, d_model=d, n_head=h, seq_len=s, batch_size=b, vocab_size=v or args.vocab), frac, training)
        for L, d, h, s, b, frac, v in (SHAPES[int(i)] for i in args.shapes.split(","))
    ]


def _describe(shape, training: Training) -> str:
    if isinstance(shape, ModelFactory):
        return f"{shape.name}, {shape.n_layer} layers" + (f", {training.precision}" if training.precision != "fp32" else "")
    if not isinstance(shape, GPTShape):
        d = shape.describe()
        return (
            f"{d['family']} {shape.n_layer} x {shape.d_model}, {shape.batch_size} x {shape.seq_len}, vocabulary "
            f"{shape.vocab_size}"
            + (f", {training.precision}" if training.precision != "fp32" else "")
            + (f", LoRA r{d['lora_rank']}" if d.get("lora_rank") else "")
            + (", checkpointed" if d.get("checkpoint") else "")
        )
    return (
        f"{shape.n_layer} x {shape.d_model}, {shape.n_head} heads, {shape.batch_size} x {shape.seq_len}, vocabulary "
        f"{shape.vocab_size}"
        + (f", {training.precision}" if training.precision != "fp32" else "")
        + (", checkpointed" if shape.checkpoint else "")
    )


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--rates", default="this-machine", help="a rates file, a profile (h100, h200) or this-machine")
    harness.add_shape_flags(ap, helps={"vocab": "vocabulary of the shapes without their own"}, vocab=8192, steps=5, warmup=2)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument(
        "--shapes",
        default=",".join(str(i) for i in range(len(SHAPES))),
        help="which shapes, comma-separated indices into " + "; ".join(f"{i}: {s[0]} x {s[1]}" for i, s in enumerate(SHAPES)),
    )
    ap.add_argument(
        "--wide",
        action="store_true",
        help=f"the {len(WIDE_SHAPES)} shapes of WIDE_SHAPES instead, each in its own precision and checkpointing (one rank)",
    )
    ap.add_argument(
        "--hf",
        action="store_true",
        help=f"transformers' families of HF_SHAPES instead ({len(HF_SHAPES)}, after a GPT of the first's shape; one rank)",
    )
    ap.add_argument(
        "--factory",
        action="store_true",
        help=f"the {len(FACTORIES)} models of FACTORIES instead, given as ModelFactory (no GPT shape; one rank)",
    )
    ap.add_argument("--ranks", type=int, default=1, help="ranks on this host (several: the derived multi-rank prediction)")
    ap.add_argument("--micro-batches", type=int, default=1, help="micro-batches accumulated a step (one rank)")
    ap.add_argument("--optimizer-states", default="fp32", choices=("fp32", "int8"), help="Adam's moments (one rank)")
    ap.add_argument(
        "--optimizer", default="adamw", choices=OPTIMIZER_NAMES, help="the optimizer, as the plan names it (one rank)"
    )
    ap.add_argument("--cpu-fraction", type=float, default=None, help="the CPU as a fraction of the model data (one rank)")
    ap.add_argument("--disk-bytes", type=harness.parse_count, default=0, help="a disk tier of this size, e.g. 1G (one rank)")
    args = ap.parse_args(argv)
    training = Training(
        args.precision, args.micro_batches, args.optimizer_states, args.cpu_fraction, args.disk_bytes, args.optimizer
    )
    if args.ranks > 1 and (training != Training(args.precision) or args.wide or args.hf or args.factory):
        raise SystemExit(
            "--micro-batches, --optimizer-states, --optimizer, --cpu-fraction, --disk-bytes, --wide, --hf and --factory are for one rank"
        )
    rates = load_rates(args.rates)
    warning = threads_mismatch(rates, torch.get_num_threads())
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr)
    rows = []
    for shape, frac, case in _cases(args, training):
        full = simulate(
            shape,
            gpu_bytes=CPU_BYTES,
            cpu_bytes=CPU_BYTES,
            precision=case.precision,
            grad_reuse=case.grad_reuse,
            optimizer_states=case.optimizer_states,
            optimizer=case.optimizer,
        )
        extra = {}
        if args.ranks > 1:
            gpu_bytes = int(full.model_data_bytes * frac / args.ranks + full.non_model_peak_bytes)
            report = predict_ranks(shape, args.ranks, gpu_bytes, args.precision, rates)
            pred, n_params, model_data = report.speed, report.n_params, full.model_data_bytes
            times, link, received = measure_ranks(shape, args.ranks, gpu_bytes, args.steps, args.warmup, args.precision)
            extra = {
                "ranks": args.ranks,
                "shared_memory_link": link,
                "collective_bytes_per_step": pred.node_collective_bytes_per_step,
                "measured_collective_bytes_per_step": sum(received.values()),
                "measured_collective_bytes_by_kind": received,
                "cpu_step_params": pred.cpu_step_params,
            }
        else:
            gpu_bytes = int(full.model_data_bytes * frac + full.non_model_peak_bytes)
            cpu_bytes = CPU_BYTES if case.cpu_fraction is None else int(full.model_data_bytes * case.cpu_fraction)
            report = predict_one(shape, gpu_bytes, cpu_bytes, case, rates)
            if report.speed is None:  # refused (a chunk's step needs more CPU than it has): so would the engine
                rows.append(
                    {
                        "shape": _describe(shape, case),
                        "skipped": report.hybridps.reason or report.speed_note,
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                continue
            pred, n_params, model_data = report.speed, report.n_params, full.model_data_bytes
            times = measure(shape, gpu_bytes, cpu_bytes, args.steps, args.warmup, case)
        measured = statistics.median(times)
        rows.append(
            {
                "shape": _describe(shape, case),
                **extra,
                "n_params": n_params,
                "tokens_per_step": pred.tokens_per_step,
                "gpu_bytes": gpu_bytes,
                "model_data_bytes": model_data,
                "predicted_s": round(pred.predicted_step_seconds, 4),
                "measured_s": round(measured, 4),
                "steps_s": [round(t, 4) for t in times],
                "predicted_over_measured": round(pred.predicted_step_seconds / measured, 3),
                "bound_by": pred.bound_by,
                "caveats": list(pred.caveats),
                "parts": {k: round(v, 4) for k, v in pred.parts.items()},
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    out = harness.header(NAME, argv)
    out.update(rates=rates.to_dict(), threads=torch.get_num_threads(), training=dataclasses.asdict(training), rows=rows)
    return harness.emit(out)
