"""The "sdpq" block through Lightning's DeepSpeedStrategy (4 gloo ranks as 2 simulated nodes x 2);
the only sdpq line is `import sdpq`.

Note: Lightning's DeepSpeedStrategy assumes CUDA in three places (a check in `setup_environment`,
a GPU-index check in `setup_distributed`, `root_device.index` as DeepSpeed's device rank); the
test works around those three so that the rest
of Lightning's own code (its DeepSpeed config handling and its `deepspeed.initialize` call) runs
here on CPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytest.importorskip("lightning")

from frameworks_common import (BLOCK, MICRO, STEPS, cross_node_bytes, meter, ranks_env, run_both_arms,  # noqa: E402
                               samples, tiny_gpt2, write_ds_config)

TIMEOUT = 300


def _lightning_fn(ctx, out_dir, with_block):
    import logging

    import lightning.pytorch as pl
    import sdpq  # noqa: F401  (the one line)
    import torch
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    import lightning.pytorch.strategies.deepspeed as lightning_ds

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's own adds only the CUDA check

        @property
        def root_device(self) -> torch.device:
            # Lightning hands DeepSpeed `root_device.index` as the device rank (None on CPU).
            return torch.device("cpu", ctx.local_rank)

    # The GPU-index check of setup_distributed (CPU devices have no index).
    lightning_ds._validate_device_index_selection = lambda devices: None

    class LitGPT(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2()
            self.losses = []

        def training_step(self, batch, _):
            loss = self.model(**batch).loss
            mean = loss.detach().float().clone()
            torch.distributed.all_reduce(mean)
            self.losses.append(float(mean) / ctx.world_size)
            return loss

        def configure_optimizers(self):
            return None  # the config's "optimizer" block builds it

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    ranks_env(ctx)
    path = write_ds_config(f"{out_dir}/ds_{ctx.rank}.json", BLOCK if with_block else None, lightning=True)
    lit = LitGPT()
    loader = torch.utils.data.DataLoader(samples(STEPS * MICRO * ctx.world_size), batch_size=MICRO)
    trainer = pl.Trainer(accelerator="cpu", devices=ctx.ranks_per_node, num_nodes=ctx.world_size // ctx.ranks_per_node,
                         strategy=CPUDeepSpeedStrategy(config=path), precision="bf16-mixed", max_steps=STEPS, gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out_dir)
    with meter(ctx.ranks_per_node) as m:
        trainer.fit(lit, loader)
    engine = trainer.strategy.model
    return {"losses": lit.losses, "cross": cross_node_bytes(m), "sdpq": getattr(engine, "sdpq", None) is not None}


def test_lightning_with_the_block_sends_a_fifth_of_the_bytes(dist, tmp_path):
    run_both_arms(dist, _lightning_fn, str(tmp_path), "Lightning", TIMEOUT)
