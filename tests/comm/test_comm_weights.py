"""Weight all-gather on real gloo ranks (sdpq.comm.weights)."""

import hashlib
import io
import warnings

import pytest
import torch

from sdpq.comm import CommStats, ReferenceMismatchWarning, Topology, WeightGather
from sdpq.config import WeightsConfig

LAYOUTS = [(1, 4), (4, 1), (2, 2), (3, 2), (2, 4)]
IDS = [f"{n}x{l}" for n, l in LAYOUTS]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _walk(numel: int, steps: int, lr: float, seed: int = 11) -> list[torch.Tensor]:
    """The true weights of every step: a random walk, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(numel, generator=g)]
    for _ in range(steps - 1):
        w.append(w[-1] + lr * torch.randn(numel, generator=g))
    return w


def _shard(w: torch.Tensor, rank: int, C: int) -> torch.Tensor:
    return w[rank * C : (rank + 1) * C]


def _step_bound(d: torch.Tensor, N: int, C: int, G: int, qmax: int) -> torch.Tensor:
    """One quantization step per element: the scale absmax(group of d) / qmax of its shard's group."""
    dp = torch.zeros(N, -(-C // G) * G)
    dp[:, :C] = torch.nn.functional.pad(d, (0, N * C - d.numel())).view(N, C)
    s = dp.abs().view(N, -1, G).amax(-1, keepdim=True).expand(-1, -1, G).reshape(N, -1)[:, :C] / qmax
    return s.reshape(-1)[: d.numel()]


def _storage_bound(out: torch.Tensor, kind: str, N: int, C: int) -> torch.Tensor:
    """What storing the reconstruction in `kind` may add to its error, per element: half a bf16
    ulp, or half a step of the int8 reference's groups of 128 (within each shard)."""
    v = out.float()
    if kind == "bf16":
        return v.abs() * 2**-8
    if kind == "int8":
        return _step_bound(v, N, C, 128, 127) * 0.5 * (1 + 2**-20)
    return torch.zeros_like(v)


def _gather_walk(ctx, numel, cfg_kwargs, steps, lr, dtype):
    topo = Topology.build(ctx.ranks_per_node)
    rec = CommStats()
    cfg = WeightsConfig(**cfg_kwargs)
    wg = WeightGather(numel, topo, cfg, dtype=dtype, record_to=rec)
    C, N = wg.shard_numel, ctx.world_size
    digests, errs, step_ratios, exact = [], [], [], []
    prev = None
    for t, w in enumerate(_walk(numel, steps, lr)):
        if t > 0:
            wg.mark_weights_changed(exact=False)  # an optimizer step changed the weights
        if t == 1:
            rec.reset()  # steady state: the first refresh is an exact exchange
        out = wg(_shard(w, ctx.rank, C).to(dtype))
        assert out.dtype == dtype and out.numel() == numel
        digests.append(_digest(out))
        wt = w.to(dtype).float()
        err = (out.float() - wt).abs()
        errs.append(float(err.max()))
        exact.append(bool(torch.equal(out.float(), wt)))
        if cfg.mode == "diff" and t > 0:
            # One step of the difference's quantizer (d = the weights minus the last reconstruction)
            # plus what the reference's storage rounds.
            bound = _step_bound(wt - prev, N, C, cfg.group_size, (1 << (cfg.bits - 1)) - 1)
            bound = bound + _storage_bound(out, cfg.reference, N, C)
            step_ratios.append(float((err / bound.clamp_min(1e-30)).max()))
        elif cfg.mode == "direct":
            bound = _step_bound(wt, N, C, cfg.group_size, 127)
            step_ratios.append(float((err / bound.clamp_min(1e-30)).max()))
        prev = out.float()
    return {
        "digests": digests,
        "errs": errs,
        "ratios": step_ratios,
        "exact": exact,
        "stats": rec.as_dict(),
        "rel": float((out.float() - wt).norm() / wt.norm()),
        "reference_bytes": wg.reference_bytes,
        "reference_kind": wg.reference_kind,
    }


def _diff_cases():
    """Every layout with a bf16 reference (the default under bf16 compute); fp32 and int8 on two layouts."""
    cases = [pytest.param(n, l, "bf16", id=f"{n}x{l}-bf16") for n, l in LAYOUTS]
    return cases + [pytest.param(n, l, k, id=f"{n}x{l}-{k}") for k in ("fp32", "int8") for n, l in [(2, 2), (4, 1)]]


@pytest.mark.parametrize("nodes,rpn,reference", _diff_cases())
def test_diff_no_drift_over_200_steps(dist, nodes, rpn, reference):
    N = nodes * rpn
    cfg = {"mode": "diff", "reference": reference}
    res = dist.run(_gather_walk, N, rpn, 4096 * N, cfg, 200, 1e-3, torch.float32)
    assert all(r["digests"] == res[0]["digests"] for r in res)  # bitwise identical on every rank
    r = res[0]
    if nodes > 1:
        assert max(r["ratios"]) <= 1.0  # within one quantization step of the true weights, every step
        early, late = max(r["errs"][1:21]), max(r["errs"][-20:])
        assert late <= 2 * early  # no drift
        print(
            f"{nodes}x{rpn} diff ({reference}): max |recon - w| steps 1-20 {early:.3g}, 181-200 {late:.3g}, "
            f"max err/step {max(r['ratios']):.3f}, final rel err {r['rel']:.3g}"
        )
        inter = r["stats"]["weights"]["inter"]["bits_per_element"]
        assert inter <= 4.02
        print(f"{nodes}x{rpn} weights inter-node {inter:.4f} bits/elem")
        # R_l: nodes shards of 4096 elements, in the storage asked for.
        per_element = {"bf16": 2, "fp32": 4, "int8": 1 + 4 / 128}[reference]
        assert r["reference_bytes"] == nodes * 4096 * per_element
    else:
        assert all(r["exact"])  # one node: no slow link and no reference, the exact gather
        assert r["reference_bytes"] == 0


@pytest.mark.parametrize("reference", ["bf16", "int8"])
def test_diff_no_drift_over_1200_refreshes(dist, reference):
    """The storage's rounding (bf16, or int8 groups) is fed into the next difference: the error
    stays within one refresh's bound for 1200 refreshes, and does not grow."""
    cfg = {"mode": "diff", "reference": reference}
    res = dist.run(_gather_walk, 4, 2, 1024 * 4, cfg, 1200, 1e-3, torch.float32, timeout=120)
    assert all(r["digests"] == res[0]["digests"] for r in res)
    r = res[0]
    assert max(r["ratios"]) <= 1.0
    early, late = max(r["errs"][1:101]), max(r["errs"][-100:])
    assert late <= 1.25 * early
    print(f"{reference}: 1200 refreshes, max |recon - w| 1-100 {early:.3g}, 1101-1200 {late:.3g}, rel {r['rel']:.3g}")


def test_int8_reference_halves_the_node_gather(dist):
    """The int8 reference's rows are what the node's all-gather sends: 8 + 32/128 bits per
    element against the 16 of bf16 (the compute dtype here)."""
    cfg = {"mode": "diff", "reference": "int8"}
    res = dist.run(_gather_walk, 4, 2, 4096 * 4, cfg, 5, 1e-3, torch.bfloat16)
    assert all(r["digests"] == res[0]["digests"] for r in res)
    intra = res[0]["stats"]["weights"]["intra"]
    assert intra["bits_per_element"] == pytest.approx(8.25)
    assert intra["baseline_bits_per_element"] == 16


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("nodes,rpn", [(2, 2), (3, 2)], ids=["2x2", "3x2"])
def test_diff_below_four_bits_no_drift(dist, nodes, rpn, bits):
    """2 and 3-bit differences: within one step of the weights every step (the reference carries
    each difference's error into the next), no drift, densely packed on the wire."""
    N = nodes * rpn
    res = dist.run(_gather_walk, N, rpn, 4096 * N, {"mode": "diff", "bits": bits}, 200, 1e-3, torch.float32)
    assert all(r["digests"] == res[0]["digests"] for r in res)
    r = res[0]
    assert max(r["ratios"]) <= 1.0
    assert max(r["errs"][-20:]) <= 2 * max(r["errs"][1:21])
    inter = r["stats"]["weights"]["inter"]["bits_per_element"]
    assert bits < inter <= bits + 0.02  # codes + one fp32 scale per 2048
    print(f"{nodes}x{rpn} {bits}-bit diff: max err/step {max(r['ratios']):.3f}, inter {inter:.4f} bits/elem")


@pytest.mark.parametrize("nodes,rpn", LAYOUTS, ids=IDS)
def test_exact_mode_bitwise(dist, nodes, rpn):
    N = nodes * rpn
    res = dist.run(_gather_walk, N, rpn, 1000 * N + 3, {"mode": "exact"}, 20, 1e-3, torch.float32)
    assert all(r["digests"] == res[0]["digests"] for r in res)
    assert all(all(r["exact"]) for r in res)


@pytest.mark.parametrize("nodes,rpn", [(2, 2), (4, 1)], ids=["2x2", "4x1"])
def test_direct_mode_int8(dist, nodes, rpn):
    N = nodes * rpn
    res = dist.run(_gather_walk, N, rpn, 2048 * N, {"mode": "direct", "bits": 8}, 5, 1e-3, torch.float32)
    assert all(r["digests"] == res[0]["digests"] for r in res)
    assert max(res[0]["ratios"]) <= 0.5 + 1e-6  # nearest rounding: half a step
    print(
        f"{nodes}x{rpn} direct int8: rel err {res[0]['rel']:.3g}, "
        f"inter {res[0]['stats']['weights']['inter']['bits_per_element']:.4f} bits/elem"
    )


def test_diff_bf16_compute_dtype(dist):
    res = dist.run(_gather_walk, 4, 2, 4096 * 4, {"mode": "diff"}, 30, 1e-2, torch.bfloat16)
    assert all(r["digests"] == res[0]["digests"] for r in res)
    assert max(res[0]["ratios"]) <= 1.0


def _save_restore(ctx, numel, save_at, steps, rounding="nearest", mode="diff", reference="auto"):
    topo = Topology.build(ctx.ranks_per_node)
    bits = 4 if mode == "diff" else 8
    cfg = WeightsConfig(verify_every=4, rounding=rounding, mode=mode, bits=bits, reference=reference)
    ws = _walk(numel, steps, 1e-3)
    wg = WeightGather(numel, topo, cfg, record_to=CommStats())
    C = wg.shard_numel
    ref_digests, saved = [], None
    for t, w in enumerate(ws):
        wg.mark_weights_changed(exact=False)
        out = wg(_shard(w, ctx.rank, C))
        if t == save_at:
            buf = io.BytesIO()
            torch.save(wg.state_dict(), buf)  # a checkpoint
            saved = buf.getvalue()
        if t > save_at:
            ref_digests.append(_digest(out))
    restored = WeightGather(numel, topo, cfg, record_to=CommStats())
    restored.load_state_dict(torch.load(io.BytesIO(saved)))
    digests = [
        _digest(restored(_shard(w, ctx.rank, C)))
        for w in ws[save_at + 1 :]
        if restored.mark_weights_changed(exact=False) is None
    ]
    return ref_digests, digests


@pytest.mark.parametrize("nodes,rpn", [(2, 2), (3, 2)], ids=["2x2", "3x2"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_reference_survives_save_restore(dist, nodes, rpn, rounding):
    for ref, restored in dist.run(_save_restore, nodes * rpn, rpn, 2048 * nodes * rpn, 10, 20, rounding):
        # Bitwise the uninterrupted run: the restored reference (and rounding stream) continues.
        assert ref == restored and len(ref) == 9


@pytest.mark.parametrize("reference", ["bf16", "int8"])
def test_narrow_reference_survives_save_restore(dist, reference):
    for ref, restored in dist.run(_save_restore, 4, 2, 2048 * 4, 5, 12, "nearest", "diff", reference):
        assert ref == restored and len(ref) == 6


def test_direct_stochastic_stream_survives_save_restore(dist):
    for ref, restored in dist.run(_save_restore, 4, 2, 2048 * 4, 5, 12, "stochastic", "direct"):
        assert ref == restored and len(ref) == 6


def _corrupt(ctx, numel, verify_every, corrupt_at, steps):
    topo = Topology.build(ctx.ranks_per_node)
    wg = WeightGather(numel, topo, WeightsConfig(bits=4, verify_every=verify_every), record_to=CommStats())
    C = wg.shard_numel
    digests, warned, errs = [], [], []
    for t, w in enumerate(_walk(numel, steps, 1e-3)):
        if t == corrupt_at and ctx.rank == 1:
            wg.reference[0, 7] += 0.5  # rank 1's copy of R_1 no longer matches node 0's
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wg.mark_weights_changed(exact=False)  # reads what the last refresh found (see the test)
            out = wg(_shard(w, ctx.rank, C))
        warned.append(any(issubclass(c.category, ReferenceMismatchWarning) for c in caught))
        digests.append(_digest(out))
        errs.append(float((out - w).abs().max()))
    return digests, warned, errs


def test_corrupted_reference_is_caught_and_repaired(dist):
    res = dist.run(_corrupt, 4, 2, 4 * 2048, 1, 5, 10)
    # The refresh of step 5 compares the checksums on the device (no host read in the hot path);
    # the next mark_weights_changed reads the outcome, warns, and the refresh of step 6 is exact.
    # Step 5 still gathers a wrong R_1 on one node: the repair comes one refresh later.
    for t in range(10):
        same = all(r[0][t] == res[0][0][t] for r in res)
        assert same == (t != 5), t  # identical outputs on every rank, every step but 5
    for rank, (_, warned, errs) in enumerate(res):
        # Holders of R_1 (local index 1: ranks 1 and 3) warn when step 6 marks the weights changed.
        assert warned == [rank % 2 == 1 and t == 6 for t in range(10)]
        assert max(errs[:5] + errs[6:]) < 1e-3  # repaired from step 6 on
    # The owner (rank 1) took step 5's difference against its corrupted copy: node 1 got R - 0.5.
    assert max(r[2][5] for r in res) >= 0.4
    # Without verification the corruption silently splits the nodes' views of the weights.
    res = dist.run(_corrupt, 4, 2, 4 * 2048, 0, 5, 10)
    assert res[0][0][9] != res[2][0][9]


def _aliasing(ctx, numel):
    # FSDP2 hands the all-gather an input that is a slice of its output.
    topo = Topology.build(ctx.ranks_per_node)
    outs = []
    for mode in ("diff", "direct", "exact"):
        wg = WeightGather(
            numel, topo, WeightsConfig(mode=mode, bits=8 if mode == "direct" else 4), record_to=CommStats()
        )
        w = _walk(numel, 1, 0.0)[0]
        C = wg.shard_numel
        out = torch.empty(wg.padded_numel)
        out[ctx.rank * C : (ctx.rank + 1) * C] = _shard(w, ctx.rank, C)
        wg.gather(out[ctx.rank * C : (ctx.rank + 1) * C], out=out)
        outs.append(float((out - w).abs().max()))
    return outs


def test_input_aliasing_output(dist):
    for diff, direct, exact in dist.run(_aliasing, 4, 2, 4 * 2048):
        assert diff == 0.0 and exact == 0.0 and direct < 0.05


def _gather_built_with(ctx, bits_by_rank, dtype_by_rank):
    from sdpq.config import ConfigError

    topo = Topology.build(ctx.ranks_per_node)
    try:
        WeightGather(4096, topo, WeightsConfig(bits=bits_by_rank[ctx.rank]), dtype=dtype_by_rank[ctx.rank])
    except ConfigError as e:
        return str(e)
    return None


def test_ranks_that_disagree_fail_alike_with_the_setting_named(dist):
    errors = dist.run(_gather_built_with, 4, 2, [4, 4, 8, 4], [torch.bfloat16] * 3 + [torch.float32])
    assert all(e is not None for e in errors) and len(set(errors)) == 1, errors
    assert "weights.bits: 4 on ranks [0, 1, 3]; 8 on ranks [2]" in errors[0]
    assert "dtype: 'torch.bfloat16' on ranks [0, 1, 2]; 'torch.float32' on ranks [3]" in errors[0]
    assert dist.run(_gather_built_with, 4, 2, [4] * 4, [torch.bfloat16] * 4) == [None] * 4


def _jump(ctx, numel):
    """A step-sized change, then a large jump marked with the default and with exact=False."""
    topo = Topology.build(ctx.ranks_per_node)
    wg = WeightGather(numel, topo, WeightsConfig(mode="diff"), record_to=CommStats())
    C = wg.shard_numel
    w0, w1 = _walk(numel, 2, 1e-3)
    wg.mark_weights_changed(exact=False)
    wg(_shard(w0, ctx.rank, C))  # the first refresh (always exact)
    out = []
    for exact in (None, False):
        jumped = w1 + 10.0 * (1 if exact is None else -1)
        wg.mark_weights_changed() if exact is None else wg.mark_weights_changed(exact=exact)
        out.append(float((wg(_shard(jumped, ctx.rank, C)).float() - jumped[:numel]).abs().max()))
    return out


def test_mark_weights_changed_is_exact_by_default(dist):
    """A change of unknown size (a loaded checkpoint, an edit by hand) marked without saying
    otherwise reaches every rank bitwise; exact=False (the step hooks) sends a 4-bit difference."""
    for default, quantized in dist.run(_jump, 2, 1, 4096 * 2):
        assert default == 0.0 and quantized > 0.0


def test_every_mark_weights_changed_has_the_same_default():
    import inspect

    pytest.importorskip("deepspeed")
    import sdpq.fsdp
    from sdpq.integrations._ds_adapter import DeepSpeedAdapter

    defaults = {
        inspect.signature(f).parameters["exact"].default
        for f in (
            WeightGather.mark_weights_changed,
            sdpq.fsdp.mark_weights_changed,
            DeepSpeedAdapter.mark_weights_changed,
        )
    }
    assert defaults == {True}
