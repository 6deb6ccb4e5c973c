"""The predicted speed of a planned run: seconds per step, tokens/s and model TFLOPS, and the
part that bounds the step.

Owns the speed model (``predict_speed``): the work of one steady step read from a
simulation (``Simulation``: the iteration replayed after warm-up) and the model's shape, each
part's seconds at a machine's measured rates (``rates.MachineRates``), and how the parts
compose into a step (``SpeedPrediction``).

[Note: the speed model]
Work per optimizer step (``micro_batches`` micro-batches of ``batch x seq_len`` tokens):

- FLOPs: model FLOPs ``6 N T + 12 L d S T`` (N params, T tokens, L layers, d hidden, S
  sequence: the formula of scripts/gpu_validate.py, recomputation not counted), plus with
  activation checkpointing what the backward recomputes, counted on meta ([Note: what
  checkpointing recomputes] in counted_work.py; where the model cannot be counted, the blocks'
  whole forward ``2 N' T + 4 L d S T``, N' without the vocabulary's matrices, which no block
  holds); ``compute`` is those FLOPs at the
  rates' TFLOPS for the model's hidden size and tokens a micro-batch (where the rates timed
  several counts: at 128 tokens the VM's blocks ran 10-25% slower a FLOP than at 1024, the
  third shape of the plan_speed bench predicted at 0.76x until they did), less the ``6 P T``
  that ``6 N T`` counts for the P params only an embedding lookup reads (an untied input
  embedding, position embeddings: a lookup multiplies nothing; ``model.lookup_params``, and
  ``hybridps calibrate`` counts its block's FLOPs the same way), with the head apart where the rates measured it (see [Note: the head apart]) and
  the attention's ``12 L d S T`` (``4 L d S T`` more recomputed) at its own rate for the
  sequence and head size where the rates timed it apart ([Note: attention apart] in
  calibrate_attention.py), in the precision the model computes in ([Note: compute by
  precision]);
- ``host``: the host's time per param tensor per micro-batch (HybridPS's hooks and accesses,
  op launches) times the tensors and micro-batches, and its time per hook unit call times
  the calls beyond the first of the units a run settles on ([Note: host time by hook unit]);
- ``link``: the simulation's bytes host -> GPU and GPU -> host per micro-batch at the pinned
  rates; one copy engine per direction, so the two directions overlap (max of the two);
  repeated per micro-batch (the param chunks cross again each forward: an upper bound);
- ``host_memory`` ([Note: host memory on the calling thread]): the copies of the link's bytes
  whose host side is a pageable buffer, at the rates' pageable GB/s (instead of in ``link``),
  and the host arena's segments mapped and pinned, and unpinned and let go, at the rates'
  seconds a GiB; where the rates measured neither, nothing (and every byte in ``link``);
- ``cpu_adam``: the params whose optimizer row stepped on the CPU in the steady iteration
  (rows not on the GPU), at the fused AdamW rate (exact moments) or ``compact_adam_``'s
  (int8 moments), another optimizer's at its timed speed over fused AdamW's ([Note: every
  optimizer's step] in calibrate_optimizers.py), plus in 16-bit training the two dtype copies
  per param, plus Python per chunk; ``gpu_adam``: the rows stepped on the GPU at its rate (a
  simulated GPU's at the CPU's, the optimizer's speed included);
- ``disk``: the disk tier's bytes read and written in the steady iteration at its rates (which
  the node's ranks share: each rank's bytes times the ranks of its node);
- ``collectives``: several ranks' all-gathers and reductions, the bytes a rank sends in each
  ring at the rates' GB/s among a node's ranks and between nodes (rank_speed.py,
  [Note: a rank's step]); nothing at one rank;
- ``device_copies``: the copies the engine makes on the compute device itself: each
  micro-batch's grads into their chunks (none while grads stay loose), and in fp32 with a
  master apart the master written back into the param row. On a simulated GPU they are
  host memcpys at the copy rate (4.5-5% of a 6 x 512 step with 30% of the model data on the
  GPU, unexplained until counted); on a real GPU they run at its memory's bandwidth, which no
  rate measures, and are taken as nothing (17 B bf16 params: 68 GB a step, ~25 ms at
  3 TB/s against a step of seconds).

Composition. On a real GPU forward and backward run the GPU's kernels, the host's Python
and launches, the chunk copies (prefetched on the copy streams) and the collectives (gathers
ahead, reductions beside backward, on NCCL's streams over links of their own) side by side:
that phase takes ``max(compute, host, link, collectives)``, written ``max(compute, host,
link)`` below. The optimizer step follows backward (chunks stepped on
the CPU one after the other, the GPU's rows beside them), and the disk's traffic is counted
whole (its reads ahead wait on the same CPU room the step uses):
``step = max(compute, host, link) + host_memory + cpu_adam + gpu_adam + disk``. With steps beside the
next forward (``Config.overlap_step`` "auto": on for a real GPU with grad reuse, so not
under accumulation) the CPU step runs on a worker while the next forward runs, whose share
of ``max(compute, host, link)`` is taken as a third (forward against forward + backward):
``cpu_adam`` counts only ``max(0, cpu_adam - max(compute, host, link) / 3)``. On a simulated GPU every part runs on
the host's cores (its copies are memcpys, its compute the CPU's), so the parts add up:
``step = compute + host + h2d + d2h + collectives + cpu_adam + gpu_adam + disk +
device_copies`` (the shared-memory link's copies, too, take the cores the ranks compute on). ``bound_by`` names the
part that contributes most to the step.

[Note: host memory on the calling thread]
A copy between a GPU and pageable host memory cannot run on a copy stream beside compute:
the runtime stages it through a pinned buffer of its own, on the calling thread, at 6.5-8.2
GB/s on the H200 node against 41-55 GB/s from pinned memory. Mapping and page-locking a host
arena segment (``cudaHostRegister``) and letting it go also run there, between two chunk
moves: 9.3 ms a 32 MiB segment made and dropped on that node. The largest GPT planned for it
(17.23 B, 340 layers) did both every step in the planner's simulation: 483 segments grown and
released, 16.5 GB of optimizer rows through pageable buffers each way, about 9 s of its 51.7
s step (docs/benchmarks/2026-11-27-largest-model-h200.md, "Where the largest step's time
goes"), which a model of pinned copies beside compute counted as under a second. So the
simulation counts them (``Simulation.pageable_*``, ``arena_*``: the mover's and the arena's
own counters over the last iteration), and a step adds their seconds to the overlapped phase
instead of hiding them in it. The shipped H200 profile carries the rates measured on that
node; a profile without them (the H100's, a simulated GPU's, where pageable and pinned
memory copy alike) counts nothing here.

[Note: the casts' trips]
Where the GPU casts a CPU step's grads and master (``Config.casts_on_gpu``, [Note: casts on
the GPU] in optim/device_casts.py), the CPU no longer casts (``cpu_cast_params_per_s``), but
each chunk's fp32 grads come down before its Adam and its master goes up after: 8 B a param
over the pinned link. The step worker stages the next chunk's grads while it steps one and
does not wait for a master's copy up ([Note: the casts' trips beside the Adam] in
optim/device_casts.py): on a real GPU the ``cpu_adam`` part counts the trips, at the link's
GB/s, only where they outlast the Adam of the params they carry; on a simulated GPU, whose
copies are memcpys on the cores that step, whole. The bytes count in ``link`` too: the copy
engines are busy then as well. (Before the worker staged ahead the trips were serial with the
Adam: the H200's largest model stepped its 9.88 G CPU params in 4.40 s, 2.24 G a second,
where the plan counted 3.97 s; a run with ``overlap_step=False``, which steps on the calling
thread, still is, and the plan, which takes the default, does not see it.) On the H200
profile the trips (0.15 ns a param) and the casts (0.16 ns) come out alike, as measured there
at 1.31 B with every optimizer row on the CPU, 8 x 1024 tokens: 0.789 s an iteration with the
casts on the GPU, 0.779 s without (docs/benchmarks/2026-11-26-h200-third-session.md). The path's gain is where the host is full: the param
chunks no longer come down for the step, so the rows stay where they are (the planner's
17.23 B on one H200: 34 GB moved each way, 17 GB of it pageable, and 500 arena segments made
and dropped a step without it; no chunk move with it).

[Note: host time by hook unit]
The host's time per tensor is timed on a tiny GPT that fits, where after the warm-up the model
is one hook unit (params/hook_units.py, [Note: the model as one unit]). A model whose chunks
move runs every module as a unit: each call of one costs its hooks, a tick of the tracer and
an access and a release of its params, forward and backward, whatever its tensors. A LoRA
Llama (4 x 256, 128 x 4 tokens, bf16) has 341 modules, 172 of them called a forward (each
linear a base layer, two adapters and a dropout; the ModuleDicts holding the adapters are
never called); on a 26 MiB simulated GPU it ran 0.147-0.176 s a step where it ran 0.126-0.153
s fitting, moving 16 MB a step (a few ms), and the plan, counting tensors alone, read
0.65-0.78. ``hybridps calibrate`` therefore times the same tiny GPT again with every module a
unit (``hook_units="module"``), in turns with it, and keeps its extra time over its extra
unit calls (``host_s_per_unit``: 0.05 ms on the VM); the simulation, which runs every module
a unit, asks the hooks which units a run settles on (``ModuleHooks.units_under_auto``: the
model as the one where everything fits, the blocks where they fit, every module otherwise)
and counts their forward calls in its last iteration (``Simulation.hook_units``: a
container never called costs nothing, a checkpointed block's modules are called again);
``host`` adds the calls beyond the first at that rate.

[Note: the head apart]
The rates' TFLOPS are a block's (a one-block GPT with a 256-entry vocabulary). What a
language model does outside its blocks runs slower per FLOP: the projection to the
vocabulary is one wide, thin matmul, the fp32 cross-entropy reads and writes every logit
several times without multiplying, and the embedding's backward writes a dense grad of the
whole vocabulary. On the 2-vCPU machine, fp32, one thread: blocks 73-87 GFLOPS, the head of
8192 entries 50-75 with 6-8 ns a logit of cross-entropy; a 4 x 256 GPT of that vocabulary at
1024 tokens spends 47% of its step there, and counting it at the block rate predicted the
step at 0.81-0.86x of the measured one. Where the rates carry ``head_s_per_logit``
(``hybridps calibrate`` times a GPT of no blocks beside the one-block GPT, at two
vocabularies: a CPU's caches hold 8192 entries' projection and not 32768's, 10-30% a logit
apart) the head's ``6 V d T`` leaves the FLOPs and its ``T x V`` logits cost that time each
instead. The shipped GPU profiles carry none: their TFLOPS were read from whole-model runs,
the head inside them.

[Note: compute by precision]
A model computes in its params' precision (``Config.precision``), and a machine's rate
depends on it: on the 2-vCPU VM (AMX, one thread) a one-block step in bf16 ran 1.2-2.8x its
fp32 rate (1.16x at hidden size 128 and 128 tokens, 2.79x at 1024 and 1024 tokens) and its
head 1.4-2.9x, while fp16 ran 0.86-1.0x (no fp16 matmul units); on Hopper fp16 and bf16
share the tensor cores' rate and fp32 (TF32 off, torch's default) runs on the CUDA cores at
about a fifteenth. Rates timed in one precision (``compute_precision``: bf16 on a GPU, fp32 on
a CPU) predicted a bf16 GPT on the VM's simulated GPU at 1.25x and 1.79x its measured step.
So ``hybridps calibrate`` times the same one-block steps and heads in the other precisions
too, kept as speeds over the timed ones (``precision_speed`` by hidden size and tokens,
``precision_head_speed`` by hidden size and tokens), and ``compute`` reads the rates at the work's
precision: the same two shapes then came to 0.73x and 0.95-0.97x. The shipped profiles
carry the datasheet's ratios (not measured, their sources say so). A precision the rates never
timed computes at their own precision's rates and the prediction says so (``caveats``).
On the CPU bf16's blocks moved with the sequence as well (20-30% slower a FLOP at sequence
128 than at 256, the same tokens), so a bf16 GPT of 8 x 128 tokens came to 0.69-0.73x: its
attention, timed apart since ([Note: attention apart]), took 13-14 ms at sequences 64-128
against 10 at 256. And bf16's head moved with the tokens (hidden size 256: 9.5 ns a logit
at 512 tokens, 12 at 2048 and beyond) while fp32's did not, so the heads of the other
precisions are timed at two token counts (the head's and twice it).

Does not own the rates (``rates``, ``calibrate``), the simulation (``simulation``) or how
the prediction prints (``report``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridps.common.errors import ConfigError
from hybridps.planner.counted_work import CountedShape, counted_shape, recomputed_flops
from hybridps.planner.op_tally import beyond_gpt, mapped_bytes
from hybridps.planner.optimizers import ADAM_KERNEL_OPTIMIZERS
from hybridps.planner.rates import MachineRates
from hybridps.planner.simulation import Simulation

#: the parts of a step, in the order the report lists them
PARTS = ("compute", "host", "link", "host_memory", "collectives", "cpu_adam", "gpu_adam", "disk", "device_copies")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepWork:
    """What one optimizer step does, independent of the machine."""

    n_params: int
    n_layer: int
    d_model: int
    seq_len: int
    batch_size: int
    #: the attention's head size (0: unknown, read at the smallest timed)
    head_dim: int = 0
    micro_batches: int = 1
    checkpoint: bool = False
    #: under checkpointing, the FLOPs a micro-batch recomputes, counted on meta ([Note: what
    #: checkpointing recomputes] in counted_work.py); None: the blocks' whole forward
    recompute_flops: float | None = None
    precision: str = "fp16"
    optimizer_states: str = "fp32"
    #: the optimizer trained with (``optimizers.OPTIMIZER_NAMES``)
    optimizer: str = "adamw"
    #: param tensors (hooks and accesses per micro-batch)
    tensors: int = 0
    #: the hook units a micro-batch runs (``Simulation.hook_units``; [Note: host time by hook unit])
    hook_units: int = 1
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    #: of those, the bytes whose host side was a pageable buffer (no arena slot), each way
    pageable_h2d_bytes: int = 0
    pageable_d2h_bytes: int = 0
    #: host arena segments' bytes mapped and pinned, and unpinned and let go, per micro-batch
    arena_grown_bytes: int = 0
    arena_released_bytes: int = 0
    cpu_step_params: int = 0
    cpu_step_chunks: int = 0
    #: of ``cpu_step_params``, those whose casts run on the GPU (``Config.casts_on_gpu``): the
    #: CPU runs their Adam alone ([Note: casts on the GPU] in optim/device_casts.py)
    cpu_step_params_cast_on_gpu: int = 0
    gpu_step_params: int = 0
    disk_read_bytes: int = 0
    disk_write_bytes: int = 0
    #: ranks of the node whose disk traffic the node's one disk tier serves beside this one's
    #: (its own included): they read and write alike, at once ([Note: a rank's step])
    disk_sharing_ranks: int = 1
    #: the steady step's grads stayed loose (no copy into chunks); the params keep an fp32
    #: master apart (written back after the step)
    grads_loose: bool = False
    master_apart: bool = True
    #: the vocabulary (0: unknown, its matrices counted as any other params)
    vocab_size: int = 0
    #: the head's weight is the input embedding's (one matrix of the vocabulary, not two)
    tied_embeddings: bool = True
    #: params only an embedding lookup reads (``Simulation.lookup_params``: an untied input
    #: embedding, position embeddings); None: unknown, an untied input embedding's ``V d``
    lookup_params: int | None = None
    #: the optimizer rows this rank steps, in params (None: every param, one rank)
    owned_params: int | None = None
    #: bytes this rank's collectives move per micro-batch: all-gathers and reductions among
    #: the ranks of its node, and anything between nodes (rank_speed.py, [Note: a rank's step])
    node_gather_bytes: int = 0
    node_reduce_bytes: int = 0
    network_bytes: int = 0
    #: collectives among the node's ranks per micro-batch (each takes ``node_collective_s``)
    node_collectives: int = 0
    #: (op, precision, calls, bytes, new bytes, mapped bytes) a micro-batch's forward and
    #: backward runs outside its matmuls beyond the GPT of its shape (``op_tally.beyond_gpt``;
    #: () for a GPT)
    beyond_gpt: tuple[tuple[str, str, int, int, int, int], ...] = ()
    #: bytes of a micro-batch's new tensors the C library maps afresh in the GPT of its shape
    #: (``op_tally.mapped_bytes``; a counted model's are in its ``beyond_block``): each a
    #: step's fresh memory ([Note: memory mapped afresh] in common/host_allocator.py)
    mapped_bytes: int = 0
    #: a model of no GPT shape: its micro-batch's work counted on meta ([Note: a model's own
    #: shape] in counted_work.py), whose FLOPs stand in for the formulas
    counted: CountedShape | None = None

    @property
    def beyond_gpt_bytes(self) -> int:
        """The net bytes of ``beyond_gpt`` a micro-batch."""
        return sum(row[3] for row in self.beyond_gpt)

    @property
    def micro_batch_tokens(self) -> int:
        """Tokens a micro-batch (a counted model: the rows of its dense matmuls)."""
        return self.counted.rows if self.counted is not None else self.batch_size * self.seq_len

    @property
    def tokens(self) -> int:
        return self.micro_batch_tokens * self.micro_batches

    @property
    def model_flops(self) -> float:
        """6 N T + 12 L d S T: what docs/BENCHMARKS.md's model TFLOPS count (a counted model:
        three times its forward's)."""
        if self.counted is not None:
            return self.counted.model_flops * self.micro_batches
        t = self.tokens
        return 6.0 * self.n_params * t + 12.0 * self.n_layer * self.d_model * self.seq_len * t

    @property
    def device_copy_bytes(self) -> int:
        """Bytes the engine copies on the compute device a step: each micro-batch's grads
        into their chunks, and in fp32 the master back into a param row apart from it (16-bit
        casts count in the optimizer's rates)."""
        elem = 4 if self.precision == "fp32" else 2
        grads = 0 if self.grads_loose else self.n_params * elem * self.micro_batches
        owned = self.n_params if self.owned_params is None else self.owned_params
        write_back = owned * 4 if self.precision == "fp32" and self.master_apart else 0
        return grads + write_back

    @property
    def lookups(self) -> int:
        """Params only an embedding lookup reads: ``lookup_params`` where the simulation counted
        them, else an untied input embedding's ``V d``."""
        if self.lookup_params is not None:
            return self.lookup_params
        return 0 if self.tied_embeddings else self.vocab_size * self.d_model

    @property
    def vocab_params(self) -> int:
        """Params no block holds: the head's matrix and the lookups' (an untied input
        embedding, position embeddings)."""
        return self.vocab_size * self.d_model + self.lookups

    @property
    def head_flops(self) -> float:
        """The head's projection, 6 V d T (inside ``model_flops``)."""
        return 6.0 * self.vocab_size * self.d_model * self.tokens

    @property
    def lookup_flops(self) -> float:
        """What ``6 N T`` counts for the lookups, which multiply nothing."""
        return 6.0 * self.lookups * self.tokens

    @property
    def attention_pass_flops(self) -> float:
        """The attention's FLOPs of one forward and backward a step: ``12 L d S T`` (a counted
        model: three times its forward's activation matmuls)."""
        if self.counted is not None:
            return 3.0 * self.counted.forward_activation_flops * self.micro_batches
        return 12.0 * self.n_layer * self.d_model * self.seq_len * self.tokens

    @property
    def attention_flops(self) -> float:
        """The attention's FLOPs a step (inside ``step_flops``): its pass, and ``4 L d S T`` more
        recomputed under activation checkpointing (a third of the pass)."""
        if self.counted is not None:
            return self.counted.activation_step_flops * self.micro_batches
        return self.attention_pass_flops * (4 / 3 if self.checkpoint else 1.0)

    @property
    def step_flops(self) -> float:
        """The model FLOPs, plus the blocks' recomputed forward under activation checkpointing
        (a counted model: its forward's and backward's, recomputation inside)."""
        if self.counted is not None:
            return self.counted.step_flops * self.micro_batches
        if not self.checkpoint:
            return self.model_flops
        if self.recompute_flops is not None:
            return self.model_flops + self.recompute_flops * self.micro_batches
        t = self.tokens
        recompute = 2.0 * (self.n_params - self.vocab_params) * t + 4.0 * self.n_layer * self.d_model * self.seq_len * t
        return self.model_flops + recompute


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeedPrediction:
    """The predicted steady step on one machine's rates."""

    rates: str
    predicted_step_seconds: float
    tokens_per_second: float
    model_tflops: float
    bound_by: str
    #: seconds of each part alone (``PARTS``)
    parts: Mapping[str, float]
    composition: str
    tokens_per_step: int
    micro_batches: int
    model_flops_per_step: float
    flops_per_step: float
    compute_tflops_used: float
    #: the head's share of ``compute`` where timed apart ([Note: the head apart]), else None
    head_seconds: float | None
    h2d_bytes_per_step: int
    d2h_bytes_per_step: int
    cpu_step_params: int
    gpu_step_params: int
    #: bytes this rank's collectives move a step among its node's ranks and between nodes
    #: (0 at one rank)
    node_collective_bytes_per_step: int = 0
    network_bytes_per_step: int = 0
    #: what the prediction could not measure and took instead (a precision the rates never
    #: timed: computed at the one they did)
    caveats: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["parts"] = {k: round(v, 6) for k, v in self.parts.items()}
        for k in ("predicted_step_seconds", "tokens_per_second", "model_tflops", "compute_tflops_used"):
            out[k] = round(out[k], 6)
        return out

    def describe(self) -> str:
        parts = ", ".join(f"{k} {_s(v)}" for k, v in self.parts.items() if v)
        return (
            f"{_s(self.predicted_step_seconds)} a step, {self.tokens_per_second:,.0f} tokens/s, "
            f"{self.model_tflops:.1f} model TFLOPS, bound by {self.bound_by} (rates {self.rates}; parts alone: {parts})"
            + "".join(f"; {c}" for c in self.caveats)
        )


def _s(seconds: float) -> str:
    return f"{seconds:.3g} s"


def step_work(sim: Simulation, model: Any, *, micro_batches: int = 1) -> StepWork:
    """The work of ``sim``'s steady step for ``model``: a ``GPTShape`` or a transformers family
    by their hidden size, sequence and batch, any other model (and a mixture of experts, or a LoRA) by its
    count on the meta device ([Note: a model's own shape] in counted_work.py). Raises ``ConfigError`` where the
    simulation did not finish or the model cannot be counted."""
    if not sim.completed:
        raise ConfigError(f"no steady step to time: the simulation did not finish ({sim.failure})")
    shaped = all(hasattr(model, a) for a in ("d_model", "seq_len", "batch_size"))
    if shaped and not getattr(model, "counted_on_meta", False):
        checkpoint = bool(getattr(model, "checkpoint", False))
        shape = dict(
            recompute_flops=recomputed_flops(model, sim.precision) if checkpoint else None,
            d_model=model.d_model,
            seq_len=model.seq_len,
            batch_size=model.batch_size,
            head_dim=int(getattr(model, "head_dim", 0) or 0),
            checkpoint=checkpoint,
            vocab_size=int(getattr(model, "vocab_size", 0) or 0),
            tied_embeddings=bool(getattr(model, "tied_embeddings", True)),
            lookup_params=sim.lookup_params,
            beyond_gpt=beyond_gpt(model, sim.precision),
            mapped_bytes=mapped_bytes(model, sim.precision),
        )
    else:  # no GPT shape, experts that 6 N T would count all of, or frozen weights it would count trained
        counted = counted_shape(model, sim.precision)
        seq = counted.seq_len or counted.rows
        shape = dict(
            d_model=counted.width,
            seq_len=seq,
            batch_size=max(1, counted.rows // seq),
            head_dim=counted.head_dim,
            lookup_params=0,  # a lookup multiplies nothing: none in the counted FLOPs
            beyond_gpt=counted.beyond_block,
            counted=counted,
        )
    moved = sim.moved_bytes_per_step
    return StepWork(
        n_params=sim.n_params,
        n_layer=sim.n_layer,
        micro_batches=micro_batches,
        precision=sim.precision,
        optimizer_states=sim.optimizer_states,
        optimizer=sim.optimizer,
        tensors=len(sim.param_numels),
        hook_units=sim.hook_units,
        h2d_bytes=h2d_bytes(moved),
        d2h_bytes=d2h_bytes(moved),
        pageable_h2d_bytes=sim.pageable_h2d_bytes_per_step,
        pageable_d2h_bytes=sim.pageable_d2h_bytes_per_step,
        arena_grown_bytes=sim.arena_grown_bytes_per_step,
        arena_released_bytes=sim.arena_released_bytes_per_step,
        cpu_step_params=sim.step_params_cpu,
        cpu_step_chunks=sim.step_chunks_cpu,
        cpu_step_params_cast_on_gpu=sim.step_params_cpu_cast_on_gpu,
        gpu_step_params=sim.step_params_gpu,
        disk_read_bytes=sim.nvme_read_bytes_per_step,
        disk_write_bytes=sim.nvme_write_bytes_per_step,
        grads_loose=sim.grads_loose,
        master_apart=sim.master_apart,
        **shape,
    )


def h2d_bytes(moved: Mapping[str, int]) -> int:
    """The bytes from the CPU to the GPU of a ``moved_bytes_per_step`` mapping."""
    return sum(v for k, v in moved.items() if k.startswith("cpu") and k.endswith("->cuda:0"))


def d2h_bytes(moved: Mapping[str, int]) -> int:
    """The bytes from the GPU to the CPU of a ``moved_bytes_per_step`` mapping."""
    return sum(v for k, v in moved.items() if k.startswith("cuda:0->") and k.endswith("cpu"))


def head_seconds(work: StepWork, rates: MachineRates) -> float | None:
    """The head's seconds a step at the rates' time per logit; None where the rates did not
    measure it or the vocabulary is unknown (the head then counts at the blocks' rate)."""
    per_logit = (
        rates.head_s_at(work.d_model, work.vocab_size, work.precision, work.micro_batch_tokens) if work.vocab_size else None
    )
    return None if per_logit is None else work.tokens * work.vocab_size * per_logit


def attention_seconds(work: StepWork, rates: MachineRates) -> float | None:
    """The attention's seconds a step at its own rate for the work's sequence and head size,
    and under checkpointing its forward again at the forward's timed share; None where the
    rates did not time it apart ([Note: attention apart] in calibrate_attention.py: their
    compute rate then includes it)."""
    at = (work.head_dim, work.seq_len, work.precision)
    tflops = rates.attention_tflops_at(*at)
    if tflops is None:
        return None
    once = work.attention_pass_flops / (tflops * 1e12)
    return once * (1.0 + (rates.attention_forward_share_at(*at) if work.checkpoint else 0.0))


def conv_seconds(work: StepWork, rates: MachineRates) -> float | None:
    """A counted model's convolutions a step at the rates' convolution rate; None where it has
    none or the rates timed none ([Note: a model's own shape] in counted_work.py)."""
    if work.counted is None or not work.counted.forward_conv_flops:
        return None
    tflops = rates.conv_tflops_at(work.d_model, work.precision)
    return None if tflops is None else work.counted.conv_step_flops * work.micro_batches / (tflops * 1e12)


def narrow_seconds(work: StepWork, rates: MachineRates) -> tuple[float, float] | None:
    """(seconds, FLOPs) a step of a counted model's narrow matmuls at the rates' narrow rates;
    None where it has none or the rates timed none ([Note: narrow matmuls] in counted_work.py)."""
    if work.counted is None or not work.counted.forward_narrow_flops:
        return None
    seconds = flops = 0.0
    for width, step in work.counted.narrow_step_flops:
        tflops = rates.narrow_tflops_at(width, work.d_model, work.precision)
        if tflops is not None:
            seconds += step * work.micro_batches / (tflops * 1e12)
            flops += step * work.micro_batches
    return (seconds, flops) if flops else None


def part_seconds(work: StepWork, rates: MachineRates, *, disk_gbps: tuple[float, float] | None = None) -> dict[str, float]:
    """Each part's seconds alone (``PARTS``); ``disk_gbps`` (read, write) stand in for rates
    that measured no disk."""
    m = work.micro_batches
    rate = rates.tflops_at(work.d_model, work.micro_batch_tokens, work.precision) * 1e12
    head = head_seconds(work, rates)
    attention = attention_seconds(work, rates)  # None: inside the blocks' rate
    flops = work.step_flops - work.lookup_flops - (0.0 if attention is None else work.attention_flops)
    conv = conv_seconds(work, rates)  # None: at the blocks' rate
    if conv is not None:
        flops -= work.counted.conv_step_flops * m
    narrow = narrow_seconds(work, rates)  # None: at the blocks' rate
    if narrow is not None:
        flops -= narrow[1]
    if head is None:  # the head at the blocks' rate
        compute = flops / rate
    else:  # [Note: the head apart]
        compute = (flops - work.head_flops) / rate + head
    compute += (attention or 0.0) + (conv or 0.0) + (narrow[0] if narrow is not None else 0.0)
    # [Note: the work outside the matmuls] (op_tally.py): a family's beyond the GPT's
    beyond = rates.elementwise_seconds(work.beyond_gpt) if work.beyond_gpt else None
    if beyond is not None:
        compute = max(compute + beyond * m, compute / 2)  # less work than the GPT's, never none
    compute += work.mapped_bytes * rates.elementwise_new_s_per_byte * m
    pageable_h2d = work.pageable_h2d_bytes if rates.pageable_h2d_gbps else 0
    pageable_d2h = work.pageable_d2h_bytes if rates.pageable_d2h_gbps else 0
    h2d = (work.h2d_bytes - pageable_h2d) * m / (rates.h2d_gbps * 1e9)
    d2h = (work.d2h_bytes - pageable_d2h) * m / (rates.d2h_gbps * 1e9)
    # another optimizer than Adam at its timed speed over fused AdamW's ([Note: every optimizer's step])
    speed = rates.optimizer_speed_at(work.optimizer, work.d_model) or 1.0
    adam = rates.cpu_compact_adam_params_per_s if work.optimizer_states == "int8" else rates.cpu_adam_params_per_s * speed
    cpu = work.cpu_step_params / adam + work.cpu_step_chunks * rates.cpu_step_s_per_chunk
    if work.precision != "fp32":  # 16-bit grads to the fp32 master and the master back, on the CPU
        cpu += (work.cpu_step_params - work.cpu_step_params_cast_on_gpu) / rates.cpu_cast_params_per_s
    # cast on the GPU instead: fp32 grads down and master up ([Note: the casts' trips])
    trips = work.cpu_step_params_cast_on_gpu * 4 * (1 / (rates.d2h_gbps * 1e9) + 1 / (rates.h2d_gbps * 1e9))
    if rates.simulated_gpu:
        cpu += trips  # memcpys on the cores that step, one after the other
    else:  # on their stream beside the Adam of the params they carry
        cpu += max(0.0, trips - work.cpu_step_params_cast_on_gpu / adam)
    read_gbps, write_gbps = rates.disk_read_gbps, rates.disk_write_gbps
    if disk_gbps is not None:
        read_gbps, write_gbps = read_gbps or disk_gbps[0], write_gbps or disk_gbps[1]
    disk = 0.0
    if work.disk_read_bytes or work.disk_write_bytes:
        if not (read_gbps and write_gbps):
            raise ConfigError(f"rates {rates.name!r} measured no disk and none was given: no disk seconds to predict")
        disk = work.disk_read_bytes / (read_gbps * 1e9) + work.disk_write_bytes / (write_gbps * 1e9)
        disk *= work.disk_sharing_ranks  # the node's ranks share the disk's rate
    return {
        "compute": compute,
        "host": (work.tensors * rates.host_s_per_tensor + max(0, work.hook_units - 1) * rates.host_s_per_unit) * m,
        # one copy engine per direction: the directions overlap on a real GPU; memcpys add up
        "link": h2d + d2h if rates.simulated_gpu else max(h2d, d2h),
        "host_memory": host_memory_seconds(work, rates),
        "collectives": collective_seconds(work, rates),
        "cpu_adam": cpu,
        # a simulated GPU steps on the CPU; a real GPU's other optimizers at its fused AdamW's rate
        "gpu_adam": work.gpu_step_params / (rates.gpu_adam_params_per_s * (speed if rates.simulated_gpu else 1.0)),
        "disk": disk,
        # a real GPU's own copies run at its memory's bandwidth: nothing here (the Note)
        "device_copies": work.device_copy_bytes / (rates.h2d_gbps * 1e9) if rates.simulated_gpu else 0.0,
    }


def host_memory_seconds(work: StepWork, rates: MachineRates) -> float:
    """Seconds a step of the host memory work that runs on the calling thread ([Note: host
    memory on the calling thread]): copies through pageable buffers at the rates' pageable
    GB/s, and the arena's segments mapped and pinned, unpinned and let go; nothing the rates
    did not measure."""
    parts = (
        (work.pageable_h2d_bytes, rates.pageable_h2d_gbps and 1 / (rates.pageable_h2d_gbps * 1e9)),
        (work.pageable_d2h_bytes, rates.pageable_d2h_gbps and 1 / (rates.pageable_d2h_gbps * 1e9)),
        (work.arena_grown_bytes, rates.arena_grow_s_per_gib and rates.arena_grow_s_per_gib / 2**30),
        (work.arena_released_bytes, rates.arena_release_s_per_gib and rates.arena_release_s_per_gib / 2**30),
    )
    return sum(nbytes * (per_byte or 0.0) for nbytes, per_byte in parts) * work.micro_batches


def collective_seconds(work: StepWork, rates: MachineRates) -> float:
    """Seconds of ``work``'s collectives a step at the rates' node and network GB/s; a
    ``ConfigError`` where the work has collectives the rates did not measure."""
    wanted = (
        ("node_gather_bytes", "node_gather_gbps", "--node-gbps"),
        ("node_reduce_bytes", "node_reduce_gbps", "--node-gbps"),
        ("network_bytes", "network_gbps", "--network-gbps"),
    )
    seconds = 0.0
    for bytes_field, rate_field, flag in wanted:
        nbytes = getattr(work, bytes_field)
        if not nbytes:
            continue
        gbps = getattr(rates, rate_field)
        if not gbps:
            where = "between nodes" if flag == "--network-gbps" else "between the GPUs of a node"
            raise ConfigError(
                f"rates {rates.name!r} measured no collectives {where}: give {flag} (GB/s a rank sends in a ring "
                f"collective), or run `hybridps calibrate` on a node with several GPUs"
            )
        seconds += nbytes * work.micro_batches / (gbps * 1e9)
    return seconds + work.node_collectives * work.micro_batches * rates.node_collective_s


def compose(parts: Mapping[str, float], *, simulated_gpu: bool, overlap_step: bool = False) -> tuple[float, str, str]:
    """(step seconds, the bounding part, the rule) of ``parts`` ([Note: the speed model]);
    ``overlap_step``: the CPU step beside the next forward (a real GPU only)."""
    if simulated_gpu:
        rule = (
            "compute + host + link + host_memory + collectives + cpu_adam + gpu_adam + disk + device_copies "
            "(a simulated GPU: every part on the host's cores)"
        )
        contributions = dict(parts)
    else:
        rule = "max(compute, host, link, collectives) + host_memory + cpu_adam + gpu_adam + disk"
        overlapped = max(("compute", "host", "link", "collectives"), key=lambda k: parts.get(k, 0.0))
        # device_copies: nothing on a real GPU (``part_seconds``)
        serial = ("host_memory", "cpu_adam", "gpu_adam", "disk")
        contributions = {overlapped: parts.get(overlapped, 0.0), **{k: parts.get(k, 0.0) for k in serial}}
        if overlap_step:
            rule = (
                "max(compute, host, link, collectives) + host_memory "
                "+ max(0, cpu_adam - max(compute, host, link, collectives) / 3) + gpu_adam + disk"
            )
            contributions["cpu_adam"] = max(0.0, parts["cpu_adam"] - contributions[overlapped] / 3)
    step = sum(contributions.values())
    bound = max(contributions, key=lambda k: contributions[k])
    return step, bound, rule


def predict_speed(
    sim: Simulation,
    model: Any,
    rates: MachineRates,
    *,
    micro_batches: int = 1,
    disk_gbps: tuple[float, float] | None = None,
    overlap_step: bool | None = None,
) -> SpeedPrediction:
    """The steady step of ``sim`` (``model``'s shape, ``micro_batches`` accumulated per
    optimizer step) on the machine of ``rates``; ``overlap_step`` None: as ``Config``'s
    "auto" (on a real GPU with grad reuse and one micro-batch)."""
    work = step_work(sim, model, micro_batches=micro_batches)
    if overlap_step is None:
        overlap_step = sim.grad_reuse and micro_batches == 1
    return predict_work(work, rates, disk_gbps=disk_gbps, overlap_step=overlap_step)


def predict_work(
    work: StepWork,
    rates: MachineRates,
    *,
    disk_gbps: tuple[float, float] | None = None,
    overlap_step: bool = False,
) -> SpeedPrediction:
    """``predict_speed`` of a ``StepWork`` (the arithmetic alone, for synthetic work)."""
    parts = part_seconds(work, rates, disk_gbps=disk_gbps)
    step, bound, rule = compose(parts, simulated_gpu=rates.simulated_gpu, overlap_step=overlap_step)
    return SpeedPrediction(
        rates=rates.name,
        predicted_step_seconds=step,
        tokens_per_second=work.tokens / step,
        model_tflops=work.model_flops / step / 1e12,
        bound_by=bound,
        parts=parts,
        composition=rule,
        tokens_per_step=work.tokens,
        micro_batches=work.micro_batches,
        model_flops_per_step=work.model_flops,
        flops_per_step=work.step_flops,
        compute_tflops_used=rates.tflops_at(work.d_model, work.micro_batch_tokens, work.precision),
        head_seconds=head_seconds(work, rates),
        h2d_bytes_per_step=work.h2d_bytes * work.micro_batches,
        d2h_bytes_per_step=work.d2h_bytes * work.micro_batches,
        cpu_step_params=work.cpu_step_params,
        gpu_step_params=work.gpu_step_params,
        node_collective_bytes_per_step=(work.node_gather_bytes + work.node_reduce_bytes) * work.micro_batches,
        network_bytes_per_step=work.network_bytes * work.micro_batches,
        caveats=precision_caveats(work, rates)
        + optimizer_caveats(work, rates)
        + beyond_gpt_caveats(work, rates)
        + counted_caveats(work, rates),
    )


def precision_caveats(work: StepWork, rates: MachineRates) -> tuple[str, ...]:
    """Why the compute part may be off: ``work``'s precision is one ``rates`` never timed
    ([Note: compute by precision])."""
    if rates.measured_in(work.precision):
        return ()
    return (
        f"compute in {work.precision} at the {rates.compute_precision} rates of {rates.name!r}, which timed no "
        f"{work.precision} (run `hybridps calibrate` again on the machine)",
    )


def optimizer_caveats(work: StepWork, rates: MachineRates) -> tuple[str, ...]:
    """Why the optimizer's parts may be off: ``work``'s optimizer is one the rates never timed,
    or its rows step on a real GPU, whose rate is fused AdamW's ([Note: every optimizer's step]
    in calibrate_optimizers.py)."""
    if work.optimizer in ADAM_KERNEL_OPTIMIZERS:
        return ()
    if rates.optimizer_speed_at(work.optimizer, work.d_model) is None:
        return (
            f"the {work.optimizer} step at fused AdamW's rate: rates {rates.name!r} timed no {work.optimizer} (run "
            f"`hybridps calibrate` again on the machine)",
        )
    if work.gpu_step_params and not rates.simulated_gpu:
        return (f"the GPU's {work.optimizer} step at its fused AdamW's rate (no optimizer but Adam is timed on a GPU)",)
    return ()


def beyond_gpt_caveats(work: StepWork, rates: MachineRates) -> tuple[str, ...]:
    """Why the compute part may be off: ``work``'s family runs work outside its matmuls the GPT
    of its shape does not, and the rates timed no such op ([Note: the work outside the
    matmuls] in op_tally.py)."""
    if not work.beyond_gpt or rates.elementwise_s_per_byte:
        return ()
    gb = work.beyond_gpt_bytes * work.micro_batches / 1e9
    against = "the block the rates timed" if work.counted is not None else "the GPT of its shape"
    return (
        f"the model's kernels outside its matmuls ({gb:+.2f} GB a step read and written against {against}) "
        f"not counted: rates {rates.name!r} timed no such op (run `hybridps calibrate` on the machine)",
    )


def counted_caveats(work: StepWork, rates: MachineRates) -> tuple[str, ...]:
    """How a model of no GPT shape was timed ([Note: a model's own shape] in counted_work.py)."""
    c = work.counted
    if c is None:
        return ()
    attention = (
        f", its {c.forward_activation_flops / 1e9:.3g} GFLOPs of activation products at the attention's rate of head size "
        f"{c.head_dim} and sequence {c.seq_len}"
        if c.forward_activation_flops
        else ""
    )
    out = (
        f"FLOPs counted on meta, not by the GPT's formula (no GPT shape, experts it would count all of, or frozen weights it would count trained): the "
        f"forward's {c.forward_dense_flops / 1e9:.3g} GFLOPs a micro-batch in "
        f"matmuls with a param at the block rate of width {c.width} and {c.rows} rows{attention}; tokens are those rows",
    )
    if c.forward_conv_flops and conv_seconds(work, rates) is None:
        out += (
            f"its convolutions ({c.forward_conv_flops / c.forward_dense_flops:.0%} of those FLOPs) at the block rate: "
            f"rates {rates.name!r} timed no convolution (run `hybridps calibrate` on the machine)",
        )
    elif c.forward_conv_flops:
        out += (
            f"its convolutions ({c.forward_conv_flops / c.forward_dense_flops:.0%} of those FLOPs) at the rate of one "
            "3 x 3 convolution",
        )
    if c.forward_narrow_flops:
        share = sum(f for _, f in c.forward_narrow_flops) / c.forward_dense_flops
        widths = ", ".join(str(w) for w, _ in c.forward_narrow_flops)
        out += (
            f"its matmuls of width {widths} ({share:.1%} of those FLOPs, as LoRA's adapters) at the block rate: rates "
            f"{rates.name!r} timed no narrow matmul (run `hybridps calibrate` on the machine)"
            if narrow_seconds(work, rates) is None
            else f"its matmuls of width {widths} ({share:.1%} of those FLOPs, as LoRA's adapters) at an adapter's timed rate",
        )
    return out
