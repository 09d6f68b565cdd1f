"""``sdpq bench scaling``: a communication/computation time model of one training step.

Predicts TFLOP/s per GPU of ZeRO-3-style sharded data parallelism, baseline vs sdpq, for GPT
1.3B-18B on two published clusters, next to SDP4Bit's published figure where we have it.

Model of one optimizer step (per GPU, no overlap of communication and compute, as a bound):
- compute: FLOPs / (peak x mfu), FLOPs = 6 P tokens + attention (Megatron's formula);
- per micro-batch the sharded weights are all-gathered twice (forward, backward) and the
  gradients reduce-scattered once (ZeRO-3 / FSDP semantics with gradient accumulation);
- a collective over D data-parallel ranks, L of them per node, moves (D - L)/D of its bytes
  across nodes; the node's inter-node link is shared by all its GPUs (TP peers included);
  intra-node bytes move at NVLink speed;
- baseline: 16-bit weights and gradients on every collective;
- sdpq: inter-node weight bytes only once per step as 4-bit differences (+ scales), gathers
  inside the node from the node-resident reference; gradients 8-bit intra, 4-bit inter;
  quantization passes over the data at ``quant_efficiency`` x HBM bandwidth.

Calibration: ``--mfu`` is the compute efficiency without communication, ``--quant-efficiency``
the fused kernels' fraction of copy bandwidth (issue-8 target 0.7; on a GPU machine pass the
``vs_copy`` that ``sdpq bench quant`` measured). Every assumption is printed with the result.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..quant import QuantSpec

COLUMNS = [
    "cluster",
    "model",
    "baseline_tflops",
    "sdpq_tflops",
    "speedup",
    "published_baseline",
    "published_sdp4bit",
    "published_speedup",
    "comm_share_baseline",
]


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    gpus_per_node: int
    inter_gbit: float  # per node, each direction
    nvlink_gbyte: float  # per GPU, intra-node
    peak_tflops: float  # bf16 dense
    hbm_gbyte: float


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    tp: int
    pp: int
    seq: int
    micro_batch: int
    vocab: int = 50257

    @property
    def params(self) -> float:
        return 12 * self.layers * self.hidden**2 + (self.vocab + self.seq) * self.hidden

    def flops_per_sequence(self) -> float:
        # Megatron-LM (Narayanan et al. 2021) without recomputation: 72 -> fwd+bwd = 3x fwd.
        L, h, s, V = self.layers, self.hidden, self.seq, self.vocab
        return 72 * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))


CLUSTERS = [
    Cluster("16x4 A100, 100 Gbit/s", 16, 4, 100, 300, 312, 1555),
    Cluster("16x8 H800, 3.2 Tbit/s", 16, 8, 3200, 200, 989, 3350),
]
# Shapes of the GPT family SDP4Bit evaluates; TP/PP/micro-batch as in their 32-GPU runs.
MODELS = [
    Model("1.3B", 24, 2048, 4, 1, 4096, 4),
    Model("2.7B", 32, 2560, 4, 1, 4096, 4),
    Model("6.7B", 32, 4096, 4, 1, 4096, 1),
    Model("13B", 40, 5120, 4, 2, 4096, 1),
    Model("18B", 40, 6144, 4, 2, 2048, 1),
]
# SDP4Bit (NeurIPS 2024) Table 2, TFLOP/s per GPU (baseline, SDP4Bit). Only the entry quoted in
# our issue tracker is filled in; the rest of the table was not available when this was written.
PUBLISHED = {("16x4 A100, 100 Gbit/s", "6.7B"): (10.8, 37.1)}


def step_seconds(
    c: Cluster, m: Model, grad_accum: int, mfu: float, quant_eff: float, sdpq: bool
) -> tuple[float, float]:
    """(total, communication) seconds of one optimizer step on one GPU."""
    gpus = c.nodes * c.gpus_per_node
    dp = gpus // (m.tp * m.pp)
    dp_per_node = max(1, c.gpus_per_node // (m.tp * m.pp)) if m.tp * m.pp <= c.gpus_per_node else 1
    n = m.params / (m.tp * m.pp)  # elements this GPU's DP group shards
    compute = grad_accum * m.micro_batch * m.flops_per_sequence() / (m.tp * m.pp) / (c.peak_tflops * 1e12 * mfu)
    inter_bw = c.inter_gbit / 8 * 1e9 / c.gpus_per_node  # bytes/s per GPU
    intra_bw = c.nvlink_gbyte * 1e9
    cross = (dp - dp_per_node) / dp  # share of a collective's bytes leaving the node
    local = (dp_per_node - 1) / dp

    def move(elements: float, inter_bits: float, intra_bits: float) -> float:
        return elements * (cross * inter_bits / 8 / inter_bw + local * intra_bits / 8 / intra_bw)

    if not sdpq:
        comm = grad_accum * (2 * move(n, 16, 16) + move(n, 16, 16))
        return compute + comm, comm
    w_bits = QuantSpec(bits=4, group_size=2048).wire_bits_per_element(1 << 20)
    g_inter = QuantSpec(bits=4, group_size=128).wire_bits_per_element(1 << 20)
    g_intra = QuantSpec(bits=8, group_size=128).wire_bits_per_element(1 << 20)
    weights = move(n, w_bits, 0) + grad_accum * 2 * n * (dp_per_node - 1) / dp * 2 / intra_bw
    grads = grad_accum * move(n, g_inter, g_intra)
    # Quantization passes: read fp32/bf16 + write codes, ~3 passes per collective element.
    quant = (1 + grad_accum) * 3 * n * 4 / (c.hbm_gbyte * 1e9 * quant_eff)
    comm = weights + grads + quant
    return compute + comm, comm


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grad-accum", type=int, default=32, help="micro-batches per optimizer step")
    p.add_argument("--mfu", type=float, default=0.45, help="compute efficiency without communication")
    p.add_argument(
        "--quant-efficiency",
        type=float,
        default=0.7,
        help="quantization kernels' fraction of HBM copy bandwidth (measure with sdpq bench quant on a GPU)",
    )


def run(args: argparse.Namespace) -> list[dict]:
    records = []
    for c in CLUSTERS:
        for m in MODELS:
            flops = args.grad_accum * m.micro_batch * m.flops_per_sequence() / (m.tp * m.pp)
            tb, cb = step_seconds(c, m, args.grad_accum, args.mfu, args.quant_efficiency, sdpq=False)
            ts, _ = step_seconds(c, m, args.grad_accum, args.mfu, args.quant_efficiency, sdpq=True)
            pub = PUBLISHED.get((c.name, m.name))
            records.append(
                dict(
                    cluster=c.name,
                    model=m.name,
                    baseline_tflops=flops / tb / 1e12,
                    sdpq_tflops=flops / ts / 1e12,
                    speedup=tb / ts,
                    published_baseline=pub[0] if pub else "n/a",
                    published_sdp4bit=pub[1] if pub else "n/a",
                    published_speedup=pub[1] / pub[0] if pub else "n/a",
                    comm_share_baseline=cb / tb,
                    assumptions=f"grad_accum={args.grad_accum} mfu={args.mfu} quant_eff={args.quant_efficiency} "
                    f"tp={m.tp} pp={m.pp} seq={m.seq} mb={m.micro_batch}",
                )
            )
    return records
