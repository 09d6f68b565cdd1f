"""Headline rows about DistributedDataParallel (for benchmarks/results_page.py), from
benchmarks/ddp_seeds.py: sdpq's comm hook against DDP's own fp32 all-reduce over three seeds. The
byte figures come from benchmarks/recount_bytes.py's least-traffic recount where it has the arm,
else from the study's own count. Standard library only."""

from __future__ import annotations

import results_recount


def _bytes_row(src, recount, key: str, against: str, where: str, arm: str):
    """Cross-node bytes of `arm` against DDP's fp32 all-reduce (`against`: ", the hook" or ""):
    recounted on steady steps, else the study's own mean over its steps."""
    counted = results_recount.steady(recount, src.name, "ddp")
    if arm in counted and "ddp" in counted:
        how = results_recount.how(recount, src.name)
        return recount.row(
            key,
            f"cross-node bytes per steady step vs DDP's fp32 all-reduce{against}, process-group meter "
            f"(ddp_seeds.py's Llama-shaped model and protocol, bf16 autocast; {how})",
            f"{counted[arm] / 1e6:.2f} MB",
            f"{counted['ddp'] / 1e6:.2f} MB",
            f"{counted[arm] / counted['ddp']:.3f}",
        )
    s = src.data["summary"]
    return src.row(
        key,
        f"cross-node bytes per step vs DDP's fp32 all-reduce{against or ', process-group meter'} ({where})",
        f"{s[arm]['bytes_per_step'] / 1e6:.2f} MB",
        f"{s['ddp']['bytes_per_step'] / 1e6:.2f} MB",
        f"{s[arm]['bytes_ratio']:.3f}",
    )


def ddp_rows(src, recount=None) -> list:
    s = src.data["summary"]
    seeds = ", ".join(str(k) for k in src.data["runs"])
    where = f"Llama-shaped model, bf16 autocast, seeds {seeds}, {src.data['args']['steps']} steps"
    base, q = s["ddp"], s["sdpq"]
    rows = [
        _bytes_row(src, recount, "bytes-ddp", "", where, "sdpq"),
        src.row(
            "loss-ddp",
            f"final training loss vs DDP, mean over seeds ({where})",
            f"{q['final_loss_mean']:.4f}",
            f"{base['final_loss_mean']:.4f} (sd {base['final_loss_sd']:.4f})",
            f"{q['diff_in_baseline_sd']:+.2f} sd",
        ),
    ]
    for arm, label in (("fp16", "torch's fp16_compress_hook"), ("powersgd", "torch's PowerSGD, rank 4")):
        if arm in s:
            rows.append(_bytes_row(src, recount, f"bytes-ddp-{arm}", f", {label}", where, arm))
    return rows
