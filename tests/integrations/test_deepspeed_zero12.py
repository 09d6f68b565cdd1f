"""sdpq.deepspeed with ZeRO-1 and ZeRO-2 (sdpq/integrations/_ds_zero12.py): 4 gloo ranks as 2
simulated nodes x 2, bf16, gradient accumulation 2, the same run without the block beside it."""

from __future__ import annotations

import pytest

deepspeed = pytest.importorskip("deepspeed")

import deepspeed.runtime.zero.stage_1_and_2  # noqa: E402,F401,F811  (before the pools fork)
import torch  # noqa: E402
from deepspeed_common import TIMEOUT, TINY, fresh_deepspeed  # noqa: E402

import sdpq  # noqa: E402
import sdpq.integrations.deepspeed as sds  # noqa: E402

STEPS, ACCUM, MICRO = 6, 2, 4
EXACT = {"weights": {"mode": "exact"}, "gradients": {"mode": "exact"}, "optimizer": {"enabled": False}}


def _config(stage: int, block: dict | None) -> dict:
    ds = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 1.0,
        # small buckets: several per step, most with pieces of two owners; ZeRO-2 with overlap_comm
        # (DeepSpeed's reduction stream) as the Trainer's stage-2 config has it, ZeRO-1 without
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 20000,
            "allgather_bucket_size": 20000,
            "overlap_comm": stage == 2,
        },
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "torch_adam": True},
        },
        "steps_per_print": 1 << 30,
    }
    if block is not None:
        ds["sdpq"] = block
    return ds


def _engine(stage: int, block: dict | None, seed: int):
    from sdpq.train.model import GPT

    fresh_deepspeed()
    torch.manual_seed(seed)
    model = GPT(TINY)
    cfg = _config(stage, block)
    return sdpq.deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _steps(ctx, engine, first: int, n: int, seed: int) -> list[float]:
    """Optimizer steps first .. first + n - 1 (ACCUM micro-batches each); their mean losses."""
    from sdpq.train.data import TokenData

    data, losses = TokenData.stdlib(), []
    for step in range(first, first + n):
        total = 0.0
        for micro in range(ACCUM):
            x, y = data.batch(step * ACCUM + micro, ctx.rank, MICRO, TINY.seq_len, seed=seed)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += float(loss) / ACCUM
        t = torch.tensor([total])
        torch.distributed.all_reduce(t)
        losses.append(float(t) / ctx.world_size)
    return losses


def _prints(engine) -> list:
    from sdpq.comm.reference_health import checksum

    return [checksum(f).tolist() for f in engine.optimizer.bit16_groups_flat]


def _train(ctx, stage: int, block: dict | None, seed: int = 0):
    """STEPS optimizer steps of the tiny GPT; -> losses, cross-node bytes (independent meter),
    and a checksum of this rank's weights."""
    from benchmarks.zeropp.bytes import LinkBytes

    engine = _engine(stage, block, seed)
    with LinkBytes(ctx.ranks_per_node) as m:
        losses = _steps(ctx, engine, 0, STEPS, seed)
    cross = sum(v["inter"]["bytes"] for v in m.as_dict()["total"].values() if "inter" in v)
    import gc

    from sdpq.memory import live_tensor_bytes

    gc.collect()
    return {
        "losses": losses,
        "cross": cross,
        "prints": _prints(engine),
        "sdpq": sds.get_adapter(engine) is not None,
        "live": live_tensor_bytes(),
    }


def _resume(ctx, stage: int, block: dict, out_dir: str):
    """Save after half the steps, load into a fresh engine, train the rest."""
    engine = _engine(stage, block, 0)
    losses = _steps(ctx, engine, 0, STEPS // 2, 0)
    engine.save_checkpoint(out_dir, tag="half")
    engine.destroy()
    engine = _engine(stage, block, 1)  # other initial weights: the checkpoint must replace them
    engine.load_checkpoint(out_dir, tag="half")
    losses += _steps(ctx, engine, STEPS // 2, STEPS - STEPS // 2, 0)
    return {"losses": losses, "prints": _prints(engine)}


def _both(dist, stage, block, seed=0):
    plain = dist.run(_train, 4, 2, stage, None, seed, timeout=TIMEOUT)
    ours = dist.run(_train, 4, 2, stage, block, seed, timeout=TIMEOUT)
    return plain, ours


@pytest.mark.parametrize("stage", [1, 2])
def test_exact_modes_train_bitwise_as_plain_zero(dist, stage):
    plain, ours = _both(dist, stage, EXACT)
    assert ours[0]["sdpq"] and not plain[0]["sdpq"]
    assert plain[0]["losses"] == ours[0]["losses"]
    assert [r["prints"] for r in plain] == [r["prints"] for r in ours]


@pytest.mark.parametrize("stage", [1, 2])
def test_the_block_sends_a_fifth_of_the_bytes_and_keeps_replicas_equal(dist, stage):
    """ZeRO-1 with the default block (sdpq's FP8 AdamW too); ZeRO-2 with torch's AdamW in both arms,
    so that what the run with the block keeps alive beyond the run without it is what the weight
    and gradient paths hold: nothing (64 KiB of slack for the cached Hadamard signs)."""
    block = {"weights": {"mode": "diff"}} if stage == 1 else {"optimizer": {"enabled": False}}
    # Note: fresh processes per arm: an engine of an earlier run in the same worker stays alive
    # (DeepSpeed keeps references to it) and would be counted.
    dist.discard(4)
    plain = dist.run(_train, 4, 2, stage, None, 0, timeout=TIMEOUT)
    dist.discard(4)
    ours = dist.run(_train, 4, 2, stage, block, 0, timeout=TIMEOUT)
    dist.discard(4)
    assert all(r["sdpq"] for r in ours)
    assert all(r["prints"] == ours[0]["prints"] for r in ours), "replicas bitwise equal"
    ratio = sum(r["cross"] for r in ours) / sum(r["cross"] for r in plain)
    p, q = plain[0]["losses"], ours[0]["losses"]
    extra = [b["live"] - a["live"] for a, b in zip(plain, ours)]
    print(f"ZeRO-{stage}: cross-node bytes {ratio:.3f} of plain; losses {p[-1]:.4f} vs {q[-1]:.4f}; live +{extra}")
    assert ratio <= 0.2, ratio
    assert abs(q[-1] / p[-1] - 1) < 0.03, (p, q)
    if stage == 2:
        assert max(extra) <= 64 * 1024, extra


def test_resume_is_bitwise_the_uninterrupted_run(dist, tmp_path):
    """ZeRO-2 with the default block (stochastic rounding of the gradients): a checkpoint saved
    mid-run resumes to the same losses and weights, bit for bit."""
    block = {"weights": {"mode": "diff"}}
    whole = dist.run(_train, 4, 2, 2, block, 0, timeout=TIMEOUT)
    resumed = dist.run(_resume, 4, 2, 2, block, str(tmp_path), timeout=TIMEOUT)
    assert resumed[0]["losses"] == whole[0]["losses"]
    assert [r["prints"] for r in resumed] == [r["prints"] for r in whole]


def test_refusals_name_the_key():
    base = _config(2, {"weights": {"mode": "direct", "bits": 8}})
    with pytest.raises(sds.IncompatibleConfigError, match='weights.mode "direct"'):
        sds.check_config(base, sdpq.Config.from_deepspeed(base))
    mcf = _config(1, {"optimizer": {"master": "mcf"}})
    with pytest.raises(sds.IncompatibleConfigError, match="'mcf' with ZeRO-1"):
        sds.check_config(mcf, sdpq.Config.from_deepspeed(mcf))
    bf16_opt = {**_config(1, {"weights": {}}), "data_types": {"grad_accum_dtype": "fp32"}}
    with pytest.raises(sds.IncompatibleConfigError, match="BF16_Optimizer"):
        sds.check_config(bf16_opt, sdpq.Config.from_deepspeed(bf16_opt))
    stage0 = _config(0, {"weights": {}})
    with pytest.raises(sds.IncompatibleConfigError, match="stages 1, 2 and 3"):
        sds.check_config(stage0, sdpq.Config.from_deepspeed(stage0))
