"""``sdpq bench optim``: optimizer step time and bytes per parameter of each sdpq.optim.AdamW
mode, next to torch.optim.AdamW (foreach) on fp32 master weights measured in the same run.

bytes_per_param comes from sdpq.optim.memory_report (tensors that exist: weights,
compensation, states, metadata; gradients excluded). The baseline counts its fp32 master,
its two fp32 states and the bf16 compute weights mixed-precision training keeps next to them
(14 bytes/param). ``vs_baseline`` = step_seconds / baseline_step_seconds.

Where the fused kernel runs (fp8+mcf on CUDA with Triton), the record also gives the step's
GB/s (minimum traffic: bf16 gradient read, bf16 weight + compensation and both FP8 code
tensors read and written, metadata), a copy of the same traffic in the same run, and the
speedup over the PyTorch path (the same optimizer with ``kernels_enabled = False``).

Note: torch's foreach AdamW allocates temporaries of the parameters' size every step. Left to
itself, glibc may hand that memory back to the OS between steps, and then every baseline step
faults it in again: from one process to the next the 10M-parameter CPU baseline took 0.025 or
0.038-0.048 s. On Linux the benchmark therefore keeps freed memory in the heap (``mallopt``: mmap
threshold 32 MB, no trimming) before timing: the baseline runs at its fast, stable speed, and
sdpq's step, which allocates nothing per step, is unaffected. ``allocator`` in each record says
whether that was done.
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import torch

from ..kernels import adamw_ops, uses_triton
from ..optim import AdamW, memory_report
from .report import default_device, paired_seconds, seconds_per_call

COLUMNS = [
    "states",
    "master",
    "v",
    "numel",
    "params",
    "device",
    "bytes_per_param",
    "baseline_bytes_per_param",
    "step_seconds",
    "baseline_step_seconds",
    "vs_baseline",
    "gbps",
    "vs_copy",
    "speedup_vs_pytorch",
]

# name -> (states, master, mcf_second_moment)
MODES = {
    "fp8+mcf": ("fp8", "mcf", False),
    "fp8+native": ("fp8", "native", False),
    "fp8+mcf+pair": ("fp8", "mcf", True),
    "bf16+mcf": ("bf16", "mcf", False),
    "bf16+native": ("bf16", "native", False),
    "fp32+native": ("fp32", "native", False),
}
_ROW = 1024  # a hidden size: parameters are [rows, 1024] matrices of at most 4M elements


def _shapes(numel: int, param_numel: int = 4 << 20) -> list[tuple[int, int]]:
    """[rows, 1024] matrices of at most param_numel elements (rows of param_numel elements below
    1024: many small parameters, as the shards of norms and biases are)."""
    width = min(_ROW, param_numel)
    rows, per = -(-numel // width), max(1, param_numel // width)
    return [(min(per, rows - r), width) for r in range(0, rows, per)]


def _params(
    numel: int, dtype: torch.dtype, device: torch.device, seed: int = 0, param_numel: int = 4 << 20
) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for shape in _shapes(numel, param_numel):
        p = (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype).requires_grad_()
        p.grad = (torch.randn(shape, generator=g, device=device) * 1e-3).to(dtype)
        out.append(p)
    return out


def _kernel_figures(opt: AdamW, numel: int, step_s: float, min_run_time: float, device: torch.device) -> dict:
    # Per element: grad 2 read, weight 2+2, compensation 2+2, m and v codes 1+1 each;
    # per 128-group: scale, k, gm of m and v, 4 bytes each, read and written.
    traffic = numel * 14 + -(-numel // 128) * 6 * 4 * 2
    src = torch.empty(traffic // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = seconds_per_call(lambda: dst.copy_(src), min_run_time)
    opt.kernels_enabled = False
    torch_s = seconds_per_call(opt.step, min_run_time)
    opt.kernels_enabled = True
    return dict(
        gbps=traffic / step_s / 1e9,
        copy_gbps=traffic / copy_s / 1e9,
        vs_copy=copy_s / step_s,
        speedup_vs_pytorch=torch_s / step_s,
    )


def _keep_freed_memory() -> bool:
    """glibc only: serve parameter-sized allocations from the heap and never trim it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, (1 << 31) - 1))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--numel",
        type=int,
        nargs="+",
        default=None,
        help="parameter counts (default: 1M 10M on CPU, 1M 10M 100M on CUDA)",
    )
    p.add_argument(
        "--param-numel",
        type=int,
        default=4 << 20,
        help="largest parameter, in elements (default 4M; e.g. 8192 for many small parameters, where "
        "the per-parameter overhead shows)",
    )
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES), help="sdpq modes to run")
    p.add_argument("--v-format", choices=["e4m3", "e5m2"], default="e4m3", help="FP8 format of v")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--min-run-time", type=float, default=0.5, help="seconds of timing per measurement")


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device) if args.device else default_device()
    sizes = args.numel or ([1 << 20, 10 << 20] if device.type == "cpu" else [1 << 20, 10 << 20, 100 << 20])
    allocator = "glibc, freed memory kept" if device.type == "cpu" and _keep_freed_memory() else "default"
    records = []
    for n in sizes:
        master = _params(n, torch.float32, device, param_numel=args.param_numel)
        baseline = torch.optim.AdamW(master, lr=1e-4, foreach=True)
        baseline.step()  # states exist from here on
        compute = [p.detach().to(torch.bfloat16) for p in master]
        base_bpp = memory_report(baseline, extra_weights=compute)["bytes_per_param"]
        del compute
        for name in args.modes:
            states, mode_master, pair = MODES[name]
            params = _params(
                n, torch.bfloat16 if mode_master == "mcf" else torch.float32, device, param_numel=args.param_numel
            )
            opt = AdamW(
                params, lr=1e-4, states=states, master=mode_master, mcf_second_moment=pair, v_format=args.v_format
            )
            opt.step()
            # the baseline is timed right next to each mode, so both see the same machine load
            base_s, step_s = paired_seconds(baseline.step, opt.step, 2 * args.min_run_time)
            rep = memory_report(opt)
            v = "pair" if pair else (args.v_format if states == "fp8" else states)
            rec = dict(
                states=states,
                master=mode_master,
                v=v,
                numel=rep["numel"],
                params=len(params),
                device=device.type,
                bytes_per_param=rep["bytes_per_param"],
                baseline_bytes_per_param=base_bpp,
                step_seconds=step_s,
                baseline_step_seconds=base_s,
                vs_baseline=step_s / base_s,
                allocator=allocator,
                breakdown=rep["per_param"],
            )
            kernel = uses_triton(params[0]) or (device.type == "cpu" and adamw_ops.cpu_available())
            if name == "fp8+mcf" and kernel and args.v_format == "e4m3":
                rec.update(_kernel_figures(opt, rep["numel"], step_s, args.min_run_time, device))
            records.append(rec)
            del params, opt
        del master, baseline
    return records
