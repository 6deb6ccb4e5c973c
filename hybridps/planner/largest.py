"""The search for the largest member of the model's family that fits: HybridPS's by
simulating candidates near the boundary a line through fitting sizes predicts, the peers'
by their published rules.

Owns ``LargestModelSearch``, the part of ``search.Planner`` that searches: the needs of a
fitting member against the node's capacities (with a disk tier its capacity added to
memory's), the line through two fitting sizes and the largest size it predicts, the
candidates simulated within the search's probe and time budgets (``PlanRequest.max_probes``,
``search_seconds``), the linear rule's answer when the time runs out, and the peers' largest
sizes.

Does not own the verdict on one member (``search.Planner.evaluate``), the simulation
(``simulation``) or the peers' formulas (``peers``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hybridps.planner.peers import peer_bytes
from hybridps.planner.report import RULE, LargestModel
from hybridps.planner.simulation import Simulation

if TYPE_CHECKING:
    from hybridps.planner.node import NodeSpec
    from hybridps.planner.request import Evaluation, PlanRequest


class LargestModelSearch:
    """The search for the largest ``n_layer``, a part of ``search.Planner``: it reads the
    planner's ``request``, ``node``, ``margin_bytes`` and ``evals`` and simulates members with
    its ``evaluate``."""

    request: PlanRequest
    node: NodeSpec
    margin_bytes: int
    evals: dict[int, Evaluation]

    def evaluate(self, n_layer: int) -> Evaluation:
        """The verdict on one member (``search.Planner.evaluate``)."""
        raise NotImplementedError

    def search_largest(self) -> LargestModel:
        """The largest n_layer that fits, confirmed by simulation where the probe budget allows.

        Needs (``_needs``) grow linearly with n_layer, so a line through two fitting sizes
        predicts the boundary; candidates are simulated there, then next to it, bisecting once
        predictions miss twice, until n_layer fits and n_layer + 1 does not. Out of
        ``search_seconds`` first, the largest is the line's (``_rule_largest``; see [Note: the
        largest model with a disk tier]).
        """
        req = self.request
        start = time.perf_counter()
        done_before = len(self.evals)
        lo, hi = 0, None  # largest size known to fit, smallest known not to
        for n, ev in self.evals.items():
            lo, hi = _bracket(lo, hi, n, ev.fits)
        deadline = None if req.search_seconds is None or math.isinf(req.search_seconds) else start + req.search_seconds
        out_of_time = False

        def budget_left() -> bool:
            return len(self.evals) - done_before < req.max_probes

        def affordable(n: int) -> bool:
            nonlocal out_of_time
            if deadline is None or n in self.evals or time.perf_counter() + self.predicted_seconds(n) <= deadline:
                return True
            out_of_time = True
            return False

        def probe(n: int) -> bool:
            nonlocal lo, hi
            fits = self.evaluate(n).fits
            lo, hi = _bracket(lo, hi, n, fits)
            return fits

        # Two fitting sizes make the line: halve until one fits, then take a quarter of it.
        n = req.model.n_layer // 2
        while lo == 0 and n >= 1 and budget_left() and affordable(n):
            probe(n)
            n //= 2
        if lo == 0 and 1 not in self.evals and budget_left() and affordable(1):
            probe(1)
        if lo and sum(ev.fits for ev in self.evals.values()) == 1 and budget_left():
            second = max(1, lo // 4) if lo > 1 else 2
            if second not in self.evals and affordable(second):
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
            if candidate in self.evals or not affordable(candidate):
                break
            fits = probe(candidate)
            if guess is not None and fits != (candidate <= guess):
                misses += 1
        confirmed = (1 in self.evals and not self.evals[1].fits) if lo == 0 else (hi is not None and hi - lo == 1)
        if out_of_time and lo and not confirmed:
            ruled = self._rule_largest(lo, hi, probes=len(self.evals) - done_before, start=start)
            if ruled is not None:
                return ruled
        return LargestModel(
            method="simulated",
            n_layer=lo,
            n_params=self.evals[lo].sim.n_params if lo else 0,
            confirmed=confirmed,
            probes=len(self.evals) - done_before,
            at_search_limit=lo >= req.max_layers,
            seconds=time.perf_counter() - start,
        )

    def _rule_largest(self, lo: int, hi: int | None, *, probes: int, start: float) -> LargestModel | None:
        """The linear rule's largest size between ``lo`` (simulated, fits) and ``hi`` (fails),
        when it is above ``lo``: the search ran out of time before confirming the boundary."""
        rule = self.predict_largest()
        upper = hi - 1 if hi is not None else self.request.max_layers
        if rule is None or min(rule, upper) <= lo:
            return None
        n = min(rule, upper)
        return LargestModel(
            method=RULE,
            n_layer=n,
            n_params=max(0, round(_on_line(self._completed_line(), n, lambda s: s.n_params))),
            confirmed=False,
            probes=probes,
            at_search_limit=n >= self.request.max_layers,
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
            # with a disk tier its capacity adds to memory's ([Note: the largest model with a disk tier])
            out.append((sim.model_data_bytes + act + margin, node.cpu_bytes + node.gpu_bytes + node.nvme_bytes))
        else:
            share, rpn = ev.share, node.ranks_per_node
            out.append((share.gpu_need_bytes, node.gpu_bytes))
            # the node's ranks keep on the CPU what of their shares their GPUs cannot hold, and
            # on the disk what the CPU cannot; kept unclipped (shares + GPU needs against CPU +
            # GPUs + disk) so the line stays a line
            out.append(
                (share.node_owned_bytes + rpn * share.gpu_need_bytes, node.cpu_bytes + rpn * node.gpu_bytes + node.nvme_bytes)
            )
        return out

    # [Note: the largest model with a disk tier]
    # A rank alone with a disk tier fits while model data + activations + margin fit GPU + CPU
    # + disk: the rule of memory alone with the disk's capacity added. The simulations of the
    # d_model 2048 GPT (137.59 GB GPU, 119.3 GB CPU, 376 GB disk) show why the disk simply
    # adds: while it has room the CPU's evictions go there (at 300 layers it peaked at 94 GB
    # in the warm-up's step, memory holding 118.8 GB of model data), and once it is full they
    # stay in memory: from 700 to 849 layers its peak stayed within 0.1 GB of the capacity
    # while the model data grew by 105 GB. So the line through two fitting sizes predicts the
    # boundary as it does without a disk, and the search simulates candidates there. Its
    # boundary there was 850 layers; simulated, 849 fits and 850 does not (in the warm-up, whose
    # GPU kept 1.7 GB more room than the replayed iteration's activation peak and the margin).
    #
    # A model of thousands of layers that spills to the disk takes minutes to simulate (the
    # client's moves to the disk scan the CPU's chunks for each eviction: 30 s to 6 minutes at
    # 700 layers, 18 minutes at 1400 on a 2-core VM), so the search has a time budget
    # (``search_seconds``, 120 s by default with a disk): a candidate predicted to take longer
    # than what is left is not simulated, and the largest size is then the line's (every need
    # of n_layer on the line through two simulated fitting sizes fits, one of n_layer + 1
    # does not), reported as the linear rule's and unconfirmed.

    def predicted_seconds(self, n_layer: int) -> float:
        """How long a simulation of ``n_layer`` is expected to take: the largest size simulated
        so far (the smaller ones are mostly fixed costs), grown linearly with the layers, or
        with their square when the rank is simulated with a disk tier (the client's moves to
        the disk scan the CPU's chunks for each eviction: 60 s at 300 layers, 18 minutes at
        1400 in the note above)."""
        if not self.evals:
            return 0.0
        largest = self.evals[max(self.evals)].sim
        power = 2 if self.node.has_disk and self.node.world_size == 1 else 1
        return largest.seconds * (n_layer / largest.n_layer) ** power

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
