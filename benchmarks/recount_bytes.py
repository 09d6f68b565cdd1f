"""Cross-node bytes per steady step of the DDP, ZeRO-1/2 and ZeRO++ studies, by the least-traffic meter.

benchmarks/ddp_seeds.py, benchmarks/deepspeed_zero12.py and benchmarks/zeropp_peer.py counted
their bytes with the process-group meter of the time, which counted a collective as if every rank
sent its piece to every other member (a baseline's world-wide all-reduce, reduce-scatter or
all-gather at 2x its least traffic at 2 ranks a node). Their losses stand; their bytes are counted
again here with the one byte model (sdpq/comm/traffic.py, the least cross-node traffic), as
benchmarks/long_bytes.py does for the long-run study: every arm of every results file, on the
study's model and protocol as its file records it (seed 0; the studies' byte counts are the same
on every seed), trained for `--steps` and for twice as many, each length in one launch of the
study's own code; the steady bytes per step are the difference divided by the extra steps (no
first-step exact refresh, no PowerSGD warm-up all-reduces: bytes per step do not depend on the
run's length after them; `--steps` 2 or more, as PowerSGD compresses from its third step).
`start_extra` is what the first `--steps` steps moved beyond as many steady steps (the N-step
total less N steady steps).

A step is each study's own: a training step for DDP and ZeRO++; for ZeRO-1/2 an optimizer step,
that is 2 micro-batches of gradient accumulation (ZeRO-2 reduces each of them, ZeRO-1 once).
ZeRO++'s figures are its study's headline paths (weights and gradients; the few bytes of the
gradient-norm all-reduces on the "other" path are left out there, for every arm); its record also
holds every path and link of a steady step (`steady_by_path`) and the first step's bytes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/recount_bytes.py     # ~9 min on 2 cores
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import ddp_seeds, deepspeed_zero12, zeropp_peer  # noqa: E402
from benchmarks.provenance import provenance  # noqa: E402
from benchmarks.steady_bytes import short_protocol, steady_and_start  # noqa: E402
from sdpq.comm.link_bytes import LINKS  # noqa: E402

TAG = "[recount_bytes]"
DDP_FILES = ("ddp_seeds.json",)
ZERO12_FILES = (
    "deepspeed_zero12.json",
    "deepspeed_zero12_fp32_accum.json",
    "deepspeed_zero12_low_bits.json",
    "deepspeed_zero12_ef.json",
)
# One measurement for the three seed files: the study counted the same bytes on every seed.
ZEROPP_FILES = tuple(f"zeropp_peer_lr1e-3_seed{s}.json" for s in range(3))
ZEROPP_PATHS = ("weights", "gradients")  # the study's headline paths (zeropp_peer.summarize_arm)
SEED = 0


def _study_bytes_per_seed(data: dict, group_of) -> bool:
    """Whether the study's own byte counts were the same on every seed it ran."""
    seen = [json.dumps(group_of(r), sort_keys=True) for r in data["runs"].values()]
    return len(set(seen)) == 1


def _meter_total(r: dict, n: int) -> int:
    return round(r["meter_cross_node_bytes_per_step"] * n)


def count_ddp(data: dict, n: int, timeout: float) -> dict:
    study = data["args"]
    arms = [a for a in study["arms"].split(",") if a]
    totals = {}
    for steps in (n, 2 * n):
        res = ddp_seeds.run_seed(short_protocol(study, steps, timeout), SEED, arms)
        totals[steps] = {"ddp": {a: _meter_total(res[a], steps) for a in arms}}
    steady, extra = steady_and_start(totals[n], totals[2 * n], n)
    same = _study_bytes_per_seed(data, lambda r: {a: x["meter_cross_node_bytes_per_step"] for a, x in r.items()})
    return {"baseline": "ddp", "step": "a training step", "steady": steady, "start_extra": extra, "same_bytes": same}


def count_zero12(data: dict, n: int, timeout: float) -> dict:
    study = data["args"]
    arms = [a for a in study["arms"].split(",") if a]
    stages = [s for s in study["stages"].split(",") if s]
    totals = {}
    for steps in (n, 2 * n):
        res = deepspeed_zero12.run_seed(short_protocol(study, steps, timeout), SEED, stages, arms)
        totals[steps] = {st: {a: _meter_total(res[st][a], steps) for a in arms} for st in stages}
    steady, extra = steady_and_start(totals[n], totals[2 * n], n)

    def per_seed(r):
        return {st: {a: x["meter_cross_node_bytes_per_step"] for a, x in v.items()} for st, v in r.items()}

    step = f"an optimizer step ({deepspeed_zero12.ACCUM} micro-batches of gradient accumulation)"
    same = _study_bytes_per_seed(data, per_seed)
    return {"baseline": "plain", "step": step, "steady": steady, "start_extra": extra, "same_bytes": same}


def count_zeropp(datas: list[dict], n: int, timeout: float) -> dict:
    from sdpq.train.run import RunSpec

    job = datas[0]["job"]
    argv = datas[0]["argv"]
    nproc = int(argv[argv.index("--nproc") + 1]) if "--nproc" in argv else 4  # zeropp_peer.py's default
    totals, firsts, medians, paths = {}, {}, {}, {}
    for steps in (n, 2 * n):
        spec = RunSpec.from_dict(job["spec"])
        spec = dataclasses.replace(spec, steps=steps, warmup=1, eval_batches=0, log_every=0, seed=SEED)
        work = Path(tempfile.mkdtemp(prefix="sdpq-recount-zeropp-"))
        res = zeropp_peer.launch(
            {"spec": dataclasses.asdict(spec), "arms": job["arms"], "ranks_per_node": job["ranks_per_node"]},
            nproc,
            work,
            timeout,
        )
        shutil.rmtree(work, ignore_errors=True)
        link = {a: r["link_bytes"] for a, r in res.items()}
        totals[steps] = {"zero3": {a: zeropp_peer._link(x["total"], ZEROPP_PATHS, "inter") for a, x in link.items()}}
        firsts[steps] = {
            a: sum(r["link_bytes"]["steps"][0].get(p, {}).get("inter", 0) for p in ZEROPP_PATHS) for a, r in res.items()
        }
        paths[steps] = {
            a: {p: {lk: x["total"].get(p, {}).get(lk, {}).get("bytes", 0) for lk in LINKS} for p in zeropp_peer.PATHS}
            for a, x in link.items()
        }
        medians = {a: zeropp_peer.summarize_arm(r, steps)["steady_cross_node_bytes_per_step"] for a, r in res.items()}
    steady, extra = steady_and_start(totals[n], totals[2 * n], n)
    by_path = {
        a: {p: {lk: (paths[2 * n][a][p][lk] - paths[n][a][p][lk]) / n for lk in LINKS} for p in per}
        for a, per in paths[n].items()
    }
    counts = [{a: x["cross_node_bytes_per_step"] for a, x in d["summary"]["arms"].items()} for d in datas]
    return {
        "baseline": "zero3",
        "step": "a training step (weights and gradients paths, as the study's headline)",
        "steady": steady,
        "start_extra": extra,
        "first_step": {"zero3": firsts[n]},
        "same_bytes": all(c == counts[0] for c in counts),  # over the seed files
        "also_for": list(ZEROPP_FILES[1 : len(datas)]),
        # The study's own steady figure (median of steps 2.. of the longer run): a cross-check.
        "steady_median": {"zero3": medians},
        # Every path and link of a steady step (the meter's "intra": the ring's hops inside nodes).
        "steady_by_path": {"zero3": by_path},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="steps of the shorter run (the longer runs twice as many)")
    ap.add_argument("--studies", default="ddp,zero12,zeropp", help="comma-separated, from ddp, zero12, zeropp")
    ap.add_argument("--results", default="benchmarks/results", help="the studies' files (relative: to the repo)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "recount_bytes.json"))
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    results = Path(args.results) if Path(args.results).is_absolute() else ROOT / args.results
    chosen = [s for s in args.studies.split(",") if s]
    if set(chosen) - {"ddp", "zero12", "zeropp"}:
        ap.error(f"--studies {args.studies!r}; allowed: ddp, zero12, zeropp")
    studies: dict = {}
    t0 = time.time()
    jobs = []
    if "ddp" in chosen:
        jobs += [(f, "benchmarks/ddp_seeds.py", lambda d: count_ddp(d[0], args.steps, args.timeout)) for f in DDP_FILES]
    if "zero12" in chosen:
        prog = "benchmarks/deepspeed_zero12.py"
        jobs += [(f, prog, lambda d: count_zero12(d[0], args.steps, args.timeout)) for f in ZERO12_FILES]
    if "zeropp" in chosen:
        jobs.append((ZEROPP_FILES[0], "benchmarks/zeropp_peer.py", lambda d: count_zeropp(d, args.steps, args.timeout)))
    for name, program, count in jobs:
        t = time.time()
        names = ZEROPP_FILES if name == ZEROPP_FILES[0] else (name,)
        datas = [json.loads((results / f).read_text()) for f in names]
        rec = count(datas)
        rec["ratios"] = {g: {a: b / per[rec["baseline"]] for a, b in per.items()} for g, per in rec["steady"].items()}
        rec["program"] = program
        rec["protocol"] = datas[0]["args"] if "args" in datas[0] else datas[0]["job"]["spec"]
        rec["seconds"] = time.time() - t
        studies[name] = rec
        for g, per in rec["steady"].items():
            for arm, b in per.items():
                print(
                    f"{TAG} {name} {g} {arm:9}: {b / 1e6:.4f} MB a steady step, "
                    f"{rec['ratios'][g][arm]:.3f} of {rec['baseline']}",
                    flush=True,
                )
        print(f"{TAG} {name}: {rec['seconds']:.0f} s", flush=True)
    shown = {k: v for k, v in vars(args).items() if k != "out"}
    command = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/recount_bytes.py" + "".join(
        f" --{k} {v}" for k, v in shown.items() if k != "timeout"
    )
    record = {
        "args": shown,
        "meta": {"wall_seconds": time.time() - t0, **provenance()},
        "command": command,
        "seed": SEED,
        "studies": studies,
    }
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"{TAG} wrote {args.out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
