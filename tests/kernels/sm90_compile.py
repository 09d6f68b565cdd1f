"""Compile sdpq's Triton kernels for an H100 (sm_90) on a machine without a GPU.

Run as a script (with TRITON_INTERPRET unset; test_sm90_compile.py does): each wrapper of
sdpq.kernels is called on CPU tensors with its launch recorded instead of run, and the recorded
kernel, arguments and options are compiled by Triton's CUDA backend (ptxas ships with Triton).
One JSON line per case: registers, stack (spilled registers), local memory and shared memory.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("sm90_compile.py compiles kernels: run it with TRITON_INTERPRET unset")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from sdpq.kernels import adamw, codec  # noqa: E402
from sdpq.quant import QuantSpec  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_launches: list = []


def _record(kernel, grid, *args, **kwargs):
    _launches.append((kernel, args, kwargs))


codec.launch = _record  # the wrappers' launches are recorded, not run
adamw.launch = _record


def _resources(cubin: bytes) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)
    return {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", out)}


def _compile(kernel, args, kwargs) -> dict:
    kwargs = dict(kwargs)
    options = {"num_warps": kwargs.pop("num_warps"), "enable_fp_fusion": False}
    values = dict(zip([p.name for p in kernel.params], args), **kwargs)
    sig, constexprs = {}, {}
    for p in kernel.params:
        if p.is_constexpr:
            sig[p.name], constexprs[p.name] = "constexpr", values[p.name]
        else:
            sig[p.name] = mangle_type(values[p.name])
    compiled = triton.compile(ASTSource(kernel, sig, constexprs), target=TARGET, options=options)
    return dict(_resources(compiled.asm["cubin"]), shared=compiled.metadata.shared, num_warps=options["num_warps"])


def _cases():
    """(name, call) pairs: the defaults of sdpq.config and the largest tiles it allows (4096)."""
    ones = torch.ones
    big4 = QuantSpec(4, 4096, rounding="stochastic")
    yield (
        "encode 4-bit G4096 H4096 ref own",
        lambda: codec.encode_rows(
            torch.randn(2, 8192), big4, ref=torch.randn(2, 8192), hadamard=(4096, ones(4096)), own_row=0
        ),
    )
    yield "encode 8-bit G128 H128 2 segments bf16 (gradients)", lambda: codec.encode_rows(
        torch.randn(4, 1024).bfloat16(), QuantSpec(8, 128, "stochastic"), segments=2, hadamard=(128, ones(128)),
        own_row=1,
    )  # fmt: skip
    yield (
        "encode 4-bit G2048 bf16 scales (weights)",
        lambda: codec.encode_rows(torch.randn(1, 8192), QuantSpec(4, 2048, scale_dtype=torch.bfloat16)),
    )
    buf = torch.zeros(2, big4.wire_bytes(8192), dtype=torch.uint8)
    yield (
        "decode 4-bit G4096 add bf16",
        lambda: codec.decode_rows(buf, big4, 8192, torch.zeros(2, 8192, dtype=torch.bfloat16), add=True),
    )
    own, bad = torch.zeros(8192), torch.zeros(1)
    yield (
        "reduce 4-bit G4096 inverse H4096",
        lambda: codec.reduce_rows(buf, big4, 8192, own, 0, bad, hadamard=(4096, ones(4096))),
    )
    yield (
        "reduce 4-bit G4096 re-encode G4096",
        lambda: codec.reduce_rows(buf, big4, 8192, own, 0, bad, encode_spec=big4, encode_rows_n=4096, own_seg=0),
    )
    for bits in (2, 3):  # below four bits: the widest tile, encode with a reference, decode, reduce
        low = QuantSpec(bits, 4096)
        low_buf = torch.zeros(2, low.wire_bytes(8192), dtype=torch.uint8)
        yield (
            f"encode {bits}-bit G4096 ref (weights)",
            lambda low=low: codec.encode_rows(torch.randn(2, 8192), low, ref=torch.randn(2, 8192)),
        )
        yield (
            f"reduce {bits}-bit G4096 inverse H4096",
            lambda low=low, b=low_buf: codec.reduce_rows(b, low, 8192, own, 0, bad, hadamard=(4096, ones(4096))),
        )

    def step(rows, cols, G):
        groups = -(-cols // G)

        def moment():
            return (torch.zeros(rows, cols, dtype=torch.uint8),) + tuple(ones(rows, groups) for _ in range(3))

        w = torch.zeros(rows, cols, dtype=torch.bfloat16)
        adamw.adamw_fp8_mcf_step(w, w.clone(), w.clone(), moment(), moment(), lr=1e-3, b1=0.9, b2=0.95, eps=1e-8,
                                 wd=0.1, step=1, group_size=G)  # fmt: skip

    yield "adamw G128 (optimizer default)", lambda: step(2, 4096, 128)
    yield "adamw G4096", lambda: step(2, 8192, 4096)


def main() -> None:
    for name, call in _cases():
        _launches.clear()
        call()
        for kernel, args, kwargs in _launches:
            try:
                res = _compile(kernel, args, kwargs)
            except Exception as e:  # reported, not raised: the test names every failing case
                res = {"error": f"{type(e).__name__}: {e}"[-2000:]}
            print(json.dumps(dict(case=name, kernel=kernel.__name__, **res)), flush=True)


if __name__ == "__main__":
    main()
