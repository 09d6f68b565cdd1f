"""Headline rows about DeepSpeed ZeRO-1 and ZeRO-2 (for benchmarks/results_page.py), from
benchmarks/deepspeed_zero12.py: the config with the "sdpq" block against the same config without
it over three seeds, and the other settings (below four bits, error feedback) on one seed. The byte
figures come from benchmarks/recount_bytes.py's least-traffic recount where it has the arm, else
from the study's own count. Standard library only."""

from __future__ import annotations

import results_recount


def _where(src) -> str:
    seeds = ", ".join(str(k) for k in src.data["runs"])
    a = src.data["args"]
    return f"Llama-shaped model, bf16, accumulation 2, seed{'s' if ',' in seeds else ''} {seeds}, {a['steps']} steps"


def _label(stage: str) -> str:
    """ "1", "2", "1-fp32" (ZeRO-1 with fp32 gradient accumulation: DeepSpeed's BF16_Optimizer)."""
    if stage.endswith("-fp32"):
        return f"ZeRO-{stage.split('-')[0]} with fp32 gradient accumulation"
    return f"ZeRO-{stage}"


def _bytes_row(src, recount, key: str, stage: str, arm: str, counted_as, recounted_as):
    """Cross-node bytes of `arm` against plain at `stage`: recounted on steady steps where the
    recount has the arm (the row says `recounted_as(protocol)`), else the study's own mean over its
    steps (`counted_as`)."""
    counted = results_recount.steady(recount, src.name, stage)
    if arm in counted and "plain" in counted:
        protocol = (
            "deepspeed_zero12.py's Llama-shaped model and protocol, bf16, accumulation 2, sequences of "
            f"{src.data['args']['seq_len']}; {results_recount.how(recount, src.name)}"
        )
        return recount.row(
            key,
            recounted_as(protocol),
            f"{counted[arm] / 1e6:.2f} MB",
            f"{counted['plain'] / 1e6:.2f} MB",
            f"{counted[arm] / counted['plain']:.3f}",
        )
    base, q = src.data["summary"][stage]["plain"], src.data["summary"][stage][arm]
    mb, base_mb = q["bytes_per_step"] / 1e6, base["bytes_per_step"] / 1e6
    return src.row(key, counted_as, f"{mb:.2f} MB", f"{base_mb:.2f} MB", f"{q['bytes_ratio']:.3f}")


def zero12_rows(src, recount=None) -> list:
    where, rows = _where(src), []
    for stage, arms in src.data["summary"].items():
        base, q, label = arms["plain"], arms["sdpq"], _label(stage)
        rows += [
            _bytes_row(
                src,
                recount,
                f"bytes-zero{stage}",
                stage,
                "sdpq",
                f"cross-node bytes per step vs {label} without the block, process-group meter ({where})",
                lambda protocol, label=label: (
                    f"cross-node bytes per steady step vs {label} without the block, process-group meter ({protocol})"
                ),
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


def variant_rows(src, recount=None) -> list:
    """The other arms (below four bits, error feedback): bytes, with the final loss in the text."""
    where, rows = _where(src), []
    for stage, arms in src.data["summary"].items():
        base = arms["plain"]
        for arm, (suffix, what) in VARIANTS.items():
            if arm not in arms:
                continue
            q = arms[arm]
            head = f"{_label(stage)}, {what}"
            loss = f"final loss {q['final_loss_mean']:.4f} vs {base['final_loss_mean']:.4f}"
            rows.append(
                _bytes_row(
                    src,
                    recount,
                    f"bytes-zero{stage}-{suffix}",
                    stage,
                    arm,
                    f"{head}: cross-node bytes per step ({loss}; {where})",
                    lambda protocol, head=head, loss=loss: (
                        f"{head}: cross-node bytes per steady step, process-group meter ({loss} in "
                        f"`{src.name}`: {where}; bytes: {protocol})"
                    ),
                )
            )
    return rows
