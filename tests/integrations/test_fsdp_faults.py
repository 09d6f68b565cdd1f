"""Faults around sdpq.fsdp's checkpoints and steps, with FSDP2 (1-D over the world) and HSDP
(sharded inside a node, replicated across nodes by sdpq's all-reduce), on 4 gloo ranks as 2
nodes x 2; checkpoints through DCP as docs/fsdp.md shows (fsdp_faults_job.py). Every fault must
end the same way on every rank within seconds: every rank loads and steps computing with the same
weights, or every rank raises one clear error; a killed rank's survivors exit, none hangs.

What main did before sdpq.fsdp agreed on a load (issue 48): a rank's file from the run's earlier
checkpoint ("stale") loaded silently; with 1-D FSDP the two nodes then computed with different
weights (their references disagreed), with HSDP the model was silently a mix of two saves. A
file DCP cannot read (truncated, random bytes, deleted, another rank's) already raised DCP's
CheckpointException on every rank, a full disk during a save too, the directory of a failed or
killed save a FileNotFoundError (its .metadata) on every rank (now one CheckpointLoadError saying
why), and a killed rank's survivors exited; those are kept here.

Note (CI time): per setup, the job that writes the checkpoints ends with a rank killed mid-save
(a pool of its own, faults_common.run_to_the_end), then one worker run damages copies and loads
each into one model; the rank killed mid-step needs a pool of its own too."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from faults_common import DAMAGES, damage, kill_this_rank, killed_at, outcome, run_to_the_end, save_on_a_full_disk
from fsdp_faults_job import (
    BLOCK,
    OTHER_BLOCK,
    RPN,
    WORLD,
    barrier,
    build,
    data_file,
    hsdp_mesh,
    load,
    probe,
    save,
    train,
)

import sdpq.comm.allreduce
import sdpq.comm.grads

SETUPS = {"fsdp": False, "hsdp": True}
DCP_ERRORS = (dcp.api.CheckpointException,)  # a BaseException, not an Exception
BAD = 1  # the rank whose file is damaged, whose disk fills, that is killed during a save
VICTIM = 2  # the rank killed mid-step
TIMEOUT = 60


@pytest.fixture
def dist(dist, request):
    """HSDP: a fresh pool before and after. An equal device mesh built again in a reused worker
    reaches torch's cached sub-meshes of the last run's, whose groups the harness has destroyed."""
    hsdp = SETUPS[request.node.callspec.params["setup"]]
    if hsdp:
        dist.discard(WORLD)
    yield dist
    if hsdp:
        dist.discard(WORLD)


def _checkpoints_then_killed_save(ctx, out_dir: str, ckpt: str, hsdp: bool) -> None:
    """The job that writes the checkpoints (its own pool: it ends with rank BAD killed while DCP
    writes its file of checkpoint t2): "early" and "t" of one run, "other-config" of a run with
    another sdpq configuration, and the probe after the step that follows t."""
    mesh = hsdp_mesh() if hsdp else None
    other, other_opt = build(mesh, OTHER_BLOCK, seed=0)
    train(ctx, other, other_opt, 0, 2)
    save(other, other_opt, f"{ckpt}/other-config")
    model, opt = build(mesh, BLOCK, seed=0)
    train(ctx, model, opt, 0, 1)
    save(model, opt, f"{ckpt}/early")
    train(ctx, model, opt, 1, 1)
    save(model, opt, f"{ckpt}/t")
    train(ctx, model, opt, 2, 1)
    uninterrupted = probe(model)
    if ctx.rank == 0:
        with open(f"{out_dir}/uninterrupted", "w") as f:
            f.write(repr(uninterrupted))
    if ctx.rank == BAD:  # killed after the first bytes of its DCP file

        def dying(obj, f, *args, **kwargs):
            f.write(b"\0" * 100)
            f.flush()
            kill_this_rank(out_dir)

        torch.save = dying
    save(model, opt, f"{ckpt}/t2")


def _full_disk_then_loads(ctx, ckpt: str, hsdp: bool) -> dict:
    """A save that fills rank BAD's disk, then every load: t, each damage of rank BAD's file of t,
    other-config, t2 (killed mid-save) and the failed save's directory."""
    if ctx.rank == 0:
        for how in DAMAGES:
            shutil.copytree(f"{ckpt}/t", f"{ckpt}/{how}")
            bad = f"{ckpt}/{how}/{data_file(BAD)}"
            damage(bad, how, other_rank=f"{ckpt}/t/{data_file(2)}", earlier=f"{ckpt}/early/{data_file(BAD)}")
    barrier()
    model, opt = build(hsdp_mesh() if hsdp else None, BLOCK, seed=1)  # other weights: a load must replace them
    out = save_on_a_full_disk(lambda: save(model, opt, f"{ckpt}/full"), ctx.rank == BAD, f"{ckpt}/t", DCP_ERRORS)
    for tag in ("t", *DAMAGES, "other-config", "t2", "full"):
        out[tag] = outcome(load, model, opt, f"{ckpt}/{tag}", errors=DCP_ERRORS)
        if "raised" not in out[tag]:
            train(ctx, model, opt, 2, 1)
            out[tag]["probe"] = probe(model)
    return out


# What each load ends in, on every rank: DCP's error, or sdpq's
RAISES = {
    "truncated": "CheckpointException",
    "random": "CheckpointException",
    "deleted": "CheckpointException",
    "other-rank": "CheckpointException",
    "stale": "CheckpointLoadError: sdpq.fsdp.load_state_dict: <root>: the ranks' all-gather counts differ "
    "(2 on ranks 0, 2, 3; 1 on rank 1)",
    "t2": "CheckpointLoadError: sdpq.fsdp.state_dict: checkpoint",
    "full": "CheckpointLoadError: sdpq.fsdp.state_dict: checkpoint",
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_checkpoint_faults_end_alike_on_every_rank(dist, tmp_path, setup):
    """Rank 1 killed while DCP writes its file of a new checkpoint: the others exit within
    seconds. Then, in a new job: the disk full on rank 1 during a save (DCP's CheckpointException
    naming ENOSPC on every rank, the previous checkpoint's files unchanged); loads of the
    previous checkpoint (resumes bitwise), of copies with rank 1's DCP file (its shards and its
    sdpq state) truncated, random, deleted, another rank's or the run's earlier one, of a
    checkpoint of another sdpq configuration, and of the killed and the failed saves' directories.
    Each ends alike on every rank: DCP's CheckpointException, sdpq's CheckpointLoadError naming
    rank 1 (before: the stale file loaded silently) or the incomplete checkpoint, or a load (a
    warned rebuild for the other configuration) after which every rank computes with the same
    weights."""
    hsdp, ckpt, out = SETUPS[setup], str(tmp_path / "ckpt"), str(tmp_path / "ends")
    ends = run_to_the_end(_checkpoints_then_killed_save, WORLD, RPN, out, ckpt, hsdp, timeout=20)
    assert ends[BAD]["end"] == "killed", ends[BAD]
    t0 = killed_at(out)
    assert all(e["end"] == "raised" and e["at"] - t0 < 10 for r, e in enumerate(ends) if r != BAD), ends
    res = dist.run(_full_disk_then_loads, WORLD, RPN, ckpt, hsdp, timeout=TIMEOUT)
    full = [r["full-save"] for r in res]  # the failed save itself: DCP's error on every rank, naming ENOSPC
    assert all(f["raised"].startswith("CheckpointException") and "No space left" in f["raised"] for f in full), full[0]
    assert all(r["unchanged"] for r in res), "the previous checkpoint is as it was"
    for tag, start in RAISES.items():
        loads = [r[tag] for r in res]
        assert loads[0].get("raised", "").startswith(start), (tag, loads[0])
        assert all(x["raised"] == loads[0]["raised"] for x in loads), (tag, "the same error on every rank")
        assert all(x["seconds"] < 10 for x in loads), (tag, [x["seconds"] for x in loads])
    assert "rank 1" in res[0]["stale"]["raised"] and "do not come from one save" in res[0]["stale"]["raised"]
    assert "not a complete DCP checkpoint" in res[0]["t2"]["raised"]
    for tag in ("t", "other-config"):
        loads = [r[tag] for r in res]
        assert all("raised" not in x and x["seconds"] < 10 for x in loads), (tag, loads)
        assert len({x["probe"] for x in loads}) == 1, (tag, "every rank computes with the same weights")
    with open(f"{out}/uninterrupted") as f:
        assert res[0]["t"]["probe"] == float(f.read()), "the previous checkpoint resumes bitwise"
    assert all(r["t"]["warned"] == [] for r in res)
    warned = [r["other-config"]["warned"] for r in res]
    assert len(warned[0]) == 1 and "another layout or configuration" in warned[0][0] and warned[1:] == [[]] * 3
    print(setup, "|", res[0]["stale"]["raised"][:400])


def _arm_kill(hsdp: bool, out_dir: str) -> None:
    """This rank dies at its next call of sdpq's cross-node gradient collective."""
    cls = sdpq.comm.allreduce.GradAllReduce if hsdp else sdpq.comm.grads.GradReduceScatter
    name = "all_reduce" if hsdp else "reduce_scatter"

    def dying(*args, **kwargs):
        kill_this_rank(out_dir)

    setattr(cls, name, dying)


def _killed_mid_step(ctx, out_dir: str, hsdp: bool) -> list[float]:
    model, opt = build(hsdp_mesh() if hsdp else None, BLOCK, seed=0)
    losses = train(ctx, model, opt, 0, 1)
    if ctx.rank == VICTIM:
        _arm_kill(hsdp, out_dir)
    return losses + train(ctx, model, opt, 1, 1)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_rank_killed_mid_step_ends_every_rank(tmp_path, setup):
    """Rank 2 is killed inside sdpq's cross-node gradient collective of the second step (1-D:
    the reduce-scatter; HSDP: the replicate all-reduce): every other rank raises (gloo: the peer
    closed the connection) and exits within seconds; none hangs."""
    out = str(tmp_path / "ends")
    ends = run_to_the_end(_killed_mid_step, WORLD, RPN, out, SETUPS[setup], timeout=20)
    assert ends[VICTIM]["end"] == "killed", ends[VICTIM]
    t0 = killed_at(out)
    for r, e in enumerate(ends):
        if r != VICTIM:
            assert e["end"] == "raised", (r, e)
            assert e["at"] - t0 < 10, (r, e["at"] - t0)
    print(setup, "|", ends[0]["error"][:200])
