"""sdpq.deepspeed: DeepSpeed ZeRO-3 integration on 4 gloo ranks (2 simulated nodes x 2).

Tiny GPT, a few steps per run. The 200-step convergence runs are benchmarks/deepspeed_convergence.py.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import warnings

import pytest

deepspeed = pytest.importorskip("deepspeed")

import torch  # noqa: E402

import sdpq  # noqa: E402

import sdpq.integrations.deepspeed as sds  # noqa: E402
from sdpq.config import ConfigError  # noqa: E402
from sdpq.integrations._ds_groups import reset_deepspeed_groups  # noqa: E402
from sdpq.train.model import GPTConfig  # noqa: E402
from sdpq.train.run import RunSpec  # noqa: E402

# Imported here, before the worker pools fork, so that ranks do not each import them (~10 s).
import deepspeed.runtime.zero.stage3  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401

TIMEOUT = 180
TINY = GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=32)
# Parameters under 1000 elements (biases, norms) stay gathered (ZeRO-3 "persistent", gathered
# once per step after the optimizer), larger ones are gathered per module in forward/backward:
# both gather paths are exercised.
ZERO = {"zero_optimization": {"stage3_param_persistence_threshold": 1000}}
SPEC = RunSpec(backend="deepspeed", model=TINY, steps=4, micro_batch=2, grad_accum=2, lr=3e-3, warmup=2,
               eval_batches=1, log_every=0, ranks_per_node=2)
EXACT = {"weights": {"mode": "exact"}, "gradients": {"mode": "exact"}, "optimizer": {"enabled": False}}
# A non-empty block; every section left out takes its defaults: the full method (two-level
# gradients, FP8 + MCF AdamW). An empty block would be plain DeepSpeed.
FULL_BLOCK = {"weights": {"mode": "diff"}}


def _fresh_deepspeed() -> None:
    """DeepSpeed caches process groups in module globals; the harness destroys the previous run's
    groups, so forget them (a real job has one engine per process)."""
    reset_deepspeed_groups()
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)


def _train(ctx, spec, overrides=None):
    from sdpq.train import deepspeed_backend

    _fresh_deepspeed()
    r = deepspeed_backend.train(spec, checks=True, ds_overrides=overrides if overrides is not None else ZERO)
    return {"losses": r.losses, "val": r.val_loss, "extra": {k: v for k, v in r.extra.items() if k != "step_times"},
            "comm": r.comm["per_rank"][ctx.rank], "cross": r.cross_node_bytes_per_step,
            "opt_bytes": r.optimizer_bytes_per_param}


def _run(dist, spec, overrides=None):
    return dist.run(_train, 4, 2, spec, overrides, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- exact = plain ZeRO-3


@pytest.mark.parametrize("bf16", [False, True])
def test_exact_modes_bitwise_equal_plain_zero3(dist, bf16):
    plain = _run(dist, dataclasses.replace(SPEC, bf16=bf16))
    exact = _run(dist, dataclasses.replace(SPEC, bf16=bf16, sdpq=EXACT))
    for p, e in zip(plain, exact):
        assert p["extra"]["sdpq"] is None and e["extra"]["sdpq"] is not None
        assert p["losses"] == e["losses"]  # every step, bitwise (gradient accumulation 2, clipping 1.0)
        assert p["val"] == e["val"]
        assert p["extra"]["partition_digests"] == e["extra"]["partition_digests"]
    # The exact run went through sdpq's collectives (that is where the baseline bytes come from).
    c = exact[0]["comm"]
    assert c["weights"]["inter"]["bytes"] > 0 and c["gradients"]["inter"]["bytes"] > 0


def test_sdpq_adamw_fp32_native_equals_deepspeed_adamw(dist):
    block = {"weights": {"mode": "exact"}, "gradients": {"mode": "exact"},
             "optimizer": {"states": "fp32", "master": "native"}}
    plain = _run(dist, SPEC)
    ours = _run(dist, dataclasses.replace(SPEC, sdpq=block))
    assert ours[0]["extra"]["optimizer"] == "sdpq.optim.adamw.AdamW"
    assert plain[0]["extra"]["optimizer"].endswith("AdamW") and "sdpq" not in plain[0]["extra"]["optimizer"]
    for p, o in zip(plain, ours):
        assert o["losses"] == pytest.approx(p["losses"], rel=1e-6, abs=0)
        assert o["val"] == pytest.approx(p["val"], rel=1e-5)


# ----------------------------------------------------------------------------- the full method


def test_full_sdpq_trains_and_references_identical_across_holders(dist):
    spec = dataclasses.replace(SPEC, steps=5, bf16=True)
    plain = _run(dist, spec)
    full = _run(dist, dataclasses.replace(spec, sdpq=FULL_BLOCK))
    ex = full[0]["extra"]
    assert ex["optimizer"] == "sdpq.optim.adamw.AdamW"
    assert ex["sdpq"]["optimizer"] == {**ex["sdpq"]["optimizer"], "states": "fp8", "master": "mcf", "enabled": True}
    assert ex["ds_config"]["bf16"]["enabled"]
    for p, f in zip(plain, full):
        assert all(abs(a - b) / a < 0.02 for a, b in zip(p["losses"], f["losses"])), (p["losses"], f["losses"])
    # Every parameter has a reference; holders with the same local index hold bitwise equal ones.
    refs = [r["extra"]["references"] for r in full]
    assert set(refs[0]) == set(full[0]["extra"]["partition_digests"])
    for ds_id in refs[0]:
        by_local = {}
        for r in refs:
            local, digest = r[ds_id]
            assert digest is not None
            by_local.setdefault(local, set()).add(digest)
        assert all(len(d) == 1 for d in by_local.values()), (ds_id, by_local)
        assert len({next(iter(d)) for d in by_local.values()}) == 2  # two different halves
    # Cross-node bytes: well below the exact baseline (weights once per step at 4 bits, grads 4 bits).
    exact = _run(dist, dataclasses.replace(spec, sdpq=EXACT))
    assert full[0]["cross"] < exact[0]["cross"] / 3
    c = full[0]["comm"]
    assert c["gradients"]["inter"]["bits_per_element"] < 4.5
    # bf16 weights = MCF high part (one copy) + bf16 low part + FP8 m and v + metadata, vs 2 + 4 + 8.
    assert plain[0]["opt_bytes"] == pytest.approx(14, abs=0.01)
    assert full[0]["opt_bytes"] < 6.3


def test_direct_weights_and_gradients_alone(dist):
    spec = dataclasses.replace(SPEC, steps=3)
    plain = _run(dist, spec)
    direct = _run(dist, dataclasses.replace(spec, sdpq={"weights": {"mode": "direct", "bits": 8},
                                                         "gradients": {"mode": "exact"},
                                                         "optimizer": {"enabled": False}}))
    grads = _run(dist, dataclasses.replace(spec, sdpq={"weights": {"mode": "exact"}, "optimizer": {"enabled": False}}))
    for p, d, g in zip(plain, direct, grads):
        assert d["losses"] != p["losses"] and g["losses"] != p["losses"]  # they did quantize
        for q in (d, g):
            assert all(abs(a - b) / a < 0.01 for a, b in zip(p["losses"], q["losses"]))
    # int8 codes + fp32 scales; the tiny model's many small shards pay a scale each.
    assert direct[0]["comm"]["weights"]["inter"]["bits_per_element"] < 9
    assert "gradients" in grads[0]["comm"] and grads[0]["comm"]["gradients"]["inter"]["bits_per_element"] < 4.5


# ----------------------------------------------------------------------------- checkpoints


def test_resume_in_fresh_processes_is_bitwise(dist, tmp_path):
    block = {"weights": {"mode": "diff"}, "gradients": {"error_feedback": True}}  # stochastic rounding, fp8, MCF
    spec = dataclasses.replace(SPEC, steps=6, bf16=True, sdpq=block, checkpoint_dir=str(tmp_path / "ckpt"))
    whole = _run(dist, dataclasses.replace(spec, save_at=3))
    dist.discard(4)  # the next run forks new processes
    resumed = _run(dist, dataclasses.replace(spec, resume=True))
    assert os.path.isfile(tmp_path / "ckpt" / "step3" / "sdpq_rank00003.pt")
    for w, r in zip(whole, resumed):
        assert r["extra"]["first_step"] == 4
        assert r["losses"][3:] == w["losses"][3:]
        assert r["extra"]["partition_digests"] == w["extra"]["partition_digests"]
        assert r["extra"]["references"] == w["extra"]["references"]
        assert r["val"] == w["val"]


def _resume_fn(ctx, spec):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        out = _train(ctx, spec)
    out["warned"] = [str(w.message) for w in caught if "sdpq" in str(w.message)]
    return out


def test_resume_on_other_layouts(dist, tmp_path):
    """Saved on 2 nodes x 2, resumed on 4 x 1 and 1 x 4 (same world: DeepSpeed loads its
    partitions; sdpq's per-layout state is rebuilt with one warning and the curve continues) and
    on 2 x 1 (another world size: DeepSpeed's ZeRO-3 files do not reshard; the load stops with a
    message that says so and what to do)."""
    block = {"weights": {"mode": "diff"}, "gradients": {"error_feedback": True}}
    spec = dataclasses.replace(SPEC, steps=6, bf16=True, sdpq=block, checkpoint_dir=str(tmp_path / "ckpt"))
    whole = _run(dist, dataclasses.replace(spec, save_at=3))[0]["losses"]
    for rpn in (1, 4):
        dist.discard(4)
        res = dist.run(_resume_fn, 4, rpn, dataclasses.replace(spec, resume=True, ranks_per_node=rpn), timeout=TIMEOUT)
        losses = res[0]["losses"]
        assert len(res[0]["warned"]) == 1 and not any(r["warned"] for r in res[1:]), [r["warned"] for r in res]
        assert "layout 2x2" in res[0]["warned"][0] and "restart from zero" in res[0]["warned"][0], res[0]["warned"]
        rel = max(abs(a - b) / b for a, b in zip(losses[3:], whole[3:]))
        print(f"DeepSpeed 2x2 -> {4 // rpn}x{rpn}: losses {losses[3:]} vs {whole[3:]}, max rel diff {rel:.4f}")
        assert rel < 0.005, (rpn, losses, whole)
    dist.discard(4)
    with pytest.raises(Exception, match="DP world size of 4 but the current world size is 2"):
        dist.run(_train, 2, 1, dataclasses.replace(spec, resume=True, ranks_per_node=1), None, timeout=TIMEOUT)


@pytest.mark.parametrize("option", ["offload_optimizer", "offload_param"])
def test_cpu_offload_with_the_block_keeps_the_loss(dist, option):
    """ZeRO-3 CPU offload with the block: the same losses as the same option without it (sdpq's
    AdamW steps the offloaded partitions; the MCF master cannot be offloaded, see below)."""
    zero = {**ZERO["zero_optimization"], option: {"device": "cpu"}}
    block = {**FULL_BLOCK, "optimizer": {"master": "native"}} if option == "offload_optimizer" else FULL_BLOCK
    plain = _run(dist, dataclasses.replace(SPEC, bf16=True), {"zero_optimization": zero})
    dist.discard(4)
    ours = _run(dist, dataclasses.replace(SPEC, bf16=True, sdpq=block), {"zero_optimization": zero})
    assert ours[0]["extra"]["sdpq"] is not None
    for p, q in zip(plain[0]["losses"], ours[0]["losses"]):
        assert abs(q - p) / p < 0.01, (plain[0]["losses"], ours[0]["losses"])


def test_offloaded_mcf_master_and_fp16_mcf_are_refused_at_startup():
    base = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(sds.IncompatibleConfigError, match=r"offload_optimizer with sdpq.optimizer.master 'mcf'"):
        sds.check_config(base, sdpq.Config.from_deepspeed({**base, "sdpq": FULL_BLOCK}))
    fp16 = {**base, "bf16": {"enabled": False}, "fp16": {"enabled": True},
            "zero_optimization": {"stage": 3}}
    with pytest.raises(sds.IncompatibleConfigError, match=r"'mcf'.*needs \"bf16\""):
        sds.check_config(fp16, sdpq.Config.from_deepspeed({**fp16, "sdpq": FULL_BLOCK}))


def test_statistics_reach_deepspeed_monitor_writers(dist, tmp_path):
    """A "csv_monitor" section in the DeepSpeed config: sdpq's per-step figures land in its files
    next to DeepSpeed's own events (the same writers serve TensorBoard, W&B and Comet)."""
    import csv

    out = str(tmp_path / "monitor")
    overrides = {**ZERO, "csv_monitor": {"enabled": True, "output_path": out, "job_name": "run"}}
    _run(dist, dataclasses.replace(SPEC, bf16=True, sdpq=FULL_BLOCK), overrides)
    rows = {}
    for name in ("sdpq_gradients_inter_bytes", "sdpq_gradients_inter_bits_per_element",
                 "sdpq_weights_inter_bits_per_element", "sdpq_skipped_steps"):
        with open(os.path.join(out, "run", name + ".csv")) as f:
            rows[name] = [float(r[1]) for r in list(csv.reader(f))[1:]]
    assert len(rows["sdpq_skipped_steps"]) == SPEC.steps  # one event per optimizer step
    assert all(b > 0 for b in rows["sdpq_gradients_inter_bytes"])
    assert all(4.0 < b < 4.5 for b in rows["sdpq_gradients_inter_bits_per_element"])
    assert all(4.0 < b < 16.5 for b in rows["sdpq_weights_inter_bits_per_element"])  # first refresh exact


# ----------------------------------------------------------------------------- weight versions


def _engine(block, *, threshold=1000, bf16=False, lr=3e-3):
    from sdpq.train import deepspeed_backend
    from sdpq.train.model import GPT

    torch.manual_seed(0)
    model = GPT(TINY)
    spec = dataclasses.replace(SPEC, sdpq=block, bf16=bf16, lr=lr, grad_accum=1)
    cfg = deepspeed_backend.ds_config(spec, {"zero_optimization": {"stage3_param_persistence_threshold": threshold}})
    return sds.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _capture(engine) -> dict:
    """name -> list of the weights every forward computed with (hooks run after ZeRO's fetch)."""
    seen: dict = {}
    names = {id(p): n for n, p in engine.module.named_parameters()}  # a tied weight has one name
    for m in engine.module.modules():
        for p in m.parameters(recurse=False):
            def hook(mod, args, p=p, key=names[id(p)]):
                seen.setdefault(key, []).append(p.detach().clone())
            m.register_forward_pre_hook(hook)
    return seen


def _truth(engine) -> dict:
    """The exact full weights, gathered from the ZeRO partitions with a plain all-gather."""
    import torch.distributed as tdist

    out = {}
    for name, p in engine.module.named_parameters():
        full = torch.empty(p.ds_tensor.numel() * tdist.get_world_size(), dtype=p.ds_tensor.dtype)
        tdist.all_gather_into_tensor(full, p.ds_tensor.data.contiguous())
        out[name] = full[: p.ds_numel].view(p.ds_shape)
    return out


def _steps(engine, rank, n, start=0):
    from sdpq.train.data import TokenData

    data = TokenData.stdlib()
    for s in range(start, start + n):
        x, y = data.batch(s, rank, 2, TINY.seq_len)
        engine.backward(engine(x, y))
        engine.step()


def _eval(engine, rank):
    from sdpq.train.data import TokenData

    x, y = TokenData.stdlib().batch(0, rank, 2, TINY.seq_len, split="val")
    engine.eval()
    with torch.no_grad():
        loss = float(engine(x, y))
    engine.train()
    return loss


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _versions_fn(ctx, ckpt):
    _fresh_deepspeed()
    block = {"weights": {"mode": "diff"}, "gradients": {"mode": "exact"}, "optimizer": {"enabled": False}}
    eng = _engine(block)
    seen = _capture(eng)
    out = {}
    # 1. After an optimizer step, the first gathers happen in eval under no_grad: current weights.
    _steps(eng, ctx.rank, 2)
    prev = {k: v.clone() for k, v in _truth(eng).items()}
    _steps(eng, ctx.rank, 1, start=2)
    now = _truth(eng)
    seen.clear()
    _eval(eng, ctx.rank)
    out["eval_err"] = {k: _rel(seen[k][-1], now[k]) for k in seen}
    out["step_change"] = {k: _rel(prev[k], now[k]) for k in seen}
    # 2. A modification outside training (GatheredParameters with a modifier rank): exact resync.
    m = eng.module.blocks[0]
    with deepspeed.zero.GatheredParameters([m.fc.weight, m.fc.bias], modifier_rank=0):
        if ctx.rank == 0:
            m.fc.weight.data.fill_(0.0125)
            m.fc.bias.data.fill_(-0.5)
    seen.clear()
    _eval(eng, ctx.rank)
    out["edited"] = (bool((seen["blocks.0.fc.weight"][-1] == 0.0125).all()),
                     bool((seen["blocks.0.fc.bias"][-1] == -0.5).all()))
    # 3. A checkpoint without sdpq's state (e.g. saved by plain DeepSpeed): references resync exactly.
    eng.save_checkpoint(ckpt, tag="t")
    import torch.distributed as tdist

    tdist.barrier()
    os.remove(os.path.join(ckpt, "t", sds.STATE_FILE.format(rank=ctx.rank)))
    tdist.barrier()
    eng2 = _engine(block)
    seen2 = _capture(eng2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng2.load_checkpoint(ckpt, tag="t")
    out["warned"] = any("refreshed exactly" in str(x.message) for x in w)
    loaded = _truth(eng2)
    # Parameters ZeRO keeps gathered were re-gathered at the end of the load, exactly...
    out["persistent_exact"] = [n for n, p in eng2.module.named_parameters()
                               if p.ds_persist and not torch.equal(p.data, loaded[n])]
    # ... and the others are gathered exactly at their next use.
    _eval(eng2, ctx.rank)
    out["after_load_exact"] = all(torch.equal(seen2[k][-1], loaded[k]) for k in seen2)
    # 4. Teardown restores DeepSpeed.
    import deepspeed.runtime.comm.coalesced_collectives as cc
    import deepspeed.runtime.zero.stage3 as stage3

    ad = sds.get_adapter(eng)
    eng.destroy()
    out["one_left"] = stage3.reduce_scatter_coalesced is not cc.reduce_scatter_coalesced
    eng2.destroy()
    out["restored"] = (stage3.reduce_scatter_coalesced is cc.reduce_scatter_coalesced,
                       sds.get_adapter(eng) is None, ad._undo == [],
                       all(getattr(p.all_gather_coalesced, "__self__", None) is None
                           and not isinstance(p.all_gather, functools.partial)
                           and not isinstance(p.partition, functools.partial) for p in eng.module.parameters()),
                       "_reassign_or_swap_out_partitioned_parameters" not in eng.optimizer.__dict__)
    return out


def test_reference_invalidation_step_eval_edit_and_load(dist, tmp_path):
    res = dist.run(_versions_fn, 4, 2, str(tmp_path), timeout=TIMEOUT)
    for r in res:
        assert len(r["eval_err"]) == len(list(TINY_NAMES))
        for k, err in r["eval_err"].items():
            # 4-bit difference of one step's update: far closer to the new weights than the old are.
            assert err < 0.2 * r["step_change"][k], (k, err, r["step_change"][k])
        assert r["edited"] == (True, True)
        assert r["warned"] if r is res[0] else True
        assert r["after_load_exact"] and r["persistent_exact"] == []
        assert r["one_left"] and r["restored"] == (True,) * 5


def _names():
    from sdpq.train.model import GPT

    return [n for n, _ in GPT(TINY).named_parameters()]


TINY_NAMES = _names()


# ----------------------------------------------------------------------------- start-up checks


def _disagree_fn(ctx):
    _fresh_deepspeed()
    block = {"weights": {"mode": "diff"}, "topology": {"ranks_per_node": 2}}
    if ctx.rank == 3:  # a node with a stale config file
        block["gradients"] = {"seed": 9}
    try:
        _engine(block, bf16=True)
    except ConfigError as e:
        return str(e)
    return None


def _bypass_fn(ctx, via):
    import deepspeed as ds

    from sdpq.train import deepspeed_backend
    from sdpq.train.model import GPT

    _fresh_deepspeed()
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
        sds.initialize(model=model, config={**base, "sdpq": {"gradients": {"inter_bits": 3}}})
    with pytest.raises(ConfigError, match=r"sdpq\.wieghts: unknown key"):
        sds.initialize(model=model, config={**base, "sdpq": {"wieghts": {}}})


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage_0_to_2_with_a_block_is_a_clear_error(stage):
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
           "sdpq": {"gradients": {"mode": "two_level"}}}
    with pytest.raises(sds.IncompatibleConfigError, match=f"ZeRO stage 3.*stage {stage}"):
        sds.initialize(model=torch.nn.Linear(4, 4), config=cfg)


def test_zeropp_flags_with_a_block_are_rejected():
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "zero_quantized_weights": True},
           "sdpq": {"weights": {"mode": "diff"}}}
    with pytest.raises(sds.IncompatibleConfigError, match="zero_quantized_weights"):
        sds.initialize(model=torch.nn.Linear(4, 4), config=cfg)


def test_version_check(monkeypatch):
    assert sds.check_deepspeed_version("0.19.8") == "0.19.8"
    assert sds.check_deepspeed_version("0.19.12+g1234") == "0.19.12+g1234"
    for bad in ("0.18.3", "0.19.7", "0.20.0", "1.0.0"):
        with pytest.raises(sds.DeepSpeedVersionError, match=r"tested with DeepSpeed >=0\.19\.8,<0\.20.*"
                                                             r"SDPQ_ALLOW_UNTESTED_DEEPSPEED"):
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

    _fresh_deepspeed()
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
            cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
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
    expected = {"zero3.json", "zero3_sdpq.json", "zero3_sdpq_weights.json", "zero3_sdpq_gradients.json",
                "zero3_sdpq_optimizer.json", "zero3_zeropp.json"}
    assert expected <= set(CONFIG_FILES)
    for f in CONFIG_FILES:
        assert f"`{f}`" in readme
        ds = json.load(open(os.path.join(CONFIGS, f)))
        cfg = Config.from_deepspeed(ds)
        if f in ("zero3.json", "zero3_zeropp.json"):
            assert cfg is None
            continue
        out = sds.prepare_config(ds, cfg, {})
        assert "sdpq" not in out and out["zero_optimization"]["stage"] == 3
    zpp = json.load(open(os.path.join(CONFIGS, "zero3_zeropp.json")))
    with pytest.raises(sds.IncompatibleConfigError, match="ZeRO\\+\\+"):
        sds.prepare_config({**zpp, "sdpq": {"weights": {}}}, Config(), {})


def _configs_fn(ctx):
    from sdpq.train.data import TokenData
    from sdpq.train.model import GPT

    _fresh_deepspeed()
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
        out[f] = {"sdpq": ad is not None, "layout": ad and ad.topology.layout,
                  "optimizer": type(eng.optimizer.optimizer).__module__,
                  "master_dtype": str(eng.optimizer.fp32_partitioned_groups_flat[0].dtype),
                  "finite": all(map(lambda v: v == v and abs(v) < 1e4, losses))}
        eng.destroy()
    return out


def test_ds_configs_train(dist):
    r = dist.run(_configs_fn, 4, 2, timeout=TIMEOUT)[0]  # topology "auto": LOCAL_WORLD_SIZE=2 -> 2x2
    assert r["zero3.json"] == {"sdpq": False, "layout": None, "optimizer": "torch.optim.adamw",
                               "master_dtype": "torch.float32", "finite": True}
    assert r["zero3_sdpq.json"] == {"sdpq": True, "layout": "2x2", "optimizer": "sdpq.optim.adamw",
                                    "master_dtype": "torch.bfloat16", "finite": True}
    assert r["zero3_sdpq_optimizer.json"]["optimizer"] == "sdpq.optim.adamw"
    for f in ("zero3_sdpq_weights.json", "zero3_sdpq_gradients.json"):
        assert r[f] == {"sdpq": True, "layout": "2x2", "optimizer": "torch.optim.adamw",
                        "master_dtype": "torch.float32", "finite": True}


@pytest.mark.parametrize("var", ["LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"])
def test_auto_ranks_per_node_reads_every_launcher(monkeypatch, var):
    from sdpq.config import Config

    for v in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
              "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(ConfigError, match="ranks_per_node"):
        sds._ranks_per_node(Config())
    monkeypatch.setenv(var, "8")
    assert sds._ranks_per_node(Config()) == 8
    assert sds._ranks_per_node(Config.from_dict({"topology": {"ranks_per_node": 2}})) == 2
