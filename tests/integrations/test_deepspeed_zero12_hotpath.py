"""No host synchronisation in sdpq's DeepSpeed ZeRO-1/2 hooks, and their allocation peaks in
sdpq.memory: training steps on 4 gloo ranks (2 nodes x 2) with the hot-path guard enabled
(`sdpq.comm.hotpath`) and transient tracking on, for both of DeepSpeed's ZeRO-1/2 optimizers
(DeepSpeedZeroOptimizer at stage 2, BF16_Optimizer at stage 1 with fp32 accumulation). The block
checks the replicas every second step (outside the guard: that check reads its verdict) and keeps
error feedback. A host read planted inside the exchanges the hooks run then raises: the hooks are
inside the guard, so the clean steps cannot pass for want of coverage."""

from __future__ import annotations

import math

import pytest

deepspeed = pytest.importorskip("deepspeed")

import deepspeed.runtime.bf16_optimizer  # noqa: E402,F401,F811  (before the pools fork)
import deepspeed.runtime.zero.stage_1_and_2  # noqa: E402,F401,F811
from zero12_common import TIMEOUT, build, prints, train  # noqa: E402

BLOCK = {"weights": {"mode": "diff", "verify_every": 2}, "gradients": {"error_feedback": True}}


def _guarded_fn(ctx, kind: str):
    import sdpq
    from sdpq.comm import OwnedReduceScatter, ReplicaDiffGather, hotpath

    eng = build(kind, BLOCK, seed=0)
    with hotpath.guard_enabled(), sdpq.memory.transients() as peaks:
        losses = train(ctx, eng, 0, 3)
    out = {"losses": losses, "prints": prints(eng), "peaks": dict(peaks.peaks)}
    out["stats"] = sdpq.stats.of(eng).as_dict()
    # Planted reads: the gather first (it raises in the step, after the reductions), then the
    # reduction (in the backward). Every rank raises at the same point, before the collective.
    for cls, name in ((ReplicaDiffGather, "gather"), (OwnedReduceScatter, "__call__")):
        orig = getattr(cls, name)

        def planted(self, x, *a, _orig=orig, **kw):
            bool(x.isfinite().all())
            return _orig(self, x, *a, **kw)

        setattr(cls, name, planted)
        try:
            with hotpath.guard_enabled():
                train(ctx, eng, 3, 1)
            out[name] = None
        except hotpath.HostSyncError as e:
            out[name] = str(e)
        finally:
            setattr(cls, name, orig)
    return out


@pytest.mark.parametrize("kind", ["zero2", "zero1-fp32-accum"])
def test_zero12_hooks_run_under_the_hot_path_guard(dist, kind):
    res = dist.run(_guarded_fn, 4, 2, kind, timeout=TIMEOUT)
    for r in res:
        assert all(math.isfinite(x) for x in r["losses"]) and r["prints"] == res[0]["prints"]
        assert set(r["peaks"]) == {"zero12.reduce", "zero12.gather"} and min(r["peaks"].values()) > 0, r["peaks"]
        assert all(r["stats"][path]["inter"]["calls"] >= 3 for path in ("gradients", "weights")), r["stats"]
        assert "inside sdpq's hot path (DeepSpeed ZeRO-1" in r["gather"] and "weight gather" in r["gather"], r
        assert "inside sdpq's hot path (DeepSpeed ZeRO-1" in r["__call__"] and "reduction" in r["__call__"], r
    print(kind, res[0]["peaks"], "|", res[0]["gather"])
