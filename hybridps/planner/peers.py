"""The peers: where DeepSpeed ZeRO-Offload and ZeRO-3 offload would place this model's
states on this node, by DeepSpeed's own published memory estimators.

Owns the rules (``PEER_RULES`` and the two estimator formulas, with their sources), their
``additional_buffer_factor`` default, and applying them with the activations HybridPS
measured (``peer_plans``, ``peer_bytes``).

Does not own DeepSpeed (it is not installed: nothing is run), the parameter counts the rules
take (``simulation.deepspeed_param_counts``), the search for a peer's largest model
(``search``) or the records the results are kept in (``report.PeerPlan``).
"""

from __future__ import annotations

from hybridps.common.units import format_bytes
from hybridps.planner.defaults import DEEPSPEED_BUFFER_FACTOR
from hybridps.planner.node import NodeSpec
from hybridps.planner.report import PeerPlan

PEER_RULES = {
    "deepspeed-zero-offload": (
        "DeepSpeed ZeRO-Offload (ZeRO-2, optimizer offloaded to CPU): per GPU 2 x params; per node CPU "
        "params x max(4 x GPUs in the job, 16) x 1.5 (estimate_zero2_model_states_mem_needs, cpu_offload=True)"
    ),
    "deepspeed-zero3-offload": (
        "DeepSpeed ZeRO-3 with param and optimizer offload to CPU: per GPU 4 x largest layer params; per node CPU "
        "params x 18 / nodes x 1.5 (estimate_zero3_model_states_mem_needs, cpu_offload=True, "
        "cpu_offload_params=True, zero_init=True)"
    ),
}


def deepspeed_zero2_offload_bytes(
    total_params: int, gpus_per_node: int, nodes: int, buffer_factor: float = DEEPSPEED_BUFFER_FACTOR
) -> tuple[int, int]:
    """(CPU bytes per node, GPU bytes per GPU) of model states under ZeRO-Offload.

    Rule: ``estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes,
    cpu_offload=True, additional_buffer_factor=1.5)`` in deepspeed/runtime/zero/
    stage_1_and_2.py (deepspeedai/DeepSpeed): ``gpu_mem = 2 * total_params`` (the fp16
    params every GPU keeps) and ``cpu_mem = total_params * max(4 * total_gpus, 16) *
    additional_buffer_factor`` (fp32 master, momentum, variance and grads, 16 B/param, on the
    host). The ZeRO-Offload paper and tutorial (deepspeed.ai/tutorials/zero-offload) describe
    the same placement: fp16 params and activations on the GPU, the optimizer on the CPU.
    """
    total_gpus = gpus_per_node * nodes
    return int(total_params * max(4 * total_gpus, 16) * buffer_factor), int(2 * total_params)


def deepspeed_zero3_offload_bytes(
    total_params: int, largest_layer_params: int, gpus_per_node: int, nodes: int, buffer_factor: float = DEEPSPEED_BUFFER_FACTOR
) -> tuple[int, int]:
    """(CPU bytes per node, GPU bytes per GPU) of model states under ZeRO-3 with params and
    optimizer offloaded to the CPU.

    Rule: ``estimate_zero3_model_states_mem_needs(total_params, largest_layer_params,
    num_gpus_per_node, num_nodes, cpu_offload=True, cpu_offload_params=True, zero_init=True,
    additional_buffer_factor=1.5)`` in deepspeed/runtime/zero/stage3.py
    (deepspeedai/DeepSpeed): ``gpu_mem = 4 * largest_layer_params`` (the gathered fp16 params
    and grads of the largest layer) and ``cpu_mem = total_params * 18 * (1 / num_nodes) *
    additional_buffer_factor``. See also the ZeRO-3 offload docs
    (deepspeed.readthedocs.io, "ZeRO", offload_param / offload_optimizer).
    """
    cpu = total_params * 18 * (1 / nodes) * buffer_factor
    return int(cpu), int(4 * largest_layer_params)


def peer_plans(
    n_params: int, largest_layer_params: int, activation_bytes: int, node: NodeSpec, margin_bytes: int, buffer_factor: float
) -> list[PeerPlan]:
    out = []
    for name in PEER_RULES:
        cpu, gpu = peer_bytes(name, n_params, largest_layer_params, node, buffer_factor)
        need = gpu + activation_bytes + margin_bytes
        reasons = []
        if need > node.gpu_bytes:
            reasons.append(f"GPU needs {format_bytes(need)} of {format_bytes(node.gpu_bytes)}")
        if cpu > node.cpu_bytes:
            reasons.append(f"CPU needs {format_bytes(cpu)} of {format_bytes(node.cpu_bytes)}")
        out.append(
            PeerPlan(
                name=name, rule=PEER_RULES[name], gpu_model_states_bytes=gpu, gpu_need_bytes=need,
                cpu_node_bytes=cpu, fits=not reasons, reason="; ".join(reasons),
            )
        )  # fmt: skip
    return out


def peer_bytes(name: str, n_params: int, largest_layer: int, node: NodeSpec, buffer_factor: float) -> tuple[int, int]:
    if name == "deepspeed-zero-offload":
        return deepspeed_zero2_offload_bytes(n_params, node.ranks_per_node, node.nodes, buffer_factor)
    return deepspeed_zero3_offload_bytes(n_params, largest_layer, node.ranks_per_node, node.nodes, buffer_factor)
