"""sdpq.deepspeed: ZeRO-3 options users combine with the block (CPU offload, fp16 with dynamic loss
scaling, DeepSpeed's monitor) on 4 gloo ranks as 2 simulated nodes x 2."""

from __future__ import annotations

import dataclasses
import os

import pytest

deepspeed = pytest.importorskip("deepspeed")

# Imported here, before the worker pools fork, so that ranks do not each import them (~10 s).
import deepspeed.runtime.zero.stage3  # noqa: E402,F401,F811
import torch  # noqa: E402
from deepspeed_common import FULL_BLOCK, SPEC, TIMEOUT, ZERO, run4, train_fn  # noqa: E402

import sdpq  # noqa: E402
import sdpq.integrations.deepspeed as sds  # noqa: E402
from sdpq.config import Config  # noqa: E402


@pytest.mark.parametrize("option", ["offload_optimizer", "offload_param"])
def test_cpu_offload_with_the_block_keeps_the_loss(dist, option):
    """ZeRO-3 CPU offload with the block: the same losses as the same option without it (sdpq's
    AdamW steps the offloaded partitions; the MCF master cannot be offloaded, see below)."""
    zero = {**ZERO["zero_optimization"], option: {"device": "cpu"}}
    block = {**FULL_BLOCK, "optimizer": {"master": "native"}} if option == "offload_optimizer" else FULL_BLOCK
    plain = run4(dist, dataclasses.replace(SPEC, bf16=True), {"zero_optimization": zero})
    dist.discard(4)
    ours = run4(dist, dataclasses.replace(SPEC, bf16=True, sdpq=block), {"zero_optimization": zero})
    assert ours[0]["extra"]["sdpq"] is not None
    for p, q in zip(plain[0]["losses"], ours[0]["losses"]):
        assert abs(q - p) / p < 0.01, (plain[0]["losses"], ours[0]["losses"])


def test_offloaded_mcf_master_and_fp16_mcf_are_refused_at_startup():
    base = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    with pytest.raises(sds.IncompatibleConfigError, match=r"offload_optimizer with sdpq.optimizer.master 'mcf'"):
        sds.check_config(base, sdpq.Config.from_deepspeed({**base, "sdpq": FULL_BLOCK}))
    fp16 = {**base, "bf16": {"enabled": False}, "fp16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    with pytest.raises(sds.IncompatibleConfigError, match=r"'mcf'.*needs \"bf16\""):
        sds.check_config(fp16, sdpq.Config.from_deepspeed({**fp16, "sdpq": FULL_BLOCK}))


def test_statistics_reach_deepspeed_monitor_writers(dist, tmp_path):
    """A "csv_monitor" section in the DeepSpeed config: sdpq's per-step figures land in its files
    next to DeepSpeed's own events (the same writers serve TensorBoard, W&B and Comet)."""
    import csv

    out = str(tmp_path / "monitor")
    overrides = {**ZERO, "csv_monitor": {"enabled": True, "output_path": out, "job_name": "run"}}
    run4(dist, dataclasses.replace(SPEC, bf16=True, sdpq=FULL_BLOCK), overrides)
    rows = {}
    for name in (
        "sdpq_gradients_inter_bytes",
        "sdpq_gradients_inter_bits_per_element",
        "sdpq_weights_inter_bits_per_element",
        "sdpq_skipped_steps",
    ):
        with open(os.path.join(out, "run", name + ".csv")) as f:
            rows[name] = [float(r[1]) for r in list(csv.reader(f))[1:]]
    assert len(rows["sdpq_skipped_steps"]) == SPEC.steps  # one event per optimizer step
    assert all(b > 0 for b in rows["sdpq_gradients_inter_bytes"])
    assert all(4.0 < b < 4.6 for b in rows["sdpq_gradients_inter_bits_per_element"])  # with group padding
    bits = Config().weights.bits  # the default's differences; the first refresh is exact (16)
    assert all(bits < b < 16.5 for b in rows["sdpq_weights_inter_bits_per_element"])


def _fp16_fn(ctx, spec, overrides):
    """A run with DeepSpeed's CPU accelerator allowed fp16: it refuses fp16 when the CPU lacks
    oneDNN fp16 kernels, yet torch computes fp16 on any CPU (slowly), which is all a test needs."""
    from deepspeed.accelerator import get_accelerator

    acc = type(get_accelerator())
    acc.is_fp16_supported = lambda self: True
    acc.supported_dtypes = lambda self: [torch.float32, torch.bfloat16, torch.float16]
    return train_fn(ctx, spec, overrides)


def test_fp16_dynamic_loss_scaling_skips_the_same_steps(dist):
    """fp16 with dynamic loss scaling and the block (master "native"; the MCF master needs bf16):
    an initial scale of 2^18 overflows the first steps (and the scale, raised again every 2 good
    steps, overflows once more). sdpq's gradient reduce-scatter turns an inf
    anywhere into NaN everywhere, so DeepSpeed sees the overflow, skips the same steps as without
    the block, lowers the scale and then trains to the same losses."""
    fp16 = {**ZERO, "fp16": {"enabled": True, "initial_scale_power": 18, "loss_scale_window": 2, "hysteresis": 1}}
    spec = dataclasses.replace(SPEC, steps=10)
    plain = dist.run(_fp16_fn, 4, 2, spec, fp16, timeout=TIMEOUT)
    dist.discard(4)
    ours = dist.run(
        _fp16_fn,
        4,
        2,
        dataclasses.replace(spec, sdpq={**FULL_BLOCK, "optimizer": {"master": "native"}}),
        fp16,
        timeout=TIMEOUT,
    )
    p, q = plain[0]["losses"], ours[0]["losses"]
    skipped = plain[0]["extra"]["skipped_steps"]
    print(f"fp16: skipped steps {skipped} / {ours[0]['extra']['skipped_steps']}; losses {p} vs {q}")
    assert 0 < skipped < spec.steps - 4  # some steps overflowed, enough trained afterwards
    assert all(r["extra"]["skipped_steps"] == skipped for r in plain + ours)
    # 2^18 overflows the first step in both arms, so the second also runs on the initial weights.
    assert q[:2] == p[:2]
    assert q[-1] < 0.9 * q[0]  # it trained
    for a, b in zip(p, q):
        assert abs(b - a) / a < 0.01, (p, q)
