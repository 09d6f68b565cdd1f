"""Where every Triton kernel of sdpq is launched from: one flat grid, checked against CUDA's limits,
and the launch geometry (elements per program, warps) and the codec's constexprs.

CUDA caps a grid at 2^31 - 1 programs on its first axis and 65535 on the other two; a launch
past a cap fails on the GPU with "invalid argument", while Triton's interpreter (the CPU tests)
runs it anyway. The kernels therefore put all their programs on the first axis (a row's tiles
one after the other, rows one after the other) and recover (row, tile) from the flat index;
``launch`` asserts the caps on every launch, so a grid that would fail on a GPU fails the CPU
tests too. The check costs a few integer comparisons per launch.

``program_index`` gives the flat index as int64: row offsets derived from it (row x stride)
may pass 2^31 elements, where int32 arithmetic would wrap to a wrong address.
"""

from __future__ import annotations

import os
from typing import Any

import triton
import triton.language as tl

__all__ = [
    "GRID_LIMITS",
    "check_grid",
    "fp8_hw_for",
    "launch",
    "libdevice_for",
    "num_warps",
    "program_index",
    "spec_constexprs",
    "tile_elements",
]

# CUDA's gridDim limits (x, y, z) on every architecture Triton targets.
GRID_LIMITS = (2**31 - 1, 65535, 65535)


def check_grid(grid: tuple[int, ...], kernel: str) -> tuple[int, ...]:
    """`grid` unchanged if CUDA can launch it; else a ValueError naming the kernel and the axis."""
    if not 1 <= len(grid) <= len(GRID_LIMITS):
        raise ValueError(f"{kernel}: a grid has 1 to 3 axes, got {grid}")
    for axis, (programs, cap) in enumerate(zip(grid, GRID_LIMITS)):
        if not isinstance(programs, int) or not 0 <= programs <= cap:
            raise ValueError(f"{kernel}: grid axis {axis} has {programs} programs; CUDA allows 0 to {cap}")
    return grid


def num_warps(tile: int, per_warp: int = 512) -> int:
    """Warps per program for a tile of `tile` elements: one per `per_warp` elements, 4 to 16.
    Compiled for an H100 (sm_90), every kernel then holds its largest tile (a group or Hadamard
    block of 4096, the most sdpq.config allows) without spilling registers: the codec with 512
    elements a warp (1024 for the encode with shuffled Hadamard butterflies), the AdamW step
    (two moments decoded and encoded per group) with 256 (tests/kernels/test_sm90_compile.py)."""
    return max(4, min(16, tile // per_warp))


def tile_elements(n: int, *sizes: int, target: int = 2048) -> int:
    """Elements per program of a row of n: a power of two, a multiple of every group / block
    size in `sizes` (powers of two), about `target`."""
    return max(max(sizes), min(target, triton.next_power_of_2(max(n, 1))))


def spec_constexprs(spec: Any) -> dict:
    """The codec kernels' constexprs of a QuantSpec."""
    import torch

    return dict(G=spec.group_size, BITS=spec.bits, SCALE_BF16=spec.scale_dtype == torch.bfloat16)


def libdevice_for(t: Any) -> bool:
    """The LIBDEVICE constexpr of a kernel on tensor t: CUDA's math library where the kernel is
    compiled for a GPU; the interpreter (TRITON_INTERPRET=1) has no libdevice."""
    return bool(t.is_cuda) and os.environ.get("TRITON_INTERPRET") != "1"


def fp8_hw_for(t: Any) -> bool:
    """The FP8_HW constexpr: the GPU converts fp32 to FP8 in hardware (sm_89 and later; Triton
    has no FP8 type for earlier GPUs, nor in the interpreter)."""
    if not libdevice_for(t):
        return False
    import torch

    return torch.cuda.get_device_capability(t.device) >= (8, 9)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """kernel[grid](*args, **kwargs) after check_grid, compiled without fused multiply-adds.

    Note: Triton contracts a * b + c into one FMA by default (enable_fp_fusion); compiled for an
    H100 the codec's encodes then hold FMAs and the AdamW step ~200. The C++ kernels are built
    with -ffp-contract=off for the same reason: the PyTorch reference rounds the product first,
    and the codec is bitwise the reference."""
    name = str(getattr(kernel, "__name__", kernel))  # a JITFunction carries its function's name
    kernel[check_grid(tuple(grid), name)](*args, enable_fp_fusion=False, **kwargs)


@triton.jit
def program_index():
    """This program's index on the flat grid, as int64 (see the module docstring)."""
    return tl.program_id(0).to(tl.int64)
