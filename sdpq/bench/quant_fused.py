"""The collectives' fused hot paths (``sdpq.kernels``): kernel vs PyTorch vs a copy.

Each op is timed twice when a kernel is available (C++ on CPU, Triton on CUDA): as the fused
kernel and as the PyTorch reference composition. GB/s here counts the op's minimum memory traffic (every
input byte read once + every output byte written once); the copy baseline moves a buffer of
half that size (``dst.copy_(src)`` reads and writes it), i.e. the same traffic, in the same run,
so ``vs_copy`` is the fraction of the achievable bandwidth the op reaches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .. import kernels as F
from ..quant import QuantSpec
from ..quant import rows as R

Op = tuple[Callable[[], object], Callable[[], object], int]  # (fused call, reference call, traffic bytes)

W_SPEC = QuantSpec(bits=4, group_size=2048)
INTRA = QuantSpec(bits=8, group_size=128)
INTER = QuantSpec(bits=4, group_size=128)
HAD = (128, 0)


def _ops(n: int, device: torch.device) -> dict[str, Op]:
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(1, n, device=device, generator=g)
    ref = w + 0.01 * torch.randn(1, n, device=device, generator=g)
    wire_w = R.encode_rows_ref(w, W_SPEC, ref, 1, None, None, None)[0]
    ops: dict[str, Op] = {}
    ops["weights_diff_encode_int4"] = (
        lambda: F.encode_rows(w, W_SPEC, ref=ref),
        lambda: R.encode_rows_ref(w, W_SPEC, ref, 1, None, None, None),
        8 * n + W_SPEC.wire_bytes(n),
    )
    ops["weights_decode_add_int4"] = (
        lambda: F.decode_rows(wire_w, W_SPEC, n, ref, add=True),
        lambda: R.decode_rows_ref(wire_w, W_SPEC, n, ref, True),
        W_SPEC.wire_bytes(n) + 8 * n,
    )
    # Gradient stages of a 2 nodes x 2 layout: 4 chunk rows of n/4, segmented into 2 wire rows.
    X = torch.randn(4, n // 4, device=device, generator=g)
    ops["grads_hadamard_encode_int8"] = (
        lambda: F.encode_rows(X, INTRA, segments=2, hadamard=HAD, own_row=0),
        lambda: R.encode_rows_ref(X, INTRA, None, 2, HAD, 0, None),
        4 * n + INTRA.wire_bytes(n) + 2 * n,
    )
    recv = R.encode_rows_ref(X, INTRA, None, 2, HAD, 0, None)[0]  # [2, wire(n/2)]
    own = torch.randn(n // 2, device=device, generator=g)
    no = torch.zeros((), dtype=torch.bool, device=device)
    ops["grads_reduce_requantize_int8_int4"] = (
        lambda: F.reduce_rows(recv, INTRA, n // 2, own, 0, no, encode_spec=INTER, encode_numel=n // 4, own_seg=0),
        lambda: R.reduce_rows_ref(
            recv, INTRA, n // 2, own, 0, torch.zeros(1, device=device), None, INTER, n // 4, 0, None
        ),
        INTRA.wire_bytes(n // 2) + 2 * n + INTER.wire_bytes(n // 2) + n,
    )
    recv2 = R.encode_rows_ref(X[:2], INTER, None, 1, None, None, None)[0]  # [2, wire(n/4)]
    own2 = torch.randn(n // 4, device=device, generator=g)
    ops["grads_reduce_inverse_hadamard_int4"] = (
        lambda: F.reduce_rows(recv2, INTER, n // 4, own2, 0, no, hadamard=HAD),
        lambda: R.reduce_rows_ref(recv2, INTER, n // 4, own2, 0, torch.zeros(1, device=device), HAD, None, 0, -1, None),
        INTER.wire_bytes(n // 4) + n + n,
    )
    return ops


def run(
    sizes: list[int],
    device: torch.device,
    timer: Callable[[Callable[[], object]], float],
    only: list[str] | None = None,
) -> list[dict]:
    probe = torch.empty(0, device=device)
    kernel = "triton" if F.uses_triton(probe) else "cpp" if F.uses_cpp(probe) else None
    records = []
    for n in sizes:
        ops = _ops(n, device)
        for name, (fused, reference, traffic) in ops.items():
            if only and not any(name.startswith(o) for o in only):
                continue
            src = torch.empty(traffic // 2, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            # Note: the fastest of three copies: a single timing of a fresh buffer swings 2-4x on a
            # shared VM (page faults, cache state), and the ratio must not flatter the op.
            copy_gbps = traffic / min(timer(functools.partial(dst.copy_, src)) for _ in range(3)) / 1e9
            paths = [(kernel, fused), ("pytorch", reference)] if kernel else [("pytorch", reference)]
            t_ref = 0.0
            for path, call in reversed(paths):  # the reference first: the kernel's speedup needs it
                t = timer(call)
                t_ref = t if path == "pytorch" else t_ref
                gbps = traffic / t / 1e9
                records.append(
                    dict(
                        primitive=f"{name}[{path}]",
                        numel=n,
                        dtype="fp32",
                        device=device.type,
                        gbps=gbps,
                        copy_gbps=copy_gbps,
                        vs_copy=gbps / copy_gbps,
                        speedup_vs_pytorch=t_ref / t,
                    )
                )
    return records
