"""sdpq.deepspeed: DeepSpeed ZeRO-3 integration on 4 gloo ranks (2 simulated nodes x 2).

Tiny GPT, a few steps per run. The 200-step convergence runs are benchmarks/deepspeed_convergence.py.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import pytest

deepspeed = pytest.importorskip("deepspeed")

# deepspeed.runtime.zero.stage3 and torch._dynamo are imported here, before the worker pools fork, so that
# ranks do not each import them (~10 s).
import deepspeed.runtime.zero.stage3  # noqa: E402,F401,F811
import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401
from deepspeed_common import EXACT, FULL_BLOCK, SPEC, TIMEOUT, TINY, build_engine, fresh_deepspeed, run4, train_fn  # noqa: E402

import sdpq.integrations.deepspeed as sds  # noqa: E402
from sdpq.config import Config  # noqa: E402
from sdpq.quant import QuantSpec  # noqa: E402

# ----------------------------------------------------------------------------- exact = plain ZeRO-3


@pytest.mark.parametrize("bf16", [False, True])
def test_exact_modes_bitwise_equal_plain_zero3(dist, bf16):
    plain = run4(dist, dataclasses.replace(SPEC, bf16=bf16))
    exact = run4(dist, dataclasses.replace(SPEC, bf16=bf16, sdpq=EXACT))
    for p, e in zip(plain, exact):
        assert p["extra"]["sdpq"] is None and e["extra"]["sdpq"] is not None
        assert p["losses"] == e["losses"]  # every step, bitwise (gradient accumulation 2, clipping 1.0)
        assert p["val"] == e["val"]
        assert p["extra"]["partition_digests"] == e["extra"]["partition_digests"]
    # The exact run went through sdpq's collectives (that is where the baseline bytes come from).
    c = exact[0]["comm"]
    assert c["weights"]["inter"]["bytes"] > 0 and c["gradients"]["inter"]["bytes"] > 0


def test_sdpq_adamw_fp32_native_equals_deepspeed_adamw(dist):
    block = {
        "weights": {"mode": "exact"},
        "gradients": {"mode": "exact"},
        "optimizer": {"states": "fp32", "master": "native"},
    }
    plain = run4(dist, SPEC)
    ours = run4(dist, dataclasses.replace(SPEC, sdpq=block))
    assert ours[0]["extra"]["optimizer"] == "sdpq.optim.adamw.AdamW"
    assert plain[0]["extra"]["optimizer"].endswith("AdamW") and "sdpq" not in plain[0]["extra"]["optimizer"]
    for p, o in zip(plain, ours):
        assert o["losses"] == pytest.approx(p["losses"], rel=1e-6, abs=0)
        assert o["val"] == pytest.approx(p["val"], rel=1e-5)


# ----------------------------------------------------------------------------- the full method


def test_full_sdpq_trains_and_references_identical_across_holders(dist):
    spec = dataclasses.replace(SPEC, steps=5, bf16=True)
    plain = run4(dist, spec)
    full = run4(dist, dataclasses.replace(spec, sdpq=FULL_BLOCK))
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
    exact = run4(dist, dataclasses.replace(spec, sdpq=EXACT))
    assert full[0]["cross"] < exact[0]["cross"] / 3
    c = full[0]["comm"]
    # 4.25 + the padding that keeps groups inside parameters (tiny model: 16-element bias chunks)
    assert c["gradients"]["inter"]["bits_per_element"] < 4.6
    # bf16 weights = MCF high part (one copy) + bf16 low part + FP8 m and v + metadata, vs 2 + 4 + 8.
    assert plain[0]["opt_bytes"] == pytest.approx(14, abs=0.01)
    assert full[0]["opt_bytes"] < 6.3
    # The opt-in workaround (workarounds.deepspeed_alias_bf16_master) only drops ZeRO-3's second
    # bf16 master copy: without it, the same losses bit for bit and 2 bytes per parameter more.
    unaliased = run4(dist, dataclasses.replace(spec, sdpq={k: v for k, v in FULL_BLOCK.items() if k != "workarounds"}))
    assert [r["losses"] for r in unaliased] == [r["losses"] for r in full]
    assert unaliased[0]["opt_bytes"] == pytest.approx(full[0]["opt_bytes"] + 2, abs=0.01)


def test_direct_weights_and_gradients_alone(dist):
    spec = dataclasses.replace(SPEC, steps=3)
    plain = run4(dist, spec)
    direct = run4(
        dist,
        dataclasses.replace(
            spec,
            sdpq={
                "weights": {"mode": "direct", "bits": 8},
                "gradients": {"mode": "exact"},
                "optimizer": {"enabled": False},
            },
        ),
    )
    grads = run4(dist, dataclasses.replace(spec, sdpq={"weights": {"mode": "exact"}, "optimizer": {"enabled": False}}))
    for p, d, g in zip(plain, direct, grads):
        assert d["losses"] != p["losses"] and g["losses"] != p["losses"]  # they did quantize
        for q in (d, g):
            assert all(abs(a - b) / a < 0.01 for a, b in zip(p["losses"], q["losses"]))
    # int8 codes + fp32 scales; the tiny model's many small shards pay a scale each.
    assert direct[0]["comm"]["weights"]["inter"]["bits_per_element"] < 9
    assert "gradients" in grads[0]["comm"] and grads[0]["comm"]["gradients"]["inter"]["bits_per_element"] < 4.6


# ----------------------------------------------------------------------------- checkpoints


def test_resume_in_fresh_processes_is_bitwise(dist, tmp_path):
    block = {"weights": {"mode": "diff"}, "gradients": {"error_feedback": True}}  # stochastic rounding, fp8, MCF
    spec = dataclasses.replace(SPEC, steps=6, bf16=True, sdpq=block, checkpoint_dir=str(tmp_path / "ckpt"))
    whole = run4(dist, dataclasses.replace(spec, save_at=3))
    dist.discard(4)  # the next run forks new processes
    resumed = run4(dist, dataclasses.replace(spec, resume=True))
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
        out = train_fn(ctx, spec)
    out["warned"] = [str(w.message) for w in caught if "sdpq" in str(w.message)]
    return out


def test_resume_on_other_layouts(dist, tmp_path):
    """Saved on 2 nodes x 2, resumed on 4 x 1 and 1 x 4 (same world: DeepSpeed loads its
    partitions; sdpq's per-layout state is rebuilt with one warning per rank and the curve continues) and
    on 2 x 1 (another world size: DeepSpeed's ZeRO-3 files do not reshard; the load stops with a
    message that says so and what to do)."""
    block = {"weights": {"mode": "diff"}, "gradients": {"error_feedback": True}}
    spec = dataclasses.replace(SPEC, steps=6, bf16=True, sdpq=block, checkpoint_dir=str(tmp_path / "ckpt"))
    whole = run4(dist, dataclasses.replace(spec, save_at=3))[0]["losses"]
    for rpn in (1, 4):
        dist.discard(4)
        res = dist.run(_resume_fn, 4, rpn, dataclasses.replace(spec, resume=True, ranks_per_node=rpn), timeout=TIMEOUT)
        losses = res[0]["losses"]
        assert all(len(r["warned"]) == 1 for r in res), [r["warned"] for r in res]  # every rank, once
        for rank, r in enumerate(res):  # each names its own problem first
            own = f"rank {rank}: {sds.STATE_FILE.format(rank=rank)} was saved on rank {rank} of layout 2x2"
            assert r["warned"][0].split(": ", 2)[2].startswith(own), r["warned"]
            assert "restart from zero" in r["warned"][0], r["warned"]
        rel = max(abs(a - b) / b for a, b in zip(losses[3:], whole[3:]))
        print(f"DeepSpeed 2x2 -> {4 // rpn}x{rpn}: losses {losses[3:]} vs {whole[3:]}, max rel diff {rel:.4f}")
        # Only the quantization noise differs (the resumed run refreshed its reference exactly):
        # 0.005 at 4-bit differences, scaled with the code step (absmax / qmax) of the default's.
        assert rel < 0.005 * 7 / QuantSpec(Config().weights.bits, 32).qmax, (rpn, losses, whole)
    dist.discard(4)
    with pytest.raises(Exception, match="DP world size of 4 but the current world size is 2"):
        dist.run(train_fn, 2, 1, dataclasses.replace(spec, resume=True, ranks_per_node=1), None, timeout=TIMEOUT)


# ----------------------------------------------------------------------------- weight versions


def _capture(engine) -> dict:
    """name -> list of the weights every forward computed with (hooks run after ZeRO's fetch)."""
    seen: dict = {}
    names = {id(p): n for n, p in engine.module.named_parameters()}  # a tied weight has one name
    for m in engine.module.modules():
        for p in m.parameters(recurse=False):
            key = names[id(p)]

            def hook(mod, args, p=p, key=key):
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
    fresh_deepspeed()
    # 4-bit differences: the invalidation is the same at every width, and the bound below is 4-bit's
    block = {"weights": {"mode": "diff", "bits": 4}, "gradients": {"mode": "exact"}, "optimizer": {"enabled": False}}
    eng = build_engine(block)
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
    out["edited"] = (
        bool((seen["blocks.0.fc.weight"][-1] == 0.0125).all()),
        bool((seen["blocks.0.fc.bias"][-1] == -0.5).all()),
    )
    # 3. A checkpoint without sdpq's state (e.g. saved by plain DeepSpeed): references resync exactly.
    eng.save_checkpoint(ckpt, tag="t")
    import torch.distributed as tdist

    tdist.barrier()
    os.remove(os.path.join(ckpt, "t", sds.STATE_FILE.format(rank=ctx.rank)))
    tdist.barrier()
    eng2 = build_engine(block)
    seen2 = _capture(eng2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng2.load_checkpoint(ckpt, tag="t")
    out["warned"] = any("refreshed exactly" in str(x.message) for x in w)
    loaded = _truth(eng2)
    # Parameters ZeRO keeps gathered were re-gathered at the end of the load, exactly...
    out["persistent_exact"] = [
        n for n, p in eng2.module.named_parameters() if p.ds_persist and not torch.equal(p.data, loaded[n])
    ]
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
    out["restored"] = (
        stage3.reduce_scatter_coalesced is cc.reduce_scatter_coalesced,
        sds.get_adapter(eng) is None,
        ad._undo == [],
        all(
            getattr(p.all_gather_coalesced, "__self__", None) is None
            and not isinstance(p.all_gather, functools.partial)
            and not isinstance(p.partition, functools.partial)
            for p in eng.module.parameters()
        ),
        "_reassign_or_swap_out_partitioned_parameters" not in eng.optimizer.__dict__,
    )
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
