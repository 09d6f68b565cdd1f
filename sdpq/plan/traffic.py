"""Cross-node bytes per step and the step time `sdpq bench scaling`'s model predicts, per planned
configuration (sdpq/bench/scaling_model.py states the model and its fitted constants).

Bytes are what one node's link carries per optimizer step (each direction), as the scaling model
counts them: a collective over the data-parallel ranks moves each element across a node
boundary (nodes - 1) / nodes times, at the bits it travels with:

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


def _bits(arm: Arm, framework: str) -> tuple[float, float]:
    """(weight bits per element per step, gradient bits per element per step) across nodes."""
    cfg = arm.sdpq
    zero12 = framework in ("zero1", "zero2")
    if cfg is None:
        if zero12:
            return 16.0, 2 * 16.0
        if arm.zeropp:
            return wire_bits(8, 2048), wire_bits(4, 128)
        if framework == "hsdp":
            return 0.0, 2 * 32.0
        return GATHERS * 16.0, 32.0 if framework == "fsdp2" else 16.0
    g = cfg.gradients
    grad = wire_bits(g.inter_bits, g.inter_group_size) if g.mode == "two_level" else 32.0
    if zero12:  # exact: DeepSpeed's own all-reduce of the bf16 buckets and all-gather
        w = cfg.weights
        return (wire_bits(w.bits, w.group_size) if w.mode == "diff" else 16.0), grad
    if framework == "hsdp":
        return 0.0, 2 * grad
    w = cfg.weights
    weights = {
        "diff": wire_bits(w.bits, w.group_size),
        "direct": GATHERS * wire_bits(8, w.group_size),
        "exact": GATHERS * 16.0,
    }[w.mode]
    return weights, grad


def cross_node_bytes(model: ModelShape, framework: str, nodes: int, arm: Arm) -> dict[str, float]:
    """{"weights", "gradients", "total"}: bytes one node's link carries per step."""
    if nodes == 1:
        return {"weights": 0.0, "gradients": 0.0, "total": 0.0}
    w, g = _bits(arm, framework)
    cross = model.params * (nodes - 1) / nodes / 8
    return {"weights": w * cross, "gradients": g * cross, "total": (w + g) * cross}


def step_seconds(
    model: ModelShape, framework: str, nodes: int, per_node: int, arm: Arm, link: Link, k: Constants
) -> dict[str, float]:
    """The time model's step (seconds) and its parts: compute, inter-node, intra-node traffic."""
    gpus = nodes * per_node
    gpt = GPT(model.name, model.layers, model.hidden, model.seq, model.vocab)
    compute = gpt.flops(gpus * link.batch_per_gpu) / gpus / (link.peak_tflops * 1e12 * k.mfu)
    inter = cross_node_bytes(model, framework, nodes, arm)["total"] / (link.link_gbit / 8 * 1e9 * k.link_efficiency)
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
