"""DeepSpeed ZeRO-3 with and without sdpq: convergence, cross-node bytes, resume (4 ranks, 2x2).

Trains the small GPT (sdpq/train/model.py defaults, bf16, 200 steps, peak lr 1e-3) with ZeRO-3
on 4 gloo ranks laid out as 2 simulated nodes x 2 ranks, once per configuration, each run its own
launch of fresh processes (torchrun by default; `--launcher deepspeed` / `mpirun` use those):

  baseline  plain ZeRO-3 (no "sdpq" block)
  exact     an "sdpq" block with every path exact: must equal the baseline bit for bit; its
            statistics are the baseline's cross-node bytes
  full      the full sdpq block: 4-bit weight differences, two-level 8/4-bit gradients,
            FP8 AdamW states with MCF master weights; saves a checkpoint after step 100
  weights / gradients / optimizer   each path alone
  resume    `full` resumed from its step-100 checkpoint in fresh processes

Prints final losses and their ratios to the baseline, cross-node bytes per step and the ratio,
the resume comparison and time per step, and writes everything to a JSON file.

    OMP_NUM_THREADS=1 python benchmarks/deepspeed_convergence.py [--steps 200] [--out FILE]
    python benchmarks/deepspeed_convergence.py --quick --launcher mpirun      # launcher smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the deepspeed launcher does not set it (8x slower)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
from sdpq.launch.local import LAUNCHERS, run_local  # noqa: E402
from sdpq.train.run import RunSpec  # noqa: E402
from sdpq.train.settings import EXACT  # noqa: E402 (bitwise the plain framework, bytes counted)

FULL = {
    "weights": {"mode": "diff"},
    "gradients": {"mode": "two_level"},
    "optimizer": {"enabled": True, "states": "fp8", "master": "mcf"},
    "workarounds": {"deepspeed_alias_bf16_master": True},
}
RUNS = {
    "baseline": None,
    "exact": EXACT,
    "full": FULL,
    "weights": {**EXACT, "weights": {"mode": "diff"}},
    "gradients": {**EXACT, "gradients": {"mode": "two_level"}},
    "gradients_nohad": {**EXACT, "gradients": {"mode": "two_level", "hadamard": False}},
    "comms": {**FULL, "optimizer": {"enabled": False}},
    "optimizer": {**EXACT, "optimizer": FULL["optimizer"]},
}


# ----------------------------------------------------------------------------- worker (one rank)


def worker(spec_file: str, result_file: str) -> None:
    import torch

    torch.set_num_threads(1)
    import sdpq.integrations.deepspeed as sds
    from sdpq.train import deepspeed_backend

    # Rank/world from torchrun or the deepspeed launcher (env://), or from MPI under mpirun.
    sds.init_distributed(dist_backend="gloo", auto_mpi_discovery=True)
    import torch.distributed as dist

    with open(spec_file) as f:
        job = json.load(f)
    spec = RunSpec.from_dict(job["spec"])
    t0 = time.perf_counter()
    r = deepspeed_backend.train(spec, ds_overrides=job.get("ds_overrides"))
    wall = time.perf_counter() - t0
    if dist.get_rank() == 0:
        out = dataclasses.asdict(r)
        out["wall_seconds"] = wall
        out["launch_env"] = {
            k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
        }
        with open(result_file, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver


def launch(
    spec, launcher: str, nproc: int, workdir: Path, name: str, timeout: float, ds_overrides: dict | None = None
) -> dict:
    spec_file, result_file = workdir / f"{name}.spec.json", workdir / f"{name}.result.json"
    spec_file.write_text(json.dumps({"spec": dataclasses.asdict(spec), "ds_overrides": ds_overrides}))
    if result_file.exists():
        result_file.unlink()
    me = [str(Path(__file__).resolve()), "--worker", str(spec_file), str(result_file)]
    t0 = time.perf_counter()
    log = workdir / f"{name}.log"
    code = run_local(me, nproc, launcher=launcher, log=log, timeout=timeout)
    if code != 0 or not result_file.exists():
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"run {name!r} ({launcher}) failed with exit code {code}:\n{tail}")
    out = json.loads(result_file.read_text())
    out["launch_seconds"] = time.perf_counter() - t0
    out["launcher"] = launcher
    return out


def _inter(r: dict) -> dict:
    tot = r["comm"]["total"]
    return {path: links.get("inter", {}).get("bytes", 0) for path, links in tot.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--save-at", type=int, default=100)
    ap.add_argument("--compare-until", type=int, default=120, help="resume: compare steps save_at+1 .. this")
    ap.add_argument("--runs", default="baseline,exact,full,weights,gradients,optimizer,resume")
    ap.add_argument("--launcher", default="torchrun", choices=LAUNCHERS)
    ap.add_argument("--quick", action="store_true", help="tiny model, 6 steps, save at 3: a launcher smoke test")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "deepspeed_convergence.json"))
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--summarize", metavar="JSON", help="recompute the summary of a saved result file")
    # Note: at 3e-3 this model and batch train chaotically: the baseline ends worse (2.435 vs 2.264
    # at 1e-3) and a benign numerics change alone (gradients reduced in fp32 instead of bf16) moves
    # its final loss by 1.8%, so a 1% comparison there measures chaos, not sdpq.
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: RunSpec's, 1e-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ds-override",
        default=None,
        help='JSON merged into every run\'s DeepSpeed config, e.g. \'{"communication_data_type": "fp32"}\'',
    )
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    if args.summarize:
        saved = json.loads(Path(args.summarize).read_text())
        saved_args = ap.parse_args(saved.get("argv", []))
        if saved_args.quick:
            saved_args.save_at, saved_args.compare_until = 3, 6
        saved["summary"] = summarize(saved["runs"], saved_args)
        Path(args.summarize).write_text(json.dumps(saved, indent=1))
        print(json.dumps(saved["summary"], indent=1))
        return 0

    from sdpq.train.model import GPTConfig
    from sdpq.train.run import RunSpec

    base = RunSpec(backend="deepspeed", steps=args.steps, bf16=True, ranks_per_node=2, seed=args.seed, log_every=20)
    if args.lr is not None:
        base = dataclasses.replace(base, lr=args.lr)
    overrides = json.loads(args.ds_override) if args.ds_override else None
    if args.quick:
        base = dataclasses.replace(
            base,
            model=GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=32),
            steps=6,
            micro_batch=2,
            warmup=2,
            eval_batches=1,
            log_every=0,
        )
        args.save_at, args.compare_until = 3, 6
    names = [n for n in args.runs.split(",") if n]
    workdir = Path(tempfile.mkdtemp(prefix="sdpq-ds-bench-"))
    ckpt = workdir / "ckpt"
    results: dict = {}
    try:
        for name in names:
            if name == "resume":
                if "full" not in results:
                    raise SystemExit("the resume run needs the full run first (--runs ...,full,...,resume)")
                spec = dataclasses.replace(base, sdpq=FULL, checkpoint_dir=str(ckpt), resume=True)
            else:
                spec = dataclasses.replace(base, sdpq=RUNS[name])
                if name == "full":
                    spec = dataclasses.replace(spec, checkpoint_dir=str(ckpt), save_at=args.save_at)
            print(f"== {name}: {args.launcher}, 4 ranks (2 nodes x 2), {spec.steps} steps", flush=True)
            r = launch(spec, args.launcher, 4, workdir, name, args.timeout, overrides)
            results[name] = r
            losses = [x for x in r["losses"] if not math.isnan(x)]
            print(
                f"   last-{LAST} loss {sum(losses[-LAST:]) / len(losses[-LAST:]):.5f}  val {r['val_loss']:.5f}  "
                f"{r['step_seconds']:.3f} s/step  "
                f"cross-node {r['cross_node_bytes_per_step'] / 1e6:.3f} MB/step  "
                f"optimizer {r['optimizer_bytes_per_param']:.2f} B/param  ({r['launch_seconds']:.0f} s)",
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    summary = summarize(results, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "runs": results, "argv": sys.argv[1:]}, f, indent=1)
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")
    return 0 if summary.get("ok", True) else 1


LAST = 20  # "final loss" = mean training loss of the last LAST steps (one batch's loss is noisy)


def summarize(results: dict, args) -> dict:
    s: dict = {
        "launcher": args.launcher,
        "layout": "2 nodes x 2 ranks (gloo, one machine)",
        "steps": {n: sum(not math.isnan(x) for x in r["losses"]) for n, r in results.items()},
    }
    runs = {n: r for n, r in results.items() if n != "resume"}
    final = {n: sum(r["losses"][-LAST:]) / len(r["losses"][-LAST:]) for n, r in runs.items()}
    s[f"final_loss_mean_last_{LAST}"] = final
    s["last_step_loss"] = {n: r["losses"][-1] for n, r in runs.items()}
    s["val_loss"] = {n: r["val_loss"] for n, r in results.items()}
    s["step_seconds"] = {n: r["step_seconds"] for n, r in results.items()}
    s["optimizer_bytes_per_param"] = {n: r["optimizer_bytes_per_param"] for n, r in results.items()}
    ok = True
    if "baseline" in final:

        def rel(d):
            return {n: (v - d["baseline"]) / d["baseline"] for n, v in d.items() if n != "baseline"}

        s["final_loss_rel_diff_vs_baseline"] = rel(final)
        s["val_loss_rel_diff_vs_baseline"] = rel({n: r["val_loss"] for n, r in runs.items()})
        s["last_step_loss_rel_diff_vs_baseline"] = rel(s["last_step_loss"])
        s["within_1pct"] = {
            n: abs(v) < 0.01 and abs(s["val_loss_rel_diff_vs_baseline"][n]) < 0.01
            for n, v in s["final_loss_rel_diff_vs_baseline"].items()
        }
        ok &= all(s["within_1pct"].values())
    if "exact" in results and "baseline" in results:
        s["exact_equals_baseline_bitwise"] = results["exact"]["losses"] == results["baseline"]["losses"]
        ok &= s["exact_equals_baseline_bitwise"]
    if "exact" in results:
        base_b = results["exact"]["cross_node_bytes_per_step"]
        s["cross_node_bytes_per_step"] = {
            n: r["cross_node_bytes_per_step"] for n, r in results.items() if n not in ("baseline",)
        }
        s["cross_node_bytes_per_step_by_path"] = {
            n: {p: b / max(1, sum(not math.isnan(x) for x in r["losses"])) for p, b in _inter(r).items()}
            for n, r in results.items()
            if n != "baseline"
        }
        s["cross_node_ratio_vs_zero3"] = {
            n: r["cross_node_bytes_per_step"] / base_b for n, r in results.items() if n not in ("baseline", "exact")
        }
        if "full" in results:
            s["full_ratio_below_one_fifth"] = s["cross_node_ratio_vs_zero3"]["full"] < 0.2
            ok &= s["full_ratio_below_one_fifth"]
    if "resume" in results and "full" in results:
        a, b = results["full"]["losses"], results["resume"]["losses"]
        lo, hi = args.save_at, args.compare_until
        s["resume"] = {
            "saved_after_step": lo,
            f"steps_{lo + 1}_{hi}_identical": a[lo:hi] == b[lo:hi],
            f"steps_{lo + 1}_{len(a)}_identical": a[lo:] == b[lo:],
            "max_abs_diff": max(abs(x - y) for x, y in zip(a[lo:], b[lo:])),
            "val_loss_identical": results["full"]["val_loss"] == results["resume"]["val_loss"],
        }
        ok &= s["resume"][f"steps_{lo + 1}_{hi}_identical"]
    s["ok"] = bool(ok)
    return s


if __name__ == "__main__":
    sys.exit(main())
