"""A step-time model of sharded data parallelism (baseline, SDP4Bit, sdpq), calibrated on
published figures (used by ``sdpq bench scaling``).

One optimizer step per GPU, no overlap of communication with compute (as in the published runs):

    t = compute + inter-node + intra-node + quantization kernels (+ tensor / pipeline traffic)

- compute = model FLOPs / (GPUs x peak x ``mfu``); model FLOPs per step are Megatron-LM's
  72 B s L h^2 (1 + s / 6h + V / 12hL) (forward + backward, no recomputation);
- a collective on the data-parallel (DP) group moves ``n`` elements (the DP group's share of the
  model: P / (TP x PP)) at ``b`` bits; over a node's link it puts n b / 8 (D - 1) / D bytes, where
  D = DP ranks' nodes (a ring or a two-level exchange crosses each node boundary once per
  element), for each DP group the node hosts (TP x PP groups per node); the link moves
  ``link_efficiency`` x its nominal bandwidth. Inside a node: (d - 1) / d of the bytes at NVLink
  speed (d = DP ranks per node);
- baseline: ``weight_gathers`` bf16 all-gathers of the weights (ZeRO-3: forward and backward)
  and one fp32 gradient reduce-scatter per step (the published baseline's precision);
- SDP4Bit: the same gathers as 4-bit weight differences (+ one fp32 scale per 2048) and the
  gradients 8-bit inside the node, 4-bit (+ one fp32 scale per 128) across nodes;
- sdpq: gradients as SDP4Bit; weights cross nodes once per step as 4-bit differences into the
  node-resident reference and are gathered inside the node (NVLink) otherwise;
- ZeRO++: gradients as SDP4Bit (qgZ); the forward gather int8 across nodes (qwZ), the backward
  one from the per-node secondary partition (hpZ);
- quantization kernels: ``kernel_passes`` passes over fp32 data per quantized collective at
  ``kernel_efficiency`` x HBM bandwidth (an assumption until sdpq's GPU kernels are measured);
- tensor parallelism: 4 all-reduces of the activations per layer (NVLink); pipeline: the
  activations once each way between stages, and a bubble of (PP - 1) / M of the compute (M
  micro-batches per step: 1 in the published runs, so two stages run one after the other).

Two constants are fitted per cluster (``mfu`` and ``link_efficiency``); everything else is stated
here and printed with every result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from ..config import Config
from ..quant import QuantSpec
from ..quant.groupwise import SCALE_DTYPES

__all__ = [
    "Cluster",
    "GPT",
    "Layout",
    "Constants",
    "PUBLISHED",
    "step_seconds",
    "tflops",
    "fit",
    "wire_bits",
    "fsdp_cross_node_bytes",
]

Scheme = Literal["baseline", "sdp4bit", "sdpq", "zeropp"]


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    gpus_per_node: int
    link_gbit: float  # inter-node, per node, each direction (nominal)
    nvlink_gbyte: float  # per GPU, intra-node
    peak_tflops: float  # bf16 dense, per GPU
    hbm_gbyte: float  # per GPU

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class GPT:
    name: str
    layers: int
    hidden: int
    seq: int = 2048
    vocab: int = 50257

    @property
    def params(self) -> float:
        return 12 * self.layers * self.hidden**2 + (self.vocab + self.seq) * self.hidden

    def flops(self, sequences: int) -> float:
        L, h, s, V = self.layers, self.hidden, self.seq, self.vocab
        return 72 * sequences * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    global_batch: int = 256
    micro_batches: int = 1  # per step and DP rank (the published runs: 1, no gradient accumulation)


@dataclass(frozen=True)
class Constants:
    mfu: float  # fitted: compute efficiency
    link_efficiency: float  # fitted: share of the nominal inter-node bandwidth a collective gets
    weight_gathers: int = 2  # ZeRO-3: forward and backward
    kernel_passes: int = 3  # read input, write codes, read + write on decode
    kernel_efficiency: float = 0.7  # of HBM bandwidth; assumed (no GPU measurement yet)


A100 = Cluster("16x4 A100-40GB, 100 Gbit/s", 16, 4, 100, 300, 312, 1555)
H800 = Cluster("16x8 H800-80GB, 3.2 Tbit/s", 16, 8, 3200, 200, 989, 3350)
MODELS = {
    "1.3B": GPT("1.3B", 24, 2048),
    "2.7B": GPT("2.7B", 32, 2560),
    "6.7B": GPT("6.7B", 32, 4096),
    "13B": GPT("13B", 40, 5120),
    "18B": GPT("18B", 40, 6144),
}
# SDP4Bit (NeurIPS 2024), Table 2: TFLOP/s per GPU (baseline, SDP4Bit), and the layouts its runs
# used (13B and 18B: TP 4 x PP 2 on A100, TP 8 on H800; the others pure sharded DP).
PUBLISHED: dict[tuple[str, str], tuple[float, float, Layout]] = {
    (A100.name, "1.3B"): (24.1, 57.6, Layout()),
    (A100.name, "2.7B"): (24.0, 58.4, Layout()),
    (A100.name, "6.7B"): (10.8, 37.1, Layout()),
    (A100.name, "13B"): (9.7, 26.0, Layout(tp=4, pp=2)),
    (A100.name, "18B"): (10.2, 29.8, Layout(tp=4, pp=2)),
    (H800.name, "1.3B"): (69.1, 106.0, Layout()),
    (H800.name, "2.7B"): (71.9, 116.9, Layout()),
    (H800.name, "6.7B"): (26.2, 77.9, Layout()),
    (H800.name, "13B"): (13.9, 53.5, Layout(tp=8)),
    (H800.name, "18B"): (14.5, 59.2, Layout(tp=8)),
}
FIT_ON = ("1.3B", "6.7B")


def wire_bits(bits: int, group_size: int, scale_dtype: str = "fp32") -> float:
    """Bits per element on the wire: codes + one scale per group, fp32 or bf16 (sdpq.quant's
    accounting)."""
    spec = QuantSpec(bits=bits, group_size=group_size, scale_dtype=SCALE_DTYPES[scale_dtype])
    return spec.wire_bits_per_element(1 << 20)


def _dp_layout(c: Cluster, lay: Layout) -> tuple[int, int, int]:
    """(DP size, DP ranks per node, DP groups per node): ranks are laid out TP innermost, then PP
    (a stage per node when TP fills it), then DP."""
    dp = c.gpus // (lay.tp * lay.pp)
    per_node = max(1, c.gpus_per_node // (lay.tp * lay.pp))
    return dp, per_node, c.gpus_per_node // per_node


def traffic(c: Cluster, m: GPT, lay: Layout, scheme: Scheme, weight_gathers: int = 2) -> dict[str, float]:
    """Bytes per step: "inter" over one node's link, "intra" per GPU over NVLink, "quantized"
    fp32 elements per GPU that go through a quantization kernel."""
    dp, d, groups = _dp_layout(c, lay)
    n = m.params / (lay.tp * lay.pp)  # elements of one DP group
    nodes = dp // d
    cross = (nodes - 1) / nodes
    local = (d - 1) / d
    inter = intra = quantized = 0.0
    if scheme == "baseline":
        inter = groups * n * cross * (weight_gathers * 2 + 4)
        intra = n * local * (weight_gathers * 2 + 4)
    else:
        g_inter, g_intra = wire_bits(4, 128) / 8, wire_bits(8, 128) / 8
        w = wire_bits(4, 2048) / 8
        inter = groups * n * cross * g_inter
        intra = n * local * g_intra
        quantized = 2 * n  # gradients, both stages
        if scheme == "zeropp":  # qwZ int8 forward gather across nodes; hpZ: backward gather in the node
            w8 = wire_bits(8, 2048) / 8
            inter += groups * n * cross * w8
            intra += n * local * (weight_gathers - 1) * 2 + n * local * w8
            quantized += n
        elif scheme == "sdp4bit":
            inter += groups * n * cross * weight_gathers * w
            intra += n * local * weight_gathers * w
            quantized += weight_gathers * n
        else:  # one 4-bit exchange across nodes, then bf16 gathers from the node's reference
            inter += groups * n * cross * w
            intra += n * local * weight_gathers * 2
            quantized += n
    return {"inter": inter, "intra": intra, "quantized": quantized}


def step_seconds(c: Cluster, m: GPT, lay: Layout, scheme: Scheme, k: Constants) -> dict[str, float]:
    """The step time of one GPU and its parts (seconds)."""
    dp, _, _ = _dp_layout(c, lay)
    seqs_per_dp = lay.global_batch / dp
    compute = m.flops(lay.global_batch) / c.gpus / (c.peak_tflops * 1e12 * k.mfu)
    bubble = compute * (lay.pp - 1) / lay.micro_batches  # one micro-batch: the stages run in turn
    t = traffic(c, m, lay, scheme, k.weight_gathers)
    link = c.link_gbit / 8 * 1e9 * k.link_efficiency
    act = seqs_per_dp * m.seq * m.hidden * 2  # bf16 activations of this DP rank's sequences
    tp = 4 * (m.layers / lay.pp) * act * 2 * (lay.tp - 1) / lay.tp / (c.nvlink_gbyte * 1e9) if lay.tp > 1 else 0.0
    pp = 2 * act * (c.gpus_per_node // (lay.tp * lay.pp) or 1) / link if lay.pp > 1 else 0.0
    parts = {
        "compute": compute + bubble,
        "inter": t["inter"] / link,
        "intra": t["intra"] / (c.nvlink_gbyte * 1e9),
        "kernels": t["quantized"] * 4 * k.kernel_passes / (c.hbm_gbyte * 1e9 * k.kernel_efficiency),
        "tp_pp": tp + pp,
    }
    parts["total"] = sum(parts.values())
    return parts


def tflops(c: Cluster, m: GPT, lay: Layout, scheme: Scheme, k: Constants) -> float:
    """Model TFLOP/s per GPU, as the published tables count them."""
    return m.flops(lay.global_batch) / c.gpus / step_seconds(c, m, lay, scheme, k)["total"] / 1e12


def fit(c: Cluster, fit_on: tuple[str, ...] = FIT_ON, base: Constants | None = None) -> Constants:
    """mfu and link_efficiency minimizing the squared log error on the published cells of the
    `fit_on` models (baseline and SDP4Bit columns): a grid search (two parameters, smooth)."""
    base = base or Constants(mfu=0.5, link_efficiency=1.0)
    cells = [(MODELS[name], *PUBLISHED[(c.name, name)]) for name in fit_on]

    def loss(mfu: float, eff: float) -> float:
        k = replace(base, mfu=mfu, link_efficiency=eff)
        total = 0.0
        for m, b, q, lay in cells:
            total += math.log(tflops(c, m, lay, "baseline", k) / b) ** 2
            total += math.log(tflops(c, m, lay, "sdp4bit", k) / q) ** 2
        return total

    best = (math.inf, 0.5, 1.0)
    for i in range(1, 91):  # mfu 0.01 .. 0.90
        for j in range(1, 201):  # link efficiency 0.01 .. 2.00
            v = loss(i / 100, j / 100)
            best = min(best, (v, i / 100, j / 100))
    return replace(base, mfu=best[1], link_efficiency=best[2])


# ----------------------------------------------------------------------------- one FSDP2 job, exactly


def fsdp_cross_node_bytes(
    modules: list[tuple[list[tuple[int, ...]], int]],
    world: int,
    per_node: int,
    sdpq: Config | None,
    *,
    param_bytes: int = 4,
    reduce_bytes: int = 4,
) -> dict[str, int]:
    """Bytes a steady-state step of an FSDP2 job sends across nodes, summed over ranks, per path
    ("weights": all-gathers, "gradients": reduce-scatters / all-to-alls), counted as the
    process-group meter counts them: the least cross-node traffic of sdpq/comm/traffic.py (a
    rank's shard crosses into each other node once).

    `modules`: per FSDP module, its parameters' shapes and how often a step gathers it (2 with
    reshard_after_forward: forward and backward; 1 without). FSDP2 pads dim 0 to a multiple of
    the world size. sdpq (weights "diff", gradients "two_level"): one refresh of
    the node reference per module (4-bit differences to the other nodes) and the inter-node
    all-to-all of the two-level reduce-scatter, cut as `chunk_layout` cuts it.
    """
    from ..comm.chunks import chunk_layout
    from ..quant.groupwise import SCALE_DTYPES

    N, L = world, per_node
    nodes, out = N // L, {"weights": 0, "gradients": 0}
    for shapes, gathers in modules:
        shard = sum(-(-s[0] // N) * math.prod(s[1:]) for s in shapes)
        if sdpq is None:
            out["weights"] += N * gathers * shard * param_bytes * (nodes - 1)
            out["gradients"] += N * shard * reduce_bytes * (nodes - 1)
            continue
        w, g = sdpq.weights, sdpq.gradients
        wspec = QuantSpec(bits=w.bits, group_size=w.group_size, scale_dtype=SCALE_DTYPES[w.scale_dtype])
        out["weights"] += N * (nodes - 1) * wspec.wire_bytes(shard)
        lay = chunk_layout(N * shard, N, L, g)
        gspec = QuantSpec(bits=g.inter_bits, group_size=g.inter_group_size, scale_dtype=SCALE_DTYPES[g.scale_dtype])
        out["gradients"] += N * (nodes - 1) * lay.slices * gspec.wire_bytes(lay.padded_chunk // lay.slices)
    return out
