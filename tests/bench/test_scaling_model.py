"""The scaling model behaves like a time model should (monotone in bandwidth, bits and overlap)."""

from dataclasses import replace

import pytest

from sdpq.bench.scaling import CLUSTERS, MODELS, step_seconds


def test_sdpq_gains_more_on_slower_links_and_never_loses_compute():
    c, m = CLUSTERS[0], MODELS[2]
    speedups = []
    for gbit in (25, 100, 400, 3200):
        cc = replace(c, inter_gbit=gbit)
        tb, cb = step_seconds(cc, m, 32, 0.45, 0.7, sdpq=False)
        ts, cs = step_seconds(cc, m, 32, 0.45, 0.7, sdpq=True)
        assert cs < cb and tb - cb == pytest.approx(ts - cs)  # same compute, less communication
        speedups.append(tb / ts)
    assert speedups == sorted(speedups, reverse=True) and speedups[-1] >= 1


def test_slow_quantization_kernels_cost_time():
    c, m = CLUSTERS[1], MODELS[0]
    fast, _ = step_seconds(c, m, 32, 0.45, 0.7, sdpq=True)
    slow, _ = step_seconds(c, m, 32, 0.45, 0.01, sdpq=True)
    assert slow > fast
