"""What keeping groups and Hadamard blocks inside parameters costs and buys, per model: bits per
element on the cross-node link and relative error, with and without the parameter segments.

Real gradients and weight changes: every rank runs `--steps` training steps of the model (plain,
unsharded, torch AdamW, its own batches of the stdlib corpus), then each FSDP2-sized bucket (one
per decoder block, one for the rest, as sdpq.train shards them) is cut as FSDP2 cuts it (dim-0
shards of every parameter) and reduced by GradReduceScatter, and its weights' change by one more
optimizer step sent by WeightGather's difference refresh, once with the parameters' segments
(what sdpq.fsdp.apply now passes) and once without (blocks and groups at fixed multiples of
the chunk, as before). Bits per element are the collectives' own statistics (bytes on the wire,
padding included, per bucket element); errors are against the fp64 sum / the exact weights.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/alignment_cost.py     # ~1 min on 2 cores
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.provenance import provenance  # noqa: E402
from sdpq.launch.local import run_local  # noqa: E402

WORLD, RPN = 4, 2
MODELS = {
    "gpt": {"kind": "gpt", "n_layer": 4, "d_model": 256},  # the demo's model
    "llama": {"kind": "llama", "n_layer": 4, "d_model": 256},  # the Llama-shaped model, same size
    "llama192": {"kind": "llama", "n_layer": 4, "d_model": 192, "n_head": 3},  # a width of 3 x 64
}


def _model(spec: dict):
    from sdpq.train.llama import Llama, LlamaConfig
    from sdpq.train.model import GPT, GPTConfig

    kw = {k: v for k, v in spec.items() if k != "kind"}
    return GPT(GPTConfig(**kw)) if spec["kind"] == "gpt" else Llama(LlamaConfig(**kw))


def _buckets(model) -> list[list]:
    """The parameters of each FSDP2 module as sdpq.train shards them: every block, then the rest."""
    blocks = [list(b.parameters()) for b in model.blocks]
    inside = {id(p) for b in blocks for p in b}
    return blocks + [[p for p in model.parameters() if id(p) not in inside]]


def _fsdp_bucket(tensors, N: int):
    """FSDP2's reduce-scatter input of these full tensors: per rank r, every dim-0 shard r
    (rows padded to a multiple of N) -> (flat bucket, [(shard elements, row width)])."""
    import torch

    cols, shards = [], []
    for t in tensors:
        R = t.shape[0]
        padded = torch.zeros((-(-R // N) * N, *t.shape[1:]), dtype=torch.float32)
        padded[:R] = t
        cols.append(padded.view(N, -1))
        shards.append((cols[-1].shape[1], t.shape[-1] if t.dim() > 1 else 0))
    return torch.cat(cols, dim=1).reshape(-1), shards


def measure(model_spec: dict, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from sdpq.comm import CommStats, GradReduceScatter, Topology, WeightGather
    from sdpq.comm.segments import sharded_segments
    from sdpq.config import GradientsConfig, WeightsConfig
    from sdpq.train.data import TokenData

    rank, N = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _model(model_spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TokenData.stdlib()
    for step in range(steps + 1):
        x, y = data.batch(step, rank, 4, 128)
        opt.zero_grad()
        model(x, y).backward()
        if step < steps:  # the last backward's gradients are the ones measured
            for p in model.parameters():  # (the replicas stay equal: average as DDP would)
                dist.all_reduce(p.grad)
                p.grad /= N
            opt.step()
    topo = Topology.build(RPN)
    buckets = _buckets(model)
    before = [_fsdp_bucket([p.detach().clone() for p in params], N) for params in buckets]
    grads = [_fsdp_bucket([p.grad for p in params], N) for params in buckets]
    for p in model.parameters():  # one more (replicated) step: the weight change a refresh sends
        dist.all_reduce(p.grad)
        p.grad /= N
    opt.step()
    after = [_fsdp_bucket([p.detach() for p in params], N)[0] for params in buckets]
    out: dict = {}
    for aligned in (False, True):
        stats = CommStats()
        err2 = ref2 = werr2 = wref2 = serr2 = sref2 = 0.0
        wbytes = welems = 0
        for (bucket, shards), (w0, wshards), w1 in zip(grads, before, after):
            segs = sharded_segments(shards, N) if aligned else None
            rs = GradReduceScatter(bucket.numel(), topo, GradientsConfig(), record_to=stats, segments=segs)
            got = rs(bucket)
            every = [torch.empty_like(bucket) for _ in range(N)]
            dist.all_gather(every, bucket)
            exact = torch.stack(every).double().sum(0).view(N, -1)[rank]
            err2 += float((got.double() - exact).pow(2).sum())
            ref2 += float(exact.pow(2).sum())
            # the 1-D parameters' elements (norms, biases): what shared scales and blocks hurt
            one_d = torch.cat([torch.full((n,), w == 0) for n, w in shards])
            serr2 += float((got.double() - exact)[one_d].pow(2).sum())
            sref2 += float(exact[one_d].pow(2).sum())
            wsegs = sharded_segments([(n, 0) for n, _ in wshards], 1)[0] if aligned else None
            wg = WeightGather(w0.numel(), topo, WeightsConfig(), record_to=stats, segments=wsegs)
            mine0, mine1 = w0.view(N, -1)[rank], w1.view(N, -1)[rank]
            wg.gather(mine0)  # the first refresh is exact (and not what is compared)
            b0, e0 = (stats.as_dict()["weights"]["inter"][k] for k in ("bytes", "elements"))
            wg.mark_weights_changed(exact=False)
            full = wg.gather(mine1)
            b1, e1 = (stats.as_dict()["weights"]["inter"][k] for k in ("bytes", "elements"))
            wbytes, welems = wbytes + b1 - b0, welems + e1 - e0
            werr2 += float((full.view(N, -1)[rank] - mine1).double().pow(2).sum())
            wref2 += float((mine1 - mine0).double().pow(2).sum())
        s = stats.as_dict()
        out["aligned" if aligned else "unaligned"] = {
            "gradients_inter_bits_per_element": s["gradients"]["inter"]["bits_per_element"],
            "gradients_intra_bits_per_element": s["gradients"]["intra"]["bits_per_element"],
            "gradients_relative_error": (err2 / ref2) ** 0.5,
            "gradients_relative_error_1d_params": (serr2 / sref2) ** 0.5,
            # the difference refreshes only (the first refresh is exact)
            "weights_diff_bits_per_element": 8 * wbytes / welems,
            "weights_relative_error_of_the_change": (werr2 / wref2) ** 0.5,
        }
    return out


def worker(job_file: str, out_file: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    job = json.loads(Path(job_file).read_text())
    res = {name: measure(MODELS[name], job["steps"]) for name in job["models"]}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res)
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "alignment_cost.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sdpq-align-") as tmp:
        job, out, log = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "log"
        job.write_text(json.dumps({"models": args.models.split(","), "steps": args.steps}))
        code = run_local([str(Path(__file__).resolve()), "--worker", str(job), str(out)], WORLD, log=log, timeout=1800)
        if code != 0 or not out.exists():
            raise RuntimeError(f"failed ({code}):\n{log.read_text()[-3000:]}")
        per_rank = json.loads(out.read_text())
    # The job's figures: bits are per rank alike (the same layout); errors averaged over ranks.
    summary: dict = {}
    for name in per_rank[0]:
        summary[name] = {}
        for arm in ("unaligned", "aligned"):
            rows = [r[name][arm] for r in per_rank]
            summary[name][arm] = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    Path(args.out).write_text(json.dumps({"args": vars(args), "meta": provenance(), "summary": summary}, indent=1))
    shown = {
        "gradients_inter_bits_per_element": "grad bits/elem",
        "gradients_relative_error": "grad rel err",
        "gradients_relative_error_1d_params": "1-D params",
        "weights_diff_bits_per_element": "weight diff bits/elem",
        "weights_relative_error_of_the_change": "change rel err",
    }
    for name, row in summary.items():
        u, a = row["unaligned"], row["aligned"]
        print(f"{name:9s} " + "  ".join(f"{label} {u[k]:.4f} -> {a[k]:.4f}" for k, label in shown.items()))
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv and argv[0] == "--worker":
        worker(argv[1], argv[2])
    else:
        sys.exit(main())
