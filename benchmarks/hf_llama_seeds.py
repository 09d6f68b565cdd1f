r"""Hugging Face Llama under FSDP2 + sdpq, several seeds: is an sdpq arm's final loss within the
bf16 baseline's seed spread, what does it send across nodes, and does Hadamard smoothing help?

Model: `LlamaForCausalLM` from a config (--layers, default 3; --vocab, default 2048; untied
embeddings, RMSNorm, SwiGLU, heads hidden/64), hidden 192 and 256 by default (neither row width
is a multiple of the default 128-element Hadamard block's row alignment on every parameter: 192 =
3 x 64). FSDP2 per decoder layer and at the root, bf16 mixed precision (param_dtype bf16,
reduce_dtype fp32), torch AdamW, 4 gloo ranks as 2 nodes x 2, byte-level text (sdpq.train.data's
stdlib corpus: token ids 0-255 only, so embedding rows past 256 get no gradient).

Arms per (hidden, seed), same initialisation and batches (--arms, a comma list with baseline;
default baseline,default,no_hadamard):
  baseline     plain FSDP2
  default      sdpq.fsdp.apply with the default block (2-bit weight differences, 8/4-bit
               gradients with Hadamard and bf16 scales)
  no_hadamard  the same with gradients.hadamard false
  w4-g4        4-bit weight differences, fp32 gradient scales (the default until 2026-11-28; the
               results files written before then call it `default`)
  w2-g4        2-bit weight differences, fp32 gradient scales (4 + 32/128 bits per inter-node
               gradient element)
  w2-g4-bf16   2-bit weight differences, bf16 gradient scales (4 + 16/128): the default, spelled
               out

Final loss = mean training loss of the last 10 steps (mean over ranks). Cross-node bytes: the
least-traffic meter (sdpq/comm/link_bytes.py, sdpq/comm/traffic.py's byte model, independent of
sdpq's own statistics) on during each training step only, one snapshot a step, every rank's
counts added; an arm's bytes per step are the mean of its steps after the first (the first
carries the exact weight refresh), its ratio the baseline's. The output also has the model's
parameter count and each arm's mean step time (rank 0, steps after the first).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hf_llama_seeds.py             # ~20 min on 2 cores

The scale study (a model at least 10x the long-run model's 918,656 parameters, 2 seeds x 300
steps, against bf16): hidden 384, 8 layers, vocab 256 (14.4M parameters, all of them trained: the
byte-level data has ids 0-255 only, so a larger vocabulary adds embedding rows that never train,
and FSDP2 gathers the root's embedding once a step rather than twice, which raises every byte
ratio: at vocab 8192 the default block measured 0.147 instead of ~0.13). Run on 2026-11-28 with
the arms baseline and w2-g4-bf16 (results/hf_llama_scale.json; ~25 min a seed on an idle 2-core
machine, 2-4 s a step; a launch runs every arm of its seed, so give it --timeout to match):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hf_llama_seeds.py --hidden 384 --layers 8 \
        --vocab 256 --micro-batch 2 --seq-len 64 --steps 300 --seeds 0,1 \
        --arms baseline,w2-g4-bf16 --partial runs/hf_llama_scale --timeout 7200 \
        --out benchmarks/results/hf_llama_scale.json

--partial keeps each seed's results as it finishes and reads them back instead of running again,
so a stopped study resumes (and a later seed may run fewer arms: each arm's figures are then over
the seeds it ran, paired with the baseline's of the same seeds).
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
ARMS = {
    "baseline": None,
    "default": NODES,
    "no_hadamard": {**NODES, "gradients": {"hadamard": False}},
    "w4-g4": {**NODES, "weights": {"bits": 4}, "gradients": {"scale_dtype": "fp32"}},
    "w2-g4": {**NODES, "weights": {"bits": 2}, "gradients": {"scale_dtype": "fp32"}},
    "w2-g4-bf16": {**NODES, "weights": {"bits": 2}, "gradients": {"scale_dtype": "bf16"}},
}
DEFAULT_ARMS = "baseline,default,no_hadamard"


def cross_node_bytes(counter) -> dict:
    """The job's cross-node bytes per training step by the least-traffic meter (every rank's
    `LinkBytes` added; the meter snapshots once a step): the first step (the first exact weight
    refresh) and the steady steps after it."""
    import torch.distributed as dist

    from sdpq.comm.link_bytes import sum_over_ranks

    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, counter.as_dict())
    steps = sum_over_ranks(per_rank)["steps"]
    inter = [sum(links.get("inter", 0) for links in st.values()) for st in steps]
    steady = inter[1:]
    paths = sorted({p for st in steps[1:] for p in st})
    return {
        "first_step": inter[0] if inter else None,
        "steady_per_step": statistics.mean(steady) if steady else None,
        "steady_min": min(steady, default=None),
        "steady_max": max(steady, default=None),
        "steady_by_path": {p: statistics.mean(st.get(p, {}).get("inter", 0) for st in steps[1:]) for p in paths},
    }


def train_arm(hidden: int, seed: int, block, args) -> dict:
    """One arm on the initialised world: {"losses" (mean over ranks), "bytes" (cross_node_bytes),
    "params", "step_seconds" (rank 0's mean wall time of the steps after the first)}."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    import sdpq.fsdp
    from sdpq.comm.link_bytes import LinkBytes
    from sdpq.train.data import TokenData

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=hidden,
        intermediate_size=(8 * hidden // 3 + 63) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
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
    # The meter (sdpq/comm/link_bytes.py) counts inside the steps only, one snapshot a step;
    # it wraps the ProcessGroup methods and changes no number.
    counter = LinkBytes(RPN, enabled=False)
    times = []
    with counter:
        for step in range(args.steps):
            t = time.perf_counter()
            counter.enabled = True
            x, y = data.batch(step, rank, args.micro_batch, args.seq_len, seed=seed)
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            counter.enabled = False
            counter.snapshot()
            losses[step] = loss.detach()
            times.append(time.perf_counter() - t)
    dist.all_reduce(losses)
    if block is not None:
        sdpq.fsdp.remove(model)
    return {
        "losses": (losses / dist.get_world_size()).tolist(),
        "bytes": cross_node_bytes(counter),
        "params": params,
        "step_seconds": statistics.mean(times[1:]) if len(times) > 1 else times[0],
    }


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
        out[arm] = r = train_arm(job["hidden"], job["seed"], ARMS[arm], args)
        if dist.get_rank() == 0:
            b = r["bytes"]["steady_per_step"]
            print(
                f"hidden {job['hidden']} seed {job['seed']} {arm}: final {statistics.mean(r['losses'][-10:]):.4f}, "
                f"{r['step_seconds']:.2f} s/step, cross-node {'-' if b is None else f'{b / 1e6:.3f} MB'} a steady step",
                flush=True,
            )
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps(out))
    dist.destroy_process_group()


def summarize(runs: dict, bytes_: dict | None = None, params: dict | None = None) -> dict:
    """Per hidden size: every arm's final loss per seed; the baseline's mean, sd and range; each
    other arm's mean, paired ratio per seed, difference in baseline sd (None under 2 seeds) and
    whether its mean lies within the baseline's seed range; Hadamard's verdict where both
    `default` and `no_hadamard` ran. With `bytes_` ({hidden: {seed: {arm: cross_node_bytes}}}),
    each arm's steady cross-node bytes per step (seed mean; deterministic) and its ratio to the
    baseline's; with `params` ({hidden: n}), the parameter count."""
    out = {}
    for hidden, seeds in runs.items():
        # Note: an arm may have run on some seeds only (a study resumed with fewer arms, see
        # --partial); its figures are over those seeds, paired with the baseline's of the same seeds.
        arms = list(dict.fromkeys(arm for per in seeds.values() for arm in per))
        if any("baseline" not in per for per in seeds.values()):
            raise ValueError(f"hidden {hidden}: a seed without the baseline arm")
        with_arm = {arm: [s for s in seeds if arm in seeds[s]] for arm in arms}
        finals = {arm: [statistics.mean(seeds[s][arm][-10:]) for s in with_arm[arm]] for arm in arms}
        b = finals["baseline"]
        sd = statistics.stdev(b) if len(b) > 1 else None
        row: dict = {"params": params.get(hidden)} if params else {}
        row.update(
            {
                "final": finals,
                "baseline_mean": statistics.mean(b),
                "baseline_sd": sd,
                "baseline_range": [min(b), max(b)],
            }
        )
        for arm in arms:
            if arm == "baseline":
                continue
            m = statistics.mean(finals[arm])
            paired = [statistics.mean(seeds[s]["baseline"][-10:]) for s in with_arm[arm]]
            row[arm] = {
                "seeds": with_arm[arm],
                "mean": m,
                "baseline_mean_same_seeds": statistics.mean(paired),
                "ratio_to_baseline_per_seed": [a / c for a, c in zip(finals[arm], paired)],
                "diff_in_baseline_sd": (m - row["baseline_mean"]) / sd if sd else None,
                "within_seed_spread": min(b) <= m <= max(b),
            }
        if "default" in arms and "no_hadamard" in arms:
            row["hadamard_no_worse"] = row["default"]["mean"] <= row["no_hadamard"]["mean"]
        if bytes_ and hidden in bytes_:
            per_seed = bytes_[hidden]
            steady = {}
            for arm in arms:
                vals = [per_seed[s][arm]["steady_per_step"] for s in per_seed if arm in per_seed[s]]
                steady[arm] = None if None in vals else statistics.mean(vals)
            row["cross_node_bytes_per_step"] = steady
            base = steady["baseline"]
            row["bytes_ratio_to_baseline"] = {
                arm: None if v is None or not base else v / base for arm, v in steady.items()
            }
        out[hidden] = row
    return out


def _run_seed(hidden: int, seed: int, arms: list[str], args) -> dict:
    """One launch of the 4 ranks for every arm of (hidden, seed): the workers' {arm: result}."""
    with tempfile.TemporaryDirectory(prefix="sdpq-hfl-") as tmp:
        job, out, log = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "log"
        job.write_text(json.dumps({"hidden": hidden, "seed": seed, "arms": arms, "args": vars(args)}))
        code = run_local(
            [str(Path(__file__).resolve()), "--worker", str(job), str(out)],
            WORLD,
            log=log,
            timeout=args.timeout,
            on_line=lambda s: print(s, end="", flush=True),
        )
        if code != 0 or not out.exists():
            raise RuntimeError(f"hidden {hidden} seed {seed} failed ({code}):\n{log.read_text()[-3000:]}")
        return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", default="192,256")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma list, with baseline; of {', '.join(ARMS)}")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hf_llama_seeds.json"))
    ap.add_argument(
        "--partial",
        default=None,
        help="folder of each (hidden, seed)'s results: written as each finishes, and read instead of "
        "running again when present (a stopped study resumes; its arms stay as they ran)",
    )
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or "baseline" not in arms:
        ap.error(f"--arms {args.arms!r}: needs baseline; allowed: {', '.join(ARMS)}")
    runs: dict = {}
    bytes_: dict = {}
    params: dict = {}
    step_seconds: dict = {}
    t0 = time.time()
    for hidden in [int(h) for h in args.hidden.split(",")]:
        runs[str(hidden)], bytes_[str(hidden)], step_seconds[str(hidden)] = {}, {}, {}
        for seed in [int(s) for s in args.seeds.split(",")]:
            kept = Path(args.partial) / f"h{hidden}_s{seed}.json" if args.partial else None
            if kept is not None and kept.exists():
                res = json.loads(kept.read_text())
                print(f"hidden {hidden} seed {seed}: read {kept} (arms {', '.join(res)})", flush=True)
            else:
                res = _run_seed(hidden, seed, arms, args)
                if kept is not None:
                    kept.parent.mkdir(parents=True, exist_ok=True)
                    kept.write_text(json.dumps(res))
            runs[str(hidden)][str(seed)] = {arm: r["losses"] for arm, r in res.items()}
            bytes_[str(hidden)][str(seed)] = {arm: r["bytes"] for arm, r in res.items()}
            step_seconds[str(hidden)][str(seed)] = {arm: r["step_seconds"] for arm, r in res.items()}
            params[str(hidden)] = res["baseline"]["params"]
    summary = summarize(runs, bytes_, params)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "args": vars(args),
                "meta": {"wall_seconds": time.time() - t0, **provenance()},
                "params": params,
                "summary": summary,
                "runs": runs,
                "bytes": bytes_,
                "step_seconds": step_seconds,
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
