"""Planning one request: whether the model fits the node, and the largest member of its
family that does, for HybridPS and for the peers.

Owns ``plan()`` (which builds a ``request.PlanRequest`` and runs it), the verdict on one
member of the family (``Planner.evaluate``: simulated, and for multi-rank jobs its derived
share checked against the node), the refusal of a shard-group layout whose gathered
chunk groups cannot fit the GPU (``Planner.refusal``, the client's registration rule), the
transient allowance for real GPUs (learnt from a one-layer member before the planned size),
the disk tier's figures of a plan and putting the report together (``Planner.run``).

Does not own the inputs (``request``), the search for the largest ``n_layer`` (``largest``,
a part of ``Planner``), the simulation itself (``simulation``), the multi-rank derivation
(``ranks``), the shard-group layout and its communication (``sharding``), the peers'
formulas (``peers``), the host peak at init (``host_peak``) or how the report prints
(``report``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from hybridps.common.config import PRECISIONS
from hybridps.common.devices import NVME
from hybridps.common.errors import ConfigError
from hybridps.common.units import format_bytes
from hybridps.planner.chunk_rows import chunk_rows
from hybridps.planner.defaults import DEEPSPEED_BUFFER_FACTOR, DEFAULT_MAX_PROBES
from hybridps.planner.host_peak import InitPeak, init_peak
from hybridps.planner.largest import LargestModelSearch
from hybridps.planner.model import PlannedModel
from hybridps.planner.node import NodeSpec
from hybridps.planner.optimizers import ADAM_KERNEL_OPTIMIZERS, DEFAULT_OPTIMIZER
from hybridps.planner.peers import peer_plans
from hybridps.planner.rank_speed import rank_step_work
from hybridps.planner.ranks import RankShare, derive_rank_share, gathered_at
from hybridps.planner.rates import MachineRates
from hybridps.planner.report import RULE, HybridPSPlan, LargestModel, PlanReport
from hybridps.planner.request import Evaluation, PlanRequest
from hybridps.planner.sharding import Communication, ShardGroupTooLargeError, smaller_shard_sizes
from hybridps.planner.simulation import DeviceFigures, Simulation, simulate
from hybridps.planner.speed import SpeedPrediction, predict_speed, predict_work

#: the package's logger ("hybridps.planner"), whose level ``hybridps plan -v`` sets
logger = logging.getLogger("hybridps.planner")

#: CPU capacity given to the simulated rank of a multi-rank job: that rank holds the whole
#: model (the sharded layout is derived afterwards), so its CPU must not be what fails.
UNBOUNDED_CPU_BYTES = 2**50


def plan(
    model: PlannedModel,
    node: NodeSpec | None = None,
    *,
    gpus: str | None = None,
    cpu: str | int | None = None,
    ranks_per_node: int | None = None,
    nodes: int | None = None,
    nvme: str | int | None = None,
    nvme_read_gbps: float | None = None,
    nvme_write_gbps: float | None = None,
    precision: str = "fp16",
    grad_reuse: bool = True,
    optimizer_states: str = "fp32",
    optimizer: str = DEFAULT_OPTIMIZER,
    margin: int | str = 0,
    chunk_size: int | None = None,
    casts_on_gpu: bool | str = "auto",
    simulated_gpus: bool = False,
    iterations: int | None = None,
    search_largest: bool = True,
    max_layers: int | None = None,
    max_probes: int = DEFAULT_MAX_PROBES,
    search_seconds: float | None = None,
    deepspeed_buffer_factor: float = DEEPSPEED_BUFFER_FACTOR,
    shard_group_size: int | str = "node",
    rates: MachineRates | None = None,
    micro_batches: int = 1,
) -> PlanReport:
    """Plan training ``model`` (a ``GPTShape``, ``ModelFactory`` or ``HFCausalLMFamily``) on
    ``node``, or on the node described by ``gpus`` (default "1x80GiB"), ``cpu`` (default
    "128GiB"), ``ranks_per_node`` (default: one per GPU), ``nodes`` (default 1) and ``nvme``
    (a disk tier per node, e.g. "2TiB", reading ``nvme_read_gbps`` and writing
    ``nvme_write_gbps`` GB/s; default none), with
    ``shard_group_size`` ranks sharing one copy of the model data ("node", "world" or a number
    of ranks dividing the world; see ``Config.shard_group_size``), trained with the optimizer
    named ``optimizer`` ("adamw", "sgd", ...: ``optimizers.OPTIMIZER_NAMES``; its states' rows
    are the model data's), Adam's moments stored as ``optimizer_states`` ("fp32", or "int8":
    ``Config.optimizer_states``, Adam and AdamW only), ``casts_on_gpu`` as
    ``Config.casts_on_gpu`` says ("auto": as a run on the node resolves it). With ``rates`` (a
    ``MachineRates``: ``rates.load_rates``) the report predicts the steady step's seconds,
    ``micro_batches`` accumulated per optimizer step (``speed``).

    Runs ``iterations`` training iterations of the real engine under ``simulate="meta"``
    (nothing is allocated), derives per-rank figures for multi-rank jobs, applies the peers'
    published placement rules and, with ``search_largest``, finds the largest ``n_layer`` of
    the family that fits for each of them. Raises ``ShardGroupTooLargeError`` when the model's
    gathered chunk groups cannot fit the GPU with that shard group (the client would refuse it).
    """
    described = dict(gpus=gpus, cpu=cpu, ranks_per_node=ranks_per_node, nodes=nodes, nvme=nvme)
    described.update(nvme_read_gbps=nvme_read_gbps, nvme_write_gbps=nvme_write_gbps)
    request = PlanRequest(
        model=model,
        node=_node_of(node, described),
        precision=precision,
        grad_reuse=grad_reuse,
        optimizer_states=optimizer_states,
        optimizer=optimizer,
        margin_bytes=margin,
        chunk_size=chunk_size,
        casts_on_gpu=casts_on_gpu,
        simulated_gpus=simulated_gpus,
        iterations=iterations,
        search_largest=search_largest,
        max_layers=max_layers,
        max_probes=max_probes,
        search_seconds=search_seconds,
        deepspeed_buffer_factor=deepspeed_buffer_factor,
        shard_group_size=shard_group_size,
        rates=rates,
        micro_batches=micro_batches,
    )
    return Planner(request).run()


def _node_of(node: NodeSpec | None, described: dict) -> NodeSpec:
    """The node ``plan`` plans on: ``node``, or the one its keyword arguments describe
    (``described``: gpus, cpu, ranks_per_node, nodes, nvme and its bandwidths; defaults one
    80 GiB GPU and 128 GiB of CPU); both at once is refused."""
    if node is not None:
        if any(v is not None for v in described.values()):
            given = ", ".join(k for k, v in described.items() if v is not None)
            raise ConfigError(f"plan() got node={node!r} and also {given}; describe the node once, one way or the other")
        return node
    bandwidth = {k: v for k, v in described.items() if k.endswith("_gbps") and v is not None}
    return NodeSpec.parse(
        described["gpus"] or "1x80GiB",
        "128GiB" if described["cpu"] is None else described["cpu"],
        ranks_per_node=described["ranks_per_node"],
        nodes=described["nodes"] or 1,
        nvme=described["nvme"],
        **bandwidth,
    )


class Planner(LargestModelSearch):
    """Runs the simulations of one request, caching one per layer count.

    ``simulations``, when given, is a cache shared with other planners of the same model:
    a simulation depends on the GPU, the CPU it was given, the margin and the training
    settings, not on the number of nodes or the shard group (the multi-rank share is derived
    from it), so a comparison of layouts simulates each size once."""

    def __init__(self, request: PlanRequest, simulations: dict[tuple, Simulation] | None = None):
        self.request = request
        self.node = request.node
        self.sharding = request.sharding
        self.simulations = {} if simulations is None else simulations
        self.evals: dict[int, Evaluation] = {}
        self.sim_seconds = 0.0
        #: GPU bytes a real GPU holds beyond what autograd saves: see ``transient_allowance``
        self.transient_bytes = 0

    @property
    def margin_bytes(self) -> int:
        """The margin every figure is planned with: the user's, plus the transient allowance."""
        return self.request.margin_bytes + self.transient_bytes

    def transient_allowance(self, sim: Simulation) -> int:
        """GPU bytes a real GPU holds at its peak beyond the bytes autograd saves: the
        simulation counts saved tensors only, while a real GPU also holds an op's output before
        it is saved or freed, the gradient of each activation during backward, cuBLAS
        workspaces and allocator slack. One more copy of the largest saved tensor stands for
        them.

        [Note: calibrated on an H100]
        GPT d_model 2048, 8 x 1024 tokens, bf16, checkpointing: the real traced non-model peak
        was 1.31 GB (170 layers) and 1.16 GB (185 layers) above the simulated one; the
        largest saved tensor (the fp32 logits) is 1.65 GB. Without the allowance the plan said
        200 layers and the run ran out of CPU memory (the GPU held fewer chunks than planned);
        185 layers trained. Simulated GPUs count exactly what the simulation counts: no
        allowance."""
        return 0 if self.request.simulated_gpus else sim.largest_saved_bytes

    # -- one member ----------------------------------------------------------------------

    def _simulate(self, n_layer: int, margin_bytes: int) -> Simulation:
        """The simulation of ``n_layer`` planned with ``margin_bytes``, from the cache when
        it ran before. The simulated rank of a multi-rank job gets an unbounded CPU and no
        disk (its share of the node's CPU and disk is derived); one rank alone gets both."""
        req, node = self.request, self.node
        multi = node.world_size > 1
        cpu_bytes = UNBOUNDED_CPU_BYTES if multi else node.cpu_bytes
        nvme_bytes = 0 if multi else node.nvme_bytes
        key = (n_layer, node.gpu_bytes, cpu_bytes, margin_bytes, req.precision, req.grad_reuse, req.chunk_size,
               req.simulated_gpus, req.iterations)  # fmt: skip
        if nvme_bytes:  # a key without a disk stays as it was (simulations shared by compare)
            key += (nvme_bytes,)
        if req.optimizer_states != "fp32":  # likewise with exact moments
            key += (req.optimizer_states,)
        if req.optimizer != DEFAULT_OPTIMIZER:  # and with AdamW
            key += (req.optimizer,)
        if req.casts_on_gpu != "auto":  # and with the casts as a run decides them
            key += (req.casts_on_gpu,)
        if key in self.simulations:
            return self.simulations[key]
        sim = simulate(
            req.model.with_layers(n_layer),
            gpu_bytes=node.gpu_bytes,
            cpu_bytes=cpu_bytes,
            precision=req.precision,
            grad_reuse=req.grad_reuse,
            margin_bytes=margin_bytes,
            chunk_size=req.chunk_size,
            iterations=req.iterations,
            nvme_bytes=nvme_bytes,
            optimizer_states=req.optimizer_states,
            optimizer=req.optimizer,
            # "auto" as a run on such GPUs resolves it: on for a real node, off on simulated GPUs
            casts_on_gpu=False if req.simulated_gpus and req.casts_on_gpu == "auto" else req.casts_on_gpu,
        )
        self.sim_seconds += sim.seconds
        self.simulations[key] = sim
        return sim

    def learn_transient_allowance(self) -> None:
        """Learn the real-GPU transient allowance from the smallest member before the first
        size is planned, so that size is simulated once instead of twice (first without the
        allowance, then with it: see ``evaluate``).

        [Note: the allowance learnt from one layer]
        The allowance is the largest single tensor autograd saves (``transient_allowance``):
        for the families planned here the logits or another per-batch tensor, whose size does
        not depend on the depth. One layer shows it in a fraction of a second, where a
        simulation of the planned size (with a disk tier, minutes) would otherwise run twice.
        The figures are the same: ``run`` simulates the planned size with exactly its own
        allowance, redoing it in the rare family whose one-layer member saves a larger tensor."""
        if self.request.simulated_gpus or self.transient_bytes:
            return
        allowance = self.transient_allowance(self._simulate(1, self.margin_bytes))
        if allowance and self.request.margin_bytes + allowance < self.node.gpu_bytes:
            self.transient_bytes = allowance

    def evaluate(self, n_layer: int) -> Evaluation:
        if n_layer in self.evals:
            return self.evals[n_layer]
        req, node = self.request, self.node
        multi = node.world_size > 1

        def run() -> Simulation:
            return self._simulate(n_layer, self.margin_bytes)

        sim = run()
        # The allowance is learnt from the first simulation (the largest saved tensor rarely
        # depends on the depth); a member that shows a larger one is simulated again with it.
        allowance = self.transient_allowance(sim)
        if allowance > self.transient_bytes and self.margin_bytes - self.transient_bytes + allowance < node.gpu_bytes:
            self.transient_bytes = allowance
            self.evals.clear()  # earlier members were planned with a smaller margin
            sim = run()
        share = None
        reasons = [] if sim.completed else [sim.failure or "the simulation failed"]
        if multi and sim.completed:
            share = derive_rank_share(
                sim,
                node,
                shard_group_size=req.shard_group_size,
                margin_bytes=self.margin_bytes,
            )
            if share.gpu_need_bytes > node.gpu_bytes:
                reasons.append(
                    f"GPU per rank needs {format_bytes(share.gpu_need_bytes)} (activations "
                    f"{format_bytes(sim.non_model_peak_bytes)} + gathered chunk groups of {share.gathered_module!r} "
                    f"{format_bytes(share.gathered_bytes)}, {share.sharding.shard_size} chunks per group"
                    f"{' + margin' if self.margin_bytes else ''}) of {format_bytes(node.gpu_bytes)} (derived)"
                )
            if share.cpu_node_bytes > node.cpu_bytes:
                reasons.append(
                    f"CPU of a node needs {format_bytes(share.cpu_node_bytes)} (what {node.ranks_per_node} ranks' shares "
                    f"leave beside their GPUs) of {format_bytes(node.cpu_bytes)} (derived)"
                )
            if share.nvme_node_bytes > node.nvme_bytes:
                reasons.append(
                    f"disk of a node needs {format_bytes(share.nvme_node_bytes)} (what {node.ranks_per_node} ranks' shares "
                    f"leave beside their GPUs and the node's {format_bytes(node.cpu_bytes)} CPU) of "
                    f"{format_bytes(node.nvme_bytes)} (derived)"
                )
            if node.has_disk and share.cpu_step_bytes > node.cpu_bytes // node.ranks_per_node:
                reasons.append(
                    f"with a disk tier each chunk's optimizer step runs on the CPU: the largest holds "
                    f"{format_bytes(share.cpu_step_bytes)} at once, above a rank's slice of the CPU "
                    f"({format_bytes(node.cpu_bytes // node.ranks_per_node)}); the client refuses it at registration (derived)"
                )
        ev = Evaluation(sim=sim, share=share, fits=not reasons, reason="; ".join(reasons))
        # a simulation shared by several layouts (compare) ran once; its seconds are that run's
        logger.info("%d layers (simulation %.1f s): %s", n_layer, sim.seconds, "fits" if ev.fits else ev.reason)
        self.evals[n_layer] = ev
        return ev

    # -- the whole plan ------------------------------------------------------------------

    def refusal(self, ev: Evaluation) -> str | None:
        """Why the client would refuse this model with this shard group at registration
        (``ParamRegistry._check_fits``, params/registry.py: a module computes with its whole
        chunk groups gathered, and they must fit the GPU's capacity minus the margin), with the
        fix; None when it would not."""
        share, node, req = ev.share, self.node, self.request
        budget = node.gpu_bytes - req.margin_bytes
        if share is None or share.gathered_bytes <= budget:
            return None
        sh = share.sharding
        what = "param chunks" if req.grad_reuse else "param + grad chunks"
        fixes = []
        for size in smaller_shard_sizes(sh):
            gathered, _ = gathered_at(ev.sim, node, size, margin_bytes=self.margin_bytes)
            if gathered <= budget:
                named = ' ("node")' if size == node.ranks_per_node else ""
                fixes.append(
                    f"a smaller shard group (--shard-group-size {size}{named}: the largest module gathers "
                    f"{format_bytes(gathered)})"
                )
                break
        size = share.chunk_size_elements // 2
        for _ in range(8):  # halving the chunk: more, narrower groups (oversize params stay whole)
            size -= size % ev.sim.alignment
            if size < ev.sim.alignment:
                break
            gathered, _ = gathered_at(ev.sim, node, sh.shard_size, margin_bytes=self.margin_bytes, chunk_size=size)
            if gathered <= budget:
                fixes.append(f"smaller chunks (--chunk-size {size}: the largest module gathers {format_bytes(gathered)})")
                break
            size //= 2
        if not fixes:
            fix = "No smaller shard group fits, and smaller chunks do not help; plan on GPUs with more memory."
        else:
            fix = "Use " + ", or ".join(fixes) + "."
            if len(fixes) == 1 and fixes[0].startswith("a smaller"):
                fix += (
                    " Smaller chunks do not help: the params of those groups are larger than a chunk and each is gathered whole."
                )
        return (
            f"{sh.describe()}: a chunk group gathers {format_bytes(share.group_bytes)} ({sh.shard_size} x "
            f"{format_bytes(share.param_chunk_bytes)} param chunks; the largest group, with chunks of params larger "
            f"than a chunk, {format_bytes(share.largest_group_bytes)}), and module {share.gathered_module!r} computes "
            f"with {format_bytes(share.gathered_bytes)} of gathered {what}, above the {format_bytes(node.gpu_bytes)} "
            f"GPU{f' minus the {format_bytes(req.margin_bytes)} margin' if req.margin_bytes else ''}: the client "
            f"refuses this layout at registration. {fix}"
        )

    def _refuse_chunk_groups_up_front(self) -> None:
        """With a chunk size given, one chunk group's bytes are known before any simulation."""
        req, node, sh = self.request, self.node, self.sharding
        if req.chunk_size is None or sh.shard_size == 1:
            return
        per_elem = PRECISIONS[req.precision].itemsize * (1 if req.grad_reuse else 2)
        group = sh.shard_size * req.chunk_size * per_elem
        if group > node.gpu_bytes - req.margin_bytes and req.refuse_unfit_layout:
            fits = [s for s in smaller_shard_sizes(sh) if s * req.chunk_size * per_elem <= node.gpu_bytes - req.margin_bytes]
            raise ShardGroupTooLargeError(
                f"{sh.describe()}: one chunk group gathers {format_bytes(group)} ({sh.shard_size} x "
                f"{format_bytes(req.chunk_size * per_elem)} chunks of {req.chunk_size} elements), above the "
                f"{format_bytes(node.gpu_bytes)} GPU{f' minus the {format_bytes(req.margin_bytes)} margin' if req.margin_bytes else ''}: "
                f"the client refuses this layout at registration. Use a smaller shard group"
                + (f" (--shard-group-size {fits[0]} or less)" if fits else "")
                + f" or smaller chunks (--chunk-size {max(1, (node.gpu_bytes - req.margin_bytes) // (4 * sh.shard_size * per_elem))} "
                f"leaves room for four groups)"
            )

    def run(self) -> PlanReport:
        req, node = self.request, self.node
        start = time.perf_counter()
        self._refuse_chunk_groups_up_front()
        n0 = req.model.n_layer
        self.learn_transient_allowance()
        ev = self.evaluate(n0)
        if self.transient_allowance(ev.sim) < self.transient_bytes:
            # the one-layer member saved a larger tensor than this size: plan it with its own
            # allowance, as without the one-layer simulation ([Note: the allowance learnt from one layer])
            self.transient_bytes = self.transient_allowance(ev.sim)
            self.evals.clear()
            ev = self.evaluate(n0)
        refused = self.refusal(ev)
        if refused is not None and req.refuse_unfit_layout:
            raise ShardGroupTooLargeError(refused)
        first_sim_seconds = self.sim_seconds
        search_start = time.perf_counter()
        largest: LargestModel | None = None
        if req.search_largest:
            largest = self.search_largest()
        search_seconds = time.perf_counter() - search_start
        activation = self.activation_bytes(n0)
        peers = peer_plans(
            ev.sim.n_params, ev.sim.largest_layer_params, activation, node, self.margin_bytes, req.deepspeed_buffer_factor
        )
        if req.search_largest:
            peers = [dataclasses.replace(p, largest=self.peer_largest(p.name)) for p in peers]
        hybrid = self._hybridps_plan(ev, largest, refused)
        notes = list(self._notes(ev, activation))
        speed, speed_note = self._speed(ev)
        method = None
        if req.search_largest:
            method = (
                "n_layer at fixed width and batch: HybridPS by simulating candidates near a linear prediction until "
                "n_layer fits and n_layer + 1 does not; peers by their published rules over n_layer, with activations "
                "interpolated linearly between simulated sizes"
            )
            if req.search_seconds is not None and not math.isinf(req.search_seconds):
                method += (
                    f"; a candidate whose simulation is predicted to take longer than the {req.search_seconds:g} s the "
                    f"search may spend (--search-seconds) is not simulated, and the largest is then the linear rule's "
                    f"(every need on the line through two simulated sizes fits at n_layer and not at n_layer + 1; "
                    f'method "{RULE}", unconfirmed)'
                )
            if node.has_disk and node.world_size == 1:
                method += (
                    "; with the disk tier its capacity adds to memory's: model data + activations + margin against "
                    "GPU + CPU + disk"
                )
        return PlanReport(
            model=req.model.describe(),
            n_params=ev.sim.n_params,
            precision=req.precision,
            grad_reuse=req.grad_reuse,
            optimizer_states=req.optimizer_states,
            optimizer=req.optimizer,
            optimizer_state_rows=ev.sim.state_rows,
            optimizer_side_states=ev.sim.side_states,
            optimizer_state_bytes_per_param=ev.sim.state_bytes_per_param,
            margin_bytes=req.margin_bytes,
            transient_allowance_bytes=self.transient_bytes,
            iterations=req.iterations,
            node=node,
            hybridps=hybrid,
            peers=tuple(peers),
            largest_model_method=method,
            seconds={
                "total": time.perf_counter() - start,
                "simulation": first_sim_seconds,
                "search": search_seconds,
                "simulations_total": self.sim_seconds,
            },
            notes=tuple(notes),
            speed=speed,
            speed_note=speed_note,
        )

    def _speed(self, ev: Evaluation) -> tuple[SpeedPrediction | None, str]:
        """The predicted steady step of ``ev`` on the request's rates, or why there is none."""
        req, node = self.request, self.node
        if req.rates is None:
            return None, "no rates: run `hybridps calibrate`, or give --rates h100, h200 or a file"
        if not ev.sim.completed:  # why, in the words of what stopped it (it does not fit)
            return None, f"the simulation did not finish ({ev.sim.failure or 'it failed'}): no steady step to time"
        disk = (node.nvme_read_gbps, node.nvme_write_gbps) if node.has_disk else None
        if ev.share is None:
            try:
                speed = predict_speed(ev.sim, req.model, req.rates, micro_batches=req.micro_batches, disk_gbps=disk)
            except ConfigError as exc:
                return None, str(exc)
            return speed, f"rates {req.rates.name} ({req.rates.device}; {req.rates.measured}); {speed.composition}"
        # [Note: a rank's step] (rank_speed.py): steps beside the next forward are for one rank
        try:
            work = rank_step_work(ev.sim, req.model, ev.share, gpu_bytes=node.gpu_bytes, micro_batches=req.micro_batches)
            speed = predict_work(work, req.rates, disk_gbps=disk, overlap_step=False)
        except ConfigError as exc:
            return None, str(exc)
        return speed, (
            f"rates {req.rates.name} ({req.rates.device}; {req.rates.measured}); one rank of {node.world_size}, its "
            f"share and collectives derived; {speed.composition}"
        )

    def _hybridps_plan(self, ev: Evaluation, largest: LargestModel | None, refused: str | None) -> HybridPSPlan:
        """HybridPS's figures for ``ev``: the simulated rank's own, or for a multi-rank job the
        derived share's (the layout the clients use for the shard group)."""
        sim, share, node = ev.sim, ev.share, self.node
        itemsize = PRECISIONS[self.request.precision].itemsize
        total_elems = sum(sim.chunk_capacities)
        if share is None:
            chunk_elems, chunks = sim.chunk_size_elements, len(sim.chunk_capacities)
            padding = sim.padding_elements / total_elems if total_elems else 0.0
            working_set, working_module = sim.min_compute_bytes, sim.min_compute_module
        else:  # the layout the clients use for the shard group
            chunk_elems, chunks, padding = share.chunk_size_elements, share.chunks, share.padding_fraction
            working_set, working_module = share.gathered_bytes, share.gathered_module
        chunk_bytes = (chunk_elems or 0) * itemsize
        init = init_peak(sim, share, node, simulated_gpus=self.request.simulated_gpus) if sim.completed else None
        common = dict(
            fits=ev.fits,
            reason=ev.reason,
            chunk_size_elements=chunk_elems,
            chunk_bytes=chunk_bytes,
            chunks=chunks,
            padding_fraction=padding,
            model_data_bytes_per_param=sim.model_data_bytes_per_param,
            min_compute_bytes=working_set,
            min_compute_module=working_module,
            non_model_peak_bytes=sim.non_model_peak_bytes,
            gpu_need_bytes=share.gpu_need_bytes
            if share
            else sim.non_model_peak_bytes + sim.min_compute_bytes + self.margin_bytes,
            simulation_failure=sim.failure,
            largest=largest,
            warnings=tuple(_plan_warnings(sim, share, init, node)),
            init=init,
            sharding=self.sharding,
            refused=refused,
            **self._disk_figures(sim, share),
        )
        if share is None:
            return HybridPSPlan(
                derived=False,
                group_bytes=chunk_bytes,
                communication=Communication.of(total_elems * itemsize, self.sharding),
                model_data_bytes=sim.model_data_bytes,
                gpu=sim.gpu,
                cpu=sim.cpu,
                cpu_node_bytes=sim.cpu.peak_bytes if sim.cpu else 0,
                moved_bytes_per_step=sim.moved_bytes_per_step,
                **common,
            )
        return HybridPSPlan(
            derived=True,
            group_bytes=share.group_bytes,
            communication=share.communication,
            model_data_bytes=share.owned_bytes,
            gpu=_derived_gpu(sim, share, node, self.margin_bytes),
            cpu=_derived_cpu(share, node),
            cpu_node_bytes=share.cpu_node_bytes,
            moved_bytes_per_step=share.moved_bytes_per_step,
            rank_share=share,
            **common,
        )

    def _disk_figures(self, sim: Simulation, share: RankShare | None) -> dict:
        """The plan's disk-tier fields (``HybridPSPlan.nvme`` ...): the simulated rank's, or a
        multi-rank job's derived ones; none without a disk tier or a finished simulation."""
        node = self.node
        if not node.has_disk or not sim.completed:
            return {}
        if share is None:
            disk = sim.nvme
            node_bytes = disk.peak_bytes if disk else 0
            read, write = sim.nvme_read_bytes_per_step, sim.nvme_write_bytes_per_step
        else:
            disk = DeviceFigures(
                device=NVME,
                capacity_bytes=node.nvme_bytes // node.ranks_per_node,
                model_data_bytes=share.nvme_bytes,
                peak_bytes=share.nvme_bytes,
                derived=True,
            )
            node_bytes = share.nvme_node_bytes
            # the disk is the node's: its ranks' reads and writes share its bandwidth, so the
            # bytes (and seconds) per step are the node's, each byte on it read and written once
            read = write = share.nvme_node_bytes
        return dict(
            nvme=disk,
            nvme_node_bytes=node_bytes,
            nvme_read_bytes_per_step=read,
            nvme_write_bytes_per_step=write,
            # GB/s are 1e9 B/s, as the drives' data sheets count them
            nvme_read_s_per_step=read / (node.nvme_read_gbps * 1e9),
            nvme_write_s_per_step=write / (node.nvme_write_gbps * 1e9),
        )

    def _notes(self, ev: Evaluation, activation: int) -> list[str]:
        if self.transient_bytes:
            notes = [
                "activations are the bytes autograd saves for backward, measured on the meta device; for what a real "
                f"GPU holds beyond them (unsaved outputs, activation grads, workspaces) "
                f"{format_bytes(self.transient_bytes)} (one more largest saved tensor) is planned on top of the "
                "margin; other processes and the CUDA context are not included (use --margin for them)",
            ]
        else:
            notes = [
                "activations are the bytes autograd saves for backward, measured on the meta device; on simulated "
                "GPUs that is all the non-model memory a run counts",
            ]
        if getattr(self.request.model, "checkpoint", False):
            notes.append(
                "with activation checkpointing the recomputed block's activations during backward are not measured, "
                "so the activation figure is a lower bound"
            )
        if self.node.world_size > 1:
            notes.append(
                "multi-rank figures are derived (derive_rank_share), not simulated: the multi-rank layout and owner "
                "assignment of the client for the shard group, plus the gathered param chunks of the largest module's "
                "groups on the GPU"
            )
            notes.append(
                "communication is per rank per step, ring collectives, upper bounds (groups kept gathered from forward "
                "to backward save part of the second all-gather); CPU-GPU moves are not included"
            )
        if not ev.sim.completed and activation:
            notes.append("the simulation did not finish, so the peers' activations are extrapolated from smaller sizes")
        if self.request.precision == "fp32":
            notes.append("the DeepSpeed rules are written for 16-bit params with fp32 optimizer states; applied unchanged")
        if ev.sim.frozen_params:
            notes.append(_frozen_note(ev.sim, self.node.world_size))
        if self.request.optimizer_states != "fp32":
            notes.append(_compact_states_note(ev.sim))
        if self.request.optimizer not in ADAM_KERNEL_OPTIMIZERS:
            notes.append(_optimizer_note(ev.sim))
        if self.node.has_disk:
            node = self.node
            if node.world_size == 1:
                traffic = (
                    f"its bytes per step are those of iteration {self.request.iterations} (steady: the first replay "
                    f"still reads back what the warm-up left there)"
                )
            else:
                traffic = (
                    "with several ranks its figures are derived: the node's CPU holds what it can of its ranks' shares "
                    "and its disk the rest, and each byte of a rank's share on the disk is read once and written once "
                    "per step"
                )
            notes.append(
                f"the disk tier: chunks go to it when the CPU is full and come back through the CPU before their use; "
                f"{traffic}; its seconds per step are those bytes at the node's sustained {node.nvme_read_gbps:g} GB/s "
                f"read and {node.nvme_write_gbps:g} GB/s write (not overlapped with compute here); the peers are "
                f"planned without it (ZeRO-Infinity's NVMe offload is not modelled)"
            )
        return notes


def _frozen_note(sim: Simulation, world_size: int) -> str:
    """The note of a plan whose model has params no optimizer steps (LoRA's base weights)."""
    note = (
        f"{sim.frozen_params / max(1, sim.n_params):.1%} of the params are frozen (no optimizer steps them): they "
        f"are laid out in chunks of their own that keep the param row alone (and a master where the compute "
        f"precision would round their values); the DeepSpeed rules count every param as trained"
    )
    if world_size > 1:
        note += "; several ranks keep them in chunk groups of their own, gathered but never reduced"
    return note


def _compact_states_note(sim: Simulation) -> str:
    """The note of a plan with compact optimizer states: what its model data counts."""
    note = (
        f"optimizer states {sim.optimizer_states}: Adam's momentum and variance are each kept as a row of 8-bit codes "
        f"and an fp32 scale per 256 elements (Config.optimizer_states; every tensor starts on a 256-element boundary)"
    )
    size = sim.chunk_size_elements
    if size and sim.model_data_bytes:
        exact = chunk_rows(sim.precision, sim.grad_reuse, "fp32")
        note += (
            f": a chunk's rows take {sim.rows.bytes_per_element(sim.rows.kinds, size):.3f} B an element where fp32 "
            f"moments take {exact.bytes_per_element(exact.kinds, size):g}, {sim.model_data_bytes_per_param:.2f} B/param "
            f"of model data here, padding included"
        )
    return (
        note + "; the step is not exact (moments are re-quantized every step); the peers are planned with their own fp32 states"
    )


def _optimizer_note(sim: Simulation) -> str:
    """The note of a plan with another optimizer than Adam: what its model data counts."""
    note = (
        f"optimizer {sim.optimizer}: each of its states shaped like its param is a chunk row, 4 B a param (the "
        f"client's probe of its step, client/optim/state_layout.py)"
    )
    if sim.side_states:
        note += (
            f"; those kept beside the rows ({', '.join(sim.side_states)}: scalars, moments factored to a row and a "
            f"column per matrix, or states only a sliver of the params keep) are not counted"
        )
    if sim.param_state_kinds:
        note += (
            "; Muon steps the 2-D params and AdamW the rest, and a chunk books the rows of its params' optimizers: "
            "Muon's momentum_buffer shares the momentum row with AdamW's exp_avg, and the variance row is booked only "
            "in chunks holding AdamW's params"
        )
    return note + "; the peers are planned with their own rules (Adam's fp32 states)"


def _plan_warnings(sim: Simulation, share: RankShare | None, init: InitPeak | None, node: NodeSpec) -> list[str]:
    """What a plan that fits may still run into on ``node``: the warm-up's GPU peak above the
    GPU, the host peak of building and loading the model (``init``) above the host, and a
    rank ``share`` well above the even one."""
    warnings = []
    if sim.gpu and sim.peak_total_warmup_bytes > node.gpu_bytes:
        warnings.append(
            f"during the warm-up iteration chunks + activations reach {format_bytes(sim.peak_total_warmup_bytes)} on "
            f"a {format_bytes(node.gpu_bytes)} GPU (the budget follows activations only after warm-up); a real GPU "
            f"needs that headroom once, so consider a margin of "
            f"{format_bytes(sim.peak_total_warmup_bytes - node.gpu_bytes)}"
        )
    if init is not None and init.host_peak_bytes * node.ranks_per_node > node.cpu_bytes:
        warnings.append(
            f"building and loading the model takes {format_bytes(init.host_peak_bytes)} of host memory per rank "
            f"({format_bytes(init.host_peak_bytes * node.ranks_per_node)} for the node's {node.ranks_per_node} ranks) "
            f"of {format_bytes(node.cpu_bytes)}: build it under hybridps.meta_init() and load with "
            f"engine.load_pretrained, and leave the host that much"
        )
    if share is not None and share.imbalance > 1.1:
        warnings.append(
            f"the largest rank owns {format_bytes(share.owned_bytes)}, {share.imbalance:.2f}x the even share "
            f"{format_bytes(share.even_share_bytes)}: chunks are few per rank, or some tensors are larger than a "
            f"chunk; more ranks per chunk group or a smaller chunk_size evens the shares"
        )
    return warnings


def _derived_gpu(sim: Simulation, share: RankShare, node: NodeSpec, margin_bytes: int) -> DeviceFigures:
    """One rank's GPU figures derived from its ``share`` of a multi-rank job, planned with
    ``margin_bytes`` (the user's margin plus the transient allowance)."""
    return DeviceFigures(
        device="cuda:0",
        capacity_bytes=node.gpu_bytes,
        # what of the share (and the gathered set) the GPU keeps beside peak activations
        model_data_bytes=min(
            share.gpu_peak_bytes,
            share.owned_bytes + share.gathered_bytes,
            max(0, node.gpu_bytes - share.gpu_need_bytes) + share.gathered_bytes,
        ),
        peak_bytes=share.gpu_peak_bytes,
        non_model_peak_bytes=sim.non_model_peak_bytes,
        # the tidal budget lets chunks fill what activations leave, as on one rank
        peak_total_bytes=min(
            node.gpu_bytes - margin_bytes,
            share.owned_bytes + share.gathered_bytes + sim.non_model_peak_bytes,
        ),
        derived=True,
    )


def _derived_cpu(share: RankShare, node: NodeSpec) -> DeviceFigures:
    """One rank's CPU figures derived from its ``share``: its slice of the node's host memory."""
    return DeviceFigures(
        device="cpu",
        capacity_bytes=node.cpu_bytes // node.ranks_per_node,
        model_data_bytes=share.cpu_bytes,
        peak_bytes=share.cpu_bytes,
        derived=True,
    )
