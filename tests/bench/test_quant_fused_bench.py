"""`sdpq bench quant`'s fused section: one record per op and path, traffic-based GB/s vs a copy."""

import torch

from sdpq import kernels as F
from sdpq.bench import quant_fused


def test_records_for_every_op_on_cpu():
    calls = []

    def timer(fn):
        fn()
        calls.append(fn)
        return 1e-3

    recs = quant_fused.run([1 << 12], torch.device("cpu"), timer)
    names = {r["primitive"] for r in recs}
    paths = ["cpp", "pytorch"] if F.uses_cpp(torch.empty(0)) else ["pytorch"]  # cpp: the compiled kernel
    assert names == {f"{op}[{p}]" for op in quant_fused._ops(1 << 12, torch.device("cpu")) for p in paths}
    for r in recs:  # same traffic for op and copy, same (fake) time: the ratio is exactly 1
        assert r["vs_copy"] == 1.0 and r["speedup_vs_pytorch"] == 1.0 and r["gbps"] > 0
    assert len(calls) == len(recs) + 3 * (len(recs) // len(paths))  # each op path; three copies per op
    assert quant_fused.run([1 << 12], torch.device("cpu"), timer, only=["grads_reduce"])[0]["primitive"].startswith(
        "grads_reduce"
    )
