"""``sdpq bench comm``: wire bits per element and time per call of the sdpq collectives, each
next to the unquantized collective measured in the same run, on real gloo ranks.

It spawns one process per rank (world sizes from the layouts, e.g. 2x4 = 2 simulated nodes of 4
ranks) on this machine. Bits per element come from sdpq's byte counters (every byte that crosses
the link, scales and padding included); seconds are the median over repeats of the slowest
rank, each collective and its baseline called in alternation. On one machine every "link" is
loopback, so the times show compute overhead rather than the bandwidth saved: the bits per
element are what carries over to a real cluster.

Records (one per path x mode x link x layout x numel): path (weights|gradients), mode, link
(intra|inter), layout, numel, wire_bits_per_element, baseline_bits_per_element, bits_ratio,
seconds, baseline_seconds, time_ratio, relative_error.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

COLUMNS = [
    "path",
    "mode",
    "link",
    "layout",
    "numel",
    "wire_bits_per_element",
    "baseline_bits_per_element",
    "bits_ratio",
    "seconds",
    "baseline_seconds",
    "time_ratio",
    "relative_error",
]

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes", type=int, nargs="+", default=[1 << 16, 1 << 20], help="bucket sizes in elements (default: 2^16 2^20)"
    )
    p.add_argument(
        "--layouts", nargs="+", default=["2x2", "2x4", "4x2"], help="nodes x ranks per node (default: 2x2 2x4 4x2)"
    )
    p.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default="bf16",
        help="dtype of the gathered weights and of the gradients (the baseline's wire dtype)",
    )
    p.add_argument("--repeats", type=int, default=21, help="timed calls per measurement (median)")
    p.add_argument("--paths", nargs="+", choices=["weights", "gradients"], default=["weights", "gradients"])
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective is abandoned")


def _parse_layout(s: str) -> tuple[int, int]:
    try:
        nodes, rpn = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise SystemExit(f"bad layout {s!r}: expected NODESxRANKS, e.g. 2x4") from None
    if nodes < 1 or rpn < 1:
        raise SystemExit(f"bad layout {s!r}")
    return nodes, rpn


def run(args: argparse.Namespace) -> list[dict]:
    import multiprocessing as mp

    layouts = [_parse_layout(s) for s in args.layouts]
    by_world: dict[int, list[tuple[int, int]]] = {}
    for nodes, rpn in layouts:
        by_world.setdefault(nodes * rpn, []).append((nodes, rpn))
    opts = {
        "sizes": list(args.sizes),
        "dtype": _DTYPES[args.dtype],
        "repeats": max(1, args.repeats),
        "paths": list(args.paths),
        "timeout": float(args.timeout),
    }
    records: list[dict] = []
    ctx = mp.get_context("spawn")
    # Note: one thread per rank; the children read it before importing torch.
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for world, lays in by_world.items():
            with tempfile.TemporaryDirectory() as tmp:
                queue = ctx.Queue()
                procs = [
                    ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "store"), lays, opts, queue))
                    for r in range(world)
                ]
                for p in procs:
                    p.start()
                try:
                    status, payload = queue.get(timeout=opts["timeout"] * 4)
                finally:
                    for p in procs:
                        p.join(timeout=30)
                        if p.is_alive():
                            p.kill()
                if status != "ok":
                    raise RuntimeError(f"sdpq bench comm failed on a rank:\n{payload}")
                records.extend(payload)
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    order = {lay: i for i, lay in enumerate(f"{n}x{l}" for n, l in layouts)}
    records.sort(key=lambda r: (r["path"], order[r["layout"]], r["numel"], r["mode"], r["link"]))
    return records


# ----------------------------------------------------------------------------- worker


def _worker(rank, world, store_path, layouts, opts, queue) -> None:
    import traceback
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        timeout = timedelta(seconds=opts["timeout"])
        dist.init_process_group(
            "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world, timeout=timeout
        )
        records = []
        for nodes, rpn in layouts:
            records += _measure_layout(rank, nodes, rpn, opts, timeout)
        if rank == 0:
            queue.put(("ok", records))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def _paired_seconds(baseline: Callable[[], object], fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Medians over repeats of the slowest rank's time for one call of baseline and of fn, called
    in alternation (all ranks start each call together), so both see the same load: 4+ ranks
    share this machine's cores, and measured one after the other a ratio took whatever the load
    did in between (a steady gather once read 1.94x its baseline, 0.81-1.01x in four other runs)."""
    import torch
    import torch.distributed as dist

    baseline(), fn()  # warm-up
    times = torch.zeros(repeats, 2, dtype=torch.float64)
    for i in range(repeats):
        for j, f in enumerate((baseline, fn)):
            dist.barrier()
            t0 = time.perf_counter()
            f()
            times[i, j] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return float(times[:, 0].median()), float(times[:, 1].median())


def _record(path, mode, link, *, layout, numel, stats: dict, seconds, baseline_seconds, rel, baseline_bits):
    bits = stats[path][link]["bits_per_element"]
    return {
        "path": path,
        "mode": mode,
        "link": link,
        "layout": layout,
        "numel": numel,
        "wire_bits_per_element": bits,
        "baseline_bits_per_element": baseline_bits,
        "bits_ratio": baseline_bits / bits,
        "seconds": seconds,
        "baseline_seconds": baseline_seconds,
        "time_ratio": seconds / baseline_seconds,
        "relative_error": rel,
    }


class _Setup(NamedTuple):
    """What every measurement of one layout shares."""

    topo: Any  # sdpq.comm.Topology
    dtype: Any  # torch.dtype of the buckets
    reps: int

    @property
    def record(self):
        return functools.partial(_record, layout=self.topo.layout, baseline_bits=8 * self.dtype.itemsize)


def _max_over_ranks(v: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _gradient_records(s: _Setup, numel: int, gen) -> list[dict]:
    """The two-level reduce-scatter of one bucket against reduce_scatter_flat in the same dtype."""
    import torch
    import torch.distributed as dist

    from ..comm import CommStats, GradReduceScatter, reduce_scatter_flat
    from ..config import GradientsConfig
    from ..quant import relative_error

    world = dist.group.WORLD
    x = torch.randn(numel, generator=gen).to(s.dtype)
    res = torch.empty(numel // s.topo.world_size, dtype=s.dtype)
    exact = torch.empty(numel // s.topo.world_size, dtype=torch.float64)
    reduce_scatter_flat(exact, x.double(), world)
    rec = CommStats()
    rs = GradReduceScatter(numel, s.topo, GradientsConfig(), record_to=rec)
    rel = _max_over_ranks(float(relative_error(rs(x).double(), exact)))
    base, secs = _paired_seconds(
        functools.partial(reduce_scatter_flat, res, x, world), functools.partial(rs, x), s.reps
    )
    stats = rec.as_dict()
    return [
        s.record("gradients", "two_level", link, numel=numel, stats=stats, seconds=secs, baseline_seconds=base, rel=rel)
        for link in ("intra", "inter")
        if link in stats.get("gradients", {})
    ]


def _weight_records(s: _Setup, numel: int, gen) -> list[dict]:
    """The weight gather (diff: refresh across nodes + gather inside; direct) of one bucket in the
    steady state of a random walk (update/weight ~ 1e-3, like an optimizer step), against the
    plain all-gather in the same dtype. Both write into a bucket allocated once, as FSDP2 and
    ZeRO-3 hand the gather their bucket."""
    import torch
    import torch.distributed as dist

    from ..comm import CommStats, WeightGather, all_gather_flat, all_gather_rows
    from ..config import WeightsConfig
    from ..quant import relative_error

    C = numel // s.topo.world_size
    walk = [torch.randn(C, generator=gen)]
    for _ in range(4):
        walk.append(walk[-1] + 1e-3 * torch.randn(C, generator=gen))
    shard = walk[-1].to(s.dtype)
    bucket = torch.empty(numel, dtype=s.dtype)
    baseline = functools.partial(all_gather_flat, bucket, shard, dist.group.WORLD)
    true = all_gather_rows(shard, dist.group.WORLD)[0].reshape(-1).float()
    out = []
    for mode in ("diff", "direct"):
        rec = CommStats()
        cfg = WeightsConfig(mode=mode, bits=4 if mode == "diff" else 8, group_size=2048 if mode == "diff" else 256)
        wg = WeightGather(numel, s.topo, cfg, dtype=s.dtype, record_to=rec)
        for t, w in enumerate(walk):
            if t == len(walk) - 1:
                rec.reset()  # steady state: one difference refresh + one gather
            wg.mark_weights_changed(exact=False)
            got = wg(w.to(s.dtype))
        stats = rec.as_dict()
        rel = _max_over_ranks(float(relative_error(got.float(), true)))

        def refresh(wg=wg):
            wg.mark_weights_changed(exact=False)
            return wg(shard, out=bucket)

        gather = _paired_seconds(baseline, functools.partial(wg, shard, out=bucket), s.reps)
        # diff: the cross-node link carries the refresh, the intra-node link every gather.
        timed = (
            {"inter": _paired_seconds(baseline, refresh, s.reps), "intra": gather}
            if mode == "diff"
            else {"inter": gather, "intra": gather}
        )
        out += [
            s.record(
                "weights",
                mode,
                link,
                numel=numel,
                stats=stats,
                seconds=timed[link][1],
                baseline_seconds=timed[link][0],
                rel=rel,
            )
            for link in ("inter", "intra")
            if link in stats["weights"]
        ]
    return out


def _measure_layout(rank, nodes, rpn, opts, timeout) -> list[dict]:
    import torch

    from ..comm import Topology

    topo = Topology.build(rpn, timeout=timeout)
    s = _Setup(topo, getattr(torch, opts["dtype"]), opts["repeats"])
    out: list[dict] = []
    for numel in opts["sizes"]:
        numel = -(-numel // topo.world_size) * topo.world_size
        gen = torch.Generator().manual_seed(1000 + rank)
        if "gradients" in opts["paths"]:
            out += _gradient_records(s, numel, gen)
        if "weights" in opts["paths"]:
            out += _weight_records(s, numel, gen)
    return out
