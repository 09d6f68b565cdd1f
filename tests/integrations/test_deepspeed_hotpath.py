"""No host synchronisation in sdpq's DeepSpeed ZeRO-3 hooks: training steps on 4 gloo ranks (2
nodes x 2) with the hot-path guard enabled (`sdpq.comm.hotpath`), so any `.item()`, `bool()`,
`float()`, `.tolist()` or `.cpu()` inside the parameter all-gathers (forward/backward fetches and
the persistent parameters' gather after every step) or the gradient reduce-scatter (or the
collectives they run) raises. On a GPU each would stall the CPU inside communication ZeRO-3
overlaps with compute.

`sdpq.deepspeed.initialize` builds every parameter's WeightGather and checks, in one collective,
that the ranks agree on them and on what shapes the run-time gradient buckets; the hooks build a
bucket's reduce-scatter without a check of their own. Covered: the full method (diff weights,
two-level gradients, FP8 + MCF AdamW, bf16), one that samples the quantization error on every
call, verifies the references every second version and keeps error feedback, and the direct /
exact modes.
"""

from __future__ import annotations

import math

import pytest

deepspeed = pytest.importorskip("deepspeed")

# Imported here, before the worker pools fork, so that ranks do not each import them (~10 s).
import deepspeed.runtime.zero.stage3  # noqa: E402,F401,F811
from deepspeed_common import FULL_BLOCK, build_engine, fresh_deepspeed, train_steps  # noqa: E402

import sdpq.integrations.deepspeed as sds  # noqa: E402

WORLD, RPN = 4, 2
SAMPLED = {
    "stats": {"error_sample_every": 1},
    "weights": {"mode": "diff", "verify_every": 2},
    "gradients": {"error_feedback": True},
    "optimizer": {"master": "native"},
}
NO_OPT = {"optimizer": {"enabled": False}}
DIRECT_EXACT = {"weights": {"mode": "direct", "bits": 8}, "gradients": {"mode": "exact"}, **NO_OPT}
CASES = {
    "full_bf16": (FULL_BLOCK, True),
    "sampled": (SAMPLED, False),
    "direct_weights_exact_gradients": (DIRECT_EXACT, False),
}


def _train(ctx, case: str, steps: int, inject: str | None = None):
    """Build the engine (counting the agreement collectives it runs), then train `steps` steps
    with the guard on. inject: plant a host read in the collective a hook runs."""
    from sdpq.comm import GradReduceScatter, agreement, hotpath
    from sdpq.integrations import _ds_adapter

    fresh_deepspeed()
    block, bf16 = CASES[case]
    rounds = []
    orig_rows, orig_gather = agreement.all_gather_rows, _ds_adapter.gather_coalesced
    orig_rs = GradReduceScatter.__call__

    def counted(*a, **kw):
        rounds.append(1)
        return orig_rows(*a, **kw)

    def gather(gathers, shards, outs):
        shards[0].sum().item()
        return orig_gather(gathers, shards, outs)

    def reduce_scatter(self, x, out=None):
        bool(x.isfinite().all())
        return orig_rs(self, x, out)

    agreement.all_gather_rows = counted
    try:
        eng = build_engine(block, bf16=bf16)
    finally:
        agreement.all_gather_rows = orig_rows
    adapter = sds.get_adapter(eng)
    built = len(adapter.weights)
    if inject == "gather":
        _ds_adapter.gather_coalesced = gather
    elif inject == "reduce_scatter":
        GradReduceScatter.__call__ = reduce_scatter  # type: ignore[method-assign]
    try:
        with hotpath.guard_enabled():
            losses = train_steps(eng, ctx.rank, steps)
    finally:
        _ds_adapter.gather_coalesced = orig_gather
        GradReduceScatter.__call__ = orig_rs  # type: ignore[method-assign]
    # Read outside the hot path: as_dict() is where the sampled errors are read.
    stats = adapter.stats.as_dict()
    return {"losses": losses, "rounds": len(rounds), "built": built, "params": len(adapter.params),
            "after": len(adapter.weights), "buckets": len(adapter.grads), "stats": stats}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_training_steps_run_under_the_hot_path_guard(dist, case):
    steps = 3
    res = dist.run(_train, WORLD, RPN, case, steps, timeout=180)
    for r in res:
        assert len(r["losses"]) == steps and all(math.isfinite(x) for x in r["losses"])
        # initialize: one agreement collective for the engine and every parameter's gather.
        assert r["rounds"] == 1
        assert r["built"] == r["after"] == r["params"] > 0
        assert r["buckets"] > 0
        stats = r["stats"]
        for path in ("weights", "gradients"):
            assert stats[path]["inter"]["calls"] >= steps, (path, stats[path])
        if CASES[case][0] is SAMPLED:
            # The sampled errors were accumulated on the device and read by as_dict() alone.
            g = stats["gradients"]["inter"]
            assert g["error_samples"] > 0 and 0 < g["relative_error_mean"] < 0.5
            w = stats["weights"]["inter"]
            assert w["error_samples"] > 0 and 0 <= w["relative_error_max"] < 0.5


@pytest.mark.parametrize(
    "inject, where",
    [("gather", r"Tensor.item\(\) inside sdpq's hot path \(DeepSpeed ZeRO-3 parameter all-gather\)"),
     ("reduce_scatter", r"bool\(tensor\) inside sdpq's hot path \(DeepSpeed ZeRO-3 gradient reduce-scatter\)")],
)  # fmt: skip
def test_the_guard_covers_the_hooks(dist, inject, where):
    """A host read placed inside the collective a hook runs raises on every rank: the hooks run
    inside the guard, so the test above cannot pass for want of coverage."""
    from harness import DistTestError

    dist.discard(WORLD)  # the failing run leaves DeepSpeed's groups behind
    with pytest.raises(DistTestError, match="HostSyncError: " + where):
        dist.run(_train, WORLD, RPN, "direct_weights_exact_gradients", 1, inject, timeout=120)


def _disagree(ctx):
    fresh_deepspeed()
    block = {"weights": {"mode": "diff", "group_size": 1024 if ctx.rank == 3 else 2048}, **NO_OPT}
    try:
        build_engine(block)
    except sds.ConfigError as e:
        return str(e)
    return None


def test_a_rank_that_disagrees_fails_at_initialize_on_every_rank(dist):
    """The one agreement of initialize still names the differing setting, on every rank."""
    dist.discard(WORLD)
    res = dist.run(_disagree, WORLD, RPN, timeout=120)
    for msg in res:
        assert msg is not None and "sdpq.deepspeed.initialize: the ranks disagree" in msg
        assert "weights.group_size: 2048 on ranks [0, 1, 2]; 1024 on ranks [3]" in msg, msg
