"""``sdpq bench scaling``: the step-time model of ``sdpq.bench.scaling_model`` next to every
published cell it can be checked against, and its extrapolation to larger jobs.

Default: per cluster of SDP4Bit's Table 2, the two constants fitted on the 1.3B and 6.7B rows
(``mfu``, ``link_efficiency``), then every row: published baseline and SDP4Bit TFLOP/s per GPU,
the model's prediction and its error ("fit" marks the cells the constants were fitted on), and
the model's sdpq column (no published figure). ``--extrapolate``: sdpq vs the baseline, ZeRO++
and SDP4Bit for 7B and 70B at 64 / 256 / 1024 GPUs on 100 and 400 Gbit/s links, with the
assumptions in every record.
"""

from __future__ import annotations

import argparse
import json
import statistics

from .scaling_model import (
    A100,
    FIT_ON,
    GPT,
    H800,
    MODELS,
    PUBLISHED,
    Cluster,
    Constants,
    Layout,
    fit,
    step_seconds,
    tflops,
)

COLUMNS = [
    "cluster",
    "model",
    "layout",
    "published_baseline",
    "baseline",
    "baseline_error",
    "published_sdp4bit",
    "sdp4bit",
    "sdp4bit_error",
    "sdpq",
    "cell",
    "published_saved_ns_per_param",
    "model_lacks",
    # --extrapolate
    "baseline_tflops",
    "sdpq_tflops",
    "sdpq_vs_baseline",
    "sdpq_vs_zeropp",
    "sdpq_vs_sdp4bit",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--extrapolate", action="store_true", help="7B / 70B at 64-1024 GPUs instead of the published table")
    p.add_argument("--mfu", type=float, default=0.4, help="--extrapolate: compute efficiency (assumed)")
    p.add_argument("--link-efficiency", type=float, default=0.7, help="--extrapolate: share of the nominal link")
    p.add_argument(
        "--kernel-efficiency", type=float, default=0.7, help="quantization kernels' share of HBM bandwidth (assumed)"
    )
    p.add_argument(
        "--gpu-report",
        metavar="GPU_REPORT_JSON",
        help="take --kernel-efficiency from a GPU check's gpu_report.json (the codec kernels' median GB/s "
        "over the device's own measured copy GB/s) instead of assuming it",
    )


def kernel_efficiency_from_report(path: str) -> float:
    """The codec kernels' measured share of memory bandwidth: the median over the `throughput`
    step's kernels of kernel GB/s / copy GB/s of the same bytes (both read + written), from a
    GPU run of `sdpq check gpu`. A copy is what the model's HBM bandwidth stands for."""
    with open(path) as f:
        doc = json.load(f)
    if doc.get("meta", {}).get("rehearsal"):
        raise ValueError(f"{path}: a rehearsal on the CPU; the scaling model needs a GPU run's report")
    step = next((s for s in doc.get("steps", []) if s.get("name") == "throughput"), None)
    if step is None or step.get("status") != "pass":
        raise ValueError(f"{path}: no passing 'throughput' step to take kernel times from")
    shares = [v["of_copy"] for v in step["figures"].values() if isinstance(v, dict) and "of_copy" in v]
    if not shares:
        raise ValueError(f"{path}: the 'throughput' step has no kernel figures")
    return float(statistics.median(shares))


def _saved_ns_per_param(c: Cluster, m: GPT, lay: Layout, b: float, q: float) -> float:
    """Seconds per step SDP4Bit saved over the baseline, per parameter (ns), from the published
    TFLOP/s alone; a bytes / bandwidth model has one value per cluster whatever the size."""
    return m.flops(lay.global_batch) / c.gpus * (1 / b - 1 / q) / 1e12 / m.params * 1e9


def _lacks(err_b: float, err_q: float, saved: float, saved_small: float, lay: Layout) -> str:
    """What the model lacks where a cell misses by more than 25%."""
    if max(abs(err_b), abs(err_q)) <= 0.25:
        return ""
    why = [] if lay.tp * lay.pp == 1 else ["the TP/PP runs' micro-batching and overlap"]
    if saved > 1.5 * saved_small:
        why.append(f"a cost per parameter {saved / saved_small:.1f}x the small models' (not bytes/bandwidth)")
    else:
        why.append("the fit's compromise with the larger models' regime")
    return "; ".join(why)


def published_table(kernel_efficiency: float = 0.7) -> list[dict]:
    records = []
    for c in (A100, H800):
        k = fit(c, base=Constants(mfu=0.5, link_efficiency=1.0, kernel_efficiency=kernel_efficiency))
        small = MODELS["1.3B"]
        b0, q0, lay0 = PUBLISHED[(c.name, small.name)]
        saved_small = _saved_ns_per_param(c, small, lay0, b0, q0)
        for name, m in MODELS.items():
            b, q, lay = PUBLISHED[(c.name, name)]
            pb, pq, ps = (tflops(c, m, lay, s, k) for s in ("baseline", "sdp4bit", "sdpq"))
            saved = _saved_ns_per_param(c, m, lay, b, q)
            records.append(
                dict(
                    cluster=c.name,
                    model=name,
                    layout=f"TP{lay.tp} PP{lay.pp}",
                    published_baseline=b,
                    baseline=pb,
                    baseline_error=pb / b - 1,
                    published_sdp4bit=q,
                    sdp4bit=pq,
                    sdp4bit_error=pq / q - 1,
                    sdpq=ps,
                    cell="fit" if name in FIT_ON else "predicted",
                    published_saved_ns_per_param=saved,
                    model_lacks=_lacks(pb / b - 1, pq / q - 1, saved, saved_small, lay),
                    assumptions=f"mfu={k.mfu} link_efficiency={k.link_efficiency} (fitted on {', '.join(FIT_ON)}); "
                    f"weight_gathers={k.weight_gathers} kernel_passes={k.kernel_passes} "
                    f"kernel_efficiency={k.kernel_efficiency}; global batch {lay.global_batch}, seq {m.seq}",
                )
            )
    return records


def extrapolation(args: argparse.Namespace) -> list[dict]:
    k = Constants(mfu=args.mfu, link_efficiency=args.link_efficiency, kernel_efficiency=args.kernel_efficiency)
    models = {"7B": (GPT("7B", 32, 4096, seq=4096), Layout(global_batch=1024)),
              "70B": (GPT("70B", 80, 8192, seq=4096), Layout(tp=8, global_batch=1024))}  # fmt: skip
    records = []
    for gbit in (100, 400):
        for gpus in (64, 256, 1024):
            c = Cluster(f"{gpus // 8}x8 H100, {gbit} Gbit/s", gpus // 8, 8, gbit, 450, 989, 3350)
            for name, (m, lay) in models.items():
                t = {s: step_seconds(c, m, lay, s, k)["total"] for s in ("baseline", "zeropp", "sdp4bit", "sdpq")}
                records.append(
                    dict(
                        cluster=c.name,
                        model=name,
                        layout=f"TP{lay.tp} PP{lay.pp}",
                        baseline_tflops=tflops(c, m, lay, "baseline", k),
                        sdpq_tflops=tflops(c, m, lay, "sdpq", k),
                        sdpq_vs_baseline=t["baseline"] / t["sdpq"],
                        sdpq_vs_zeropp=t["zeropp"] / t["sdpq"],
                        sdpq_vs_sdp4bit=t["sdp4bit"] / t["sdpq"],
                        assumptions=f"mfu={k.mfu} link_efficiency={k.link_efficiency} (assumed, not fitted); "
                        f"kernel_efficiency={k.kernel_efficiency}; global batch {lay.global_batch} x {m.seq} tokens; "
                        "no overlap of communication with compute",
                    )
                )
    return records


def run(args: argparse.Namespace) -> list[dict]:
    if args.gpu_report:
        args.kernel_efficiency = kernel_efficiency_from_report(args.gpu_report)
    return extrapolation(args) if args.extrapolate else published_table(args.kernel_efficiency)
