"""Hugging Face Llama under FSDP2 + sdpq, several seeds: is the default config's final loss within
the baseline's seed spread, and does Hadamard smoothing help or hurt?

Model: `LlamaForCausalLM` from a config (3 layers, vocab 2048, untied embeddings, RMSNorm,
SwiGLU), hidden 192 and 256 (neither row width is a multiple of the default 128-element Hadamard
block's row alignment on every parameter: 192 = 3 x 64). FSDP2 per decoder layer and at the
root, bf16 mixed precision (param_dtype bf16, reduce_dtype fp32), torch AdamW, 4 gloo ranks as
2 nodes x 2, byte-level text (sdpq.train.data's stdlib corpus).

Arms per (hidden, seed), same initialisation and batches:
  baseline   plain FSDP2
  default    sdpq.fsdp.apply with the default block (4-bit weight differences, 8/4-bit
             gradients with Hadamard)
  no_hadamard  the same with gradients.hadamard false

Final loss = mean training loss of the last 10 steps (mean over ranks).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hf_llama_seeds.py             # ~20 min on 2 cores
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
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
NODES = {"topology": {"ranks_per_node": RPN}}  # 2 simulated nodes on this machine
ARMS = {"baseline": None, "default": NODES, "no_hadamard": {**NODES, "gradients": {"hadamard": False}}}


def train_arm(hidden: int, seed: int, block, args) -> list[float]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    import sdpq.fsdp
    from sdpq.train.data import TokenData

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=(8 * hidden // 3 + 63) // 64 * 64,
        num_hidden_layers=3,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if block is not None:
        sdpq.fsdp.apply(model, block, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    data, rank = TokenData.stdlib(), dist.get_rank()
    losses = torch.zeros(args.steps)
    for step in range(args.steps):
        x, y = data.batch(step, rank, args.micro_batch, args.seq_len, seed=seed)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses[step] = loss.detach()
    dist.all_reduce(losses)
    if block is not None:
        sdpq.fsdp.remove(model)
    return (losses / dist.get_world_size()).tolist()


def worker(job_file: str, out_file: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    job = json.loads(Path(job_file).read_text())
    args = argparse.Namespace(**job["args"])
    out: dict = {}
    for arm in job["arms"]:
        out[arm] = train_arm(job["hidden"], job["seed"], ARMS[arm], args)
        if dist.get_rank() == 0:
            print(
                f"hidden {job['hidden']} seed {job['seed']} {arm}: final {statistics.mean(out[arm][-10:]):.4f}",
                flush=True,
            )
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps(out))
    dist.destroy_process_group()


def summarize(runs: dict) -> dict:
    out = {}
    for hidden, seeds in runs.items():
        finals = {arm: [statistics.mean(seeds[s][arm][-10:]) for s in seeds] for arm in ARMS}
        b = finals["baseline"]
        row = {
            "final": finals,
            "baseline_mean": statistics.mean(b),
            "baseline_sd": statistics.stdev(b),
            "baseline_range": [min(b), max(b)],
        }
        for arm in ("default", "no_hadamard"):
            m = statistics.mean(finals[arm])
            row[arm] = {
                "mean": m,
                "ratio_to_baseline_per_seed": [a / c for a, c in zip(finals[arm], b)],
                "diff_in_baseline_sd": (m - row["baseline_mean"]) / row["baseline_sd"],
                "within_seed_spread": min(b) <= m <= max(b),
            }
        row["hadamard_no_worse"] = row["default"]["mean"] <= row["no_hadamard"]["mean"]
        out[hidden] = row
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", default="192,256")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hf_llama_seeds.json"))
    args = ap.parse_args(argv)
    runs: dict = {}
    t0 = time.time()
    for hidden in [int(h) for h in args.hidden.split(",")]:
        runs[str(hidden)] = {}
        for seed in [int(s) for s in args.seeds.split(",")]:
            with tempfile.TemporaryDirectory(prefix="sdpq-hfl-") as tmp:
                job, out, log = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "log"
                job.write_text(json.dumps({"hidden": hidden, "seed": seed, "arms": list(ARMS), "args": vars(args)}))
                code = run_local(
                    [str(Path(__file__).resolve()), "--worker", str(job), str(out)],
                    WORLD,
                    log=log,
                    timeout=args.timeout,
                    on_line=lambda s: print(s, flush=True),
                )
                if code != 0 or not out.exists():
                    raise RuntimeError(f"hidden {hidden} seed {seed} failed ({code}):\n{log.read_text()[-3000:]}")
                runs[str(hidden)][str(seed)] = json.loads(out.read_text())
    summary = summarize(runs)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "args": vars(args),
                "meta": {"wall_seconds": time.time() - t0, **provenance()},
                "summary": summary,
                "runs": runs,
            },
            indent=1,
        )
    )
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv and argv[0] == "--worker":
        worker(argv[1], argv[2])
    else:
        sys.exit(main())
