"""DeepSpeed's ZeRO++ as the peer of sdpq: loss and link bytes in one run (4 gloo ranks, 2 nodes x 2).

Trains the small GPT (sdpq/train/model.py, d_model 192 by default) with DeepSpeed ZeRO-3 on 4
gloo ranks laid out as 2 simulated nodes x 2 ranks (node = rank // 2), three arms on the same
seed, data, schedule and ZeRO-3 settings, one after the other in the same launch:

  zero3   plain ZeRO-3 (bf16 weights and gradients on the wire)
  zeropp  ZeRO-3 + DeepSpeed's own ZeRO++: qwZ (int8 weight gathers), hpZ (secondary weight
          partition per node, zero_hpz_partition_size 2), qgZ (int4 two-hop gradient all-to-all);
          DeepSpeed's code paths, with the CUDA quantizer op replaced by benchmarks/zeropp/cpu_kernels.py
  sdpq    ZeRO-3 + sdpq with the default "sdpq" block (4-bit weight differences against a
          node-resident reference, two-level 8/4-bit Hadamard gradients, FP8 AdamW + MCF master),
          through sdpq.train.deepspeed_backend.train

Ablations on request (--arms): zeropp_qwz_hpz (ZeRO++ without qgZ), zeropp_qgz (qgZ alone).

Every arm is trained by sdpq.train.deepspeed_backend.train (bf16, AdamW, clipping 1.0, warm-up +
cosine), with benchmarks.zeropp.ZERO3_AT_SCALE (no prefetch, reuse distance 0: backward gathers
again, as it does on large models; see that constant). Bytes are counted the same way for every
arm by sdpq/comm/link_bytes.py at the process-group level, only during the training steps
(engine construction, evaluation and result gathering excluded), summed over ranks, and split by
whether a transfer crosses the simulated node boundary. The sdpq arm's own statistics are
printed beside them as a cross-check.

Prints final loss (mean of the last 10 steps), validation loss, cross-node and intra-node bytes
per step and their ratios to ZeRO-3, and writes everything (per-step curves too) to JSON.

    OMP_NUM_THREADS=1 python benchmarks/zeropp_peer.py --steps 200 [--out FILE]
    python benchmarks/zeropp_peer.py --steps 20 --arms zero3,zeropp      # quick look
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 4 ranks share the cores; more threads only thrash

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
from sdpq.launch.local import run_local  # noqa: E402
from sdpq.train.run import RunSpec  # noqa: E402

ARMS = ("zero3", "zeropp", "sdpq")
# Ablations of the ZeRO++ arm (not run by default): which of its parts costs the loss.
ZEROPP_PARTS = {"zeropp_qwz_hpz": dict(qgz=False), "zeropp_qgz": dict(qwz=False, hpz=False)}
# A non-empty block with every section at its defaults (an EMPTY block means plain DeepSpeed).
SDPQ_DEFAULT_BLOCK = {"weights": {}, "gradients": {}, "optimizer": {}}
PATHS = ("weights", "gradients", "other")
TAG = "[zeropp_peer]"  # rank 0's progress lines, echoed by the driver


# ----------------------------------------------------------------------------- one arm, every rank


def arm_config(arm: str, ranks_per_node: int) -> tuple[dict | None, dict]:
    """(sdpq block, DeepSpeed config overrides) of an arm."""
    from benchmarks.zeropp import ZERO3_AT_SCALE, zeropp_overrides
    from sdpq.train.deepspeed_backend import merge_config

    if arm == "zero3":
        return None, ZERO3_AT_SCALE
    if arm == "zeropp" or arm in ZEROPP_PARTS:
        return None, merge_config(ZERO3_AT_SCALE, zeropp_overrides(ranks_per_node, **ZEROPP_PARTS.get(arm, {})))
    if arm == "sdpq":
        return SDPQ_DEFAULT_BLOCK, ZERO3_AT_SCALE
    raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS + tuple(ZEROPP_PARTS))}")


def run_arm(arm: str, spec, ranks_per_node: int) -> dict:
    """Train one arm on the initialised world (every rank calls it); rank 0 gets the totals."""
    import torch.distributed as dist

    from benchmarks.zeropp import install_cpu_kernels, reset_deepspeed_groups, simulate_nodes
    from benchmarks.zeropp.window import training_window
    from sdpq.comm.link_bytes import LinkBytes, sum_over_ranks
    from sdpq.train import deepspeed_backend

    block, overrides = arm_config(arm, ranks_per_node)
    spec = dataclasses.replace(spec, sdpq=block)
    reset_deepspeed_groups()  # the previous arm's hpZ / all-to-all groups must not be reused
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        # Every arm sees the same node layout (LOCAL_SIZE, as the deepspeed launcher sets it).
        stack.enter_context(simulate_nodes(ranks_per_node))
        if arm == "zeropp" or arm in ZEROPP_PARTS:
            stack.enter_context(install_cpu_kernels())
        counter = stack.enter_context(LinkBytes(ranks_per_node))
        stack.enter_context(training_window(counter, spec.steps))
        r = deepspeed_backend.train(spec, ds_overrides=overrides)
    wall = time.perf_counter() - t0
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, counter.as_dict())
    return {
        "arm": arm,
        "losses": r.losses,
        "val_loss": r.val_loss,
        "step_seconds": r.step_seconds,
        "wall_seconds": wall,
        "link_bytes": sum_over_ranks(per_rank),
        # sdpq's own accounting (weights + gradients paths; zero for arms without sdpq)
        "sdpq_cross_node_bytes_per_step": r.cross_node_bytes_per_step,
        "sdpq_comm_total": r.comm.get("total"),
        "params": r.extra.get("params"),
        "optimizer": r.extra.get("optimizer"),
        "zero_optimization": r.extra["ds_config"]["zero_optimization"],
    }


def worker(job_file: str, out_dir: str) -> None:
    import logging
    import warnings

    import torch

    torch.set_num_threads(1)
    import sdpq.integrations.deepspeed as sds

    sds.init_distributed(dist_backend="gloo")  # env:// from torchrun; no shared-memory op build
    import torch.distributed as dist

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 collective renames
    job = json.loads(Path(job_file).read_text())
    spec = RunSpec.from_dict(job["spec"])
    rank = dist.get_rank()
    for arm in job["arms"]:
        if rank == 0:
            print(f"{TAG} == {arm}: {spec.steps} steps", flush=True)
        res = run_arm(arm, spec, job["ranks_per_node"])
        if rank == 0:
            (Path(out_dir) / f"{arm}.json").write_text(json.dumps(res))
            s = summarize_arm(res, spec.steps)
            print(
                f"{TAG}    {arm}: final loss {s['final_loss']:.4f}  val {s['val_loss']:.4f}  "
                f"cross-node {s['cross_node_bytes_per_step'] / 1e6:.3f} MB/step  "
                f"intra-node {s['intra_node_bytes_per_step'] / 1e6:.3f} MB/step  "
                f"{s['step_seconds']:.3f} s/step  ({res['wall_seconds']:.0f} s)",
                flush=True,
            )
        dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- summary


def _link(total: dict, paths, link: str) -> int:
    return sum(total.get(p, {}).get(link, {}).get("bytes", 0) for p in paths)


def summarize_arm(res: dict, steps: int) -> dict:
    """Figures of one arm. Headline bytes = weights + gradients paths (what sdpq's statistics
    count); the "other" path (gradient-norm all-reduces and the like) is reported apart."""
    losses = [x for x in res["losses"] if not math.isnan(x)]
    tot = res["link_bytes"]["total"]
    per_step = res["link_bytes"]["steps"]
    n = max(1, len(per_step))
    main = ("weights", "gradients")

    def step_link(s, link):
        return sum(s.get(p, {}).get(link, 0) for p in main)

    out = {
        "final_loss": statistics.fmean(losses[-10:]) if losses else float("nan"),
        "val_loss": res["val_loss"],
        "step_seconds": res["step_seconds"],
        "steps_counted": len(per_step),
        "cross_node_bytes_per_step": _link(tot, main, "inter") / n,
        "intra_node_bytes_per_step": _link(tot, main, "intra") / n,
        "by_path_per_step": {p: {lk: _link(tot, (p,), lk) / n for lk in ("inter", "intra")} for p in PATHS},
        # Steps 2.. only: ZeRO++'s first step gathers from the hpZ copies made at initialisation.
        "steady_cross_node_bytes_per_step": statistics.median(step_link(s, "inter") for s in per_step[1:])
        if len(per_step) > 1
        else float("nan"),
        "steady_intra_node_bytes_per_step": statistics.median(step_link(s, "intra") for s in per_step[1:])
        if len(per_step) > 1
        else float("nan"),
    }
    if res["arm"] == "sdpq":
        out["sdpq_self_reported_cross_node_bytes_per_step"] = res["sdpq_cross_node_bytes_per_step"]
    return out


def summarize(results: dict, steps: int) -> dict:
    arms = {a: summarize_arm(r, steps) for a, r in results.items()}
    s: dict = {"layout": "4 gloo ranks = 2 simulated nodes x 2 (node = rank // 2), one machine", "arms": arms}
    if "zero3" in arms:
        b = arms["zero3"]
        for x in arms.values():
            x["cross_node_ratio_vs_zero3"] = x["cross_node_bytes_per_step"] / b["cross_node_bytes_per_step"]
            x["intra_node_ratio_vs_zero3"] = x["intra_node_bytes_per_step"] / b["intra_node_bytes_per_step"]
            x["steady_cross_node_ratio_vs_zero3"] = (
                x["steady_cross_node_bytes_per_step"] / b["steady_cross_node_bytes_per_step"]
            )
            x["final_loss_rel_diff_vs_zero3"] = (x["final_loss"] - b["final_loss"]) / b["final_loss"]
            x["val_loss_rel_diff_vs_zero3"] = (x["val_loss"] - b["val_loss"]) / b["val_loss"]
    return s


def table(summary: dict) -> str:
    rows = [
        ["arm", "final loss", "val loss", "cross-node MB/step", "x ZeRO-3", "intra-node MB/step", "x ZeRO-3", "s/step"]
    ]
    for a, x in summary["arms"].items():
        rows.append(
            [
                a,
                f"{x['final_loss']:.4f}",
                f"{x['val_loss']:.4f}",
                f"{x['cross_node_bytes_per_step'] / 1e6:.4f}",
                f"{x.get('cross_node_ratio_vs_zero3', math.nan):.3f}",
                f"{x['intra_node_bytes_per_step'] / 1e6:.4f}",
                f"{x.get('intra_node_ratio_vs_zero3', math.nan):.3f}",
                f"{x['step_seconds']:.3f}",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = []
    for a, x in summary["arms"].items():
        if "sdpq_self_reported_cross_node_bytes_per_step" in x:
            notes.append(
                f"sdpq's own statistics for the sdpq arm: "
                f"{x['sdpq_self_reported_cross_node_bytes_per_step'] / 1e6:.4f} cross-node MB/step "
                f"(process-group count above: {x['cross_node_bytes_per_step'] / 1e6:.4f})"
            )
        if "steady_cross_node_ratio_vs_zero3" in x and a != "zero3":
            notes.append(
                f"{a}: steady state (steps 2..) cross-node ratio vs ZeRO-3 {x['steady_cross_node_ratio_vs_zero3']:.3f}"
            )
    return "\n".join(lines + [""] + notes)


# ----------------------------------------------------------------------------- driver


def launch(job: dict, nproc: int, workdir: Path, timeout: float) -> dict:
    """One torchrun launch running every arm in turn; returns {arm: result} of those finished."""
    job_file, out_dir, log = workdir / "job.json", workdir / "out", workdir / "run.log"
    out_dir.mkdir(exist_ok=True)
    job_file.write_text(json.dumps(job))

    def show(line: str) -> None:
        if line.startswith(TAG):
            print(line[len(TAG) :].rstrip(), flush=True)
        elif line.startswith("step "):  # deepspeed_backend.train's progress lines (rank 0)
            print("      " + line.rstrip(), flush=True)

    argv = [str(Path(__file__).resolve()), "--worker", str(job_file), str(out_dir)]
    # The ranks import this folder's helper package as `benchmarks.zeropp`: the repository root on their path.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    code = run_local(argv, nproc, log=log, timeout=timeout, on_line=show, env={"PYTHONPATH": path})
    results = {
        a: json.loads((out_dir / f"{a}.json").read_text()) for a in job["arms"] if (out_dir / f"{a}.json").exists()
    }
    if code != 0 or len(results) != len(job["arms"]):
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"the launch failed (exit code {code}; arms finished: {list(results)}):\n{tail}")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("JOB", "OUTDIR"), help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument(
        "--arms",
        default=",".join(ARMS),
        help=f"comma-separated, from {','.join(ARMS + tuple(ZEROPP_PARTS))} (ablations: ZeRO++ without qgZ, qgZ alone)",
    )
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20, help="warm-up steps (at most a quarter of --steps)")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "zeropp_peer.json"))
    ap.add_argument("--timeout", type=float, default=4 * 3600)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0

    from sdpq.train.model import GPTConfig
    from sdpq.train.run import RunSpec

    arms = [a for a in args.arms.split(",") if a]
    for a in arms:
        if a not in ARMS and a not in ZEROPP_PARTS:
            ap.error(f"--arms: unknown arm {a!r}; choose from {', '.join(ARMS + tuple(ZEROPP_PARTS))}")
    if args.nproc % args.ranks_per_node or args.nproc // args.ranks_per_node < 2:
        ap.error(
            f"--nproc {args.nproc} must be a multiple of --ranks-per-node {args.ranks_per_node} "
            "with at least 2 nodes (ZeRO++'s qgZ and hpZ need more than one node)"
        )
    spec = RunSpec(
        backend="deepspeed",
        steps=args.steps,
        bf16=True,
        micro_batch=args.micro_batch,
        lr=args.lr,
        warmup=min(args.warmup, max(1, args.steps // 4)),
        seed=args.seed,
        eval_batches=args.eval_batches,
        log_every=args.log_every,
        ranks_per_node=args.ranks_per_node,
        model=GPTConfig(d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head, seq_len=args.seq_len),
    )
    job = {"spec": dataclasses.asdict(spec), "arms": arms, "ranks_per_node": args.ranks_per_node}
    nodes = args.nproc // args.ranks_per_node
    print(
        f"{args.nproc} gloo ranks as {nodes} simulated nodes x {args.ranks_per_node}; GPT d_model {args.d_model} "
        f"x {args.n_layer} layers, seq {args.seq_len}, micro-batch {args.micro_batch}/rank, bf16, {args.steps} steps; "
        f"arms {', '.join(arms)}",
        flush=True,
    )
    workdir = Path(tempfile.mkdtemp(prefix="sdpq-zeropp-peer-"))
    t0 = time.perf_counter()
    results = launch(job, args.nproc, workdir, args.timeout)  # on failure the log stays in workdir
    shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(results, args.steps)
    summary["wall_seconds"] = time.perf_counter() - t0
    print()
    print(table(summary))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "runs": results, "argv": sys.argv[1:], "job": job}, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
