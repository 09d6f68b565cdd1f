"""benchmarks/zeropp: DeepSpeed ZeRO++ on CPU (plain-PyTorch quantizer kernels, link-byte counting).

- the CPU kernels follow the CUDA op's documented math (scales, round half to even, clipping,
  int4 packing, swizzled group order, fp16 reduction), shapes and dtypes;
- DeepSpeed's own ``all_to_all_quant_reduce`` runs on 4 gloo ranks (2 simulated nodes x 2) and
  moves exactly the bytes its wire format implies, intra- and inter-node;
- a tiny GPT trains with ZeRO-3 + qwZ + hpZ + qgZ (loss goes down) and sends fewer bytes
  across nodes than plain ZeRO-3.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

deepspeed = pytest.importorskip("deepspeed")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Imported before the worker pools fork, so that ranks do not each import them (~10 s).
import deepspeed.runtime.comm.coalesced_collectives  # noqa: E402,F401,F811
import deepspeed.runtime.zero.stage3  # noqa: E402,F401

from benchmarks.zeropp import cpu_kernels as K  # noqa: E402
from benchmarks.zeropp.window import training_window  # noqa: E402
from sdpq.comm.link_bytes import LinkBytes, sum_over_ranks  # noqa: E402

SYM = K.QuantType.Symmetric
TIMEOUT = 120


def _step_of(stored: torch.Tensor, group_size: int) -> torch.Tensor:
    return stored.reshape(-1, 1).expand(-1, group_size).reshape(-1)


# ----------------------------------------------------------------------------- kernel math


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_roundtrip_bounds_shapes_dtypes(bits, dtype):
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(6, 256, generator=g) * torch.logspace(-3, 1, 6).unsqueeze(1)).to(dtype)
    groups = 12  # 128 elements each
    q, params = K.quantize(x, groups, bits, SYM)
    assert q.dtype == torch.int8 and q.shape == (6, 256 if bits == 8 else 128)
    assert params.dtype == torch.float32 and params.shape == (groups, 1)
    out16 = K.dequantize(q, params, groups, bits, SYM)
    out32 = K.dequantize_fp32(q, params, groups, bits, SYM)
    assert out16.dtype == torch.float16 and out16.shape == x.shape
    assert out32.dtype == torch.float32 and out32.shape == x.shape
    assert torch.equal(out16, out32.half())
    # The kernel reads fp16: bounds hold against the fp16 value of the input.
    xh = x.half().float().reshape(groups, -1)
    gmax = xh.abs().amax(dim=1, keepdim=True)
    step = params  # stored = 1/scale = max / 2**(b-1): one quantization step
    assert torch.allclose(step, gmax / 2 ** (bits - 1), rtol=1e-6)
    err = (out32.reshape(groups, -1) - xh).abs()
    qmax = 2 ** (bits - 1) - 1
    clipped = xh / step > qmax - 0.5  # only +max-ish values above the top level are clipped
    assert (err[~clipped] <= step.expand_as(err)[~clipped] * (0.5 + 1e-4)).all()
    assert (err <= step * (1 + 1e-4)).all()  # +max itself decodes one step low (2**(b-1) -> qmax)


def test_exact_codes_round_half_even_and_top_clip():
    # Group max 1.0: int4 scale = 16 / 2 = 8, stored 1/8. Codes: rint(x * 8), half to even.
    x = torch.tensor([1.0, -1.0, 0.5, 0.0625, 0.1875, -0.3125, 0.0, 0.125])
    q, p = K.quantize(x, 1, 4, SYM)
    assert p.item() == 0.125
    codes = K.unpack_int4(q)
    assert codes.tolist() == [7, -8, 4, 0, 2, -2, 0, 1]  # 8 clips to 7; 0.5 -> 0, 1.5 -> 2, -2.5 -> -2
    q8, p8 = K.quantize(x, 1, 8, SYM)
    assert p8.item() == 1 / 128 and q8.tolist() == [127, -128, 64, 8, 24, -40, 0, 16]


def test_int4_packing_zero_and_nonfinite_groups():
    q, _ = K.quantize(torch.tensor([1.0 / 8, 2.0 / 8] + [1.0] * 6), 1, 4, SYM)
    assert q[0].item() == 0x12  # element 0 in bits 4-7, element 1 in bits 0-3 (PackedInt4 layout)
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(2)
    assert torch.equal(K.unpack_int4(K.pack_int4(codes)), codes)
    x = torch.cat([torch.zeros(8), torch.tensor([1.0, float("inf")] + [0.5] * 6)])
    q, p = K.quantize(x, 2, 8, SYM)
    assert p[0].item() == 1.0 and (q[:8] == 0).all()  # all-zero group: scale 1, codes 0
    assert math.isinf(p[1].item())  # inf: scale 0, stored inf ...
    out = K.dequantize_fp32(q, p, 2, 8, SYM)
    assert (out[:8] == 0).all() and torch.isnan(out[8:]).all()  # ... the whole group decodes to NaN


def test_asymmetric_roundtrip():
    x = torch.linspace(2.0, 3.0, 64)
    q, p = K.quantize(x, 2, 8, K.QuantType.Asymmetric)
    assert p.shape == (2, 2)
    out = K.dequantize_fp32(q, p, 2, 8, K.QuantType.Asymmetric)
    step = (p[:, :1]).expand(-1, 32).reshape(-1)  # stored 1/scale = (max - min) / 256
    err = (out - x.half().float()).abs()
    # As in the kernel, max maps to level +128 and is clipped to 127: one step off at the top.
    top = torch.zeros(64, dtype=torch.bool)
    top[[31, 63]] = True
    assert (err[~top] <= step[~top] * (0.5 + 1e-4)).all() and (err <= step * (1 + 1e-4)).all()


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="num_bits 4 or 8"):
        K.quantize(torch.ones(8), 1, 2, SYM)
    with pytest.raises(ValueError, match="equal groups"):
        K.quantize(torch.ones(10), 3, 8, SYM)
    with pytest.raises(ValueError, match="partitions"):
        K.swizzle_quant(torch.ones(64), 6, 4, SYM, 1, 2, 2)
    with pytest.raises(TypeError, match="fp16"):
        K.quantize(torch.ones(8, dtype=torch.int32), 1, 8, SYM)


def test_swizzle_order_matches_kernel_comment():
    # swizzled_quantize.cu: 2 nodes x 4 devices, partitions 0..7 become 0 4 1 5 2 6 3 7.
    x = torch.arange(8, dtype=torch.float32).repeat_interleave(16) + 1  # group z holds z + 1
    q, p = K.swizzle_quant(x, 8, 8, SYM, 1, 2, 4)
    assert q.shape == (128,) and p.shape == (8, 1)
    out = K.dequantize_fp32(q, p, 8, 8, SYM).reshape(8, 16)
    assert out[:, 0].round().tolist() == [1, 5, 2, 6, 3, 7, 4, 8]
    # Two pipeline slices, 2 nodes x 2 devices, 2 groups per (partition, slice): output rows of
    # input groups. Slice 0 of every partition comes first, partitions in swizzled order 0 2 1 3.
    slots = K.swizzle_slots(16, 2, 2, 2)
    assert slots.tolist() == [0, 1, 8, 9, 4, 5, 12, 13, 2, 3, 10, 11, 6, 7, 14, 15]


def test_quantized_reduction_sums_in_fp16_and_requantizes():
    g = torch.Generator().manual_seed(1)
    dpn, n, in_groups, out_groups = 2, 512, 8, 4
    parts = [torch.randn(n, generator=g) for _ in range(dpn)]
    enc = [K.quantize(t, in_groups // dpn, 4, SYM) for t in parts]
    data = torch.cat([e[0] for e in enc])
    scales = torch.cat([e[1] for e in enc])
    out, p = K.quantized_reduction(data, scales, in_groups, out_groups, 4, SYM, dpn)
    assert out.dtype == torch.int8 and out.shape == (n // 2,) and p.shape == (out_groups, 1)
    # Reference: fp16 dequantized parts, added in fp16, then the int4 round trip.
    ref = sum(K.dequantize(e[0], e[1], in_groups // dpn, 4, SYM) for e in enc)
    got = K.dequantize_fp32(out, p, out_groups, 4, SYM)
    step = _step_of(p, n // out_groups)
    assert ((got - ref.float()).abs() <= step * (1 + 1e-6)).all()
    q_ref, p_ref = K.quantize(ref, out_groups, 4, SYM)
    assert torch.equal(q_ref, out) and torch.equal(p_ref, p)


# ----------------------------------------------------------------------------- multi-rank


def _setup_deepspeed(ctx):
    import sdpq.integrations.deepspeed as sds
    from benchmarks.zeropp import reset_deepspeed_groups

    reset_deepspeed_groups()
    sds.init_distributed(dist_backend="gloo")  # the harness's gloo group is already there


def _quant_reduce(ctx, shape):
    """DeepSpeed's own all_to_all_quant_reduce (qgZ) with the CPU kernels, bytes counted."""
    import deepspeed.runtime.comm.coalesced_collectives as cc
    import deepspeed.utils.groups as G

    from benchmarks.zeropp import install_cpu_kernels, simulate_nodes

    _setup_deepspeed(ctx)
    g = torch.Generator().manual_seed(100 + ctx.rank)
    grad = torch.randn(*shape, generator=g).half()
    with simulate_nodes(ctx.ranks_per_node), install_cpu_kernels():
        groups = G._get_local_all_to_all_group()
        with LinkBytes(ctx.ranks_per_node) as counter:
            out = cc.all_to_all_quant_reduce([grad], groups)[0]
    everyone = [torch.empty_like(grad) for _ in range(ctx.world_size)]
    torch.distributed.all_gather(everyone, grad)
    return out, torch.stack(everyone).float().sum(0), counter.as_dict()


def test_deepspeed_qgz_flow_values_and_link_bytes(dist):
    shape = (64, 32)  # 2048 elements; DeepSpeed picks max(64, 32, world) = 64 groups of 32
    res = dist.run(_quant_reduce, 4, 2, shape, timeout=TIMEOUT)
    numel, groups, world, dpn, nodes = 2048, 64, 4, 2, 2
    chunk = numel // world
    for rank, (out, total, counts) in enumerate(res):
        assert out.dtype == torch.float16 and out.shape == (chunk,)
        mine = total.reshape(-1)[rank * chunk : (rank + 1) * chunk]
        # DeepSpeed divides the two-hop sum by num_nodes (not by the world size as its
        # reduce-scatter path does): the result is dpn x the mean. Both int4 hops add error.
        slope = float(out.float() @ mine / (mine @ mine))  # least squares: out ~ slope * sum
        assert abs(slope - 1 / nodes) < 0.05, slope  # 1 / world would be the mean
        assert torch.nn.functional.cosine_similarity(out.float(), mine, dim=0) > 0.97
        # Hop 1 (intra-node): half of the int4 buffer + half of the fp32 scales to the node peer.
        # Hop 2 (inter-node): half of the reduced int4 buffer + half of its scales to the other node.
        grads = counts["total"]["gradients"]
        assert grads["intra"]["bytes"] == (numel // 2) // dpn + 4 * groups // dpn
        assert grads["inter"]["bytes"] == (numel // 2 // dpn) // nodes + 4 * (groups // dpn) // nodes
        assert grads["intra"]["calls"] == 2 and grads["inter"]["calls"] == 2


TINY = dict(n_layer=2, d_model=64, n_head=4, seq_len=32)


def _train(ctx, zeropp: bool, steps: int):
    from benchmarks.zeropp import ZERO3_AT_SCALE, install_cpu_kernels, simulate_nodes, zeropp_overrides
    from sdpq.train import deepspeed_backend
    from sdpq.train.model import GPTConfig
    from sdpq.train.run import RunSpec

    _setup_deepspeed(ctx)
    spec = RunSpec(
        backend="deepspeed",
        model=GPTConfig(**TINY),
        steps=steps,
        micro_batch=2,
        lr=3e-3,
        warmup=2,
        eval_batches=1,
        log_every=0,
        ranks_per_node=ctx.ranks_per_node,
        bf16=True,
    )
    # ZERO3_AT_SCALE (backward gathers again, as it must at scale, so hpZ has work), and every
    # parameter partitioned (threshold 0) so that even the biases take the quantized paths.
    over = {"zero_optimization": dict(ZERO3_AT_SCALE["zero_optimization"], stage3_param_persistence_threshold=0)}
    if zeropp:
        over["zero_optimization"].update(zeropp_overrides(ctx.ranks_per_node)["zero_optimization"])
    calls = {"swizzle_quant": 0, "quantize": 0}
    ops = K.CPUQuantizerOps
    saved = {n: ops.__dict__[n] for n in calls}

    def counted(name):
        fn = saved[name].__func__

        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return staticmethod(wrapper)

    with simulate_nodes(ctx.ranks_per_node), install_cpu_kernels(), LinkBytes(ctx.ranks_per_node) as counter:
        for n in calls:
            setattr(ops, n, counted(n))
        try:
            with training_window(counter, steps):
                r = deepspeed_backend.train(spec, ds_overrides=over)
        finally:
            for n, f in saved.items():
                setattr(ops, n, f)
    per_rank = [None] * ctx.world_size
    torch.distributed.all_gather_object(per_rank, counter.as_dict())
    return {
        "losses": r.losses,
        "val": r.val_loss,
        "bytes": sum_over_ranks(per_rank),
        "calls": calls,
        "ds_config": r.extra["ds_config"]["zero_optimization"],
    }


def test_zeropp_zero3_trains_on_two_simulated_nodes(dist):
    steps = 8
    zpp = dist.run(_train, 4, 2, True, steps, timeout=TIMEOUT)
    base = dist.run(_train, 4, 2, False, steps, timeout=TIMEOUT)
    z = zpp[0]
    assert z["ds_config"]["zero_hpz_partition_size"] == 2 and z["ds_config"]["zero_quantized_gradients"]
    assert all(math.isfinite(x) for x in z["losses"]) and math.isfinite(z["val"])
    assert sum(z["losses"][-3:]) / 3 < z["losses"][0] - 0.3, z["losses"]  # it trains
    assert abs(z["losses"][-1] - base[0]["losses"][-1]) < 0.1 * base[0]["losses"][-1]
    assert z["calls"]["quantize"] > 0 and z["calls"]["swizzle_quant"] > 0  # qwZ and qgZ ran
    zb, bb = z["bytes"], base[0]["bytes"]
    assert len(zb["steps"]) == steps and len(bb["steps"]) == steps  # the window saw every step
    assert "gradients" in zb["total"] and zb["total"]["gradients"]["inter"]["calls"] > 0

    def inter(b, path):
        return b["total"].get(path, {}).get("inter", {}).get("bytes", 0)

    print(
        f"losses zero++ {[round(x, 3) for x in z['losses']]}\n       zero-3 {[round(x, 3) for x in base[0]['losses']]}"
    )
    for path in ("weights", "gradients", "other"):
        print(
            f"{path:9s} inter-node bytes/step zero++ {inter(zb, path) / steps:10.0f}  "
            f"zero-3 {inter(bb, path) / steps:10.0f}"
        )

    # Steady state (step 1 is special: ZeRO++'s first forward uses the hpZ copies made at init).
    # qwZ: the forward gather is int8 (+ scales) instead of bf16; hpZ: the backward gather stays
    # inside the node, so only the forward crosses: ~1/4 of ZeRO-3's two bf16 gathers.
    last_z, last_b = zb["steps"][-1], bb["steps"][-1]
    assert 0.2 < last_z["weights"]["inter"] / last_b["weights"]["inter"] < 0.3
    assert last_z["weights"]["intra"] > 0
    # qgZ: int4 two-hop all-to-all (+ bf16 reduce-scatter of the 1-D parameters).
    assert inter(zb, "gradients") < 0.3 * inter(bb, "gradients")
