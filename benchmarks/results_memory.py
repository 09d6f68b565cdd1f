"""Headline rows about memory (for benchmarks/results_page.py): what a GPU keeps, measured on the
CPU layouts by benchmarks/plan_check.py (sdpq.memory's report, rank 0, just before the last
optimizer step), how far `sdpq plan` is from it, and the planned per-GPU memory of Llama-2 70B
on nodes of 8 GPUs (benchmarks/memory_table.py). Standard library only."""

from __future__ import annotations

from typing import Any

LABELS = {"fsdp2": "FSDP2", "hsdp": "HSDP", "zero3": "ZeRO-3"}


def _per_param(run: dict, kinds: Any = None) -> float:
    r0 = run["ranks"][0]
    got = r0["measured"]
    return sum(got[k] for k in (kinds or r0["planned"])) / run["model_numel"]


def measured_rows(src) -> list:
    """Per framework at 2x2: model state per GPU (sdpq's default vs plain), the weight reference
    at 2x2 and on one node, and the plan's largest error over every run."""
    runs = {(r["framework"], r["layout"], r["arm"]): r for r in src.data["rows"]}
    rows = []
    for fw, label in LABELS.items():
        plain, with_sdpq = runs.get((fw, "2x2", "plain")), runs.get((fw, "2x2", "sdpq"))
        if plain is None or with_sdpq is None:
            continue
        a, b = _per_param(with_sdpq), _per_param(plain)
        rows.append(
            src.row(
                f"memory-{fw}",
                f"model state per GPU (B/param, measured by sdpq.memory), bf16 {label} at 2x2, sdpq's default",
                f"{a:.3f}",
                f"{b:.3f}",
                f"{a / b:.2f}",
            )
        )
    for layout, arm in (("2x2", "sdpq"), ("2x2", "sdpq-int8"), ("1x4", "sdpq")):
        run = runs.get(("fsdp2", layout, arm))
        if run is not None:
            ref = _per_param(run, ["weight_reference"])
            kind = "int8" if arm == "sdpq-int8" else "bf16 (the compute dtype)"
            rows.append(
                src.row(
                    f"reference-{layout}" + ("-int8" if arm == "sdpq-int8" else ""),
                    f"weight reference per GPU (B/param, measured), FSDP2 at {layout}, {kind}",
                    f"{ref:.3f}",
                    "2/L (ZeRO++'s hpZ copy, planned)",
                    "n/a",
                )
            )
    worst = max(r["max_abs_relative_difference"] for r in src.data["rows"])
    layouts = sorted({r["layout"] for r in src.data["rows"]})
    rows.append(
        src.row(
            "plan-vs-measured",
            f"largest difference of `sdpq plan` from the measured memory, any kind and rank ({', '.join(layouts)}; "
            "FSDP2, HSDP, ZeRO-3; plain and sdpq)",
            f"{100 * worst:.2f}%",
            "n/a",
            "n/a",
        )
    )
    return rows


def planned_rows(src, model: str = "70b", nodes: int = 4) -> list:
    """Planned GB per GPU of Llama-2 `model` on `nodes` nodes of 8 GPUs (ZeRO-3), per configuration."""
    arms = src.data["bytes"][model]["zero3"]
    plain = arms["bf16"][str(nodes)]
    rows = []
    for arm, key in (("sdpq", "sdpq"), ("sdpq int8 reference", "int8"), ("ZeRO++ (hpZ+qwZ+qgZ)", "zeropp")):
        gb = arms[arm][str(nodes)]
        rows.append(
            src.row(
                f"plan-{model}-{nodes}nodes-{key}",
                f"planned model state per GPU (GB), Llama-2 {model}, ZeRO-3, {nodes} nodes x 8 GPUs, {arm} vs bf16",
                f"{gb / 1e9:.1f}",
                f"{plain / 1e9:.1f}",
                f"{gb / plain:.2f}",
            )
        )
    return rows
