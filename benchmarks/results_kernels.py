"""Headline rows about the GPU kernels' cost (for benchmarks/results_page.py): instructions per
element on sm_90 against the bandwidth budget (benchmarks/kernel_budget.py, no GPU needed), and
the GPU check's speed steps where a report holds them (else "not yet measured"). Standard
library only."""

from __future__ import annotations

NOT_YET = "not yet measured"


def budget_rows(src) -> list:
    cases = src.data["cases"]
    over = [r for r in cases if r["per_element"] > r["budget"]]
    over_text = "; ".join(f"{r['case']} {r['per_element']:.0f} / {r['budget']:.0f}" for r in over) or "none"
    worst = max(cases, key=lambda r: r["per_element"] / r["budget"])
    return [
        src.row(
            "kernel-issue-budget",
            "Triton kernels compiled for an H100 (sm_90): instructions issued per element against the budget "
            f"0.8 of HBM bandwidth leaves, {len(cases)} launches of a training step (over budget: {over_text})",
            f"{len(cases) - len(over)} of {len(cases)} within",
            "budget = 12.5 x bytes moved per element",
            f"worst {worst['per_element'] / worst['budget']:.2f} of budget",
        )
    ]


def speed_rows(src, unrecorded) -> list:
    """The speed steps of a GPU report (throughput timed back to back, adamw_speed, step_share);
    rows saying "not yet measured" where no report with them exists."""
    steps = {s["name"]: s for s in src.data["steps"]} if src.exists else {}
    tp, adamw, share = steps.get("throughput"), steps.get("adamw_speed"), steps.get("step_share")
    new_timing = tp is not None and all("of_copy_one_launch" in v for v in tp["figures"].values())
    rows = []
    if new_timing and adamw is not None and share is not None:
        device = steps["env"]["figures"]["device"]
        k = tp["figures"]
        a, s = adamw["figures"], share["figures"]["1.3B"]
        rows += [
            src.row(
                "gpu-kernels-back-to-back",
                f"codec kernels vs a device copy of the bytes they move, 20 launches per event pair, one {device} "
                f"({', '.join(k)})",
                " / ".join(f"{v['of_copy']:.2f}" for v in k.values()),
                "goal 0.8 each",
                " / ".join(f"{v['of_copy_one_launch']:.2f}" for v in k.values()) + " with one launch per pair",
            ),
            src.row(
                "gpu-adamw-vs-fused",
                f"sdpq AdamW step (FP8 states, MCF master) vs torch's fused fp32 AdamW, {a['parameters']} "
                f"parameters, one {device}",
                f"{a['sdpq_adamw_ms']:.2f} ms",
                f"{a['fused_adamw_ms']:.2f} ms",
                f"{a['of_fused']:.2f} (goal <= 0.6)",
            ),
            src.row(
                "gpu-step-share-1p3b",
                f"sdpq's codec + AdamW per block over a 1.3B-shaped block's forward + backward, one {device}",
                f"{s['codec_ms_per_block'] + s['adamw_ms_per_block']:.2f} ms",
                f"{s['forward_backward_ms_per_block']:.2f} ms",
                f"{s['share_of_compute']:.3f} (goal <= 0.05)",
            ),
        ]
    else:
        for key, what in (
            ("gpu-kernels-back-to-back", "codec kernels vs a device copy, 20 launches per event pair (goal 0.8)"),
            ("gpu-adamw-vs-fused", "sdpq AdamW step vs torch's fused fp32 AdamW on a GPU (goal <= 0.6)"),
            ("gpu-step-share-1p3b", "sdpq's codec + AdamW over a 1.3B-shaped block's forward + backward (goal 5%)"),
        ):
            rows.append(unrecorded(key, what))
    return rows
