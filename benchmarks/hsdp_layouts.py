"""Which FSDP2 layout to pick with sdpq: 1-D FSDP vs HSDP, plain and with sdpq (4 gloo ranks, 2 nodes x 2).

Arms (same seed, data, schedule; fp32 parameters and compute, gradients reduced in bf16:
``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``; fp32 compute because this CPU has no fast
bf16 arithmetic, bf16 gradients because that is what large jobs send):

  fsdp        1-D FSDP2 over the 4 ranks
  fsdp+sdpq   the same + sdpq (4-bit weight differences, 8/4-bit Hadamard gradients)
  hsdp        FSDP2's native HSDP: 2-D mesh (replicate = 2 nodes, shard = 2 ranks of a node)
  hsdp+sdpq   1-D FSDP on the shard dim + sdpq.fsdp.apply(replicate=...): the replicate
              all-reduce quantized by sdpq (4-bit reduce-scatter + 4-bit all-gather, Hadamard)
  hsdp_fp32_reduce  extra context: native HSDP reducing gradients in fp32 (torchtitan's default)
  hsdp+sdpq_exact_weights  (on request) HSDP + sdpq with weights "exact": the shard group's
              gathers stay FSDP2's plain ones inside the node; only gradients are quantized

Bytes are counted by sdpq/comm/link_bytes.py at the process-group level (not sdpq's own
statistics), per optimizer step, summed over ranks, split by whether a transfer crosses the
simulated node boundary (node = rank // 2). The 1-D rows gather fp32 weights (fp32 parameters);
the column "bf16 weights" gives what they would send with bf16 weights (weights path halved).
Every arm records the digest of the weights each FSDP module's forward used: with HSDP + sdpq
they must be identical on all 4 ranks (both replicas) at every step.

    python benchmarks/hsdp_layouts.py --steps 200 [--out FILE]      # ~20 min on 2 cores
    sudo .venv/bin/python benchmarks/hsdp_layouts.py --steps 20 --bandwidth 1gbit   # step time on a shaped link
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from sdpq.launch.local import run_local

ROOT = Path(__file__).resolve().parents[1]
WORLD, RPN = 4, 2
QUANT = {"weights": {"mode": "diff"}, "gradients": {"mode": "two_level"}, "optimizer": {"enabled": False}}
GRADS_ONLY = {**QUANT, "weights": {"mode": "exact"}}
ARMS = {"fsdp": None, "fsdp+sdpq": QUANT, "hsdp": None, "hsdp+sdpq": QUANT, "hsdp_fp32_reduce": None,
        "hsdp+sdpq_exact_weights": GRADS_ONLY}  # fmt: skip


def _arm(name: str, spec_kw: dict) -> dict:
    """One arm on this rank (all ranks call it): losses, forward digests and link bytes per step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from sdpq.comm.link_bytes import LinkBytes
    from sdpq.train.fsdp_backend import train
    from sdpq.train.run import RunSpec

    spec = RunSpec.from_dict({**spec_kw, "sdpq": ARMS[name]})
    reduce_dtype = torch.float32 if name.endswith("fp32_reduce") else torch.bfloat16
    kw: dict = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=reduce_dtype), "checks": True}
    if name.startswith("hsdp"):
        mesh = init_device_mesh("cpu", (WORLD // RPN, RPN), mesh_dim_names=("replicate", "shard"))
        kw.update({"mesh": mesh} if ARMS[name] is None else {"mesh": mesh["shard"], "replicate": mesh["replicate"]})
    counter = LinkBytes(RPN)
    hook = register_optimizer_step_post_hook(lambda *_: counter.snapshot())
    try:
        with counter:
            r = train(spec, **kw)
    finally:
        hook.remove()
    per_rank: list = [None] * WORLD
    dist.all_gather_object(per_rank, {"bytes": counter.as_dict()["steps"], "fwd": r.extra["forward_digests"]})
    return {
        "losses": r.losses,
        "val_loss": r.val_loss,
        "step_seconds": r.step_seconds,
        "link_steps": [p["bytes"] for p in per_rank],
        "replicas_identical_every_step": all(p["fwd"] == per_rank[0]["fwd"] for p in per_rank),
        "sdpq_inter_bytes_per_step": r.cross_node_bytes_per_step,
    }


def worker(job_file: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    job = json.loads(Path(job_file).read_text())
    for name in job["arms"]:
        res = _arm(name, job["spec"])
        if dist.get_rank() == 0:
            (Path(out_dir) / f"{name}.json").write_text(json.dumps(res))
            print(
                f"{name}: final loss {statistics.fmean(res['losses'][-10:]):.4f}  {res['step_seconds']:.3f} s/step",
                flush=True,
            )
    dist.barrier()  # every rank done with gloo before any tears it down (else: terminate called ...)
    dist.destroy_process_group()


def _bytes(res: dict, link: str, paths=("weights", "gradients", "other"), scale: dict | None = None) -> float:
    """Mean bytes per step on `link` (all ranks), steps 2.. (the first holds set-up traffic)."""
    scale = scale or {}
    steps = list(zip(*res["link_steps"]))[1:]  # per step: every rank's {path: {link: bytes}}
    return statistics.fmean(
        sum(r.get(p, {}).get(link, 0) * scale.get(p, 1.0) for r in step for p in paths) for step in steps
    )


def summarize(results: dict) -> dict:
    out = {}
    for name, res in results.items():
        out[name] = {
            "final_loss": statistics.fmean(res["losses"][-10:]),
            "val_loss": res["val_loss"],
            "step_seconds": res["step_seconds"],
            "cross_node_bytes_per_step": _bytes(res, "inter"),
            # plain 1-D arms only: their weights path is the fp32 all-gather, halved for bf16 weights
            "cross_node_bytes_per_step_bf16_weights": _bytes(res, "inter", scale={"weights": 0.5})
            if ARMS[name] is None
            else None,
            "intra_node_bytes_per_step": _bytes(res, "intra"),
            "replicas_identical_every_step": res["replicas_identical_every_step"],
            "sdpq_self_reported_inter_bytes_per_step": res["sdpq_inter_bytes_per_step"],
        }
    for quant, base in (("fsdp+sdpq", "fsdp"), ("hsdp+sdpq", "hsdp"), ("hsdp+sdpq_exact_weights", "hsdp")):
        if quant in out and base in out:
            q, b = out[quant], out[base]
            q["cross_node_ratio"] = q["cross_node_bytes_per_step"] / b["cross_node_bytes_per_step"]
            q["cross_node_ratio_vs_bf16_weights"] = (
                q["cross_node_bytes_per_step"] / b["cross_node_bytes_per_step_bf16_weights"]
            )
            if quant == "hsdp+sdpq" and "hsdp_fp32_reduce" in out:
                q["cross_node_ratio_vs_fp32_reduce"] = (
                    q["cross_node_bytes_per_step"] / out["hsdp_fp32_reduce"]["cross_node_bytes_per_step"]
                )
            q["final_loss_ratio"] = q["final_loss"] / b["final_loss"]
            q["val_loss_ratio"] = q["val_loss"] / b["val_loss"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--arms", default="fsdp,fsdp+sdpq,hsdp,hsdp+sdpq,hsdp_fp32_reduce", help=f"of {list(ARMS)}")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hsdp_layouts.json"))
    ap.add_argument("--timeout", type=float, default=3 * 3600)
    ap.add_argument("--bandwidth", help="run on 2 emulated nodes joined by a link of this rate (root), e.g. 1gbit")
    args = ap.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    spec = {
        "backend": "fsdp2",
        "model": {"d_model": args.d_model, "n_layer": args.n_layer},
        "steps": args.steps,
        "lr": args.lr,
        "micro_batch": 4,
        "ranks_per_node": RPN,
        "log_every": 0,
        "eval_batches": 8,
    }
    with tempfile.TemporaryDirectory(prefix="sdpq-hsdp-") as tmp:
        job, log = Path(tmp) / "job.json", Path(tmp) / "run.log"
        job.write_text(json.dumps({"arms": arms, "spec": spec}))
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # benchmarks.zeropp
        argv = [str(Path(__file__).resolve()), "--worker", str(job), tmp]
        if args.bandwidth:  # the same job on network namespaces: the node boundary is a shaped link
            from sdpq.launch.emulated import run_job
            from sdpq.launch.netns import EmulatedNodes

            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
            with EmulatedNodes(WORLD // RPN, args.bandwidth) as cluster:
                code = run_job(cluster, argv, RPN, timeout=args.timeout, env=env, logs=Path(tmp) / "nodes")
            log = Path(tmp) / "nodes" / "node0.log"
        else:
            code = run_local(
                argv, WORLD, log=log, timeout=args.timeout, env={"PYTHONPATH": path}, on_line=lambda s: print(s, end="")
            )
        results = {
            a: json.loads((Path(tmp) / f"{a}.json").read_text()) for a in arms if (Path(tmp) / f"{a}.json").exists()
        }
        if code != 0 or len(results) != len(arms):
            print(log.read_text()[-4000:])
            return 1
    summary = summarize(results)
    print(json.dumps(summary, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "runs": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:4])
        sys.exit(0)
    sys.exit(main())
