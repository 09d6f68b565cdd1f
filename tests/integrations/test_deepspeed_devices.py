"""sdpq.deepspeed on a GPU cluster's devices, checked on CPU: with the group reported as NCCL
(tests/collective_devices.py), every tensor the adapter hands a collective must be on the
communication device (the stand-in accelerator), also with ZeRO-3's CPU offload (partitions or
optimizer on the host), and through a checkpoint load. And a checkpoint whose sdpq file is
damaged on one rank is rebuilt on every rank alike instead of leaving the others waiting.
4 gloo ranks as 2 simulated nodes x 2."""

from __future__ import annotations

import os
import warnings

import pytest

deepspeed = pytest.importorskip("deepspeed")

# Imported here, before the worker pools fork, so that ranks do not each import them (~10 s).
import deepspeed.runtime.zero.stage3  # noqa: E402,F401,F811
import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
from collective_devices import STANDIN, device_of, nccl_devices  # noqa: E402
from deepspeed_common import build_engine, fresh_deepspeed, train_steps  # noqa: E402

import sdpq.integrations.deepspeed as sds  # noqa: E402

BLOCK = {"weights": {"mode": "diff"}, "gradients": {"error_feedback": True}, "optimizer": {"master": "native"}}
OFFLOAD = {
    "none": {},
    "offload_param": {"offload_param": {"device": "cpu"}},
    "offload_optimizer": {"offload_optimizer": {"device": "cpu"}},
}


def _state_devices(adapter) -> set[str]:
    """Where the restored sdpq state lives: references, residuals (as the test mode sees it)."""
    out = {str(device_of(wg.reference)) for wg in adapter.weights.values() if wg.reference is not None}
    out |= {str(device_of(g.residual)) for g in adapter.grads.values() if g.residual is not None}
    return out


def _offload_fn(ctx, ckpt, option):
    fresh_deepspeed()
    with nccl_devices() as report:
        eng = build_engine(BLOCK, zero=OFFLOAD[option])
        losses = train_steps(eng, ctx.rank, 2)
        eng.save_checkpoint(ckpt, tag="t")
        eng2 = build_engine(BLOCK, zero=OFFLOAD[option])
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # the saved state fits: no rebuild
            eng2.load_checkpoint(ckpt, tag="t")
        restored = _state_devices(sds.get_adapter(eng2))
        persistent = {str(device_of(p)) for p in eng2.module.parameters() if p.ds_persist}
        partitions = {str(device_of(p.ds_tensor)) for p in eng2.module.parameters()}
        losses += train_steps(eng2, ctx.rank, 1, start=2)
    return {"losses": losses, "checked": report.checked, "restored": restored, "persistent": persistent,
            "partitions": partitions}  # fmt: skip


@pytest.mark.parametrize("option", list(OFFLOAD))
def test_collectives_on_the_communication_device(dist, tmp_path, option):
    """Steps, a save and a load, with and without ZeRO-3 CPU offload: no tensor of sdpq's
    collectives off the communication device (the mode raises otherwise), the restored references
    and residuals on it, the gathered parameters on it while the partitions stay where ZeRO-3
    keeps them (the host here: DeepSpeed's CPU accelerator)."""
    res = dist.run(_offload_fn, 4, 2, str(tmp_path), option, timeout=120)
    for r in res:
        assert r["checked"] > 20  # the set-up agreement, gathers, reduce-scatters, the load's decision
        assert r["restored"] == {str(STANDIN)}, r["restored"]
        assert r["persistent"] == {str(STANDIN)} and r["partitions"] == {"cpu"}
        assert all(torch.isfinite(torch.tensor(r["losses"]))) and r["losses"][2] < r["losses"][0] + 0.5


# What a rank's damaged sdpq file must make every rank's warning say (besides the file's name)
DAMAGES = {
    "truncated": "cannot read",
    "garbage": "cannot read",
    # a setting ZeRO-3 did not compare before (it loaded the file and kept the other rounding)
    "other-config": "was saved with sdpq.weights.rounding = 'stochastic'",
    "other-rank": "was saved on rank 2",
    # rank 1's file of the run's earlier checkpoint (before: loaded, its references one step old)
    "stale": "not saved together",
}


def _damage(ckpt: str, how: str) -> None:
    """A copy of checkpoint "t" with rank 1's sdpq file damaged (-> tag `how`)."""
    import shutil

    dst = os.path.join(ckpt, how)
    shutil.copytree(os.path.join(ckpt, "t"), dst)
    path = os.path.join(dst, sds.STATE_FILE.format(rank=1))
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif how == "garbage":  # overwritten with text (e.g. a log written to the wrong name)
        with open(path, "w") as f:
            f.write("Traceback (most recent call last):\n  not a checkpoint\n" * 20)
    elif how == "other-config":
        state = torch.load(path, weights_only=True)
        state["config"]["weights"]["rounding"] = "stochastic"
        torch.save(state, path)
    elif how == "other-rank":
        shutil.copy(os.path.join(dst, sds.STATE_FILE.format(rank=2)), path)
    else:
        shutil.copy(os.path.join(ckpt, "early", sds.STATE_FILE.format(rank=1)), path)


def _exact(p) -> torch.Tensor:
    """The exact full weight, gathered from the ZeRO partitions with a plain all-gather."""
    full = torch.empty(p.ds_tensor.numel() * tdist.get_world_size(), dtype=p.ds_tensor.dtype)
    tdist.all_gather_into_tensor(full, p.ds_tensor.data.contiguous())
    return full[: p.ds_numel].view(p.ds_shape)


def _counters(adapter) -> dict:
    """What decides a collective or a rounding: the same on every rank after a rebuild."""
    weights = {i: (wg.version, wg.dirty, wg._force_exact, wg._gen is None) for i, wg in adapter.weights.items()}
    return {"weights": weights, "grads": len(adapter.grads)}


def _damaged_fn(ctx, ckpt):
    fresh_deepspeed()
    eng = build_engine(BLOCK)
    train_steps(eng, ctx.rank, 1)
    eng.save_checkpoint(ckpt, tag="early")
    train_steps(eng, ctx.rank, 1, start=1)
    eng.save_checkpoint(ckpt, tag="t")
    tdist.barrier()
    if ctx.rank == 0:
        for how in DAMAGES:
            _damage(ckpt, how)
    tdist.barrier()
    eng2 = build_engine(BLOCK)
    adapter = sds.get_adapter(eng2)
    out = {}
    for how in DAMAGES:
        with nccl_devices() as report, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            eng2.load_checkpoint(ckpt, tag=how)
        rebuilt = adapter.grads == {}  # residuals from zero, rounding streams from their seeds
        for ds_id, wg in adapter.weights.items():
            p = adapter.params[ds_id]
            if p.ds_persist:  # re-gathered at the end of the load: exactly
                rebuilt &= torch.equal(p.data, _exact(p)) and wg.version == 1
            else:  # gathered exactly at their next use
                rebuilt &= wg.dirty and wg._force_exact and wg.version == 0
        counters = _counters(adapter)
        losses = train_steps(eng2, ctx.rank, 1, start=2)  # training continues
        out[how] = {"warned": [str(w.message) for w in caught if "sdpq" in str(w.message)], "rebuilt": rebuilt,
                    "counters": counters, "losses": losses, "checked": report.checked}  # fmt: skip
    return out


def test_a_damaged_state_file_is_rebuilt_on_every_rank(dist, tmp_path):
    """Rank 1's sdpq_rank00001.pt truncated, overwritten, saved with another weights config, by
    another rank, or at an earlier step: no rank raises or waits; every rank warns once, naming
    rank 1, the file and what is wrong, and rebuilds alike (weight versions and rounding streams
    anew, the references refreshed exactly, residuals from zero), then trains on."""
    res = dist.run(_damaged_fn, 4, 2, str(tmp_path), timeout=120)
    for how, says in DAMAGES.items():
        runs = [r[how] for r in res]
        for r in runs:
            assert len(r["warned"]) == 1, (how, r["warned"])
            msg = r["warned"][0]
            assert "rank 1" in msg and "sdpq_rank00001.pt" in msg and says in msg, (how, msg)
            assert "every rank rebuilds" in msg and "restart from zero" in msg, msg
            assert r["rebuilt"] and r["checked"] >= 1, how
            assert r["counters"] == runs[0]["counters"], how
            assert all(torch.isfinite(torch.tensor(r["losses"]))), (how, r["losses"])
        print(f"{how}: {runs[0]['warned'][0]}")
