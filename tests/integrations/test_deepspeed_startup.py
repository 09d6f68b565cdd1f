"""sdpq.deepspeed: what is checked at start-up (the block reached, ranks agree, bad keys, stages,
versions, launchers) and the shipped ds_configs/."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

deepspeed = pytest.importorskip("deepspeed")

# Imported here, before the worker pools fork, so that ranks do not each import them (~10 s).
import deepspeed.runtime.zero.stage3  # noqa: E402,F401,F811
import torch  # noqa: E402
from deepspeed_common import FULL_BLOCK, SPEC, TIMEOUT, TINY, ZERO, build_engine, fresh_deepspeed  # noqa: E402

import sdpq.integrations.deepspeed as sds  # noqa: E402
from sdpq.config import ConfigError  # noqa: E402


def _disagree_fn(ctx):
    fresh_deepspeed()
    block = {"weights": {"mode": "diff"}, "topology": {"ranks_per_node": 2}}
    if ctx.rank == 3:  # a node with a stale config file
        block["gradients"] = {"seed": 9}
    try:
        build_engine(block, bf16=True)
    except ConfigError as e:
        return str(e)
    return None


def _bypass_fn(ctx, via):
    import deepspeed as ds

    from sdpq.train import deepspeed_backend
    from sdpq.train.model import GPT

    fresh_deepspeed()
    model = GPT(TINY)
    cfg = deepspeed_backend.ds_config(dataclasses.replace(SPEC, sdpq=FULL_BLOCK, bf16=True, grad_accum=1), ZERO)
    cfg["sdpq"] = {**FULL_BLOCK, "topology": {"ranks_per_node": 2}}
    initialize = ds.initialize if via == "deepspeed.initialize" else ds.initialize.__sdpq_original__
    try:
        engine = initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    except sds.IncompatibleConfigError as e:
        return str(e)
    return sds.get_adapter(engine) is not None


def test_deepspeed_initialize_applies_the_block_and_a_bypass_fails_at_startup(dist):
    """After `import sdpq`, a framework's own deepspeed.initialize call applies the block (what the
    Trainer, Accelerate and Lightning do); a path that bypasses it (an initialize bound before
    `import sdpq`) fails at start-up instead of silently ignoring the block."""
    assert dist.run(_bypass_fn, 4, 2, "deepspeed.initialize", timeout=TIMEOUT) == [True] * 4
    errors = dist.run(_bypass_fn, 4, 2, "original", timeout=TIMEOUT)
    assert all(isinstance(e, str) and "built without sdpq" in e for e in errors), errors


def test_ranks_that_disagree_fail_alike_at_initialize(dist):
    errors = dist.run(_disagree_fn, 4, 2, timeout=TIMEOUT)
    assert len(set(errors)) == 1 and errors[0] is not None, errors
    msg = errors[0]
    assert msg.startswith("sdpq.deepspeed.initialize:") and "config.gradients.seed" in msg, msg
    assert "9 on ranks [3]" in msg and "0 on ranks [0, 1, 2]" in msg, msg


def test_typo_in_sdpq_block_fails_at_startup_with_key_path():
    model = torch.nn.Linear(4, 4)
    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with pytest.raises(ConfigError, match=r"sdpq\.weights\.bitz: unknown key"):
        sds.initialize(model=model, config={**base, "sdpq": {"weights": {"bitz": 4}}})
    with pytest.raises(ConfigError, match=r"sdpq\.gradients\.inter_bits"):
        sds.initialize(model=model, config={**base, "sdpq": {"gradients": {"inter_bits": 5}}})
    with pytest.raises(ConfigError, match=r"sdpq\.wieghts: unknown key"):
        sds.initialize(model=model, config={**base, "sdpq": {"wieghts": {}}})


def test_stage_0_with_a_block_is_a_clear_error():
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 0},
        "sdpq": {"gradients": {"mode": "two_level"}},
    }
    with pytest.raises(sds.IncompatibleConfigError, match="ZeRO stages 1, 2 and 3.*stage 0"):
        sds.initialize(model=torch.nn.Linear(4, 4), config=cfg)


def test_zeropp_flags_with_a_block_are_rejected():
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "zero_quantized_weights": True},
        "sdpq": {"weights": {"mode": "diff"}},
    }
    with pytest.raises(sds.IncompatibleConfigError, match="zero_quantized_weights"):
        sds.initialize(model=torch.nn.Linear(4, 4), config=cfg)


def test_version_check(monkeypatch):
    assert sds.check_deepspeed_version("0.19.8") == "0.19.8"
    assert sds.check_deepspeed_version("0.19.12+g1234") == "0.19.12+g1234"
    for bad in ("0.18.3", "0.19.7", "0.20.0", "1.0.0"):
        with pytest.raises(
            sds.DeepSpeedVersionError,
            match=r"tested with DeepSpeed >=0\.19\.8,<0\.20.*"
            r"SDPQ_ALLOW_UNTESTED_DEEPSPEED",
        ):
            sds.check_deepspeed_version(bad)
    # At start-up, before anything is built.
    monkeypatch.setattr(deepspeed, "__version__", "0.21.0")
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "sdpq": {"weights": {}}}
    with pytest.raises(sds.DeepSpeedVersionError, match="DeepSpeed 0.21.0 is installed"):
        sds.initialize(model=torch.nn.Linear(4, 4), config=cfg)
    monkeypatch.setenv("SDPQ_ALLOW_UNTESTED_DEEPSPEED", "1")
    with pytest.warns(RuntimeWarning, match="DeepSpeed 0.21.0"):
        sds.check_deepspeed_version()


def _plain_and_no_jit_fn(ctx, ext_dir):
    import deepspeed.comm.comm as dscomm

    fresh_deepspeed()
    os.environ["TORCH_EXTENSIONS_DIR"] = ext_dir
    mod = sys.modules["deepspeed.comm.torch"]

    def boom():
        raise AssertionError("the shared-memory op JIT build was attempted")

    orig, mod.build_shm_op = mod.build_shm_op, boom
    dscomm.cdb = None  # as in a fresh process: the next initialize creates the backend
    try:
        import argparse
        import json

        out = {}
        for stage, block in ((2, {}), (3, None)):  # an empty block, no block: plain DeepSpeed
            cfg = {
                "train_micro_batch_size_per_gpu": 1,
                "zero_optimization": {"stage": stage},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            }
            model = torch.nn.Linear(8, 8)
            if block is not None:  # through args.deepspeed_config, as a launcher script passes it
                cfg["sdpq"] = block
                path = os.path.join(ext_dir + ".json")
                with open(path, "w") as f:
                    json.dump(cfg, f)
                args = argparse.Namespace(deepspeed_config=path, local_rank=0)
                eng = sds.initialize(args, model, model_parameters=model.parameters())[0]
            else:
                eng = sds.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
            out[stage] = (sds.get_adapter(eng) is None, type(eng.optimizer).__name__)
        out["restored"] = mod.build_shm_op is boom
        out["built"] = os.listdir(ext_dir) if os.path.isdir(ext_dir) else []
        return out
    finally:
        mod.build_shm_op = orig


def test_empty_block_is_plain_deepspeed_and_no_jit_build(dist, tmp_path):
    (r,) = dist.run(_plain_and_no_jit_fn, 1, 1, str(tmp_path / "ext"), timeout=TIMEOUT)
    assert r[2] == (True, "DeepSpeedZeroOptimizer")
    assert r[3] == (True, "DeepSpeedZeroOptimizer_Stage3")
    assert r["restored"] and r["built"] == []


# ----------------------------------------------------------------------------- ds_configs/

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "ds_configs")
CONFIG_FILES = sorted(f for f in os.listdir(CONFIGS) if f.endswith(".json"))


def test_ds_configs_are_valid_and_documented():
    import json

    from sdpq.config import Config

    readme = open(os.path.join(CONFIGS, "README.md")).read()
    expected = {
        "zero3.json",
        "zero3_sdpq.json",
        "zero3_sdpq_weights.json",
        "zero3_sdpq_gradients.json",
        "zero3_sdpq_optimizer.json",
        "zero3_zeropp.json",
        "zero2_sdpq.json",
    }
    assert expected <= set(CONFIG_FILES)
    for f in CONFIG_FILES:
        assert f"`{f}`" in readme
        ds = json.load(open(os.path.join(CONFIGS, f)))
        cfg = Config.from_deepspeed(ds)
        if f in ("zero3.json", "zero3_zeropp.json"):
            assert cfg is None
            continue
        out, runs = sds.prepare_config(ds, cfg, {})
        stage = int(f[4])
        assert "sdpq" not in out and out["zero_optimization"]["stage"] == stage
        # the config sdpq runs with: at ZeRO-1/2 the MCF default becomes a native master
        master = "native" if stage < 3 and cfg.optimizer.enabled else cfg.optimizer.master
        assert runs.optimizer.master == master and runs.weights == cfg.weights, f
    zpp = json.load(open(os.path.join(CONFIGS, "zero3_zeropp.json")))
    with pytest.raises(sds.IncompatibleConfigError, match="ZeRO\\+\\+"):
        sds.prepare_config({**zpp, "sdpq": {"weights": {}}}, Config(), {})


def _master(zopt):
    """The first fp32 (or bf16) master partition: ZeRO-3's or ZeRO-1/2's."""
    flat = getattr(zopt, "fp32_partitioned_groups_flat", None)
    return flat[0] if flat is not None else zopt.single_partition_of_fp32_groups[0]


def _configs_fn(ctx):
    from sdpq.train.data import TokenData
    from sdpq.train.model import GPT

    fresh_deepspeed()
    data = TokenData.stdlib()
    out = {}
    for f in CONFIG_FILES:
        if f == "zero3_zeropp.json":
            continue  # ZeRO++ kernels are CUDA only
        torch.manual_seed(0)
        model = GPT(TINY)
        eng = sds.initialize(model=model, model_parameters=model.parameters(), config=os.path.join(CONFIGS, f))[0]
        losses = []
        for s in range(2):
            x, y = data.batch(s, ctx.rank, 4, TINY.seq_len)
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
            losses.append(float(loss))
        ad = sds.get_adapter(eng)
        out[f] = {
            "sdpq": ad is not None,
            "layout": ad and ad.topology.layout,
            "optimizer": type(eng.optimizer.optimizer).__module__,
            "master_dtype": str(_master(eng.optimizer).dtype),
            "finite": all(map(lambda v: v == v and abs(v) < 1e4, losses)),
        }
        eng.destroy()
    return out


def test_ds_configs_train(dist):
    r = dist.run(_configs_fn, 4, 2, timeout=TIMEOUT)[0]  # topology "auto": LOCAL_WORLD_SIZE=2 -> 2x2
    assert r["zero3.json"] == {
        "sdpq": False,
        "layout": None,
        "optimizer": "torch.optim.adamw",
        "master_dtype": "torch.float32",
        "finite": True,
    }
    assert r["zero3_sdpq.json"] == {
        "sdpq": True,
        "layout": "2x2",
        "optimizer": "sdpq.optim.adamw",
        "master_dtype": "torch.bfloat16",
        "finite": True,
    }
    assert r["zero3_sdpq_optimizer.json"]["optimizer"] == "sdpq.optim.adamw"
    assert r["zero2_sdpq.json"] == {  # ZeRO-2: sdpq's AdamW on DeepSpeed's fp32 master partitions
        "sdpq": True,
        "layout": "2x2",
        "optimizer": "sdpq.optim.adamw",
        "master_dtype": "torch.float32",
        "finite": True,
    }
    for f in ("zero3_sdpq_weights.json", "zero3_sdpq_gradients.json"):
        assert r[f] == {
            "sdpq": True,
            "layout": "2x2",
            "optimizer": "torch.optim.adamw",
            "master_dtype": "torch.float32",
            "finite": True,
        }
