"""sdpq.deepspeed with ZeRO-1 and ZeRO-2 (sdpq/integrations/_ds_zero12.py): 4 gloo ranks as 2
simulated nodes x 2, bf16, gradient accumulation 2, the same run without the block beside it."""

from __future__ import annotations

import pytest

deepspeed = pytest.importorskip("deepspeed")

import deepspeed.runtime.zero.stage_1_and_2  # noqa: E402,F401,F811  (before the pools fork)
from deepspeed_common import TIMEOUT  # noqa: E402
from zero12_common import KINDS  # noqa: E402
from zero12_common import build as _engine  # noqa: E402
from zero12_common import config as _config  # noqa: E402
from zero12_common import prints as _prints  # noqa: E402
from zero12_common import train as _steps  # noqa: E402

import sdpq  # noqa: E402
import sdpq.integrations.deepspeed as sds  # noqa: E402
from sdpq.plan import Arm, rank_memory  # noqa: E402

STEPS = 6
EXACT = {"weights": {"mode": "exact"}, "gradients": {"mode": "exact"}, "optimizer": {"enabled": False}}


def _train(ctx, stage: int | str, block: dict | None, seed: int = 0):
    """STEPS optimizer steps of the tiny GPT; -> losses, cross-node bytes (independent meter),
    and a checksum of this rank's weights."""
    from sdpq.comm.link_bytes import LinkBytes

    engine = _engine(stage, block, seed)
    with LinkBytes(ctx.ranks_per_node) as m:
        losses = _steps(ctx, engine, 0, STEPS, seed)
    cross = sum(v["inter"]["bytes"] for v in m.as_dict()["total"].values() if "inter" in v)
    import gc

    from sdpq.memory import live_tensor_bytes

    gc.collect()
    report = sdpq.memory.report(engine).bytes
    return {
        "report": report,
        "shapes": [tuple(p.shape) for p in engine.module.parameters()],
        "losses": losses,
        "cross": cross,
        "prints": _prints(engine),
        "sdpq": sds.get_adapter(engine) is not None,
        # the master sdpq's AdamW keeps, as the adapter reports it (and sdpq.train's run record)
        "master": sds.get_adapter(engine).config.optimizer.master if sds.get_adapter(engine) else None,
        "optimizer": type(engine.optimizer).__name__,
        "norm": float(engine.get_global_grad_norm()),
        "live": live_tensor_bytes(),
    }


def _resume(ctx, stage: int | str, block: dict, out_dir: str):
    """Save after half the steps, load into a fresh engine, train the rest."""
    engine = _engine(stage, block, 0)
    losses = _steps(ctx, engine, 0, STEPS // 2, 0)
    engine.save_checkpoint(out_dir, tag="half")
    engine.destroy()
    engine = _engine(stage, block, 1)  # other initial weights: the checkpoint must replace them
    engine.load_checkpoint(out_dir, tag="half")
    if hasattr(engine.optimizer, "offload_states"):  # DeepSpeedZeroOptimizer
        engine.offload_states()
        engine.reload_states()
    losses += _steps(ctx, engine, STEPS // 2, STEPS - STEPS // 2, 0)
    return {"losses": losses, "prints": _prints(engine)}


_PLAIN: dict = {}


def _plain(dist, stage):
    """The run without the block (seed 0), once per stage for the two tests that compare with it.
    Note: in fresh processes: an engine of an earlier run in the same worker stays alive
    (DeepSpeed keeps references to it) and would be counted in its live bytes."""
    if stage not in _PLAIN:
        dist.discard(4)
        _PLAIN[stage] = dist.run(_train, 4, 2, stage, None, 0, timeout=TIMEOUT)
    return _PLAIN[stage]


@pytest.mark.parametrize("stage", list(KINDS))
def test_exact_modes_train_bitwise_as_plain_zero(dist, stage):
    plain = _plain(dist, stage)
    ours = dist.run(_train, 4, 2, stage, EXACT, 0, timeout=TIMEOUT)
    assert ours[0]["sdpq"] and not plain[0]["sdpq"]
    assert ours[0]["optimizer"] == plain[0]["optimizer"]
    assert plain[0]["losses"] == ours[0]["losses"]
    assert [r["prints"] for r in plain] == [r["prints"] for r in ours]


@pytest.mark.parametrize("stage", list(KINDS))
def test_the_block_sends_a_fifth_of_the_bytes_and_keeps_replicas_equal(dist, stage):
    """ZeRO-1 with the default block (sdpq's FP8 AdamW too); ZeRO-2 with torch's AdamW in both arms,
    so that what the run with the block keeps alive beyond the run without it is what the weight
    and gradient paths hold: nothing (64 KiB of slack for the cached Hadamard signs)."""
    block = {"weights": {"mode": "diff"}} if stage == "zero1" else {"optimizer": {"enabled": False}}
    plain = _plain(dist, stage)  # fresh processes per arm (see _plain)
    dist.discard(4)
    ours = dist.run(_train, 4, 2, stage, block, 0, timeout=TIMEOUT)
    dist.discard(4)
    assert all(r["sdpq"] for r in ours)
    if stage == "zero1":  # sdpq's AdamW with the MCF default: a native fp32 master runs, and is reported
        assert ours[0]["master"] == "native" and ours[0]["report"]["master"] > 0
    assert all(r["prints"] == ours[0]["prints"] for r in ours), "replicas bitwise equal"
    ratio = sum(r["cross"] for r in ours) / sum(r["cross"] for r in plain)
    p, q = plain[0]["losses"], ours[0]["losses"]
    extra = [b["live"] - a["live"] for a, b in zip(plain, ours)]
    print(f"{stage}: cross-node bytes {ratio:.3f} of plain; losses {p[-1]:.4f} vs {q[-1]:.4f}; live +{extra}")
    assert ratio <= 0.2, ratio
    assert abs(q[-1] / p[-1] - 1) < 0.03, (p, q)
    # the last step's global gradient norm (for clipping): the whole gradient's, on every rank
    assert len({r["norm"] for r in ours}) == 1 and abs(ours[0]["norm"] / plain[0]["norm"] - 1) < 0.1
    if stage != "zero1":
        assert max(extra) <= 64 * 1024, extra
    # sdpq.memory's report of the engine after the run against sdpq plan's figures for this stage,
    # byte for byte (gradients, whose buffers DeepSpeed sizes from its bucket settings and frees
    # after the step, are not compared)
    for block_, runs in ((None, plain), (block, ours)):
        arm = Arm("x", None if block_ is None else sdpq.Config.from_dict(block_))
        want = rank_memory([runs[0]["shapes"]], f"zero{KINDS[stage][0]}", 2, 2, arm)
        for r in runs:
            got = r["report"]
            assert all(got[k] == want[k] for k in ("parameters", "master", "optimizer_states")), (got, want)
            assert got["weight_reference"] == got["error_feedback"] == 0


@pytest.mark.parametrize("stage", ["zero2", "zero1-fp32-accum"])
def test_resume_is_bitwise_the_uninterrupted_run(dist, tmp_path, stage):
    """The default block (stochastic rounding of the gradients, sdpq's AdamW; at ZeRO-2 with
    error feedback, whose residuals the checkpoint carries): a checkpoint saved mid-run resumes
    to the same losses and weights, bit for bit (at ZeRO-2 with the resumed engine's states
    offloaded and reloaded first: the weights come back as they were)."""
    block = {"weights": {"mode": "diff"}}
    if stage == "zero2":
        block["gradients"] = {"error_feedback": True}
    whole = dist.run(_train, 4, 2, stage, block, 0, timeout=TIMEOUT)
    resumed = dist.run(_resume, 4, 2, stage, block, str(tmp_path), timeout=TIMEOUT)
    assert resumed[0]["losses"] == whole[0]["losses"]
    assert [r["prints"] for r in resumed] == [r["prints"] for r in whole]


def test_refusals_name_the_key():
    base = _config(2, {"weights": {"mode": "direct", "bits": 8}})
    with pytest.raises(sds.IncompatibleConfigError, match='weights.mode "direct"'):
        sds.check_config(base, sdpq.Config.from_deepspeed(base))
    mcf = _config(1, {"optimizer": {"master": "mcf"}})
    with pytest.raises(sds.IncompatibleConfigError, match="'mcf' with ZeRO-1"):
        sds.check_config(mcf, sdpq.Config.from_deepspeed(mcf))
    default = _config(1, {"weights": {"mode": "diff"}})  # the MCF default: native at stages 1-2
    _, runs = sds.prepare_config(default, sdpq.Config.from_deepspeed(default), {})
    assert runs.optimizer.master == "native" and sdpq.Config.from_deepspeed(default).optimizer.master == "mcf"
    stage0 = _config(0, {"weights": {}})
    with pytest.raises(sds.IncompatibleConfigError, match="stages 1, 2 and 3"):
        sds.check_config(stage0, sdpq.Config.from_deepspeed(stage0))
