"""Killed processes under sdpq.deepspeed, ZeRO-2 and ZeRO-3 with the "sdpq" block, on 4 gloo ranks
as 2 simulated nodes x 2 (ZeRO-1 runs ZeRO-2's code path: the same adapter, hooks, reduce and
gather, and the same save; test_deepspeed_zero12_faults.py covers its damaged files). Per stage,
two jobs, each on a pool of its own that ends with a rank killed (faults_common.run_to_the_end):

1. one step, `save_checkpoint(tag="t")`, one more step, then a save over "t" in which rank 1 is
   killed (SIGKILL) between writing its new sdpq file beside its old one and the rename: the
   other ranks, waiting in the save's agreement, raise and exit within seconds; "t" stays as it
   was (DeepSpeed's files too, and "latest"), with only rank 1's temporary file beside it (which
   no load reads; the survivors discard theirs: before the save was _files.save_agreed, each
   survivor left its temporary file too);
2. a fresh engine loads "latest" (= "t") without a warning and its next step is bitwise the step
   the first job took after saving "t"; then rank 2 is killed as it enters sdpq's collective of the
   following step (ZeRO-2: the gradient reduce; ZeRO-3: the weight gather of the forward): every
   other rank raises and exits within seconds, none hangs.

Note (CI time): one DeepSpeed engine per job, 2-3 steps; the resume and the mid-step kill share
the second job."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest

deepspeed = pytest.importorskip("deepspeed")

# Imported and loaded here, before the pools fork, so that the ranks of every fresh pool do not
# each do it at their first engine (see test_zero3_faults.py).
import deepspeed.runtime.zero.stage3  # noqa: E402,F401,F811
import deepspeed.runtime.zero.stage_1_and_2  # noqa: E402,F401
import torch  # noqa: E402
import torch._dynamo.repro.after_dynamo  # noqa: E402,F401
import torch._inductor.kernel.flex.flex_attention  # noqa: E402,F401
import torch.distributed.tensor  # noqa: E402,F401
import zero12_common  # noqa: E402
from deepspeed_common import build_engine, fresh_deepspeed, train_steps  # noqa: E402
from faults_common import (  # noqa: E402
    kill_this_rank,
    kill_within_next_save,
    killed_at,
    run_to_the_end,
    tree,
    warm_up_before_fork,
)

import sdpq.comm.grads_owned  # noqa: E402
import sdpq.integrations._ds_adapter  # noqa: E402
import sdpq.integrations.deepspeed as sds  # noqa: E402
import sdpq.train.deepspeed_backend  # noqa: E402,F401
from sdpq.comm.reference_health import checksum  # noqa: E402

warm_up_before_fork()

WORLD, RPN = 4, 2
BAD = 1  # killed during the save
VICTIM = 2  # killed mid-step
TIMEOUT = 30  # gloo's, per job (the job's wait: 5 s more)
# Every piece of state a resume restores is live: rounding streams, error-feedback residuals.
BLOCKS = {
    2: {"weights": {"mode": "diff", "rounding": "stochastic"}, "gradients": {"error_feedback": True}},
    3: {"weights": {"mode": "diff"}, "gradients": {"error_feedback": True}, "optimizer": {"master": "native"}},
}


def _engine(stage: int):
    if stage == 2:
        return zero12_common.build(2, BLOCKS[2], seed=0)
    fresh_deepspeed()
    return build_engine(BLOCKS[3])


def _step(ctx, stage: int, eng, step: int) -> None:
    """Optimizer step `step` (the same batches in every job)."""
    if stage == 2:
        zero12_common.train(ctx, eng, step, 1)
    else:
        train_steps(eng, ctx.rank, 1, start=step)


def _replica(stage: int, eng) -> list:
    """This rank's weights as checksums (ZeRO-2: its full bf16 replica; ZeRO-3: its partitions)."""
    if stage == 2:
        return zero12_common.prints(eng)
    return [checksum(p.ds_tensor.data).tolist() for p in eng.module.parameters()]


def _write(out_dir: str, name: str, obj) -> None:
    with open(os.path.join(out_dir, name), "wb") as f:
        pickle.dump(obj, f)


def _read(out_dir: str, name: str):
    with open(os.path.join(out_dir, name), "rb") as f:
        return pickle.load(f)


def _killed_save(ctx, out_dir: str, ckpt: str, stage: int) -> None:
    """Job 1: ends with rank BAD killed between writing its new sdpq file of "t" and the rename."""
    eng = _engine(stage)
    _step(ctx, stage, eng, 0)
    eng.save_checkpoint(ckpt, tag="t")
    _step(ctx, stage, eng, 1)
    _write(out_dir, f"uninterrupted{ctx.rank}", _replica(stage, eng))
    torch.distributed.barrier()
    if ctx.rank == 0:
        shutil.copytree(os.path.join(ckpt, "t"), os.path.join(out_dir, "t-before"))
    torch.distributed.barrier()
    if ctx.rank == BAD:
        kill_within_next_save(out_dir)
    eng.save_checkpoint(ckpt, tag="t")


def _resumed_then_killed_mid_step(ctx, out_dir: str, ckpt: str, stage: int) -> None:
    """Job 2: a fresh engine resumes from "latest", steps once, then rank VICTIM is killed inside
    sdpq's collective of the next step."""
    import warnings

    eng = _engine(stage)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, _ = eng.load_checkpoint(ckpt)  # "latest"
    _step(ctx, stage, eng, 1)
    resumed = {
        "path": os.path.basename(os.path.dirname(path)),
        "warned": [str(w.message) for w in caught if "sdpq" in str(w.message)],
        "replica": _replica(stage, eng),
    }
    _write(out_dir, f"resumed{ctx.rank}", resumed)
    if ctx.rank == VICTIM:

        def dying(*args, **kwargs):
            kill_this_rank(out_dir)

        if stage == 2:  # the gradient reduce of the first micro-batch's backward
            sdpq.comm.grads_owned.OwnedReduceScatter.__call__ = dying  # type: ignore[method-assign]
        else:  # the first weight gather of the forward
            sdpq.integrations._ds_adapter.gather_coalesced = dying  # type: ignore[assignment]
    _step(ctx, stage, eng, 2)


def _survivors_exit(ends: list[dict], killed: int, out_dir: str) -> list[float]:
    """Every rank but `killed` raised; their seconds from the kill to their exit."""
    assert ends[killed]["end"] == "killed", ends[killed]
    t0 = killed_at(out_dir)
    seconds = []
    for r, e in enumerate(ends):
        if r != killed:
            assert e["end"] == "raised", (r, e)
            seconds.append(e["at"] - t0)
    assert max(seconds) < 10, seconds
    return seconds


@pytest.mark.parametrize("stage", [2, 3])
def test_killed_save_keeps_the_checkpoint_and_a_killed_step_ends_every_rank(tmp_path, stage):
    ckpt, out1, out2 = str(tmp_path / "ckpt"), str(tmp_path / "save"), str(tmp_path / "step")
    saved = run_to_the_end(_killed_save, WORLD, RPN, out1, ckpt, stage, timeout=TIMEOUT)
    save_exits = _survivors_exit(saved, BAD, out1)
    t = os.path.join(ckpt, "t")
    after, before = tree(t), tree(os.path.join(out1, "t-before"))
    left = sorted(set(after) - set(before))
    name = sds.STATE_FILE.format(rank=BAD)
    assert len(left) == 1 and left[0].startswith(f".{name}.") and left[0].endswith(".tmp"), left
    assert {n: after[n] for n in before} == before, "t's files are as they were"
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip() == "t"

    stepped = run_to_the_end(_resumed_then_killed_mid_step, WORLD, RPN, out2, ckpt, stage, timeout=TIMEOUT)
    step_exits = _survivors_exit(stepped, VICTIM, out2)
    for r in range(WORLD):
        resumed = _read(out2, f"resumed{r}")
        assert resumed["path"] == "t" and resumed["warned"] == [], resumed
        assert resumed["replica"] == _read(out1, f"uninterrupted{r}"), (r, "the resumed step is bitwise")
    print(
        f"ZeRO-{stage}: killed save: survivors out in {max(save_exits):.2f} s ({saved[0]['error'][:150]}); "
        f"killed step: survivors out in {max(step_exits):.2f} s ({stepped[0]['error'][:150]})"
    )
