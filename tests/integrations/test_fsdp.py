"""sdpq.fsdp (FSDP2 integration) on 4 real gloo ranks as 2 simulated nodes x 2.

Properties asserted (tiny GPT, a few steps each):
- quantization off (weights and gradients "exact") is bitwise plain FSDP2: losses and every
  rank's final shards, in every supported setup (reshard_after_forward True/False, mixed
  precision with fp32/bf16 reduce, bf16 model, gradient accumulation, frozen parameters, tied
  embeddings, HSDP with the shard dim inside or across nodes, activation checkpointing with
  torch.compile of every block);
- quantized: every rank's forward used bitwise identical weights at every step, every holder
  of a weight reference holds it bitwise identically, the loss stays close to plain FSDP2;
- DCP save/resume reproduces the uninterrupted losses and shards bitwise;
- misuse is a clear error; remove() restores FSDP2's defaults; stale weights are detected.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from sdpq.comm import TopologyError
from sdpq.comm.topology import group_layout
from sdpq.config import Config
from sdpq.integrations import _fsdp_internals
from sdpq.quant import QuantSpec

WORLD, RPN = 4, 2  # 2 simulated nodes x 2 ranks
TINY = dict(n_layer=2, d_model=64, n_head=2, seq_len=32)
EXACT = {"weights": {"mode": "exact"}, "gradients": {"mode": "exact"}, "optimizer": {"enabled": False}}
QUANT = {
    "weights": {"mode": "diff", "verify_every": 2},
    "gradients": {"mode": "two_level"},
    "optimizer": {"enabled": False},
    "stats": {"error_sample_every": 1},
}
QUANT_MCF = {**QUANT, "optimizer": {"enabled": True, "states": "fp8", "master": "mcf"}}


# ----------------------------------------------------------------------------- rank functions


def _spec(ctx, sdpq, steps=4, **kw):
    from sdpq.train.model import GPTConfig
    from sdpq.train.run import RunSpec

    base = dict(
        model=GPTConfig(**TINY),
        sdpq=sdpq,
        steps=steps,
        micro_batch=2,
        warmup=2,
        lr=3e-3,
        eval_batches=0,
        log_every=0,
        ranks_per_node=ctx.ranks_per_node,
    )
    base.update(kw)
    return RunSpec(**base)


def _fsdp_kwargs(setup: dict) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    kw = {"reshard_after_forward": setup.get("reshard", True), "freeze": setup.get("freeze", ())}
    mesh = setup.get("mesh")
    if mesh == "hsdp":  # replicate across nodes, shard inside a node (the usual HSDP)
        kw["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    elif mesh == "hsdp_cross":  # replicate inside a node, shard across nodes
        kw["mesh"] = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("replicate", "shard"))
    if setup.get("ac_compile"):
        kw["per_block"] = _checkpoint_and_compile
    mp = setup.get("mp")
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if mp == "fp32" else torch.bfloat16
        )
    return kw


def _checkpoint_and_compile(block):
    """What torchtitan-style recipes do to each block before fully_shard: activation checkpointing,
    then torch.compile. aot_eager traces the block with dynamo and AOTAutograd as inductor does,
    without inductor's code generation (tens of seconds per rank on this machine; run once by
    hand, inductor gave the same losses within 3e-7)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    block = checkpoint_wrapper(block)
    block.compile(backend="aot_eager")
    return block


def _compare_runs(ctx, setup, configs, steps):
    """Train the same model/data under each sdpq config (None = plain FSDP2); per-run results."""
    from sdpq.train.fsdp_backend import train

    warnings.simplefilter("error", category=RuntimeWarning)  # StaleWeights/ReferenceMismatch fail the test
    spec_kw = {k: setup[k] for k in ("bf16", "grad_accum") if k in setup}
    out = []
    for cfg in configs:
        r = train(_spec(ctx, cfg, steps=steps, **spec_kw), checks=True, **_fsdp_kwargs(setup))
        out.append(
            {
                "losses": r.losses,
                "params": r.extra["param_digests"],
                "fwd": r.extra["forward_digests"],
                "refs": r.extra.get("references"),
                "comm": r.comm["per_rank"][ctx.rank],
                "skipped": r.extra["skipped_steps"],
                "optimizer": r.extra["optimizer"],
            }
        )
    return out


SETUPS = {
    "default": {},
    "no_reshard": {"reshard": False},
    "mp_bf16_fp32reduce": {"mp": "fp32"},
    "mp_bf16_bf16reduce": {"mp": "bf16"},
    "bf16_model": {"bf16": True},
    "grad_accum": {"grad_accum": 2},
    "frozen": {"freeze": ("wpe", "blocks.0.")},
    "hsdp": {"mesh": "hsdp"},
    "hsdp_cross_node_shard": {"mesh": "hsdp_cross"},
    "activation_checkpointing_and_compile": {"ac_compile": True},
}


@pytest.mark.parametrize("name", list(SETUPS))
def test_exact_is_bitwise_plain_fsdp2_and_quantized_invariants(dist, name):
    setup = SETUPS[name]
    steps = 4
    res = dist.run(_compare_runs, WORLD, RPN, setup, [None, EXACT, QUANT], steps, timeout=150)
    plain, exact, quant = (list(x) for x in zip(*res))  # [run][rank]
    # Quantization off == plain FSDP2, bitwise (exact averaging: comm sums, FSDP divides).
    assert exact[0]["losses"] == plain[0]["losses"]
    for r in range(WORLD):
        assert exact[r]["params"] == plain[r]["params"], f"rank {r}: shards differ from plain FSDP2"
    # Quantized: every rank's forward used identical weights, at every step.
    for step in range(steps):
        assert all(quant[r]["fwd"][step] == quant[0]["fwd"][step] for r in range(WORLD)), f"step {step + 1}"
    # Every holder of a reference holds it bitwise identically (holders share a local index);
    # HSDP's shard group lies inside one node: no reference there.
    for module in quant[0]["refs"]:
        holders: dict = {}
        for r in range(WORLD):
            local, digest = quant[r]["refs"][module]
            assert (digest is None) == (name == "hsdp")
            holders.setdefault(local, set()).add(digest)
        assert all(len(d) == 1 for d in holders.values()), f"{module}: {holders}"
    q, p = quant[0]["losses"], plain[0]["losses"]
    assert all(abs(a - b) / b < 0.03 for a, b in zip(q, p)), (q, p)
    assert q[-1] < q[0]
    # The gradient comm ran once per optimizer step and module (not per micro-step).
    links = quant[0]["comm"]["gradients"]
    calls = max(c["calls"] for c in links.values())
    modules = 2 if name == "frozen" else 3  # blocks.0 frozen: no gradients, no reduce-scatter
    assert calls == modules * steps, (calls, links)
    inter = quant[0]["comm"].get("weights", {}).get("inter")
    if name == "hsdp":
        # Shard group inside a node: nothing of sdpq's crosses nodes (FSDP's replicate all-reduce does).
        assert "inter" not in quant[0]["comm"]["gradients"] and inter is None
    else:
        assert quant[0]["comm"]["gradients"]["inter"]["bits_per_element"] < 6
        # Weights cross nodes once per step as 2-bit differences (the first refresh exact), instead
        # of in the compute dtype at every gather.
        exact_inter = exact[0]["comm"]["weights"]["inter"]
        assert inter["bytes"] < 0.5 * exact_inter["bytes"], (inter, exact_inter)


def test_bf16_model_with_sdpq_adamw_mcf(dist):
    pytest.importorskip("sdpq.optim")
    steps = 5
    res = dist.run(_compare_runs, WORLD, RPN, {"bf16": True}, [None, QUANT_MCF], steps, timeout=150)
    plain, quant = (list(x) for x in zip(*res))
    assert quant[0]["optimizer"].startswith("sdpq.optim.AdamW(states=fp8, master=mcf")
    assert quant[0]["skipped"] == 0
    for step in range(steps):
        assert all(quant[r]["fwd"][step] == quant[0]["fwd"][step] for r in range(WORLD))
    q, p = quant[0]["losses"], plain[0]["losses"]
    assert all(abs(a - b) / b < 0.03 for a, b in zip(q, p)), (q, p)


# ----------------------------------------------------------------------------- checkpoints


def _resume(ctx, cfg, path, bf16):
    from sdpq.train.fsdp_backend import train

    warnings.simplefilter("error", category=RuntimeWarning)
    full = train(_spec(ctx, cfg, steps=6, bf16=bf16, checkpoint_dir=path, save_at=3), checks=True)
    resumed = train(_spec(ctx, cfg, steps=6, bf16=bf16, checkpoint_dir=path, resume=True), checks=True)
    return (
        full.losses,
        resumed.losses,
        full.extra["param_digests"],
        resumed.extra["param_digests"],
        full.extra["references"],
        resumed.extra["references"],
    )


@pytest.mark.parametrize("cfg_name", ["quant_error_feedback", "quant_mcf"])
def test_dcp_resume_is_bitwise(dist, tmp_path, cfg_name):
    if cfg_name == "quant_mcf":
        pytest.importorskip("sdpq.optim")
        cfg, bf16 = QUANT_MCF, True
    else:  # stochastic rounding + error feedback: RNG states and residuals must be restored too
        cfg, bf16 = {**QUANT, "gradients": {"error_feedback": True}}, False
    res = dist.run(_resume, WORLD, RPN, cfg, str(tmp_path / "ckpt"), bf16, timeout=150)
    for r, (full, resumed, p_full, p_res, ref_full, ref_res) in enumerate(res):
        assert all(math.isnan(v) for v in resumed[:3])  # placeholders: steps 1-3 were not run
        assert resumed[3:] == full[3:], f"rank {r}: {full[3:]} vs {resumed[3:]}"
        assert p_res == p_full and ref_res == ref_full


def _save_only(ctx, cfg, path, bf16):
    from sdpq.train.fsdp_backend import train

    return train(_spec(ctx, cfg, steps=6, bf16=bf16, checkpoint_dir=path, save_at=3), checks=True).losses


def _resume_only(ctx, cfg, path, bf16):
    from sdpq.integrations.fsdp import ResumeLayoutWarning
    from sdpq.train.fsdp_backend import train

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResumeLayoutWarning)
        r = train(_spec(ctx, cfg, steps=6, bf16=bf16, checkpoint_dir=path, resume=True), checks=True)
    return r.losses, [str(w.message) for w in caught if issubclass(w.category, ResumeLayoutWarning)]


@pytest.mark.parametrize("cfg_name", ["quant_error_feedback", "quant_mcf"])
def test_dcp_resume_on_other_layouts_continues_the_curve(dist, tmp_path, cfg_name):
    """Saved on 2 nodes x 2, resumed on 4 x 1, 1 x 4 and 2 x 1: DCP reshards the model and the
    optimizer; sdpq's per-layout state is rebuilt (exact reference refresh, residuals from zero)
    with a warning on rank 0, and the loss continues the uninterrupted curve."""
    cfg, bf16 = (
        (QUANT_MCF, True) if cfg_name == "quant_mcf" else ({**QUANT, "gradients": {"error_feedback": True}}, False)
    )
    path = str(tmp_path / "ckpt")
    full = dist.run(_save_only, WORLD, RPN, cfg, path, bf16, timeout=150)[0]
    for world, rpn in [(4, 1), (4, 4), (2, 1)]:
        res = dist.run(_resume_only, world, rpn, cfg, path, bf16, timeout=150)
        losses, warned = res[0]
        assert len(warned) == 1 and "another layout" in warned[0], warned
        assert all(not w for _, w in res[1:])  # one warning per job, not per rank
        rel = max(abs(a - b) / b for a, b in zip(losses[3:], full[3:]))
        print(f"{cfg_name} 2x2 -> {world // rpn}x{rpn}: losses {losses[3:]} vs {full[3:]}, max rel diff {rel:.4f}")
        # Same world: only the quantization noise differs: 0.005 at 4-bit weight differences,
        # scaled with the code step (absmax / qmax) of the default's. World 2: each step averages
        # half the batch of the 2 x 2 run (ranks 0 and 1's micro-batches), so batch noise adds ~3%.
        noise = 0.005 * 7 / QuantSpec(Config().weights.bits, 32).qmax
        assert rel < (noise if world == WORLD else 0.05), (world, rpn, losses, full)


# ----------------------------------------------------------------------------- API behaviour


def _misuse(ctx):
    import torch.distributed as tdist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    import sdpq
    from sdpq.integrations import fsdp as sf
    from sdpq.train.fsdp_backend import build_model
    from sdpq.train.model import GPT, GPTConfig

    spec = _spec(ctx, None)
    errors = {}

    def expect(name, exc, fn):
        try:
            fn()
        except exc as e:
            errors[name] = str(e)
        else:
            raise AssertionError(f"{name}: no {exc.__name__}")

    expect("unsharded", TypeError, lambda: sf.apply(GPT(GPTConfig(**TINY)), QUANT))
    model = build_model(spec)
    expect("bad_topology", TopologyError, lambda: sf.apply(model, {**QUANT, "topology": {"ranks_per_node": 3}}))
    assert not sf.is_applied(model)
    other = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    expect("foreign_optimizer", ValueError, lambda: sf.apply(model, QUANT, optimizer=other))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sf.apply(model, {**QUANT, "topology": {"ranks_per_node": ctx.ranks_per_node}}, optimizer=opt)
    expect("twice", RuntimeError, lambda: sf.apply(model, QUANT))
    comms = sf.module_comms(model)
    assert set(comms) == {"", "blocks.0", "blocks.1"}
    assert model.head.weight is model.wte.weight  # tied embedding survives sharding: one parameter

    # A step and a forward (which refreshes the reference), then weights edited by hand:
    # unmarked -> warning; marked -> the gathered weights are exactly the edited shards.
    x, y = _batch(spec, ctx.rank)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    model(x, y).backward()
    opt.zero_grad()
    seen = []
    hook = model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(m.fc.weight.detach().clone()))
    with torch.no_grad():
        model.blocks[0].fc.weight.mul_(0.5)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model(x, y)
    assert any(issubclass(i.category, sf.StaleWeightsWarning) for i in w), [str(i.message) for i in w]
    full = model.blocks[0].fc.weight.full_tensor()
    assert not torch.equal(seen[-1], full)
    sdpq.mark_weights_changed(model)  # the front door: finds sdpq.fsdp, which built the model
    model(x, y)
    assert torch.equal(seen[-1], full)
    hook.remove()

    # remove() restores FSDP2's defaults; training then matches a plain model bitwise.
    sf.remove(model)
    assert not sf.is_applied(model)
    for m in (model, *model.blocks):
        st = _fsdp_internals.param_groups(m)[0]  # the torch-version-aware accessor
        assert isinstance(st._all_gather_comm, DefaultAllGather)
        assert isinstance(st._reduce_scatter_comm, DefaultReduceScatter)
        assert st.force_sum_reduction_for_comms is False
    expect("removed_twice", RuntimeError, lambda: sf.remove(model))
    tdist.barrier()
    return errors


def _batch(spec, rank, step=0):
    from sdpq.train.data import TokenData

    return TokenData.stdlib().batch(step, rank, spec.micro_batch, spec.model.seq_len, seed=spec.seed)


def test_misuse_errors_remove_and_stale_weights(dist):
    errors = dist.run(_misuse, WORLD, RPN, timeout=120)[0]
    assert "fully_shard" in errors["unsharded"]
    assert "ranks_per_node 3" in errors["bad_topology"]
    assert "remove" in errors["twice"]
    assert "optimizer" in errors["foreign_optimizer"]


def _disagree(ctx, per_rank, version_on_rank):
    import sdpq.comm.agreement as agreement
    from sdpq.config import ConfigError
    from sdpq.integrations import fsdp as sf
    from sdpq.train.fsdp_backend import build_model

    real = agreement.__version__
    if ctx.rank == version_on_rank:
        agreement.__version__ = "0.0.1"  # another sdpq release on one node
    model = build_model(_spec(ctx, None))
    cfg = {**QUANT, "topology": {"ranks_per_node": ctx.ranks_per_node}, **per_rank.get(ctx.rank, {})}
    try:
        sf.apply(model, cfg)
    except ConfigError as e:
        return str(e), sf.is_applied(model)
    finally:
        agreement.__version__ = real  # the worker process runs later tests
    return None, sf.is_applied(model)


@pytest.mark.parametrize("case", ["optimizer", "version"])
def test_ranks_that_disagree_fail_alike_at_apply(dist, case):
    """One rank with other settings (even ones that do not shape the wire) or another sdpq
    release: every rank raises the same error naming the key and who holds what; nothing is
    installed."""
    per_rank = {2: {"optimizer": {"enabled": False, "states": "bf16"}}} if case == "optimizer" else {}
    res = dist.run(_disagree, WORLD, RPN, per_rank, 1 if case == "version" else -1, timeout=120)
    errors = {e for e, _ in res}
    assert len(errors) == 1 and None not in errors, errors
    assert not any(applied for _, applied in res)
    msg = errors.pop()
    key, odd = ("config.optimizer.states", [2]) if case == "optimizer" else ("sdpq_version", [1])
    assert msg.startswith("sdpq.fsdp.apply:") and key in msg and f"on ranks {odd}" in msg, msg


def _no_optimizer(ctx):
    from sdpq.integrations import fsdp as sf
    from sdpq.train.fsdp_backend import build_model

    spec = _spec(ctx, None)
    model = build_model(spec)
    sf.apply(model, {**QUANT, "topology": {"ranks_per_node": ctx.ranks_per_node}})  # no optimizer given
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(spec, ctx.rank)
    model(x, y).backward()
    opt.step()  # changes the shards without telling sdpq
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model(x, y)
    return [str(i.message) for i in w if issubclass(i.category, sf.StaleWeightsWarning)]


def test_apply_without_optimizer_warns_when_a_step_goes_unmarked(dist):
    """apply() without the optimizer cannot see its steps: the next forward gathers the previous
    weights and says so (StaleWeightsWarning), naming the fix."""
    for warned in dist.run(_no_optimizer, WORLD, RPN, timeout=120):
        assert warned and "mark_weights_changed" in warned[0], warned


def _reshard_int(ctx):
    from sdpq.integrations import fsdp as sf
    from sdpq.train.fsdp_backend import build_model

    model = build_model(_spec(ctx, None), reshard_after_forward=2)
    try:
        sf.apply(model, QUANT)
    except ValueError as e:
        return str(e)
    return None


def test_reshard_after_forward_int_is_rejected(dist):
    msg = dist.run(_reshard_int, WORLD, RPN, timeout=60)[0]
    assert msg is not None and "reshard_after_forward" in msg


def test_group_layout():
    assert group_layout([0, 1], 2) == (1, 2)
    assert group_layout([0, 2], 2) == (2, 1)
    assert group_layout([0, 1, 2, 3], 2) == (2, 2)
    with pytest.raises(TopologyError, match="same number"):
        group_layout([0, 1, 2], 2)


def _two_models(ctx):
    import sdpq
    from sdpq.train.fsdp_backend import build_model

    sdpq.stats.reset()
    spec = _spec(ctx, None)
    cfg = {**QUANT, "topology": {"ranks_per_node": ctx.ranks_per_node}}
    a, b = build_model(spec), build_model(spec)
    for m in (a, b):
        sdpq.fsdp.apply(m, cfg)
    x, y = _batch(spec, ctx.rank)
    for m, steps in ((a, 2), (b, 1)):
        for _ in range(steps):
            m(x, y).backward()
            sdpq.fsdp.mark_weights_changed(m, exact=False)
    out = {k: sdpq.stats.of(t).as_dict() for k, t in (("a", a), ("b", b), ("all", None))}
    try:
        sdpq.stats.of(torch.nn.Linear(2, 2))
    except TypeError as e:
        out["error"] = str(e)
    sdpq.stats.reset(a)
    out["a_after_reset"] = sdpq.stats.of(a).as_dict()
    out["all_after_reset"] = sdpq.stats.of().as_dict()
    return out


def test_each_model_counts_its_own_statistics(dist):
    """Two models in one process: each has its own counters, the process-wide ones sum both."""
    r = dist.run(_two_models, WORLD, RPN, timeout=120)[0]
    for path in ("weights", "gradients"):
        for link in ("intra", "inter"):
            a, b, total = (r[k][path][link] for k in ("a", "b", "all"))
            assert a["bytes"] > b["bytes"] > 0 and a["calls"] == 2 * b["calls"], (path, link, a, b)
            assert total["bytes"] == a["bytes"] + b["bytes"] and total["calls"] == a["calls"] + b["calls"]
    assert "sdpq.fsdp.apply" in r["error"] and "Linear" in r["error"]
    assert r["a_after_reset"] == {}  # a model's reset clears its own counters only
    assert r["all_after_reset"]["gradients"]["inter"]["bytes"] == r["all"]["gradients"]["inter"]["bytes"]
