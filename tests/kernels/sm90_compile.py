"""Compile sdpq's Triton kernels for an H100 (sm_90) on a machine without a GPU.

Run as a script (with TRITON_INTERPRET unset; test_sm90_compile.py does): each wrapper of
sdpq.kernels is called on CPU tensors with its launch recorded instead of run, and the recorded
kernel, arguments and options are compiled by Triton's CUDA backend (ptxas ships with Triton)
with the specialisations the runtime would give the same arguments (pointers and integers
divisible by 16, integers equal to 1): without them Triton cannot prove alignment and every
global access is 32 bits wide.

One JSON line per case: registers, stack (spilled registers), local memory, shared memory, and
what the SASS issues (tests/kernels/sass.py): instructions per element, shuffles, shared-memory
traffic, barriers, atomics, the width of each global access. "Budget" cases are the shapes the
training paths launch (defaults of sdpq.config, 2^20 elements); they also carry the bytes each
element moves and the issue budget those bytes allow at 0.8 of an H100's bandwidth.
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
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from sdpq.kernels import adamw, codec, codec_reduce  # noqa: E402
from sdpq.quant import QuantSpec  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import sass  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_launches: list = []


def _record(kernel, grid, *args, **kwargs):
    _launches.append((kernel, args, kwargs))


codec.launch = codec_reduce.launch = _record  # the wrappers' launches are recorded, not run
adamw.launch = _record
# The tensors are on the CPU, but the kernels are compiled as a GPU runs them: with CUDA's math
# library and the hardware's rounding instructions (the LIBDEVICE constexpr).
codec.libdevice_for = codec_reduce.libdevice_for = adamw.libdevice_for = adamw.fp8_hw_for = lambda t: True


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([tool, *flags, path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)


def _resources(cubin: bytes) -> dict:
    out = _cuobjdump(cubin, "-res-usage")
    return {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", out)}


_BACKEND = make_backend(TARGET)


def _compile(kernel, args, kwargs):
    """(Triton's compiled kernel, its options) for the launch, specialised as the runtime would.
    Note: the binder and _pack_args are JITFunction.run's own first steps (Triton 3.9)."""
    kwargs = dict(kwargs, enable_fp_fusion=False)
    binder = create_function_from_signature(kernel.signature, kernel.params, _BACKEND)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(_BACKEND, kwargs, bound, specialization, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=options.__dict__), options, bound


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _moved(name: str, v: dict) -> tuple[int, int, int]:
    """(elements, bytes read + written, elements per program) of one launch, from its arguments.
    Placeholder tensors of branches compiled out are not counted."""
    if name == "_encode_kernel":
        x = v["x_ptr"]
        moved = _nbytes(x) + (_nbytes(v["ref_ptr"]) if v["HAS_REF"] else 0) + _nbytes(v["out_ptr"])
        moved += _nbytes(v["own_ptr"]) if v["WRITE_OWN"] else 0
        return x.numel(), moved, v["TILE"]
    if name == "_decode_kernel":
        out, n = v["out_ptr"], v["n"]
        elements = v["buf_ptr"].shape[0] * n
        return elements, _nbytes(v["buf_ptr"]) + elements * out.element_size() * (2 if v["ADD"] else 1), v["TILE"]
    if name == "_reduce_kernel":
        buf, rows, n = v["buf_ptr"], v["ROWS"], v["n"]
        moved = _nbytes(buf) * (rows - 1) // rows + 4 * n  # the own row is read from `own`, not the wire
        moved += _nbytes(v["enc_ptr"]) + _nbytes(v["own_out_ptr"]) if v["ENCODE"] else 4 * n
        return n, moved, v["TILE"]
    if name == "_adamw_kernel":
        w = v["w_ptr"]
        states = ("w_ptr", "lo_ptr", "mc_ptr", "ms_ptr", "mk_ptr", "mg_ptr", "vc_ptr", "vs_ptr", "vk_ptr", "vg_ptr")
        return w.numel(), 2 * sum(_nbytes(v[k]) for k in states) + _nbytes(v["g_ptr"]), v["GPB"] * v["G"]
    raise KeyError(name)


def _measure(kernel, args, kwargs, budget: bool) -> dict:
    compiled, options, values = _compile(kernel, args, kwargs)
    cubin = compiled.asm["cubin"]
    res = dict(_resources(cubin), shared=compiled.metadata.shared, num_warps=options.num_warps)
    cost = sass.cost(_cuobjdump(cubin, "-sass"))
    elements, moved, per_program = _moved(kernel.__name__, values)
    # the reduce's rows past its first chunk run in a loop (sass.py reports its body apart)
    trips = -(-values["ROWS"] // values["CHUNK"]) if kernel.__name__ == "_reduce_kernel" else 0
    res.update(
        instructions=cost.straight,
        loop_body=cost.loop_body,
        per_element=round(cost.per_element(32 * options.num_warps, per_program, trips), 2),
        families=dict(cost.families),
        global_loads={str(k): c for k, c in sorted(cost.global_loads.items())},
        global_stores={str(k): c for k, c in sorted(cost.global_stores.items())},
    )
    if budget:
        per = moved / elements
        res.update(bytes_per_element=round(per, 3), budget=round(sass.ISSUE_PER_BYTE * per, 2))
    return res


def _spill_cases():
    """(name, call) pairs: the largest tiles sdpq.config allows (4096). The defaults' tiles are
    the budget cases, held to the same no-spill rule."""
    ones = torch.ones
    big4 = QuantSpec(4, 4096, rounding="stochastic")
    yield (
        "encode 4-bit G4096 H4096 ref own",
        lambda: codec.encode_rows(
            torch.randn(2, 8192), big4, ref=torch.randn(2, 8192), hadamard=(4096, ones(4096)), own_row=0
        ),
    )
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
    yield (  # 32 elements a thread with shuffled butterflies, at the largest group
        "encode 4-bit G4096 H128 stochastic own (gradients' tile)",
        lambda: codec.encode_rows(
            torch.randn(4, 8192).bfloat16(), big4, segments=2, hadamard=(128, ones(128)), own_row=0
        ),
    )
    buf8 = torch.zeros(8, big4.wire_bytes(8192), dtype=torch.uint8)
    yield "reduce 4-bit G4096 8 rows", lambda: codec.reduce_rows(buf8, big4, 8192, own, 0, bad)
    rows12 = torch.zeros(12, QuantSpec(8, 128).wire_bytes(8192), dtype=torch.uint8)
    yield (  # a chunk of 8 rows in flight, then 4 of a second: the row loop
        "reduce 8-bit 12 rows",
        lambda: codec.reduce_rows(rows12, QuantSpec(8, 128), 8192, own, 0, bad),
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

    yield "adamw G4096", lambda: step(2, 8192, 4096)


def _budget_cases():
    """(name, call) pairs: the launches of a training step at sdpq.config's defaults, 2^20
    elements a row (what sdpq.check's throughput step times on the GPU, and the paths' shapes)."""
    n = 1 << 20
    # sdpq.config's defaults: 2-bit weight differences (fp32 scales per 2048); gradients with
    # stochastic rounding and bf16 scales, 8-bit inside the node and 4-bit across nodes
    w2, bf16 = QuantSpec(2, 2048), torch.bfloat16
    g8, g4 = QuantSpec(8, 128, scale_dtype=bf16), QuantSpec(4, 128, scale_dtype=bf16)
    g8s, g4s = QuantSpec(8, 128, "stochastic", bf16), QuantSpec(4, 128, "stochastic", bf16)
    had = (128, torch.ones(128))
    yield (
        "encode diff 2b G2048 fp32 - fp32 ref",
        lambda: codec.encode_rows(torch.randn(1, n), w2, ref=torch.randn(1, n)),
    )
    yield (
        "encode diff 2b G2048 fp32 - bf16 ref (weights)",
        lambda: codec.encode_rows(torch.randn(1, n), w2, ref=torch.randn(1, n).bfloat16()),
    )
    yield "encode hadamard 8b G128 fp32", lambda: codec.encode_rows(torch.randn(1, n), g8, hadamard=had)
    yield (
        "encode hadamard 8b G128 bf16 2 segments own stochastic (gradients)",
        lambda: codec.encode_rows(torch.randn(4, n).bfloat16(), g8s, segments=2, hadamard=had, own_row=0),
    )
    wire2 = torch.zeros(1, w2.wire_bytes(n), dtype=torch.uint8)
    yield "decode 2b G2048 -> bf16", lambda: codec.decode_rows(wire2, w2, n, torch.zeros(1, n, dtype=torch.bfloat16))
    yield (
        "decode 2b G2048 add bf16 (reference)",
        lambda: codec.decode_rows(wire2, w2, n, torch.zeros(1, n, dtype=torch.bfloat16), add=True),
    )
    own, bad = torch.zeros(n), torch.zeros(1)
    rows8 = torch.zeros(2, g8.wire_bytes(n), dtype=torch.uint8)
    yield "reduce 2 rows 8b", lambda: codec.reduce_rows(rows8, g8, n, own, 0, bad)
    yield "reduce 8 rows 8b", lambda: codec.reduce_rows(rows8.repeat(4, 1), g8, n, own, 0, bad)
    yield (
        "reduce 2 rows 8b re-encode 4b stochastic (gradients)",
        lambda: codec.reduce_rows(rows8, g8s, n, own, 0, bad, encode_spec=g4s, encode_rows_n=n // 2, own_seg=0),
    )
    rows4 = torch.zeros(2, g4.wire_bytes(n), dtype=torch.uint8)
    yield (
        "reduce 2 rows 4b inverse H128 (gradients)",
        lambda: codec.reduce_rows(rows4, g4, n, own, 0, bad, hadamard=had),
    )

    def step():
        groups = n // 128

        def moment():
            return (torch.zeros(1, n, dtype=torch.uint8),) + tuple(torch.ones(1, groups) for _ in range(3))

        w = torch.zeros(1, n, dtype=torch.bfloat16)
        adamw.adamw_fp8_mcf_step(w, w.clone(), torch.zeros(1, n), moment(), moment(), lr=1e-3, b1=0.9, b2=0.95,
                                 eps=1e-8, wd=0.1, step=1, group_size=128)  # fmt: skip

    yield "adamw G128 fp32 grads (optimizer)", step


def main() -> None:
    cases = [(name, call, False) for name, call in _spill_cases()]
    cases += [(name, call, True) for name, call in _budget_cases()]
    only = sys.argv[1:]  # substrings of case names: compile only those
    for name, call, budget in cases:
        if only and not any(o in name for o in only):
            continue
        _launches.clear()
        call()
        for kernel, args, kwargs in _launches:
            try:
                res = _measure(kernel, args, kwargs, budget)
            except Exception as e:  # reported, not raised: the test names every failing case
                res = {"error": f"{type(e).__name__}: {e}"[-2000:]}
            print(json.dumps(dict(case=name, kernel=kernel.__name__, budget_case=budget, **res)), flush=True)


if __name__ == "__main__":
    main()
