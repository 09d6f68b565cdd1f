"""`sdpq bench optim` produces the documented records (tiny sizes: a smoke test of the bench)."""

import argparse

from sdpq.bench import optim as bench


def test_bench_optim_records():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        ["--numel", "5000", "--modes", "fp8+mcf", "fp32+native", "--device", "cpu", "--min-run-time", "0.01"]
    )
    records = bench.run(args)
    assert [(r["states"], r["master"]) for r in records] == [("fp8", "mcf"), ("fp32", "native")]
    for r in records:
        assert {"states", "master", "numel", "bytes_per_param", "step_seconds", "baseline_step_seconds"} <= set(r)
        assert r["numel"] >= 5000 and r["step_seconds"] > 0 and r["baseline_step_seconds"] > 0
        assert abs(r["baseline_bytes_per_param"] - 14.0) < 0.01
    assert records[0]["bytes_per_param"] < 6.5 and abs(records[1]["bytes_per_param"] - 12.0) < 0.01


def test_many_small_parameters():
    """--param-numel caps each parameter: 5000 values in parameters of at most 512."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        ["--numel", "5000", "--param-numel", "512", "--modes", "fp8+mcf", "--device", "cpu", "--min-run-time", "0.01"]
    )
    (r,) = bench.run(args)
    assert r["params"] == 10 and r["numel"] >= 5000
    assert bench._shapes(5000, 512) == [(1, 512)] * 10
    assert bench._shapes(10 << 20) == [(4096, 1024), (4096, 1024), (2048, 1024)]
