"""The bytes / loss frontier below four bits: cross-node bytes against final loss for every
(weight-difference bits, inter-node gradient bits, gradient error feedback) in
{4, 3, 2} x {4, 3, 2} x {off, on}, next to the bf16 baseline on the same seed and data.

The protocol is the long-run study's (benchmarks/convergence_long.py: the Llama-shaped model,
4 gloo ranks as 2 nodes x 2, the same schedule and data, the independent byte meter) shortened
for a screen: one seed, a few hundred steps, FSDP2. Each setting is one arm on top of the
default "sdpq" block; finished arms are cached next to --out, so an interrupted screen resumes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/frontier.py --steps 200      # ~20 min on 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/frontier.py --replot

Writes --out (JSON: every arm's losses, bytes and the summary) and a PNG (bytes ratio against
final-loss difference, one point per setting).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import convergence_long as cl  # noqa: E402
from benchmarks.provenance import provenance  # noqa: E402

TAG = "[frontier]"
WIDTHS = (4, 3, 2)


def setting_name(w: int, g: int, ef: bool) -> str:
    return f"w{w}-g{g}" + ("-ef" if ef else "")


def block(w: int, g: int, ef: bool) -> dict:
    """The long-run study's block (the defaults) with the weights' and the inter-node gradients'
    widths set."""
    return {**cl.SDPQ, "weights": {"bits": w}, "gradients": {"inter_bits": g, "error_feedback": ef}}


def arms(settings: list[tuple[int, int, bool]]) -> dict:
    out: dict = {"baseline": cl.ARMS["baseline"]}
    for w, g, ef in settings:
        out[setting_name(w, g, ef)] = (block(w, g, ef), True)
    return out


def parse_settings(text: str) -> list[tuple[int, int, bool]]:
    """ "all" or names like w3-g2-ef, comma-separated."""
    every = [(w, g, ef) for w in WIDTHS for g in WIDTHS for ef in (False, True)]
    if text == "all":
        return every
    by_name = {setting_name(*s): s for s in every}
    out = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        if name not in by_name:
            raise SystemExit(f"--settings: {name!r}; allowed: all, or names like {', '.join(list(by_name)[:3])}, ...")
        out.append(by_name[name])
    return out


def summarize(results: dict) -> list[dict]:
    """One row per setting: bytes per step and their ratio to the baseline's, final loss (mean
    of the last 50 steps) and its difference in percent, validation loss."""
    base = results["baseline"]
    b_loss, b_bytes = cl.final_loss(base["losses"]), base["meter_cross_node_bytes_per_step"]
    rows = []
    for name, r in results.items():
        loss = cl.final_loss(r["losses"])
        rows.append(
            {
                "setting": name,
                "bytes_per_step": r["meter_cross_node_bytes_per_step"],
                "bytes_ratio": r["meter_cross_node_bytes_per_step"] / b_bytes,
                "final_loss": loss,
                "loss_diff_percent": 100 * (loss - b_loss) / b_loss,
                "val_loss": r["val_loss"],
                "val_diff_percent": 100 * (r["val_loss"] - base["val_loss"]) / base["val_loss"],
            }
        )
    return sorted(rows, key=lambda row: row["bytes_ratio"])


def pareto(rows: list[dict]) -> list[str]:
    """Settings no other setting beats on both bytes and final loss."""
    out = []
    for r in rows:
        if r["setting"] == "baseline":
            continue
        dominated = any(
            o is not r
            and o["setting"] != "baseline"
            and o["bytes_ratio"] <= r["bytes_ratio"]
            and o["final_loss"] <= r["final_loss"]
            and (o["bytes_ratio"] < r["bytes_ratio"] or o["final_loss"] < r["final_loss"])
            for o in rows
        )
        if not dominated:
            out.append(r["setting"])
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    front = set(pareto(rows))
    top = 4.0  # percent: settings far above (a diverging arm) are drawn on the top edge, value in the label
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        if r["setting"] == "baseline":
            continue
        ef, y = r["setting"].endswith("-ef"), r["loss_diff_percent"]
        off = y > top
        ax.scatter(
            r["bytes_ratio"], min(y, top), marker="^" if off else ("s" if ef else "o"),
            color="tab:red" if r["setting"] in front else ("tab:grey" if ef else "tab:blue"), zorder=3,
        )  # fmt: skip
        label = f"{r['setting']} ({y:+.0f}%)" if off else r["setting"]
        ax.annotate(label, (r["bytes_ratio"], min(y, top)), fontsize=7, xytext=(4, -10 if off else 2),
                    textcoords="offset points", rotation=0 if off else 20)  # fmt: skip
    ax.set_ylim(-1.0, top + 0.3)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.axvline(0.10, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("cross-node bytes per step / bf16 baseline's (independent meter)")
    ax.set_ylabel("final training loss vs bf16 baseline (%)\nred: Pareto front; squares/grey: error feedback")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _relative(path: str) -> str:
    """A path inside the repository as the repository names it (the results page shows it)."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--framework", default="fsdp2", choices=list(cl.FRAMEWORKS))
    ap.add_argument("--settings", default="all", help='"all" or names like w3-g2-ef, comma-separated')
    cl.add_model_arguments(ap)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "frontier_fsdp2_200steps.json"))
    ap.add_argument("--replot", action="store_true", help="only redraw the plot of an existing --out JSON")
    args = ap.parse_args(argv)
    out = Path(args.out)
    title = f"{args.framework}, Llama-shaped model, seed {args.seed}, {args.steps} steps, 2 nodes x 2 ranks (gloo)"
    if args.replot:
        plot(json.loads(out.read_text())["summary"], out.with_suffix(".png"), title)
        return 0
    every = arms(parse_settings(args.settings))
    parts = out.with_suffix(".parts")  # each finished arm, so that an interrupted screen resumes
    parts.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    t0 = time.time()
    for name, arm in every.items():
        part = parts / f"{args.framework}_seed{args.seed}_{args.steps}steps_{name}.json"
        if part.exists():
            results[name] = json.loads(part.read_text())
            continue
        t = time.time()
        results[name] = cl.run_job(args, args.framework, args.seed, {name: arm})[name]
        part.write_text(json.dumps(results[name]))
        r = results[name]
        print(
            f"{TAG} {name}: final loss {cl.final_loss(r['losses']):.4f}, val {r['val_loss']:.4f}, "
            f"cross-node {r['meter_cross_node_bytes_per_step'] / 1e6:.3f} MB/step ({time.time() - t:.0f} s)",
            flush=True,
        )
    rows = summarize(results)
    meta = {"world": f"{cl.WORLD // cl.RPN} nodes x {cl.RPN} ranks (gloo)", "wall_seconds": time.time() - t0}
    meta.update(provenance())
    shown = {**vars(args), "out": _relative(args.out)}
    doc = {"args": shown, "meta": meta, "pareto": pareto(rows), "summary": rows, "runs": results}
    out.write_text(json.dumps(doc, indent=1))
    plot(rows, out.with_suffix(".png"), title)
    for r in rows:
        print(
            f"{r['setting']:>12}  bytes {r['bytes_ratio']:.3f}  loss {r['final_loss']:.4f} "
            f"({r['loss_diff_percent']:+.2f}%)  val {r['val_loss']:.4f} ({r['val_diff_percent']:+.2f}%)"
        )
    print(f"pareto: {', '.join(doc['pareto'])}\nwrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
