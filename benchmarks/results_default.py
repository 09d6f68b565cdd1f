"""Headline rows about sdpq's default block (for benchmarks/results_page.py): its cross-node bytes
against bf16 FSDP2 and ZeRO-3 at 2 nodes x 4 ranks (benchmarks/plan_bytes_check.py, with the
plan's figure beside the measured one), and the scale study that decided it
(benchmarks/hf_llama_seeds.py on a 14.4M-parameter Llama, 300 steps). Standard library only."""

from __future__ import annotations

# The scale study's arms by their settings (benchmarks/hf_llama_seeds.py's ARMS), not `default`,
# whose meaning changed on 2026-11-28: arm -> (row key suffix, what it runs).
SCALE_ARMS = {
    "w2-g4-bf16": ("default", "the default block: 2-bit weight differences, bf16 gradient scales"),
    "w2-g4": ("w2-fp32", "2-bit weight differences, fp32 gradient scales"),
    "w4-g4": ("w4", "4-bit weight differences, fp32 gradient scales (the default until 2026-11-28)"),
}
_FRAMEWORKS = {
    "fsdp2": "bf16 FSDP2 (fp32 reduce)",
    "zero3": "bf16 ZeRO-3 (parameters re-gathered in the backward, as at scale)",
}


def plan_check_rows(src, layout: str = "2x4") -> list:
    """sdpq's default against plain, measured on live runs and planned, at `layout`."""
    by = {(r["framework"], r["layout"], r["arm"]): r for r in src.data["rows"]}
    rows = []
    for fw, label in _FRAMEWORKS.items():
        plain, q = by.get((fw, layout, "plain")), by.get((fw, layout, "sdpq"))
        if plain is None or q is None:
            continue
        measured = q["measured_per_node_per_step"] / plain["measured_per_node_per_step"]
        planned = q["planned"]["total"] / plain["planned"]["total"]
        rows.append(
            src.row(
                f"bytes-default-{fw}",
                f"cross-node bytes per steady step vs {label}, sdpq's default block (Llama-shaped "
                f"model of sdpq.train, 1.74 M parameters, {layout.replace('x', ' nodes x ')} gloo ranks, "
                f"least traffic per node; `sdpq plan` says {planned:.3f})",
                f"{q['measured_per_node_per_step'] / 1e6:.3f} MB",
                f"{plain['measured_per_node_per_step'] / 1e6:.3f} MB",
                f"{measured:.3f}",
            )
        )
    return rows


def scale_rows(src) -> list:
    """The scale study: each arm's final loss against bf16 FSDP2's over the seeds it ran, and its
    steady cross-node bytes."""
    rows = []
    for hidden, x in src.data["summary"].items():
        params = src.data["params"][hidden] / 1e6
        base_seeds = ", ".join(src.data["runs"][hidden])
        for arm, (suffix, what) in SCALE_ARMS.items():
            if arm not in x:
                continue
            a = x[arm]
            seeds = ", ".join(a["seeds"])
            where = (
                f"Hugging Face Llama, {params:.1f}M parameters, FSDP2, 4 ranks as 2 nodes x 2, "
                f"{src.data['args']['steps']} steps, seed{'s' if len(a['seeds']) > 1 else ''} {seeds}; {what}"
            )
            ratios = ", ".join(f"{r:.4f}" for r in a["ratio_to_baseline_per_seed"])
            rows.append(
                src.row(
                    f"loss-scale-{suffix}",
                    f"training loss vs bf16 FSDP2, mean of the last 10 steps, mean over seeds ({where})",
                    f"{a['mean']:.4f}",
                    f"{a['baseline_mean_same_seeds']:.4f} (seeds {base_seeds}: sd {x['baseline_sd']:.4f})"
                    if x["baseline_sd"]
                    else f"{a['baseline_mean_same_seeds']:.4f}",
                    f"{a['mean'] / a['baseline_mean_same_seeds']:.4f} (per seed {ratios})",
                )
            )
            steady = x["cross_node_bytes_per_step"]
            rows.append(
                src.row(
                    f"bytes-scale-{suffix}",
                    f"cross-node bytes per steady step vs bf16 FSDP2 (fp32 reduce), process-group meter ({where})",
                    f"{steady[arm] / 1e6:.2f} MB",
                    f"{steady['baseline'] / 1e6:.2f} MB",
                    f"{x['bytes_ratio_to_baseline'][arm]:.3f}",
                )
            )
    return rows
