"""sdpq in a user's own Accelerate training loop (4 gloo ranks as 2 simulated nodes x 2):
- the "sdpq" block through Accelerate's DeepSpeed plugin; the only sdpq line is `import sdpq`;
- Accelerate's FSDP2 plugin, then one `sdpq.fsdp.apply` after `accelerator.prepare`.

Note: Accelerate selects FSDP only on GPUs (on CPU it picks DDP); the FSDP2 test sets the
distributed type itself, so that the rest (Accelerate's fully_shard wrapping, mixed precision
and optimizer parameter swap) is Accelerate's own code.
"""

from __future__ import annotations

import warnings

import pytest

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
    warmup_decay,
    write_ds_config,
)

preload("accelerate", "accelerate.utils")
TIMEOUT = 300


def _accelerate_fn(ctx, out_dir, with_block):
    import os

    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    import sdpq  # noqa: F401  (the one line)

    ranks_env(ctx)
    path = write_ds_config(f"{out_dir}/ds_{ctx.rank}.json", BLOCK if with_block else None)
    # What `accelerate launch --use_deepspeed --deepspeed_config_file FILE` sets for the script.
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    model = tiny_gpt2()
    acc = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=path))
    # Note: driven this way on CPU, Accelerate's state counts one process and would hand every
    # rank the whole dataset; each rank takes its own share, as Accelerate does on GPUs.
    data = samples(STEPS * MICRO * ctx.world_size)[ctx.rank :: ctx.world_size]
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)
    # The config's "optimizer" and "scheduler" blocks build them: Accelerate's placeholders stand in.
    opt = DummyOptim(model.parameters(), lr=LR)
    model, opt, loader, _ = acc.prepare(
        model, opt, loader, DummyScheduler(opt, total_num_steps=STEPS, warmup_num_steps=4)
    )
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
    return {
        "batches": len(loader),
        "losses": losses,
        "cross": cross_node_bytes(m),
        "sdpq": getattr(model, "sdpq", None) is not None,
    }


def test_accelerate_with_the_block_cuts_the_cross_node_bytes(dist, tmp_path):
    pytest.importorskip("deepspeed")
    plain, _ = run_both_arms(dist, _accelerate_fn, str(tmp_path), "Accelerate", TIMEOUT)
    assert plain[0]["batches"] == STEPS


def _accelerate_fsdp2_fn(ctx, out_dir, with_sdpq):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    import sdpq

    ranks_env(ctx)
    model = tiny_gpt2()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"]
    )
    acc = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin, cpu=True)
    acc.state.distributed_type = DistributedType.FSDP  # what Accelerate picks on GPUs (see the note)
    acc.state.fsdp_plugin = plugin
    plugin.set_mixed_precision("bf16")
    data = samples(STEPS * MICRO * ctx.world_size)[ctx.rank :: ctx.world_size]
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    sched = warmup_decay(opt)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    if with_sdpq:
        sdpq.fsdp.apply(model, sdpq.Config(), optimizer=opt)  # the one sdpq line, after prepare
    losses = []
    with meter(ctx.ranks_per_node) as m, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a stale-weights warning fails the test
        for batch in loader:
            loss = model(**batch).loss
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            mean = loss.detach().float().clone()
            torch.distributed.all_reduce(mean)
            losses.append(float(mean) / ctx.world_size)
    return {"losses": losses, "cross": cross_node_bytes(m), "sdpq": sdpq.fsdp.is_applied(model)}


def test_accelerate_fsdp2_with_sdpq_cuts_the_cross_node_bytes(dist, tmp_path):
    run_both_arms(dist, _accelerate_fsdp2_fn, str(tmp_path), "Accelerate FSDP2", TIMEOUT, stack="fsdp2")
