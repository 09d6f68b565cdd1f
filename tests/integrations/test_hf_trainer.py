"""The "sdpq" block in a Hugging Face Trainer run (4 gloo ranks as 2 simulated nodes x 2).

The user's script gains one line, `import sdpq`; `TrainingArguments(deepspeed=FILE)` is theirs.
Bytes are counted by an independent meter that wraps torch.distributed (not sdpq's statistics).
"""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # both arms of a framework run (about a minute each); CI runs them
pytest.importorskip("accelerate")

from frameworks_common import (  # noqa: E402
    BLOCK,
    LR,
    MICRO,
    STEPS,
    cross_node_bytes,
    meter,
    preload,
    ranks_env,
    run_both_arms,
    samples,
    tiny_gpt2,
    write_ds_config,
)

from sdpq.config import Config  # noqa: E402

BITS = Config().weights.bits  # the default's weight differences (codes; scales add ~0.02 bits)

preload("deepspeed.runtime.zero.stage3", "transformers.trainer", "accelerate")
TIMEOUT = 300


def _trainer_fn(ctx, out_dir, with_block, stage=3, steps=STEPS):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import sdpq  # (the one line: deepspeed.initialize now applies the block)
    import sdpq.hf

    ranks_env(ctx)
    path = write_ds_config(f"{out_dir}/ds_{ctx.rank}.json", BLOCK if with_block else None, hf_auto=True, stage=stage)
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=MICRO,
        max_steps=steps,
        learning_rate=LR,
        adam_beta2=0.95,
        warmup_steps=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=True,
        deepspeed=path,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        max_grad_norm=1.0,
    )

    class Reporter(TrainerCallback):  # stands for report_to's integrations: sees what they see
        seen: dict = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.update({k: v for k, v in (logs or {}).items() if k.startswith("sdpq/")})

    trainer = Trainer(
        model=tiny_gpt2(), args=args, train_dataset=samples(steps * MICRO * ctx.world_size), callbacks=[Reporter()]
    )
    if with_block:
        sdpq.hf.log_stats(trainer)
    with meter(ctx.ranks_per_node) as m:
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    engine = trainer.model_wrapped
    logged = Reporter.seen
    return {
        "logged": logged,
        "losses": losses,
        "cross": cross_node_bytes(m),
        "sdpq": getattr(engine, "sdpq", None) is not None,
    }


def test_trainer_with_the_block_cuts_the_cross_node_bytes(dist, tmp_path):
    _, ours = run_both_arms(dist, _trainer_fn, str(tmp_path), "HF Trainer", TIMEOUT)
    logged = ours[0]["logged"]  # sdpq.hf.log_stats: the figures reach the Trainer's reporters
    assert logged["sdpq/gradients/inter/bytes"] > 0 and 4.0 < logged["sdpq/gradients/inter/bits_per_element"] < 4.5
    assert BITS < logged["sdpq/weights/inter/bits_per_element"] < BITS + 0.5, logged


def test_trainer_zero2_with_the_block(dist, tmp_path):
    """DeepSpeed's stage-2 config (the Trainer's usual start) with the block and `import sdpq`:
    ZeRO-2's reductions and gathers go through sdpq (docs/zero12.md), at most 0.25 of the cross-node
    bytes of the same config without it by the least-traffic count (the baseline all-reduces bf16
    gradients and all-gathers bf16 partitions, 48 bits a parameter; sdpq sends 4-bit gradients and
    2-bit differences, 6-7 bits with scales and the tiny model's padding; 0.199 with the earlier
    4-bit differences). 10
    steps: the bytes and the hook are what is checked here; ZeRO-2's loss with the block over
    seeds is benchmarks/deepspeed_zero12.py's."""
    plain = dist.run(_trainer_fn, 4, 2, str(tmp_path), False, 2, 10, timeout=TIMEOUT)
    dist.discard(4)
    ours = dist.run(_trainer_fn, 4, 2, str(tmp_path), True, 2, 10, timeout=TIMEOUT)
    assert all(r["sdpq"] for r in ours) and not any(r["sdpq"] for r in plain)
    ratio = sum(r["cross"] for r in ours) / sum(r["cross"] for r in plain)
    print(f"HF Trainer ZeRO-2: cross-node bytes ratio {ratio:.3f}; losses {ours[0]['losses']}")
    assert ratio <= 0.25, ratio
    assert ours[0]["losses"][-1] < ours[0]["losses"][0]
    logged = ours[0]["logged"]
    assert BITS < logged["sdpq/weights/inter/bits_per_element"] < BITS + 0.5, logged
