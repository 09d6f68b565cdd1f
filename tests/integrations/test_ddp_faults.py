"""Faults around sdpq.ddp's checkpoints and steps on 4 gloo ranks as 2 nodes x 2, checkpoints as
docs/ddp.md shows (ddp_faults_job.py). Every fault must end the same way on every rank within
seconds: every rank loads and steps with bitwise equal replicas (a warned rebuild of sdpq's state
where a rank's file is bad), or every rank raises one clear error; a killed rank's survivors exit.

What main did before (issue 48), with the per-rank file it documented (model, optimizer and
`sdpq.ddp.state_dict` in one torch.save, as sdpq.train's DDP backend writes it): a rank whose file
was truncated, random or deleted raised alone and the others waited in the load's collectives
until it exited; another rank's file loaded silently; the run's earlier file on one rank left the
ranks on different iterations and buckets, and every rank hung in a mismatched collective until
gloo's timeout; a full disk or a process killed during a save raised on that rank alone (the others
returned) and left its previous file destroyed, so the next load failed again. sdpq.ddp had no
save of its own; save_checkpoint / load_checkpoint are new.

Note (CI time): the checkpoints are written by the job whose rank 1 is then killed mid-save (a
pool of its own); one worker run on the shared pool damages copies and loads each."""

from __future__ import annotations

import os
import shutil

import torch
from ddp_faults_job import BLOCK, OTHER_BLOCK, RPN, TRAIN_FILE, WORLD, build, load, replica, save, train
from faults_common import (
    DAMAGES,
    damage,
    kill_this_rank,
    kill_within_next_save,
    killed_at,
    outcome,
    run_to_the_end,
    save_on_a_full_disk,
)

import sdpq.comm.allreduce
from sdpq.integrations._ddp_checkpoint import STATE_FILE

BAD = 1  # the rank whose file is damaged, whose disk fills, that is killed during a save
VICTIM = 2  # the rank killed mid-step
TIMEOUT = 60
# What the warning says about rank 1's file, besides its name
SAYS = {
    "truncated": "cannot read",
    "random": "cannot read",
    "deleted": "no ",
    "other-rank": "was saved on rank 2; this is rank 1",
    "stale": "saved at different points (iteration 2 on ranks 0, 2, 3; iteration 1 on rank 1)",
    "other-config": "was saved with sdpq.gradients.error_feedback = False",
    "other-layout": "was saved on layout '4x1'",
}


def _checkpoints_then_killed_save(ctx, out_dir: str, ckpt: str) -> None:
    """The job that writes the checkpoints (its own pool: it ends with rank BAD killed between
    writing its new sdpq file and putting it in place of its file of checkpoint t)."""
    for tag, block in (("other-config", OTHER_BLOCK), ("other-layout", {**BLOCK, "topology": {"ranks_per_node": 1}})):
        other, other_opt = build(block, seed=0)
        train(ctx, other, other_opt, 0, 2)
        save(other, other_opt, f"{ckpt}/{tag}")
    model, opt = build(BLOCK, seed=0)
    train(ctx, model, opt, 0, 1)
    save(model, opt, f"{ckpt}/early")
    train(ctx, model, opt, 1, 1)
    save(model, opt, f"{ckpt}/t")
    train(ctx, model, opt, 2, 1)
    if ctx.rank == 0:
        torch.save(replica(model), f"{out_dir}/uninterrupted")
    if ctx.rank == BAD:
        kill_within_next_save(out_dir)  # the new file complete beside the old one, then killed
    save(model, opt, f"{ckpt}/t")  # over t


def _full_disk_then_loads(ctx, ckpt: str) -> dict:
    """A save that fills rank BAD's disk, then every load: t, each damage of rank BAD's file of
    t, other-config, other-layout, and t with rank BAD's model from the earlier checkpoint."""
    name = STATE_FILE.format(rank=BAD)
    if ctx.rank == 0:
        for how in DAMAGES:
            shutil.copytree(f"{ckpt}/t", f"{ckpt}/{how}")
            other, earlier = f"{ckpt}/t/{STATE_FILE.format(rank=2)}", f"{ckpt}/early/{name}"
            damage(f"{ckpt}/{how}/{name}", how, other_rank=other, earlier=earlier)
    torch.distributed.barrier()
    model, opt = build(BLOCK, seed=1)  # other weights: a load must replace them
    out = save_on_a_full_disk(lambda: save(model, opt, f"{ckpt}/t"), ctx.rank == BAD, f"{ckpt}/t")
    for tag in ("t", *DAMAGES, "other-config", "other-layout"):
        out[tag] = outcome(load, model, opt, f"{ckpt}/{tag}")
        if "raised" not in out[tag]:
            train(ctx, model, opt, 2, 1)
            out[tag]["replica"] = replica(model)
    mixed = f"{ckpt}/early/{TRAIN_FILE}" if ctx.rank == BAD else None
    out["mixed"] = outcome(load, model, opt, f"{ckpt}/t", mixed)
    return out


def test_checkpoint_faults_end_alike_on_every_rank(dist, tmp_path):
    """Rank 1 killed between writing its new sdpq file and renaming it over its file of
    checkpoint t: the others exit within seconds and t stays as it was. Then, in a new job: the
    disk full on rank 1 during a save over t (the same CheckpointSaveError on every rank naming
    rank 1, its file and ENOSPC; t's files unchanged); loads of t (resumes bitwise), of copies with
    rank 1's sdpq file truncated, random, deleted, another rank's or the run's earlier one, of
    checkpoints of another sdpq configuration and layout: each a warned rebuild, the same text on
    every rank naming rank 1 and its file, after which the replicas step on bitwise equal; and a
    load where rank 1's model is the earlier checkpoint's: the same CheckpointLoadError on every
    rank (the replicas differ)."""
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "ends")
    ends = run_to_the_end(_checkpoints_then_killed_save, WORLD, RPN, out, ckpt, timeout=20)
    assert ends[BAD]["end"] == "killed", ends[BAD]
    t0 = killed_at(out)
    assert all(e["end"] == "raised" and e["at"] - t0 < 10 for r, e in enumerate(ends) if r != BAD), ends
    left = sorted(n for n in os.listdir(f"{ckpt}/t") if not n.startswith("sdpq_ddp_rank") and n != TRAIN_FILE)
    assert len(left) == 1 and left[0].startswith(f".{STATE_FILE.format(rank=BAD)}."), left  # never read by a load
    res = dist.run(_full_disk_then_loads, WORLD, RPN, ckpt, timeout=TIMEOUT)
    full = [r["full-save"]["raised"] for r in res]
    assert full[0].startswith("CheckpointSaveError: sdpq.ddp.save_checkpoint: not saved: rank 1: cannot write"), full
    assert STATE_FILE.format(rank=BAD) in full[0] and "No space left on device" in full[0] and full == [full[0]] * 4
    assert all(r["unchanged"] for r in res), "the previous checkpoint is as it was"
    uninterrupted = torch.load(f"{out}/uninterrupted")
    t = [r["t"] for r in res]
    assert all("raised" not in x and x["warned"] == [] for x in t), t
    assert all(x["replica"] == uninterrupted for x in t), "t resumes bitwise (the killed save changed nothing)"
    for tag, says in SAYS.items():
        loads = [r[tag] for r in res]
        assert all("raised" not in x and x["seconds"] < 10 for x in loads), (tag, loads)
        warned = loads[0]["warned"]
        assert len(warned) == 1 and says in warned[0], (tag, warned)
        if tag not in ("other-config", "other-layout", "stale"):  # (a whole checkpoint: every rank's file)
            assert "rank 1: " in warned[0] and f"{ckpt}/{tag}/{STATE_FILE.format(rank=BAD)}" in warned[0], (tag, warned)
        assert all(x["warned"] == warned for x in loads), (tag, "the same warning on every rank")
        assert all(x["replica"] == loads[0]["replica"] for x in loads), (tag, "the replicas step on equal")
    mixed = [r["mixed"].get("raised", "") for r in res]
    assert mixed[0].startswith("CheckpointLoadError: sdpq.ddp:") and "the replicas differ" in mixed[0], mixed[0]
    assert "rank(s) [1]" in mixed[0] and mixed == [mixed[0]] * 4
    print(res[0]["random"]["warned"][0][:300], "|", mixed[0][:200])


def _killed_mid_step(ctx, out_dir: str) -> None:
    model, opt = build(BLOCK, seed=0)
    train(ctx, model, opt, 0, 1)  # DDP's first iteration: exact
    if ctx.rank == VICTIM:

        def dying(*args, **kwargs):
            kill_this_rank(out_dir)

        sdpq.comm.allreduce.GradAllReduce.all_reduce = dying  # type: ignore[method-assign]
    train(ctx, model, opt, 1, 1)


def test_a_rank_killed_mid_step_ends_every_rank(tmp_path):
    """Rank 2 is killed inside sdpq's quantized all-reduce (the comm hook) of the second step:
    every other rank raises (gloo: the peer closed the connection) and exits within seconds."""
    out = str(tmp_path / "ends")
    ends = run_to_the_end(_killed_mid_step, WORLD, RPN, out, timeout=20)
    assert ends[VICTIM]["end"] == "killed", ends[VICTIM]
    t0 = killed_at(out)
    for r, e in enumerate(ends):
        if r != VICTIM:
            assert e["end"] == "raised" and e["at"] - t0 < 10, (r, e)
    print(ends[0]["error"][:200])
