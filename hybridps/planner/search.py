"""Planning one request: whether the model fits the node, and the largest member of its
family that does, for HybridPS and for the peers.

Owns the planner's inputs (``PlanRequest``, and ``plan()`` which builds one), the verdict on
one member of the family (``Planner.evaluate``: simulated, and for multi-rank jobs its
derived share checked against the node), the refusal of a shard-group layout whose gathered
chunk groups cannot fit the GPU (``Planner.refusal``, the client's registration rule), the
transient allowance for real GPUs, the search for the largest ``n_layer`` (simulated for
HybridPS, by the published rules for the peers) and putting the report together
(``Planner.run``).

Does not own the simulation itself (``simulation``), the multi-rank derivation (``ranks``),
the shard-group layout and its communication (``sharding``), the peers' formulas
(``peers``), the host peak at init (``host_peak``) or how the report prints (``report``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence

from hybridps.common.config import PRECISIONS
from hybridps.common.errors import ConfigError
from hybridps.common.units import format_bytes, parse_bytes
from hybridps.planner.defaults import DEEPSPEED_BUFFER_FACTOR, DEFAULT_MAX_LAYERS, DEFAULT_MAX_PROBES
from hybridps.planner.host_peak import InitPeak, init_peak
from hybridps.planner.model import PlannedModel
from hybridps.planner.node import NodeSpec
from hybridps.planner.peers import peer_bytes, peer_plans
from hybridps.planner.ranks import RankShare, derive_rank_share, gathered_at
from hybridps.planner.report import HybridPSPlan, LargestModel, PlanReport
from hybridps.planner.sharding import Communication, ShardGroupTooLargeError, Sharding, smaller_shard_sizes
from hybridps.planner.simulation import DeviceFigures, Simulation, simulate
from hybridps.planner.validation import check_positive_int

#: the package's logger ("hybridps.planner"), whose level ``hybridps plan -v`` sets
logger = logging.getLogger("hybridps.planner")

#: CPU capacity given to the simulated rank of a multi-rank job: that rank holds the whole
#: model (the sharded layout is derived afterwards), so its CPU must not be what fails.
UNBOUNDED_CPU_BYTES = 2**50


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """The planner's inputs, validated."""

    model: PlannedModel
    node: NodeSpec
    precision: str = "fp16"
    grad_reuse: bool = True
    margin_bytes: int = 0
    chunk_size: int | None = None
    #: plan a run on simulated GPUs (GPU chunks in host memory, the host arena unpinned, no
    #: real-GPU transients) instead of a real node
    simulated_gpus: bool = False
    iterations: int = 2
    search_largest: bool = True
    max_layers: int = DEFAULT_MAX_LAYERS
    max_probes: int = DEFAULT_MAX_PROBES
    deepspeed_buffer_factor: float = DEEPSPEED_BUFFER_FACTOR
    #: ranks sharing one copy of the model data (``Config.shard_group_size``): "node", "world"
    #: or a number of ranks dividing the world
    shard_group_size: int | str = "node"
    #: raise ``ShardGroupTooLargeError`` when the model's gathered chunk groups cannot fit the
    #: GPU (as the client does at registration); False: report it and plan on (comparisons)
    refuse_unfit_layout: bool = True

    def __post_init__(self) -> None:
        for attr in ("n_layer", "with_layers", "build", "inputs", "loss", "describe"):
            if not hasattr(self.model, attr):
                raise ConfigError(
                    f"model {self.model!r} lacks {attr!r}; pass a GPTShape(...) or a ModelFactory(build_fn=..., inputs_fn=..., n_layer=...)"
                )
        check_positive_int("n_layer", self.model.n_layer)
        if not isinstance(self.node, NodeSpec):
            raise ConfigError(f"node={self.node!r} must be a NodeSpec, e.g. NodeSpec.parse('8x80GiB', '1TiB')")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r}; use one of {', '.join(PRECISIONS)}")
        if not isinstance(self.grad_reuse, bool):
            raise ConfigError(f"grad_reuse={self.grad_reuse!r} must be True or False")
        object.__setattr__(self, "margin_bytes", parse_bytes(self.margin_bytes, what="margin"))
        if self.margin_bytes >= self.node.gpu_bytes:
            raise ConfigError(
                f"margin {format_bytes(self.margin_bytes)} leaves nothing of the {format_bytes(self.node.gpu_bytes)} GPU; "
                f"lower the margin"
            )
        if self.chunk_size is not None:
            check_positive_int("chunk_size", self.chunk_size)
        check_positive_int("iterations", self.iterations)
        if self.iterations < 2:
            raise ConfigError(
                f"iterations={self.iterations}: the first iteration is the warm-up; plan with at least 2 so one "
                f"iteration replays the trace as training does"
            )
        check_positive_int("max_layers", self.max_layers)
        check_positive_int("max_probes", self.max_probes)
        if not (isinstance(self.deepspeed_buffer_factor, (int, float)) and self.deepspeed_buffer_factor > 0):
            raise ConfigError(f"deepspeed_buffer_factor={self.deepspeed_buffer_factor!r} must be a positive number")
        object.__setattr__(self, "shard_group_size", self.sharding.requested)  # validated against the node

    @property
    def sharding(self) -> Sharding:
        return Sharding.resolve(self.shard_group_size, self.node)


def plan(
    model: PlannedModel,
    node: NodeSpec | None = None,
    *,
    gpus: str | None = None,
    cpu: str | int | None = None,
    ranks_per_node: int | None = None,
    nodes: int | None = None,
    precision: str = "fp16",
    grad_reuse: bool = True,
    margin: int | str = 0,
    chunk_size: int | None = None,
    simulated_gpus: bool = False,
    iterations: int = 2,
    search_largest: bool = True,
    max_layers: int = DEFAULT_MAX_LAYERS,
    max_probes: int = DEFAULT_MAX_PROBES,
    deepspeed_buffer_factor: float = DEEPSPEED_BUFFER_FACTOR,
    shard_group_size: int | str = "node",
) -> PlanReport:
    """Plan training ``model`` (a ``GPTShape`` or ``ModelFactory``) on ``node``, or on the
    node described by ``gpus`` (default "1x80GiB"), ``cpu`` (default "128GiB"),
    ``ranks_per_node`` (default: one per GPU) and ``nodes`` (default 1), with
    ``shard_group_size`` ranks sharing one copy of the model data ("node", "world" or a
    number of ranks dividing the world; see ``Config.shard_group_size``).

    Raises ``ShardGroupTooLargeError`` when the model's gathered chunk groups cannot fit the
    GPU with that shard group (the client would refuse it at registration).

    Runs ``iterations`` training iterations of the real engine under ``simulate="meta"``
    (nothing is allocated), derives per-rank figures for multi-rank jobs, applies the peers'
    published placement rules and, with ``search_largest``, finds the largest ``n_layer`` of
    the family that fits for each of them.
    """
    described = {"gpus": gpus, "cpu": cpu, "ranks_per_node": ranks_per_node, "nodes": nodes}
    if node is None:
        node = NodeSpec.parse(
            gpus or "1x80GiB", "128GiB" if cpu is None else cpu, ranks_per_node=ranks_per_node, nodes=nodes or 1
        )
    elif any(v is not None for v in described.values()):
        given = ", ".join(k for k, v in described.items() if v is not None)
        raise ConfigError(f"plan() got node={node!r} and also {given}; describe the node once, one way or the other")
    request = PlanRequest(
        model=model,
        node=node,
        precision=precision,
        grad_reuse=grad_reuse,
        margin_bytes=margin,
        chunk_size=chunk_size,
        simulated_gpus=simulated_gpus,
        iterations=iterations,
        search_largest=search_largest,
        max_layers=max_layers,
        max_probes=max_probes,
        deepspeed_buffer_factor=deepspeed_buffer_factor,
        shard_group_size=shard_group_size,
    )
    return Planner(request).run()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Evaluation:
    """One member of the family on the node: the simulation and the verdict built on it."""

    sim: Simulation
    share: RankShare | None
    fits: bool
    reason: str


class Planner:
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

    def evaluate(self, n_layer: int) -> Evaluation:
        if n_layer in self.evals:
            return self.evals[n_layer]
        req, node = self.request, self.node
        multi = node.world_size > 1

        def run() -> Simulation:
            cpu_bytes = UNBOUNDED_CPU_BYTES if multi else node.cpu_bytes
            key = (n_layer, node.gpu_bytes, cpu_bytes, self.margin_bytes, req.precision, req.grad_reuse, req.chunk_size,
                   req.simulated_gpus, req.iterations)  # fmt: skip
            if key in self.simulations:
                return self.simulations[key]
            sim = simulate(
                req.model.with_layers(n_layer),
                gpu_bytes=node.gpu_bytes,
                cpu_bytes=cpu_bytes,
                precision=req.precision,
                grad_reuse=req.grad_reuse,
                margin_bytes=self.margin_bytes,
                chunk_size=req.chunk_size,
                iterations=req.iterations,
            )
            self.sim_seconds += sim.seconds
            self.simulations[key] = sim
            return sim

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
        method = None
        if req.search_largest:
            method = (
                "n_layer at fixed width and batch: HybridPS by simulating candidates near a linear prediction until "
                "n_layer fits and n_layer + 1 does not; peers by their published rules over n_layer, with activations "
                "interpolated linearly between simulated sizes"
            )
        return PlanReport(
            model=req.model.describe(),
            n_params=ev.sim.n_params,
            precision=req.precision,
            grad_reuse=req.grad_reuse,
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
        return notes

    # -- the largest model ---------------------------------------------------------------

    def search_largest(self) -> LargestModel:
        """The largest n_layer that fits, confirmed by simulation where the probe budget allows.

        Needs (model data + activations against CPU + GPU, activations + working sets
        against the GPU, the derived per-rank needs) grow linearly with n_layer, so a line
        through two fitting sizes predicts the boundary; candidates are simulated there, then
        next to it, bisecting once predictions miss twice, until n_layer fits and
        n_layer + 1 does not.
        """
        req = self.request
        start = time.perf_counter()
        done_before = len(self.evals)
        lo, hi = 0, None  # largest size known to fit, smallest known not to
        for n, ev in self.evals.items():
            lo, hi = _bracket(lo, hi, n, ev.fits)

        def budget_left() -> bool:
            return len(self.evals) - done_before < req.max_probes

        def probe(n: int) -> bool:
            nonlocal lo, hi
            fits = self.evaluate(n).fits
            lo, hi = _bracket(lo, hi, n, fits)
            return fits

        # Two fitting sizes make the line: halve until one fits, then take a quarter of it.
        n = req.model.n_layer // 2
        while lo == 0 and n >= 1 and budget_left():
            probe(n)
            n //= 2
        if lo == 0 and 1 not in self.evals and budget_left():
            probe(1)
        if lo and sum(ev.fits for ev in self.evals.values()) == 1 and budget_left():
            second = max(1, lo // 4) if lo > 1 else 2
            if second not in self.evals:
                probe(second)
        misses, step = 0, 1
        while lo and budget_left() and (hi is None or hi - lo > 1) and lo < req.max_layers:
            upper = hi if hi is not None else req.max_layers + 1
            guess = self.predict_largest() if misses < 2 else None
            candidate = None
            if guess is not None:
                guess = min(max(guess, lo), upper - 1)
                if guess > lo and guess not in self.evals:
                    candidate = guess  # where the line says the boundary is
                elif lo + 1 < upper and lo + 1 not in self.evals:
                    candidate = lo + 1  # the line says lo is the largest: check the next size
            if candidate is None:
                candidate = min(lo + step, req.max_layers) if hi is None else (lo + hi) // 2
                step *= 2
            if candidate in self.evals:
                break
            fits = probe(candidate)
            if guess is not None and fits != (candidate <= guess):
                misses += 1
        if lo == 0:
            confirmed = 1 in self.evals and not self.evals[1].fits
        else:
            confirmed = hi is not None and hi - lo == 1
        return LargestModel(
            method="simulated",
            n_layer=lo,
            n_params=self.evals[lo].sim.n_params if lo else 0,
            confirmed=confirmed,
            probes=len(self.evals) - done_before,
            at_search_limit=lo >= req.max_layers,
            seconds=time.perf_counter() - start,
        )

    def _fits_line(self) -> list[Evaluation]:
        """The two fitting evaluations that span the widest range of n_layer near the top."""
        fitting = sorted((n, ev) for n, ev in self.evals.items() if ev.fits)
        if len(fitting) < 2:
            return []
        return [fitting[0][1], fitting[-1][1]] if len(fitting) == 2 else [fitting[-2][1], fitting[-1][1]]

    def predict_largest(self) -> int | None:
        """Largest n_layer whose needs, on the line through two fitting sizes, fit."""
        line = self._fits_line()
        if not line:
            return None
        a, b = line
        needs = [(self._needs(a), a.sim.n_layer), (self._needs(b), b.sim.n_layer)]
        best: float = float(self.request.max_layers)
        for (need_a, cap), (need_b, _) in zip(needs[0][0], needs[1][0], strict=True):
            slope = (need_b - need_a) / (needs[1][1] - needs[0][1])
            if slope > 0:
                best = min(best, needs[0][1] + (cap - need_a) / slope)
        return max(0, math.floor(best))

    def _needs(self, ev: Evaluation) -> list[tuple[int, int]]:
        """(need, capacity) pairs of one fitting evaluation, one per constraint."""
        sim, node, margin = ev.sim, self.node, self.margin_bytes
        act = sim.non_model_peak_bytes
        out = [(act + sim.min_compute_bytes + margin, node.gpu_bytes)]
        if ev.share is None:
            out.append((sim.model_data_bytes + act + margin, node.cpu_bytes + node.gpu_bytes))
        else:
            share, rpn = ev.share, node.ranks_per_node
            out.append((share.gpu_need_bytes, node.gpu_bytes))
            # the node's ranks keep on the CPU what of their shares their GPUs cannot hold; kept
            # unclipped (shares + GPU needs against CPU + GPUs) so the line stays a line
            out.append((share.node_owned_bytes + rpn * share.gpu_need_bytes, node.cpu_bytes + rpn * node.gpu_bytes))
        return out

    def activation_bytes(self, n_layer: int) -> int:
        """Activation peak at ``n_layer``: measured when that size was simulated to the end,
        else on the line through the two nearest completed simulations."""
        ev = self.evals.get(n_layer)
        if ev is not None and ev.sim.completed:
            return ev.sim.non_model_peak_bytes
        line = self._completed_line()
        if not line:
            return ev.sim.non_model_peak_bytes if ev else 0
        return max(0, round(_on_line(line, n_layer, lambda s: s.non_model_peak_bytes)))

    def _completed_line(self) -> list[Simulation]:
        done = sorted((n, ev.sim) for n, ev in self.evals.items() if ev.sim.completed)
        return [done[-2][1], done[-1][1]] if len(done) >= 2 else []

    def peer_largest(self, name: str) -> LargestModel:
        """Largest n_layer a peer fits by its published rule (monotone in n_layer: bisect)."""
        start = time.perf_counter()
        line = self._completed_line()
        if not line:
            return LargestModel(method="published rule", n_layer=0, n_params=0, confirmed=False, seconds=0.0)
        node, req = self.node, self.request
        largest_layer = line[-1].largest_layer_params

        def params(n: int) -> int:
            return max(0, round(_on_line(line, n, lambda s: s.n_params)))

        def fits(n: int) -> bool:
            cpu, gpu = peer_bytes(name, params(n), largest_layer, node, req.deepspeed_buffer_factor)
            act = max(0, round(_on_line(line, n, lambda s: s.non_model_peak_bytes)))
            return gpu + act + self.margin_bytes <= node.gpu_bytes and cpu <= node.cpu_bytes

        lo, hi = 0, req.max_layers + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return LargestModel(
            method="published rule",
            n_layer=lo,
            n_params=params(lo) if lo else 0,
            confirmed=True,
            at_search_limit=lo >= req.max_layers,
            seconds=time.perf_counter() - start,
        )


def _bracket(lo: int, hi: int | None, n: int, fits: bool) -> tuple[int, int | None]:
    if fits:
        return max(lo, n), hi
    return lo, n if hi is None else min(hi, n)


def _on_line(line: Sequence[Simulation], n: int, value: Callable[[Simulation], int]) -> float:
    a, b = line[0], line[-1]
    if a.n_layer == b.n_layer:
        return float(value(a))
    slope = (value(b) - value(a)) / (b.n_layer - a.n_layer)
    return value(a) + slope * (n - a.n_layer)


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
