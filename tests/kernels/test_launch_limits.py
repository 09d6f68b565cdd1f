"""The Triton kernels at sizes a GPU enforces and the interpreter does not.

- Grid caps: CUDA launches at most 65535 programs on grid axes 1 and 2 (2^31 - 1 on axis 0);
  past them the launch fails with "invalid argument", but Triton's interpreter runs any grid.
  The kernels are swapped for recorders here, so a 70000 x 32 parameter's launch is checked
  without running 70000 interpreted programs (~20 ms each); the kernels' flat indexing itself
  runs in the interpreter in test_codec.py / test_adamw_kernel.py (several rows of several tiles).
- int64 offsets: a wire buffer whose third row starts 2^31 + 4096 bytes after its first (two
  int32 factors whose product wraps) is read at the right row. The buffer is 4 GiB of address
  space of which only the written pages are ever touched (the interpreter reads the storage in
  place).
"""

import ast
import os
import pathlib

import pytest
import torch

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from sdpq.kernels import adamw, codec, codec_reduce  # noqa: E402
from sdpq.kernels._launch import GRID_LIMITS, check_grid  # noqa: E402
from sdpq.quant import QuantSpec  # noqa: E402
from sdpq.quant.rows import decode_rows_ref as _decode_rows_ref  # noqa: E402
from sdpq.quant.rows import encode_rows_ref as _encode_rows_ref  # noqa: E402
from sdpq.quant.rows import reduce_rows_ref as _reduce_rows_ref  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
KERNELS = pathlib.Path(adamw.__file__).parent


class _Recorder:
    """Stands in for a @triton.jit kernel: records the grid of every launch, runs nothing."""

    def __init__(self):
        self.grids: list[tuple] = []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return lambda *args, **kwargs: None


def _launchable(grid: tuple) -> bool:
    return 1 <= len(grid) <= 3 and all(0 <= g <= cap for g, cap in zip(grid, GRID_LIMITS))


def test_check_grid_refuses_what_cuda_refuses():
    assert check_grid((70000,), "k") == (70000,)
    assert check_grid((2**31 - 1, 65535, 65535), "k") == (2**31 - 1, 65535, 65535)
    for bad, axis in (((2**31,), 0), ((1, 65536), 1), ((1, 1, 70000), 2)):
        with pytest.raises(ValueError, match=f"k: grid axis {axis} has {bad[axis]} programs; CUDA allows 0 to"):
            check_grid(bad, "k")


def test_adamw_launch_of_a_70000_row_parameter(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(adamw, "_adamw_kernel", rec)
    rows, cols = 70000, 32  # an embedding shard of 70000 tokens x 32 values: one program per row
    w = torch.zeros(rows, cols, dtype=torch.bfloat16, device=DEV)

    def moment():
        meta = torch.ones(rows, 1, device=DEV)
        return (torch.zeros(rows, cols, dtype=torch.uint8, device=DEV), meta, meta.clone(), meta.clone())

    adamw.adamw_fp8_mcf_step(w, w.clone(), w.float(), moment(), moment(), lr=1e-3, b1=0.9, b2=0.95, eps=1e-8,
                             wd=0.0, step=1, group_size=128)  # fmt: skip
    [grid] = rec.grids
    assert _launchable(grid), grid
    assert grid[0] * (grid[1] if len(grid) > 1 else 1) >= rows  # every row still gets a program


def test_codec_launches_of_70000_rows(monkeypatch):
    recs = {name: _Recorder() for name in ("_encode_kernel", "_decode_kernel", "_reduce_kernel")}
    for name, rec in recs.items():
        monkeypatch.setattr(codec_reduce if name == "_reduce_kernel" else codec, name, rec)
    spec = QuantSpec(4, 32)
    rows = 70000
    codec.encode_rows(torch.zeros(rows, 32, device=DEV), spec)
    buf = torch.zeros(rows, spec.wire_bytes(32), dtype=torch.uint8, device=DEV)
    codec.decode_rows(buf, spec, 32, torch.empty(rows, 32, device=DEV))
    codec.reduce_rows(buf, spec, 32, torch.zeros(32, device=DEV), 0, torch.zeros(1, device=DEV))
    for name, rec in recs.items():
        [grid] = rec.grids
        assert _launchable(grid), (name, grid)


def test_every_kernel_indexes_programs_in_int64():
    """A program index read with tl.program_id is int32: row * stride computed from it wraps past
    2^31. Every kernel takes its index from _launch.program_index (int64) instead."""
    for path in sorted(KERNELS.glob("*.py")):
        if path.name == "_launch.py":
            continue
        calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)]
        assert not [n for n in calls if n.attr == "program_id"], f"{path.name} reads tl.program_id directly"


def _wide_rows(wire: torch.Tensor, decoy: torch.Tensor) -> torch.Tensor:
    """wire [3, wb] copied into rows 2^30 + 2048 bytes apart; where an int32 row offset of row 2
    would wrap to (2 * stride - 2^32 bytes from row 0), the decoy row is written instead."""
    stride, first = 2**30 + 2048, 2**31
    wb = wire.shape[1]
    big = torch.empty(first + 2 * stride + wb, dtype=torch.uint8, device=DEV)  # pages never touched stay free
    rows = big.as_strided((3, wb), (stride, 1), first)
    rows.copy_(wire)
    wrapped = first + 2 * stride - 2**32
    big[wrapped : wrapped + wb] = decoy
    return rows


def test_row_offsets_past_2_31_bytes():
    spec, n = QuantSpec(4, 32), 256
    g = torch.Generator().manual_seed(0)
    x, decoy = torch.randn(3, n, generator=g).to(DEV), 100 * torch.randn(1, n, generator=g).to(DEV)
    wire = _encode_rows_ref(x, spec, None, 1, None, None, None)[0]
    bufs = _wide_rows(wire, _encode_rows_ref(decoy, spec, None, 1, None, None, None)[0][0])
    got = codec.decode_rows(bufs, spec, n, torch.empty(3, n, device=DEV))
    assert torch.equal(got, _decode_rows_ref(wire, spec, n, torch.empty(3, n, device=DEV), False))
    own, zero = torch.randn(n, generator=g).to(DEV), torch.zeros(1, device=DEV)
    got = codec.reduce_rows(bufs, spec, n, own, 0, zero)
    assert torch.equal(got, _reduce_rows_ref(wire, spec, n, own, 0, zero, None, None, 0, -1, None))
