"""Faults around sdpq.deepspeed's ZeRO-1/2 checkpoints (sdpq/integrations/_ds_zero12.py): one
rank's sdpq state file damaged, a save that fails midway, the hooks' exact fallback. Every fault
must end the same way on every rank, within seconds: a warned rebuild with the replicas bitwise
equal afterwards, or one clear error on every rank. 4 gloo ranks as 2 simulated nodes x 2, bf16.

Note (CI time): each test builds as few DeepSpeed engines as it can. The damage test saves one
checkpoint per stage and loads every damage (from a copy of it) into one engine per stage."""

from __future__ import annotations

import errno
import os
import shutil
import time
import warnings

import pytest

deepspeed = pytest.importorskip("deepspeed")

import deepspeed.runtime.zero.stage_1_and_2  # noqa: E402,F401,F811  (before the pools fork)
import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
from faults_common import damage, tree  # noqa: E402
from zero12_common import TIMEOUT, build, prints, train  # noqa: E402

import sdpq.integrations.deepspeed as sds  # noqa: E402

# Every counter a rebuild must reset is live: stochastic weight rounding (a rounding stream per
# group), error feedback at stage 2 (residuals). The two stages' blocks differ, so that one
# stage's file is "a file from another config" for the other.
BLOCKS = {
    2: {"weights": {"mode": "diff", "rounding": "stochastic"}, "gradients": {"error_feedback": True}},
    1: {"weights": {"mode": "diff"}},
}
DAMAGES = ("truncated", "random", "deleted", "other-config", "other-rank", "stale")
BAD = 1  # the rank whose file is damaged
# What the warning must say about rank BAD's file, besides its name
SAYS = {
    "truncated": "cannot read",
    "random": "cannot read",
    "deleted": "no sdpq_rank00001.pt",
    "other-config": "saved with sdpq.",
    "other-rank": "saved on rank 2",
    "stale": "different steps",
}


def _damage(ckpt: str, stage: int, how: str) -> str:
    """A copy of stage's checkpoint "t" with rank BAD's sdpq file damaged (on rank 0; -> its tag)."""
    tag = f"{how}{stage}"
    src, dst = os.path.join(ckpt, f"t{stage}"), os.path.join(ckpt, tag)
    shutil.copytree(src, dst)
    name = sds.STATE_FILE.format(rank=BAD)
    path = os.path.join(dst, name)
    if how == "other-config":  # the other stage's file (another block): a copy, as "stale" is
        damage(path, "stale", earlier=os.path.join(ckpt, f"t{3 - stage}", name))
    else:
        other, earlier = os.path.join(dst, sds.STATE_FILE.format(rank=2)), os.path.join(ckpt, f"early{stage}", name)
        damage(path, how, other_rank=other, earlier=earlier)
    return tag


def _counters(adapter) -> dict:
    """Everything that decides a collective or a rounding: must be the same on every rank after a
    rebuild (rounding streams compared as 'not started')."""
    grads = adapter.grads
    return {
        "steps": adapter._steps,
        "exact_next": sorted(adapter._exact_next),
        "weights": {i: (rg.versions, rg._gen is None) for i, rg in adapter.weights.items()},
        "grads": None if grads is None else (grads.calls, grads._gen is None, len(grads.residuals)),
        "groups": len(adapter.hooks.flat_groups()),
    }


def _restored(eng, opt) -> bool:
    """Nothing of sdpq's left on the engine or its optimizer (after remove)."""
    mine = {"save_checkpoint", "load_checkpoint", "destroy", "step", "sdpq"}
    hooked = {"average_tensor", "_optimizer_step", "step", "update_lp_params", "get_grads_for_norm"}
    return not (mine & vars(eng).keys()) and not (hooked & vars(opt).keys())


def _damaged_fn(ctx, ckpt: str):
    from deepspeed.runtime.zero import stage_1_and_2

    from sdpq.integrations._ds_zero12_internals import ALL_GATHER_DP_GROUPS

    # The process-wide gather dispatcher as it is before (DeepSpeed's function unless an engine
    # of an earlier test in this worker still holds it): each engine takes one reference,
    # destroy() gives it back, and with none left DeepSpeed's function is back.
    out: dict = {"patch": [], "restored": []}
    held, before = ALL_GATHER_DP_GROUPS.holders, stage_1_and_2.all_gather_dp_groups
    for stage in (2, 1):  # save both first: each stage's file is the other's "other config"
        eng = build(stage, BLOCKS[stage], seed=0)
        out["patch"].append(ALL_GATHER_DP_GROUPS.holders - held)
        train(ctx, eng, 0, 1)
        eng.save_checkpoint(ckpt, tag=f"early{stage}")
        train(ctx, eng, 1, 1)
        eng.save_checkpoint(ckpt, tag=f"t{stage}")
        opt = eng.optimizer
        eng.destroy()
        out["restored"].append(_restored(eng, opt))
        out["patch"].append(ALL_GATHER_DP_GROUPS.holders - held)
    out["patch"].append(stage_1_and_2.all_gather_dp_groups is before)
    tdist.barrier()
    if ctx.rank == 0:
        for stage in (2, 1):
            for how in DAMAGES:
                _damage(ckpt, stage, how)
    tdist.barrier()
    for stage in (2, 1):
        eng = build(stage, BLOCKS[stage], seed=1)  # other initial weights: the load must replace them
        adapter = sds.get_adapter(eng)
        for how in DAMAGES:
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                eng.load_checkpoint(ckpt, tag=f"{how}{stage}")
            seconds = time.perf_counter() - t0
            after_load = _counters(adapter)
            losses = train(ctx, eng, 2, 2)
            out[(stage, how)] = {
                "warned": [str(w.message) for w in caught if "sdpq" in str(w.message)],
                "counters": after_load,
                "prints": prints(eng),
                "losses": losses,
                "seconds": seconds,
            }
    return out


def test_a_damaged_state_file_rebuilds_on_every_rank(dist, tmp_path):
    """Rank 1's sdpq_rank00001.pt truncated, overwritten with random bytes, deleted, from another
    config, from another rank, from an earlier checkpoint, at stages 2 and 1: every rank loads,
    warns once naming rank 1, the file and what was wrong, rebuilds (steps, versions, rounding
    streams and residuals reset alike: the exact gathers and the replica check come first), and
    steps on with bitwise equal replicas. Before the fix rank 0 aborted in gloo ("Received data
    size doesn't match expected size"): the ranks kept different step counts. The two engines that
    saved are destroyed first: nothing of sdpq's is left on them, and the process-wide gather
    dispatcher goes back to DeepSpeed's function (before: it stayed for good)."""
    res = dist.run(_damaged_fn, 4, 2, str(tmp_path), timeout=TIMEOUT)
    for r in res:  # destroy() undid every hook and gave the process-wide dispatcher back
        assert r["patch"] == [1, 0, 1, 0, True] and r["restored"] == [True, True], (r["patch"], r["restored"])
    for stage in (2, 1):
        for how in DAMAGES:
            runs = [r[(stage, how)] for r in res]
            for r in runs:
                assert len(r["warned"]) == 1, (stage, how, r["warned"])
                msg = r["warned"][0]
                assert "sdpq_rank00001.pt" in msg and SAYS[how] in msg, (stage, how, msg)
                assert f"rank {BAD}" in msg, (stage, how, msg)
                assert r["counters"] == runs[0]["counters"], (stage, how)
                assert all(torch.isfinite(torch.tensor(r["losses"]))), (stage, how, r["losses"])
                assert r["seconds"] < 10, (stage, how, r["seconds"])
            c = runs[0]["counters"]
            assert c["steps"] == 0 and c["weights"] == {} and c["exact_next"] == list(range(c["groups"])), (
                stage,
                how,
                c,
            )
            assert c["grads"] == (0, True, 0), (stage, how, c)
            assert all(r["prints"] == runs[0]["prints"] for r in runs), (stage, how, "replicas bitwise equal")
        print(f"stage {stage}: {res[0][(stage, 'random')]['warned'][0]}")


def _save_fails_fn(ctx, ckpt: str):
    eng = build(2, BLOCKS[2], seed=0)
    adapter = sds.get_adapter(eng)
    train(ctx, eng, 0, 2)
    eng.save_checkpoint(ckpt, tag="t")
    tdist.barrier()
    before, saved = tree(os.path.join(ckpt, "t")), prints(eng)
    train(ctx, eng, 2, 1)
    # The disk fills on rank BAD while its sdpq file is written over the previous one (same tag).
    real_save = torch.save

    def full_disk(obj, f):
        f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    torch.save = full_disk if ctx.rank == BAD else real_save
    t0 = time.perf_counter()
    try:
        eng.save_checkpoint(ckpt, tag="t")
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        torch.save = real_save
    seconds = time.perf_counter() - t0
    tdist.barrier()
    after = tree(os.path.join(ckpt, "t"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng.load_checkpoint(ckpt, tag="t")
    save = {
        "error": error,
        "seconds": seconds,
        "unchanged": after == before,
        "left": sorted(set(after) - set(before)),
        "load_warned": [str(w.message) for w in caught if "sdpq" in str(w.message)],
        "loaded": prints(eng) == saved and adapter._steps == 2,
    }
    # The hooks lose one group's partition as it was before the step (the weights' old values):
    # DeepSpeed's exact all-gather runs instead of the differences, counted and warned once.
    inner = eng.optimizer._optimizer_step

    def losing(i):
        inner(i)
        adapter.hooks._old.pop(i, None)

    eng.optimizer._optimizer_step = losing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(ctx, eng, 2, 2)
    eng.optimizer._optimizer_step = inner
    h = adapter.hooks
    fallback = {
        "warned": [str(w.message) for w in caught if "sdpq" in str(w.message)],
        "count": adapter.exact_fallbacks,
        # DeepSpeed's exact gather: this rank's partition is its master rounded, as without sdpq
        "exact": all(
            torch.equal(h.own_partition(i), h.master(i).to(h.own_partition(i).dtype))
            for i in range(len(h.flat_groups()))
        ),
        "prints": prints(eng),
    }
    losses = train(ctx, eng, 4, 1)  # the differences again
    fallback.update(after=prints(eng), count_after=adapter.exact_fallbacks, losses=losses)
    return {"save": save, "fallback": fallback}


def test_a_failed_save_and_the_exact_fallback(dist, tmp_path):
    """ZeRO-2. (1) The disk fills on rank 1 while sdpq's state is written over the same tag's
    previous checkpoint: every rank raises the same CheckpointSaveError within seconds, naming
    rank 1, its file and ENOSPC; the previous checkpoint is bitwise as it was (DeepSpeed's files
    too: nothing was written), no temporary file is left, and it loads without a warning. Before,
    rank 1 raised alone (its file truncated) while the others went on into DeepSpeed's save.
    (2) When the hooks lack a group's partition as it was before the step, DeepSpeed's exact
    all-gather runs: counted in engine.sdpq.exact_fallbacks and warned once (before: silently)."""
    res = dist.run(_save_fails_fn, 4, 2, str(tmp_path), timeout=TIMEOUT)
    for r in res:
        s = r["save"]
        assert s["error"] and s["error"].startswith("CheckpointSaveError"), s["error"]
        assert "rank 1: cannot write" in s["error"] and "sdpq_rank00001.pt" in s["error"], s["error"]
        assert "No space left on device" in s["error"], s["error"]
        assert s["seconds"] < 10, s["seconds"]
        assert s["unchanged"] and s["left"] == [], s["left"]
        assert s["load_warned"] == [] and s["loaded"], s
        f = r["fallback"]
        assert len(f["warned"]) == 1 and "exact_fallbacks" in f["warned"][0], f["warned"]
        assert f["count"] == 2 and f["count_after"] == 2 and f["exact"]
        assert f["prints"] == res[0]["fallback"]["prints"] and f["after"] == res[0]["fallback"]["after"]
        assert all(torch.isfinite(torch.tensor(f["losses"])))
    print(res[0]["save"]["error"], "|", res[0]["fallback"]["warned"][0])
