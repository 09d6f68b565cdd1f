"""Kernel steps of the GPU check: the environment, the codec kernels against the PyTorch
reference, their throughput next to a copy, and the codec's time per training step (the AdamW
kernel's step is sdpq.check.adamw_step).

The comparisons are the ones tests/kernels holds the kernels to: nearest rounding bitwise equal
to the reference (`sdpq.quant.rows`, the PyTorch composition), stochastic rounding within one
quantization step per element and unbiased, AdamW within a bf16-pair ulp (weights) and one
E4M3 step (moments).
"""

from __future__ import annotations

import functools
import math
import shutil
import subprocess

import torch

from ..quant.groupwise import QuantSpec
from ..quant.hadamard import signs
from ..quant.rows import decode_rows_ref as _decode_rows_ref
from ..quant.rows import encode_rows_ref as _encode_rows_ref
from ..quant.rows import reduce_rows_ref as _reduce_rows_ref
from .steps import Checks, Ctx
from .timing import device_time, median_time

__all__ = ["env", "codec", "throughput", "codec_block"]

MiB = 1 << 20


def large_sizes(ctx: Ctx) -> dict[str, int]:
    """fp32 element counts of the large cases, named by their bytes."""
    if ctx.rehearse:
        return {"64KiB": 16 * 1024, "256KiB": 64 * 1024}
    return {"64MiB": 16 * MiB, "256MiB": 64 * MiB, "1GiB": 256 * MiB}


def _odd_sizes(ctx: Ctx) -> list[int]:
    return [1, 100, 4132] if ctx.rehearse else [1, 100, 4132, 1_000_003]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values (NaN == NaN; the reference's sums may flip the sign of a zero)."""
    return a.shape == b.shape and torch.equal(a.float().nan_to_num(123.0), b.float().nan_to_num(123.0))


def _had(block: int | None, seed: int, device) -> tuple:
    """(reference's (block, seed), kernel's (block, signs tensor)) or (None, None)."""
    if block is None:
        return None, None
    return (block, seed), (block, signs(block, seed, device))


# ---------------------------------------------------------------------------------- env


def env(ctx: Ctx) -> dict:
    import triton

    import sdpq

    figures: dict = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "sdpq": sdpq.__version__,
        "deepspeed": _version_of("deepspeed"),
        "transformers": _version_of("transformers"),
    }
    c = Checks()
    if ctx.rehearse:
        figures["device"] = "cpu (rehearsal)"
    else:
        props = torch.cuda.get_device_properties(ctx.device)
        figures.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            driver=_nvidia_smi("driver_version"),
        )
        c.add("cuda device usable", torch.ones(1, device=ctx.device).sum().item() == 1.0)
    n = (64 * MiB if ctx.rehearse else 1024 * MiB) // 4
    src = torch.randn(n, device=ctx.device)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), ctx, reps=5 if ctx.rehearse else 20)
    figures["copy_bytes"] = 4 * n
    figures["copy_gb_s"] = round(2 * 4 * n / t / 1e9, 1)  # read + write
    c.add("copy is exact", torch.equal(dst, src))
    return c.result(figures, ["copy_gb_s counts bytes read and written"])


def _version_of(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - absent or unreadable: reported as None
        return None


def _nvidia_smi(field: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True, timeout=20)
        return out.stdout.decode().strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


# ---------------------------------------------------------------------------------- codec


def codec(ctx: Ctx) -> dict:
    from ..kernels import codec as k

    c, dev = Checks(), ctx.device
    g = torch.Generator(device=dev).manual_seed(0)
    w_spec = QuantSpec(4, 128, scale_dtype=torch.bfloat16)  # the weights path's shape of spec
    _odd_sizes_bitwise(k, c, ctx, g, w_spec)
    _gradient_path_bitwise(k, c, dev, g)
    # 48 draws in the interpreter (each is two interpreted launches), 200 on the GPU
    c.add("stochastic: within one step, unbiased", _stochastic_ok(k, dev, g, 48 if ctx.rehearse else 200))
    _large_sizes_bitwise(k, c, ctx, g, w_spec)
    figures = {} if ctx.rehearse else {"over_2^31": _beyond_int32(k, dev, c)}
    return c.result(figures, [] if not ctx.rehearse else ["> 2^31 elements: GPU only (8 GiB)"])


def _odd_sizes_bitwise(k, c: Checks, ctx: Ctx, g, w_spec: QuantSpec) -> None:
    """Difference encode and decode + add at odd sizes, every code width."""
    dev = ctx.device
    for n in _odd_sizes(ctx):
        x = torch.randn(2, n, device=dev, generator=g) * torch.logspace(-3, 3, n, device=dev)
        ref = torch.randn(2, n, device=dev, generator=g)
        for spec in (w_spec, QuantSpec(8, 128), QuantSpec(4, 2048), QuantSpec(3, 2048), QuantSpec(2, 128)):
            wire, _, flag = k.encode_rows(x, spec, ref=ref)
            want, _, _ = _encode_rows_ref(x, spec, ref, 1, None, None, None)
            c.add(f"encode n={n} {spec.bits}b G{spec.group_size} (diff)", torch.equal(wire, want) and int(flag[0]) == 0)
            base = torch.randn(2, n, device=dev, generator=g).to(torch.bfloat16)
            got = k.decode_rows(want, spec, n, base.clone(), add=True)
            c.add(
                f"decode+add n={n} {spec.bits}b G{spec.group_size}",
                _same(got, _decode_rows_ref(want, spec, n, base.clone(), True)),
            )


def _gradient_path_bitwise(k, c: Checks, dev, g) -> None:
    """The gradient path: segmented 8-bit Hadamard encode, reduce with the inverse transform,
    reduce then re-encode for the inter-node stage at 4, 3 and 2 bits, and the inter-node
    reduce + inverse transform at 3 and 2 bits."""
    spec8 = QuantSpec(8, 128)
    inter = (
        QuantSpec(4, 128, scale_dtype=torch.bfloat16),
        QuantSpec(3, 128),
        QuantSpec(2, 128, scale_dtype=torch.bfloat16),
    )
    zero = torch.zeros(1, device=dev)
    for n in (1024, 4096):
        x = torch.randn(4, n, device=dev, generator=g)
        x[0, 7] = 300.0
        h_ref, h_k = _had(128, 5, dev)
        wire, own, _ = k.encode_rows(x, spec8, segments=2, hadamard=h_k, own_row=1)
        want, want_own, _ = _encode_rows_ref(x, spec8, None, 2, h_ref, 1, None)
        c.add(
            f"hadamard encode n={n}",
            torch.equal(wire, want) and own is not None and want_own is not None and _same(own, want_own),
        )
        own_v = torch.randn(2 * n, device=dev, generator=g)
        got = k.reduce_rows(want, spec8, 2 * n, own_v, 0, zero, hadamard=h_k)
        c.add(
            f"reduce + inverse hadamard n={n}",
            _same(got, _reduce_rows_ref(want, spec8, 2 * n, own_v, 0, zero, h_ref, None, 0, -1, None)),
        )
        for spec in inter:
            enc, own_out, _ = k.reduce_rows(
                want, spec8, 2 * n, own_v, 0, zero, encode_spec=spec, encode_rows_n=n, own_seg=1
            )
            w2, o2, _ = _reduce_rows_ref(want, spec8, 2 * n, own_v, 0, zero, None, spec, n, 1, None)
            c.add(f"reduce then {spec.bits}-bit encode n={n}", torch.equal(enc, w2) and _same(own_out, o2))
            if spec.bits < 4:  # below four bits: the inter-node stage's own reduce
                rows_low = _encode_rows_ref(x, spec, None, 1, None, None, None)[0]
                own4 = torch.randn(n, device=dev, generator=g)
                got = k.reduce_rows(rows_low, spec, n, own4, 0, zero, hadamard=h_k)
                c.add(
                    f"{spec.bits}-bit reduce + inverse hadamard n={n}",
                    _same(got, _reduce_rows_ref(rows_low, spec, n, own4, 0, zero, h_ref, None, 0, -1, None)),
                )


def _large_sizes_bitwise(k, c: Checks, ctx: Ctx, g, w_spec: QuantSpec) -> None:
    """Hadamard encode and decode of 64 MiB-1 GiB rows."""
    dev = ctx.device
    for name, n in large_sizes(ctx).items():
        x = torch.randn(1, n, device=dev, generator=g)
        h_ref, h_k = _had(128, 1, dev)
        wire, _, _ = k.encode_rows(x, w_spec, hadamard=h_k)
        want, _, _ = _encode_rows_ref(x, w_spec, None, 1, h_ref, None, None)
        c.add(f"encode {name} (hadamard)", torch.equal(wire, want))
        out = torch.empty(1, n, device=dev)
        c.add(
            f"decode {name}",
            _same(k.decode_rows(want, w_spec, n, out), _decode_rows_ref(want, w_spec, n, torch.empty_like(out), False)),
        )
        del x, wire, want, out


def _stochastic_ok(k, dev, g, draws: int) -> bool:
    """`draws` seeds of one row: every draw within one step, their mean within 5 sigma."""
    spec = QuantSpec(4, 64, rounding="stochastic")
    x = torch.randn(1, 256, device=dev, generator=g)
    scale = x.view(4, 64).abs().amax(1, keepdim=True) / spec.qmax
    d = torch.stack(
        [
            k.decode_rows(k.encode_rows(x, spec, seed=s)[0], spec, 256, torch.empty(1, 256, device=dev))
            for s in range(draws)
        ]
    ).view(draws, 4, 64)
    within = bool(((d - x.view(4, 64)).abs() < scale).all())
    unbiased = bool(((d.mean(0) - x.view(4, 64)).abs() <= 5 * scale / (2 * math.sqrt(draws))).all())
    return within and unbiased


def _beyond_int32(k, dev, c: Checks) -> dict:
    """A row of 2^31 + 2^20 bf16 values: the tail groups (past int32 offsets) must equal the
    reference's encoding of the tail alone (groups are independent without a transform)."""
    spec = QuantSpec(4, 2048)
    n, tail = (1 << 31) + (1 << 20), 1 << 20
    x = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
    x.view(-1)[: n - tail].fill_(0.5)
    x.view(-1)[n - tail :].copy_(torch.randn(tail, device=dev))
    wire, _, _ = k.encode_rows(x, spec)
    want, _, _ = _encode_rows_ref(x[:, n - tail :], spec, None, 1, None, None, None)
    cb, tcb = spec.code_bytes(n), spec.code_bytes(tail)
    g0 = (n - tail) // spec.group_size
    codes_ok = torch.equal(wire[0, (n - tail) * spec.bits // 8 : cb], want[0, :tcb])
    scales_ok = torch.equal(wire[0, cb + 4 * g0 :], want[0, tcb:])
    c.add("encode past 2^31 elements (tail codes and scales)", codes_ok and scales_ok)
    del want
    out = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
    k.decode_rows(wire, spec, n, out)
    ref_tail = _decode_rows_ref(
        _encode_rows_ref(x[:, n - tail :], spec, None, 1, None, None, None)[0],
        spec,
        tail,
        torch.empty(1, tail, dtype=torch.bfloat16, device=dev),
        False,
    )
    c.add("decode past 2^31 elements (tail)", _same(out[:, n - tail :], ref_tail))
    return {"elements": n, "gib_bf16": round(2 * n / 2**30, 2)}


# ---------------------------------------------------------------------------------- throughput


def throughput(ctx: Ctx) -> dict:
    """Each kernel's bytes moved per second next to a copy of the same bytes, and the time of
    the PyTorch composition it replaces (same device, same inputs). Kernel and copy are timed
    alike, 20 launches back to back per event pair (timing.device_time); the one-launch figure
    of earlier reports is kept beside it (of_copy_one_launch) so the host's share is known."""
    from ..kernels import codec as k

    dev = ctx.device
    n = (16 * 1024) if ctx.rehearse else (64 * MiB)
    reps = 1 if ctx.rehearse else 5
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, n, device=dev, generator=g)
    ref = torch.randn(1, n, device=dev, generator=g)
    spec = QuantSpec(4, 2048)
    h_ref, h_k = _had(128, 1, dev)
    wire = k.encode_rows(x, spec, ref=ref)[0]
    g8 = QuantSpec(8, 128)
    rows2 = _encode_rows_ref(torch.randn(2, n, device=dev, generator=g), g8, None, 1, None, None, None)[0]
    own, zero = torch.randn(n, device=dev, generator=g), torch.zeros(1, device=dev)
    out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    cases = {
        # name: (kernel, reference, bytes read + written by the kernel)
        "encode diff 4b G2048": (
            lambda: k.encode_rows(x, spec, ref=ref),
            lambda: _encode_rows_ref(x, spec, ref, 1, None, None, None),
            8 * n + wire.numel(),
        ),
        "encode hadamard 8b G128": (
            lambda: k.encode_rows(x, g8, hadamard=h_k),
            lambda: _encode_rows_ref(x, g8, None, 1, h_ref, None, None),
            4 * n + rows2.shape[1],
        ),
        "decode 4b -> bf16": (
            lambda: k.decode_rows(wire, spec, n, out),
            lambda: _decode_rows_ref(wire, spec, n, out, False),
            wire.numel() + 2 * n,
        ),
        "reduce 2 rows 8b": (  # row 0 is this rank's own: read from `own` in fp32, never from the wire
            lambda: k.reduce_rows(rows2, g8, n, own, 0, zero),
            lambda: _reduce_rows_ref(rows2, g8, n, own, 0, zero, None, None, 0, -1, None),
            rows2.shape[1] + 8 * n,
        ),
    }
    figures, c = {}, Checks()
    for name, (kern, refn, nbytes) in cases.items():
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        copy = functools.partial(dst.copy_, src)
        t_copy, t_k = device_time(copy, ctx, reps), device_time(kern, ctx, reps)
        # rehearsal: one launch is what device_time timed (the interpreter's times mean nothing)
        t_copy1, t_k1 = (t_copy, t_k) if ctx.rehearse else (median_time(copy, ctx, reps), median_time(kern, ctx, reps))
        t_r = median_time(refn, ctx, max(1, reps // 2))
        figures[name] = {
            "bytes": nbytes,
            "kernel_gb_s": round(nbytes / t_k / 1e9, 1),
            "copy_gb_s": round(nbytes / t_copy / 1e9, 1),
            "of_copy": round(t_copy / t_k, 3),
            "of_copy_one_launch": round(t_copy1 / t_k1, 3),
            "speedup_vs_pytorch": round(t_r / t_k1, 2),
        }
        c.add(f"{name} timed", t_k > 0)
    notes = [
        "goal on the GPU: of_copy >= 0.8; in rehearsal the interpreter's times mean nothing",
        "of_copy: 20 launches back to back per event pair, kernel and copy alike; of_copy_one_launch: "
        "one launch per event pair (the method of earlier reports: the host's launch work is billed)",
        "bytes: what the kernel reads and writes (the reduce reads its own row from fp32, not the wire)",
    ]
    return c.result(figures, notes)


# ---------------------------------------------------------------------------------- 1.3B buckets


def codec_block(dev, d: int, world: int, nodes: int):
    """A callable doing one rank's codec work for one block of d_model `d` (12 d^2 parameters)
    on `nodes` nodes of world / nodes ranks: the gradient path's 8-bit encode (Hadamard) +
    reduce/re-encode + 4-bit reduce/inverse Hadamard of the bucket share, and the weights path's
    4-bit difference encode + decode into the (bf16) reference. Note: earlier reports decoded
    `world` rows into the reference; a rank holds one shard per node, so it decodes `nodes`."""
    from ..kernels import codec as k

    numel = 12 * d * d
    chunk = -(-numel // (world * 128)) * 128  # what each rank owns of a block's bucket
    g = torch.Generator(device=dev).manual_seed(0)
    grads = torch.randn(world, chunk, device=dev, generator=g)  # this rank's full bucket, as rows
    shard = torch.randn(1, chunk, device=dev, generator=g)
    refw = torch.randn(1, chunk, device=dev, generator=g)
    spec8, spec4 = QuantSpec(8, 128), QuantSpec(4, 128, scale_dtype=torch.bfloat16)
    wspec = QuantSpec(4, 2048)
    _, h_k = _had(128, 1, dev)
    L = nodes
    zero, own = torch.zeros(1, device=dev), torch.randn(L * chunk, device=dev, generator=g)
    # the reference this rank holds: 1/per-node of the model = one shard from each node
    ref_all = torch.empty(L, chunk, device=dev, dtype=torch.bfloat16)

    def one_block():
        w8, _, _ = k.encode_rows(grads, spec8, segments=L, hadamard=h_k, own_row=0)  # intra-node 8-bit
        enc, own4, _ = k.reduce_rows(
            w8, spec8, L * chunk, own, 0, zero, encode_spec=spec4, encode_rows_n=chunk, own_seg=0
        )
        k.reduce_rows(enc, spec4, chunk, own4, 0, zero, hadamard=h_k)  # inter-node 4-bit + inverse
        wd, _, _ = k.encode_rows(shard, wspec, ref=refw)  # weight difference, once per step
        k.decode_rows(wd.expand(L, -1).contiguous(), wspec, chunk, ref_all, add=True)

    return one_block
