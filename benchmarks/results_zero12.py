"""Headline rows about DeepSpeed ZeRO-1 and ZeRO-2 (for benchmarks/results_page.py), from
benchmarks/deepspeed_zero12.py: the config with the "sdpq" block against the same config without
it over three seeds, and the other settings (below four bits, error feedback) on one seed. Standard
library only."""

from __future__ import annotations


def _where(src) -> str:
    seeds = ", ".join(str(k) for k in src.data["runs"])
    a = src.data["args"]
    return f"Llama-shaped model, bf16, accumulation 2, seed{'s' if ',' in seeds else ''} {seeds}, {a['steps']} steps"


def _label(stage: str) -> str:
    """ "1", "2", "1-fp32" (ZeRO-1 with fp32 gradient accumulation: DeepSpeed's BF16_Optimizer)."""
    if stage.endswith("-fp32"):
        return f"ZeRO-{stage.split('-')[0]} with fp32 gradient accumulation"
    return f"ZeRO-{stage}"


def zero12_rows(src) -> list:
    where, rows = _where(src), []
    for stage, arms in src.data["summary"].items():
        base, q, label = arms["plain"], arms["sdpq"], _label(stage)
        rows += [
            src.row(
                f"bytes-zero{stage}",
                f"cross-node bytes per step vs {label} without the block, process-group meter ({where})",
                f"{q['bytes_per_step'] / 1e6:.2f} MB",
                f"{base['bytes_per_step'] / 1e6:.2f} MB",
                f"{q['bytes_ratio']:.3f}",
            ),
            src.row(
                f"loss-zero{stage}",
                f"final training loss vs {label} without the block, mean over seeds ({where})",
                f"{q['final_loss_mean']:.4f}",
                f"{base['final_loss_mean']:.4f} (sd {base['final_loss_sd']:.4f})",
                f"{q['diff_in_baseline_sd']:+.2f} sd",
            ),
        ]
    return rows


# arm -> (row key suffix, what the arm changes)
VARIANTS = {
    "sdpq3": ("3bit", "3-bit weight differences and inter-node gradients"),
    "sdpq2": ("2bit", "2-bit weight differences and inter-node gradients"),
    "sdpq-ef": ("ef", "the default block with error feedback on the inter-node gradients"),
}


def variant_rows(src) -> list:
    """The other arms (below four bits, error feedback): bytes, with the final loss in the text."""
    where, rows = _where(src), []
    for stage, arms in src.data["summary"].items():
        base = arms["plain"]
        for arm, (suffix, what) in VARIANTS.items():
            if arm not in arms:
                continue
            q = arms[arm]
            rows.append(
                src.row(
                    f"bytes-zero{stage}-{suffix}",
                    f"{_label(stage)}, {what}: cross-node bytes per step (final loss "
                    f"{q['final_loss_mean']:.4f} vs {base['final_loss_mean']:.4f}; {where})",
                    f"{q['bytes_per_step'] / 1e6:.2f} MB",
                    f"{base['bytes_per_step'] / 1e6:.2f} MB",
                    f"{q['bytes_ratio']:.3f}",
                )
            )
    return rows
