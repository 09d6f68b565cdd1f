"""Headline rows about DistributedDataParallel (for benchmarks/results_page.py), from
benchmarks/ddp_seeds.py: sdpq's comm hook against DDP's own fp32 all-reduce over three seeds.
Standard library only."""

from __future__ import annotations


def ddp_rows(src) -> list:
    s = src.data["summary"]
    seeds = ", ".join(str(k) for k in src.data["runs"])
    where = f"Llama-shaped model, bf16 autocast, seeds {seeds}, {src.data['args']['steps']} steps"
    base, q = s["ddp"], s["sdpq"]
    rows = [
        src.row(
            "bytes-ddp",
            f"cross-node bytes per step vs DDP's fp32 all-reduce, process-group meter ({where})",
            f"{q['bytes_per_step'] / 1e6:.2f} MB",
            f"{base['bytes_per_step'] / 1e6:.2f} MB",
            f"{q['bytes_ratio']:.3f}",
        ),
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
            rows.append(
                src.row(
                    f"bytes-ddp-{arm}",
                    f"cross-node bytes per step vs DDP's fp32 all-reduce, {label} ({where})",
                    f"{s[arm]['bytes_per_step'] / 1e6:.2f} MB",
                    f"{base['bytes_per_step'] / 1e6:.2f} MB",
                    f"{s[arm]['bytes_ratio']:.3f}",
                )
            )
    return rows
