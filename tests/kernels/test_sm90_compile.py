"""Every Triton kernel compiles for an H100 (sm_90) at the largest tile sdpq.config allows, with
no register spilled, no local memory and shared memory within a block's 227 KiB; and each launch
of a training step issues no more instructions per element than 0.8 of an H100's bandwidth
leaves time for (the budget of tests/kernels/sass.py).

No GPU is needed: Triton's CUDA backend (and the ptxas / cuobjdump it ships) compiles for a
named target. The interpreter the other kernel tests use does not compile anything, so it takes
what the compiler refuses (a reassigned constexpr, tiles past the shared memory) and says
nothing about spills; this test runs the compiler, in a subprocess without TRITON_INTERPRET.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
_BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
if not (_BIN / "ptxas").exists() or not (_BIN / "cuobjdump").exists():
    pytest.skip("Triton's CUDA backend tools (ptxas, cuobjdump) are not installed", allow_module_level=True)

SHARED_MAX = 227 * 1024  # the most shared memory one block may use on an H100


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    root = pathlib.Path(__file__).parents[2]
    proc = subprocess.run([sys.executable, str(pathlib.Path(__file__).parent / "sm90_compile.py")], cwd=root,
                          env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_compiles_without_spilling(compiled):
    kernels = {r["kernel"] for r in compiled}
    assert kernels == {"_encode_kernel", "_decode_kernel", "_reduce_kernel", "_adamw_kernel"}, kernels
    for r in compiled:
        assert "error" not in r, (r["case"], r.get("error"))
        assert r["stack"] == 0 and r["local"] == 0, r  # spilled registers live on the stack
        assert r["shared"] <= SHARED_MAX, r


def test_every_training_launch_is_within_its_issue_budget(compiled):
    cases = [r for r in compiled if r["budget_case"]]
    assert len(cases) >= 10 and all("error" not in r for r in cases)
    for r in cases:
        print(f"{r['case']:58s} {r['per_element']:7.2f} instructions/element, budget {r['budget']:7.2f}")
    over = {r["case"]: (r["per_element"], r["budget"]) for r in cases if r["per_element"] > r["budget"]}
    assert not over, f"over budget (instructions per element, budget): {over}"
