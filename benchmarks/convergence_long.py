"""Long-run convergence: the Llama-shaped model, bf16 baseline vs full sdpq, several seeds, FSDP2
and ZeRO-3, 4 gloo ranks as 2 nodes x 2.

Arms (same data - a pure function of (seed, step, rank) - same schedule, per seed):
  baseline  the framework without sdpq, bf16 mixed precision as users run it (FSDP2:
            param_dtype bf16, reduce_dtype fp32; ZeRO-3: "bf16": {"enabled": true}) and the
            framework's own AdamW
  sdpq      the default "sdpq" block (4-bit weight differences, 8/4-bit gradients with
            Hadamard, FP8 states + MCF master on bf16 parameters), the same compute policy

The seed sets the model's initialisation and the batches' order alike in both arms, so each
seed is a paired comparison; the baseline's spread over seeds is the yardstick: sdpq's
final-loss difference is reported in units of that standard deviation and in percent.

Cross-node bytes come from an independent meter (sdpq/comm/link_bytes.py wraps every
ProcessGroup collective; it does not read sdpq's statistics), counted during the training steps
only. Writes --out (JSON) and a PNG of the loss curves (mean over seeds and min-max band).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/convergence_long.py            # ~1 hour on 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/convergence_long.py --steps 20 --seeds 0 --out /tmp/x.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.provenance import provenance  # noqa: E402
from sdpq.launch.local import run_local  # noqa: E402

WORLD, RPN = 4, 2
TAG = "[convergence_long]"
# The library's defaults, spelled out (an empty block would be plain DeepSpeed); the ZeRO-3
# workaround drops its redundant bf16 master copy (FSDP2 ignores it).
SDPQ = {"weights": {}, "gradients": {}, "optimizer": {}, "workarounds": {"deepspeed_alias_bf16_master": True}}
ARMS = {"baseline": (None, False), "sdpq": (SDPQ, True)}  # name: (block, bf16 parameters)
FRAMEWORKS = {"fsdp2": "fsdp2", "zero3": "deepspeed"}


@contextlib.contextmanager
def step_window(counter, backend):
    """Count the training steps of an sdpq.train backend module (fsdp_backend, ddp_backend) only,
    not set-up or evaluation: the meter is on inside each `_step`, and every step is a snapshot."""
    orig = backend._step

    def step(*a, **kw):
        counter.enabled = True
        try:
            return orig(*a, **kw)
        finally:
            counter.enabled = False
            counter.snapshot()

    counter.enabled = False
    backend._step = step
    try:
        yield
    finally:
        backend._step = orig


def run_arm(spec, framework: str) -> dict:
    """Train one arm on the initialised world (every rank calls it); rank 0 gets the totals."""
    import torch.distributed as dist

    from benchmarks.zeropp import reset_deepspeed_groups, simulate_nodes
    from benchmarks.zeropp.window import training_window
    from sdpq.comm.link_bytes import LinkBytes, sum_over_ranks

    with contextlib.ExitStack() as stack:
        stack.enter_context(simulate_nodes(RPN))
        counter = stack.enter_context(LinkBytes(RPN))
        if framework == "zero3":
            from sdpq.train import deepspeed_backend

            reset_deepspeed_groups()
            stack.enter_context(training_window(counter, spec.steps))
            r = deepspeed_backend.train(spec)
        else:
            from sdpq.train import fsdp_backend

            stack.enter_context(step_window(counter, fsdp_backend))
            r = fsdp_backend.train(spec)
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, counter.as_dict())
    link = sum_over_ranks(per_rank)
    inter = sum(links.get("inter", {}).get("bytes", 0) for links in link["total"].values())
    return {
        "losses": r.losses,
        "val_loss": r.val_loss,
        "step_seconds": r.step_seconds,
        "meter_cross_node_bytes_per_step": inter / spec.steps,
        "meter_by_path": {p: links.get("inter", {}).get("bytes", 0) / spec.steps for p, links in link["total"].items()},
        "sdpq_cross_node_bytes_per_step": r.cross_node_bytes_per_step,
        "optimizer_bytes_per_param": r.optimizer_bytes_per_param,
        "optimizer": r.extra.get("optimizer"),
        "params": r.extra.get("params"),
    }


def worker(job_file: str, out_file: str) -> None:
    """One rank (started by torchrun): every arm of one (framework, seed)."""
    import logging
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    job = json.loads(Path(job_file).read_text())
    if job["framework"] == "zero3":
        import sdpq.integrations.deepspeed as sds

        sds.init_distributed(dist_backend="gloo")
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    import torch.distributed as dist

    from sdpq.train.run import RunSpec

    out = {}
    for arm in job["arms"]:
        spec = RunSpec.from_dict(job["specs"][arm])
        if dist.get_rank() == 0:
            print(f"{TAG} {job['framework']} seed {spec.seed} {arm}: {spec.steps} steps", flush=True)
        out[arm] = run_arm(spec, job["framework"])
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps(out))
    dist.destroy_process_group()


def spec_for(args, framework: str, arm: str, seed: int, arms: dict = ARMS):
    """The run of one arm (arms: name -> (sdpq block or None, bf16 parameters))."""
    from sdpq.train.llama import LlamaConfig
    from sdpq.train.run import RunSpec

    block, bf16 = arms[arm]
    model = LlamaConfig(seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads, d_model=args.d_model)
    return RunSpec(
        backend=FRAMEWORKS[framework],
        model=model,
        sdpq=block,
        bf16=bf16,
        mixed_precision="bf16",
        steps=args.steps,
        micro_batch=args.micro_batch,
        lr=args.lr,
        warmup=args.warmup,
        seed=seed,
        ranks_per_node=RPN,
        log_every=0,
        eval_batches=args.eval_batches,
    )


def run_job(args, framework: str, seed: int, arms: dict = ARMS) -> dict:
    """Every arm of `arms` for one (framework, seed), in one launched world; {arm: results}."""
    with tempfile.TemporaryDirectory(prefix="sdpq-long-") as tmp:
        job, out, log = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "run.log"
        specs = {arm: dataclasses.asdict(spec_for(args, framework, arm, seed, arms)) for arm in arms}
        job.write_text(json.dumps({"framework": framework, "arms": list(arms), "specs": specs}))
        launcher = "deepspeed" if framework == "zero3" else "torchrun"
        code = run_local(
            [str(Path(__file__).resolve()), "--worker", str(job), str(out)],
            WORLD,
            launcher=launcher,
            log=log,
            timeout=args.timeout,
        )
        if code != 0 or not out.exists():
            raise RuntimeError(f"{framework} seed {seed} failed (exit code {code}):\n{log.read_text()[-4000:]}")
        return json.loads(out.read_text())


def final_loss(losses: list[float], last: int = 50) -> float:
    """The mean of the last `last` steps' training losses (one step's loss is noisy)."""
    tail = [v for v in losses[-last:] if not math.isnan(v)]
    return sum(tail) / len(tail)


def summarize(runs: dict, args, arm: str = "sdpq") -> dict:
    """Per framework: the baseline's seed mean and sd, `arm`'s paired difference in sd and %, val
    loss, bytes per step from the meter and their ratio, optimizer bytes per parameter."""
    out: dict = {}
    arms = ("baseline", arm)
    for fw, seeds in runs.items():
        finals = {a: [final_loss(seeds[s][a]["losses"]) for s in seeds] for a in arms}
        vals = {a: [seeds[s][a]["val_loss"] for s in seeds] for a in arms}
        b_mean = statistics.mean(finals["baseline"])
        b_sd = statistics.stdev(finals["baseline"]) if len(seeds) > 1 else float("nan")
        s_mean = statistics.mean(finals[arm])
        diffs = [s - b for s, b in zip(finals[arm], finals["baseline"])]
        first = next(iter(seeds.values()))
        bytes_ = {a: statistics.mean(seeds[s][a]["meter_cross_node_bytes_per_step"] for s in seeds) for a in arms}
        out[fw] = {
            "seeds": [int(s) for s in seeds],
            "params": first["baseline"]["params"],
            "final_loss": {a: finals[a] for a in arms},
            "baseline_mean": b_mean,
            "baseline_sd": b_sd,
            f"{arm}_mean": s_mean,
            "diff_mean": s_mean - b_mean,
            "paired_diffs": diffs,
            "diff_in_baseline_sd": (s_mean - b_mean) / b_sd if b_sd > 0 else float("nan"),
            "diff_percent": 100 * (s_mean - b_mean) / b_mean,
            "within_1_sd": abs(s_mean - b_mean) <= b_sd,
            "within_half_percent": abs(s_mean - b_mean) <= 0.005 * b_mean,
            "val_loss": {a: statistics.mean(vals[a]) for a in arms},
            "val_loss_sd": {a: statistics.stdev(vals[a]) if len(seeds) > 1 else float("nan") for a in arms},
            "meter_cross_node_bytes_per_step": bytes_,
            "bytes_ratio": bytes_[arm] / bytes_["baseline"] if bytes_["baseline"] else float("nan"),
            "optimizer_bytes_per_param": {a: first[a]["optimizer_bytes_per_param"] for a in arms},
            "optimizer": {a: first[a]["optimizer"] for a in arms},
            "step_seconds": {a: statistics.mean(seeds[s][a]["step_seconds"] for s in seeds) for a in arms},
        }
    return out


def plot(runs: dict, path: Path, args, window: int = 25) -> None:
    """Per framework: the training loss (moving mean over `window` steps), mean over seeds with a
    min-max band, per arm; below, sdpq minus baseline per seed (paired)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(xs):
        return [sum(xs[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(xs))]

    fws = list(runs)
    fig, axes = plt.subplots(2, len(fws), figsize=(6 * len(fws), 7), squeeze=False, height_ratios=[2, 1])
    for j, fw in enumerate(fws):
        ax, dx = axes[0][j], axes[1][j]
        seeds = runs[fw]
        for i, arm in enumerate(ARMS):
            curves = [smooth(seeds[s][arm]["losses"]) for s in seeds]
            steps = range(1, len(curves[0]) + 1)
            mean = [statistics.mean(c[k] for c in curves) for k in range(len(curves[0]))]
            ax.plot(steps, mean, color=f"C{i}", linewidth=1, label=f"{arm} (mean of {len(curves)} seeds)")
            ax.fill_between(
                steps,
                [min(c[k] for c in curves) for k in range(len(mean))],
                [max(c[k] for c in curves) for k in range(len(mean))],
                color=f"C{i}",
                alpha=0.2,
            )
        for i, s in enumerate(seeds):
            b, q = smooth(seeds[s]["baseline"]["losses"]), smooth(seeds[s]["sdpq"]["losses"])
            dx.plot(
                range(1, len(b) + 1), [y - x for x, y in zip(b, q)], linewidth=0.8, color=f"C{i + 2}", label=f"seed {s}"
            )
        # The first tenth of the run (the loss falling from ~5.5) would flatten the rest.
        skip = len(seeds[next(iter(seeds))]["baseline"]["losses"]) // 10
        tail = [v for s in seeds for arm in ARMS for v in smooth(seeds[s][arm]["losses"])[skip:]]
        pad = 0.05 * (max(tail) - min(tail))
        ax.set_ylim(min(tail) - pad, max(tail) + pad)
        ax.set_title(f"{fw}: Llama {args.layers}x{args.d_model}, 2 nodes x 2 ranks, bf16")
        ax.set_ylabel(f"training loss (mean of {window} steps)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        dx.axhline(0.0, color="k", linewidth=0.5)
        dx.set_ylabel("sdpq - baseline (same seed)")
        dx.set_xlabel("step")
        dx.legend(fontsize=7)
        dx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The model and schedule of the protocol (spec_for reads them), shared with the studies
    that reuse it (benchmarks/frontier.py)."""
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--frameworks", default="fsdp2,zero3")
    add_model_arguments(ap)
    ap.add_argument("--timeout", type=float, default=2 * 3600)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "convergence_long.json"))
    ap.add_argument("--replot", action="store_true", help="only redraw the plot of an existing --out JSON")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.replot:
        saved = json.loads(out.read_text())
        plot(saved["runs"], out.with_suffix(".png"), argparse.Namespace(**saved["args"]))
        return 0
    fws = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    for f in fws:
        if f not in FRAMEWORKS:
            ap.error(f"--frameworks: {f!r}; allowed: {', '.join(FRAMEWORKS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict = {f: {} for f in fws}
    t0 = time.time()
    parts = out.with_suffix(".parts")  # each finished job, so that an interrupted study resumes
    parts.mkdir(parents=True, exist_ok=True)
    for f in fws:
        for s in seeds:
            t, part = time.time(), parts / f"{f}_seed{s}_{args.steps}steps.json"
            if part.exists():
                runs[f][str(s)] = json.loads(part.read_text())
                continue
            runs[f][str(s)] = res = run_job(args, f, s)
            part.write_text(json.dumps(res))
            print(
                f"{TAG} {f} seed {s}: final loss baseline {final_loss(res['baseline']['losses']):.4f} "
                f"sdpq {final_loss(res['sdpq']['losses']):.4f}  cross-node MB/step "
                f"{res['baseline']['meter_cross_node_bytes_per_step'] / 1e6:.3f} -> "
                f"{res['sdpq']['meter_cross_node_bytes_per_step'] / 1e6:.3f}  ({time.time() - t:.0f} s)",
                flush=True,
            )
    summary = summarize(runs, args)
    tokens = args.steps * WORLD * args.micro_batch * args.seq_len
    meta = {
        "world": f"{WORLD // RPN} nodes x {RPN} ranks (gloo)",
        "tokens_per_run": tokens,
        "wall_seconds": time.time() - t0,
        **provenance(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "meta": meta, "summary": summary, "runs": runs}, indent=1))
    plot(runs, out.with_suffix(".png"), args)
    print(json.dumps({"meta": meta, "summary": summary}, indent=1, default=str))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    if argv and argv[0] == "--worker":
        worker(argv[1], argv[2])
    else:
        sys.exit(main())
