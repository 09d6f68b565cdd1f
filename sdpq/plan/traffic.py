"""Cross-node bytes per step and the step time `sdpq bench scaling`'s model predicts, per planned
configuration (sdpq/bench/scaling_model.py states the model and its fitted constants).

Bytes are what one node's link carries per optimizer step (each direction), by the byte model of
sdpq/comm/traffic.py (the one the process-group meter and sdpq's statistics use): the least
cross-node traffic of each collective, (nodes - 1) / nodes of the tensor for an all-gather or a
reduce-scatter, twice that for an all-reduce, at the bits it travels with. NCCL's ring
((N - 1) / N for N data-parallel ranks) is given beside it as context ("ring_total"):

| configuration | weights (per step) | gradients (per step) |
|---|---|---|
| FSDP2 / ZeRO-3, bf16 | 2 gathers x 16 bits | FSDP2: fp32 reduce (32 bits); ZeRO-3: bf16 (16) |
| HSDP, bf16 | none (gathered inside the node) | all-reduce across nodes: 2 x 32 bits |
| ZeRO++ | the forward gather int8 (qwZ; hpZ serves the backward one) | int4 (qgZ) |
| sdpq, weights "diff" | one 2-8-bit difference | `gradients.inter_bits` (+ scales) |
| sdpq, weights "direct" | 2 gathers x 8 bits | as above |
| sdpq, HSDP | none | 2 x `gradients.inter_bits` (reduce-scatter + all-gather) |
| ZeRO-1/2, bf16 | the updated partitions once (16) | all-reduce of the buckets: 2 x 16 |
| sdpq, ZeRO-1/2 | one 2-8-bit difference | `gradients.inter_bits` to the owners |

ZeRO-2 reduces every micro-step: the gradient column is per micro-step there (the plan assumes
one micro-step per step).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..bench.scaling_model import GPT, Constants, wire_bits
from ..comm import traffic
from .memory import Arm
from .shapes import ModelShape

__all__ = ["Link", "cross_node_bytes", "step_seconds"]

GATHERS = 2  # a step gathers the weights twice (forward, backward), as FSDP2 and ZeRO-3 reshard


@dataclass(frozen=True)
class Link:
    """The cluster as the time model needs it (per GPU unless said)."""

    link_gbit: float  # inter-node, per node, each direction
    nvlink_gbyte: float = 450.0
    peak_tflops: float = 989.0  # bf16 dense
    hbm_gbyte: float = 3350.0
    batch_per_gpu: int = 1  # sequences per GPU and step


# (collective kind of comm/traffic.py, bits per element it carries, whether it runs over the
# whole data-parallel group (NCCL's ring: "world") or hierarchically over one member per node
# ("nodes": sdpq's inter-node stages, ZeRO++'s qgZ), where the ring and the least traffic agree).
Hop = tuple[str, float, str]


def _hops(arm: Arm, framework: str) -> tuple[list[Hop], list[Hop]]:
    """(the weight collectives of one step, the gradient collectives of one step) across nodes."""
    cfg = arm.sdpq
    zero12 = framework in ("zero1", "zero2")
    if cfg is None:
        if zero12:
            return [("all_gather", 16.0, "world")], [("all_reduce", 16.0, "world")]
        if arm.zeropp:
            return [("all_gather", wire_bits(8, 2048), "world")], [("reduce_scatter", wire_bits(4, 128), "nodes")]
        if framework == "hsdp":
            return [], [("all_reduce", 32.0, "nodes")]  # over the replicate group: one rank per node
        grad = 32.0 if framework == "fsdp2" else 16.0
        return [("all_gather", 16.0, "world")] * GATHERS, [("reduce_scatter", grad, "world")]
    g = cfg.gradients
    grads: Hop = (
        ("reduce_scatter", wire_bits(g.inter_bits, g.inter_group_size, g.scale_dtype), "nodes")
        if g.mode == "two_level"
        else ("reduce_scatter", 32.0, "world")
    )
    if framework == "hsdp":
        return [], [("all_reduce", grads[1], grads[2])]
    w = cfg.weights
    if zero12:  # the owners' differences go to every rank in one world all-gather
        diff = wire_bits(w.bits, w.group_size, w.scale_dtype)
        return [("all_gather", diff if w.mode == "diff" else 16.0, "world")], [grads]
    weights: list[Hop] = {
        "diff": [("all_gather", wire_bits(w.bits, w.group_size, w.scale_dtype), "nodes")],
        "direct": [("all_gather", wire_bits(8, w.group_size, w.scale_dtype), "world")] * GATHERS,
        "exact": [("all_gather", 16.0, "world")] * GATHERS,
    }[w.mode]
    return weights, [grads]


def cross_node_bytes(model: ModelShape, framework: str, nodes: int, per_node: int, arm: Arm) -> dict[str, float]:
    """{"weights", "gradients", "total", "ring_total"}: bytes one node's link carries per step
    (least traffic; "ring_total" what NCCL's ring would carry, as context)."""
    out = {"weights": 0.0, "gradients": 0.0, "ring_total": 0.0}
    for path, hops in zip(("weights", "gradients"), _hops(arm, framework)):
        for kind, bits, over in hops:
            members = per_node if over == "world" else 1
            b = traffic.per_node(kind, model.params * bits / 8, nodes, members)
            out[path] += b["least"]
            out["ring_total"] += b["ring"]
    out["total"] = out["weights"] + out["gradients"]
    return out


def step_seconds(
    model: ModelShape, framework: str, nodes: int, per_node: int, arm: Arm, link: Link, k: Constants
) -> dict[str, float]:
    """The time model's step (seconds) and its parts: compute, inter-node, intra-node traffic."""
    gpus = nodes * per_node
    gpt = GPT(model.name, model.layers, model.hidden, model.seq, model.vocab)
    compute = gpt.flops(gpus * link.batch_per_gpu) / gpus / (link.peak_tflops * 1e12 * k.mfu)
    inter = cross_node_bytes(model, framework, nodes, per_node, arm)["total"] / (
        link.link_gbit / 8 * 1e9 * k.link_efficiency
    )
    local = (per_node - 1) / per_node * model.params
    # Inside the node every configuration gathers bf16 weights twice (sdpq from its reference; an
    # int8 reference sends 8.25 bits) and reduces the node's share of the gradients once.
    wbits = wire_bits(8, 128) if arm.sdpq is not None and arm.sdpq.weights.reference == "int8" else 16.0
    # ZeRO-1/2: one all-gather of the updated partitions and an all-reduce of the buckets.
    bits = 16.0 + 2 * 16.0 if framework in ("zero1", "zero2") else GATHERS * wbits + 16.0
    intra = local * bits / 8 / (link.nvlink_gbyte * 1e9)
    parts = {"compute": compute, "inter": inter, "intra": intra}
    parts["total"] = sum(parts.values())
    return parts
