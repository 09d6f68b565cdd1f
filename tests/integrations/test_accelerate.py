"""The "sdpq" block through Accelerate's DeepSpeed plugin, in a user's own training loop
(4 gloo ranks as 2 simulated nodes x 2); the only sdpq line is `import sdpq`."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from frameworks_common import (BLOCK, LR, MICRO, STEPS, cross_node_bytes, meter, ranks_env, run_both_arms,  # noqa: E402
                               samples, tiny_gpt2, write_ds_config)

TIMEOUT = 300


def _accelerate_fn(ctx, out_dir, with_block):
    import os

    import sdpq  # noqa: F401  (the one line)
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    ranks_env(ctx)
    path = write_ds_config(f"{out_dir}/ds_{ctx.rank}.json", BLOCK if with_block else None)
    # What `accelerate launch --use_deepspeed --deepspeed_config_file FILE` sets for the script.
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    model = tiny_gpt2()
    acc = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=path))
    # Note: driven this way on CPU, Accelerate's state counts one process and would hand every
    # rank the whole dataset; each rank takes its own share, as Accelerate does on GPUs.
    data = samples(STEPS * MICRO * ctx.world_size)[ctx.rank::ctx.world_size]
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)
    # The config's "optimizer" and "scheduler" blocks build them: Accelerate's placeholders stand in.
    opt = DummyOptim(model.parameters(), lr=LR)
    model, opt, loader, _ = acc.prepare(model, opt, loader, DummyScheduler(opt, total_num_steps=STEPS,
                                                                            warmup_num_steps=4))
    losses = []
    with meter(ctx.ranks_per_node) as m:
        for batch in loader:
            loss = model(**batch).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            mean = loss.detach().float().clone()
            torch.distributed.all_reduce(mean)  # (Accelerate's reduce("mean") sums on gloo)
            losses.append(float(mean) / ctx.world_size)
    return {"batches": len(loader), "losses": losses, "cross": cross_node_bytes(m), "sdpq": getattr(model, "sdpq", None) is not None}


def test_accelerate_with_the_block_sends_a_fifth_of_the_bytes(dist, tmp_path):
    plain, _ = run_both_arms(dist, _accelerate_fn, str(tmp_path), "Accelerate", TIMEOUT)
    assert plain[0]["batches"] == STEPS
