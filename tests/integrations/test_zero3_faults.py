"""Faults around sdpq.deepspeed's ZeRO-3 checkpoints that ZeRO-1/2's tests cover and ZeRO-3's did
not (test_deepspeed_zero12_faults.py; ZeRO-3's other damaged files: test_deepspeed_devices.py):
rank 1's sdpq file deleted, and the disk full on rank 1 while sdpq's state is written over the same
tag's previous checkpoint. 4 gloo ranks as 2 simulated nodes x 2."""

from __future__ import annotations

import os
import shutil

import pytest

deepspeed = pytest.importorskip("deepspeed")

# Imported and loaded here, before the worker pools fork, so that the ranks do not each do it at
# their first engine (~4 CPU seconds a rank): DeepSpeed's engine reaches torch._dynamo.optimize,
# which imports dynamo's compiler back ends (functorch's AOT autograd, inductor's kernels).
import deepspeed.runtime.zero.stage3  # noqa: E402,F401,F811
import torch  # noqa: E402
import torch._dynamo.repro.after_dynamo  # noqa: E402,F401
import torch._inductor.kernel.flex.flex_attention  # noqa: E402,F401
import torch.distributed as tdist  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401
from deepspeed_common import build_engine, fresh_deepspeed, train_steps  # noqa: E402
from faults_common import outcome, save_on_a_full_disk, warm_up_before_fork  # noqa: E402

import sdpq.integrations.deepspeed as sds  # noqa: E402
import sdpq.train.deepspeed_backend  # noqa: E402,F401

warm_up_before_fork()

BLOCK = {"weights": {"mode": "diff"}, "gradients": {"error_feedback": True}, "optimizer": {"master": "native"}}
BAD = 1


def _state(adapter) -> dict:
    """What decides a collective on this rank: the same on every rank after a rebuild."""
    return {
        "weights": {i: (wg.version, wg.dirty, wg._force_exact) for i, wg in adapter.weights.items()},
        "grads": len(adapter.grads),
    }


def _faults_fn(ctx, ckpt: str) -> dict:
    fresh_deepspeed()
    eng = build_engine(BLOCK)
    adapter = sds.get_adapter(eng)
    train_steps(eng, ctx.rank, 2)
    eng.save_checkpoint(ckpt, tag="t")
    saved = {i: wg.reference.clone() for i, wg in adapter.weights.items() if wg.reference is not None}
    train_steps(eng, ctx.rank, 1, start=2)
    tdist.barrier()
    if ctx.rank == 0:
        shutil.copytree(os.path.join(ckpt, "t"), os.path.join(ckpt, "deleted"))
        os.remove(os.path.join(ckpt, "deleted", sds.STATE_FILE.format(rank=BAD)))
    out = save_on_a_full_disk(lambda: eng.save_checkpoint(ckpt, tag="t"), ctx.rank == BAD, f"{ckpt}/t")
    out["left"] = sorted(n for n in os.listdir(f"{ckpt}/t") if n.endswith(".tmp"))
    out["t"] = outcome(eng.load_checkpoint, ckpt, "t")
    refs = {i: wg.reference for i, wg in adapter.weights.items() if wg.reference is not None}
    out["t"]["restored"] = refs.keys() == saved.keys() and all(torch.equal(refs[i], saved[i]) for i in saved)
    out["deleted"] = outcome(eng.load_checkpoint, ckpt, "deleted")
    out["deleted"]["state"] = _state(adapter)
    out["deleted"]["losses"] = train_steps(eng, ctx.rank, 1, start=2)
    return out


def test_a_deleted_file_and_a_full_disk_at_zero3(dist, tmp_path):
    """(1) The disk fills on rank 1 while sdpq's state is written over tag "t": every rank raises
    the same CheckpointSaveError naming rank 1, its file and ENOSPC, the tag's files (DeepSpeed's
    too) stay as they were, no temporary file is left, and "t" then loads without a warning, its
    references restored. (2) Rank 1's sdpq file deleted from a copy of "t": every rank warns the
    same text, naming rank 1 and the missing file, rebuilds alike and trains on."""
    res = dist.run(_faults_fn, 4, 2, str(tmp_path), timeout=180)
    full = [r["full-save"].get("raised", "") for r in res]
    assert full[0].startswith("CheckpointSaveError") and "rank 1: cannot write" in full[0], full[0]
    assert sds.STATE_FILE.format(rank=BAD) in full[0] and "No space left on device" in full[0]
    assert full == [full[0]] * 4, "the same error on every rank"
    for r in res:
        assert r["unchanged"] and r["left"] == [], r["left"]
        assert "raised" not in r["t"] and r["t"]["warned"] == [] and r["t"]["restored"], r["t"]
    warned = [r["deleted"]["warned"] for r in res]
    assert len(warned[0]) == 1 and f"no {sds.STATE_FILE.format(rank=BAD)}" in warned[0][0], warned[0]
    assert "rank 1" in warned[0][0] and warned == [warned[0]] * 4
    assert all(r["deleted"]["state"] == res[0]["deleted"]["state"] for r in res), "rebuilt alike"
    assert all(torch.isfinite(torch.tensor(r["deleted"]["losses"])).all() for r in res)
    print(full[0][:300], "|", warned[0][0][:300])
