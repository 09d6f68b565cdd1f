"""``sdpq bench quant``: throughput of each quantization primitive next to a plain copy.

GB/s counts the bytes of the primitive's input tensor; the copy baseline moves the same
tensor (``dst.copy_(src)``) in the same run, so ``vs_copy`` = gbps / copy_gbps is the figure
that carries over between machines. The fused hot paths of the collectives follow
(``quant_fused``: Triton kernel and PyTorch reference side by side, counted by memory traffic).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch

from ..quant import QuantSpec, decode, encode, hadamard, inverse_hadamard
from .report import default_device, seconds_per_call

COLUMNS = ["primitive", "numel", "dtype", "device", "gbps", "copy_gbps", "vs_copy", "speedup_vs_pytorch"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _primitives() -> dict[str, Callable[[torch.Tensor], Callable[[], object]]]:
    """name -> factory(x) returning the zero-argument call to time (set-up outside the timing)."""
    prims: dict[str, Callable[[torch.Tensor], Callable[[], object]]] = {}
    for bits, group in ((8, 128), (4, 128), (4, 2048)):
        for rounding in ("nearest", "stochastic"):
            spec = QuantSpec(bits=bits, group_size=group, rounding=rounding)

            def _encode(x, s=spec):
                return lambda: encode(x, s)

            prims[f"encode_int{bits}_g{group}_{rounding[:4]}"] = _encode
        spec = QuantSpec(bits=bits, group_size=group)

        def _decode(x, s=spec):
            buf = encode(x, s)
            return lambda: decode(buf, s, x.numel())

        prims[f"decode_int{bits}_g{group}"] = _decode
    prims["hadamard_b128"] = lambda x: lambda: hadamard(x, 128, 0)
    prims["inverse_hadamard_b128"] = lambda x: lambda: inverse_hadamard(x, 128, 0)
    prims.update(_optional_primitives())
    return prims


def _optional_primitives() -> dict[str, Callable[[torch.Tensor], Callable[[], object]]]:
    """FP8 expansion and MCF primitives (sdpq.quant.fp8 / sdpq.quant.mcf)."""
    from .quant_extra import primitives

    return primitives()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=None,
        help="element counts (default: 2^16 2^20 2^22 on CPU, up to 2^26 on CUDA)",
    )
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--only", nargs="+", default=None, help="primitive name prefixes to run")
    p.add_argument("--min-run-time", type=float, default=0.2, help="seconds of timing per measurement")


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device) if args.device else default_device()
    sizes = args.sizes or ([1 << 16, 1 << 20, 1 << 22] if device.type == "cpu" else [1 << 20, 1 << 24, 1 << 26])
    dtype = _DTYPES[args.dtype]
    prims = _primitives()
    if args.only:
        prims = {k: v for k, v in prims.items() if any(k.startswith(o) for o in args.only)}
    records = []
    gen = torch.Generator(device=device).manual_seed(0)
    for n in sizes:
        x = torch.randn(n, device=device, generator=gen).to(dtype)
        dst = torch.empty_like(x)
        nbytes = x.numel() * x.element_size()
        copy_gbps = nbytes / seconds_per_call(functools.partial(dst.copy_, x), args.min_run_time) / 1e9
        for name, factory in prims.items():
            t = seconds_per_call(factory(x), args.min_run_time)
            gbps = nbytes / t / 1e9
            records.append(
                dict(
                    primitive=name,
                    numel=n,
                    dtype=args.dtype,
                    device=device.type,
                    gbps=gbps,
                    copy_gbps=copy_gbps,
                    vs_copy=gbps / copy_gbps,
                )
            )
    from . import quant_fused

    return records + quant_fused.run(sizes, device, lambda f: seconds_per_call(f, args.min_run_time), args.only)
