"""The scaling model behaves like a time model should, and its fit recovers known constants."""

from dataclasses import replace

import pytest

from sdpq.bench import scaling_model as sm
from sdpq.bench.scaling_model import A100, H800, MODELS, Constants, Layout, step_seconds, tflops, traffic

K = Constants(mfu=0.4, link_efficiency=0.5)


def test_fewer_bytes_cost_less_time_and_the_same_compute():
    m, lay = MODELS["6.7B"], Layout()
    speedups = []
    for gbit in (25, 100, 400, 3200):
        c = replace(A100, link_gbit=gbit)
        t = {s: step_seconds(c, m, lay, s, K) for s in ("baseline", "zeropp", "sdp4bit", "sdpq")}
        assert len({round(p["compute"], 12) for p in t.values()}) == 1  # same compute in every scheme
        assert t["sdpq"]["inter"] < t["sdp4bit"]["inter"] < t["baseline"]["inter"]
        assert t["sdpq"]["inter"] < t["zeropp"]["inter"] < t["baseline"]["inter"]
        speedups.append(t["baseline"]["total"] / t["sdpq"]["total"])
    assert speedups == sorted(speedups, reverse=True) and speedups[-1] >= 1


def test_bytes_follow_the_wire_formats():
    c, m, lay = A100, MODELS["1.3B"], Layout()
    n, cross = m.params, 15 / 16  # 16 nodes, one DP group per node
    assert traffic(c, m, lay, "baseline")["inter"] == pytest.approx(n * cross * (2 * 2 + 4))
    g4, w4 = sm.wire_bits(4, 128) / 8, sm.wire_bits(4, 2048) / 8
    assert traffic(c, m, lay, "sdpq")["inter"] == pytest.approx(n * cross * (g4 + w4))
    assert traffic(c, m, lay, "sdp4bit")["inter"] == pytest.approx(n * cross * (g4 + 2 * w4))
    # TP 4 x PP 2 on 4-GPU nodes: 4 DP groups per node, each of P / 8, over 8 nodes.
    tp = Layout(tp=4, pp=2)
    assert traffic(c, m, tp, "baseline")["inter"] == pytest.approx(4 * n / 8 * 7 / 8 * 8)


def test_one_micro_batch_runs_pipeline_stages_in_turn():
    c, m = A100, MODELS["13B"]
    one = step_seconds(c, m, Layout(tp=4, pp=2), "baseline", K)
    many = step_seconds(c, m, Layout(tp=4, pp=2, micro_batches=32), "baseline", K)
    assert one["compute"] == pytest.approx(2 * many["compute"] * 32 / 33)


def test_fit_recovers_the_constants_of_a_synthetic_table(monkeypatch):
    truth = Constants(mfu=0.37, link_efficiency=0.62)
    table = dict(sm.PUBLISHED)
    for name in sm.FIT_ON:
        _, _, lay = table[(H800.name, name)]
        m = MODELS[name]
        table[(H800.name, name)] = (
            tflops(H800, m, lay, "baseline", truth),
            tflops(H800, m, lay, "sdp4bit", truth),
            lay,
        )
    monkeypatch.setattr(sm, "PUBLISHED", table)
    k = sm.fit(H800)
    assert (k.mfu, k.link_efficiency) == (0.37, 0.62)


def test_kernel_efficiency_comes_from_a_gpu_report(tmp_path):
    """--gpu-report replaces the assumed 0.7 by the measured kernels' share of a copy's GB/s;
    a rehearsal's report is refused (its interpreter times mean nothing)."""
    import json

    from sdpq.bench.scaling import kernel_efficiency_from_report

    def report(rehearsal, shares):
        figures = {f"k{i}": {"of_copy": s, "kernel_gb_s": 1.0} for i, s in enumerate(shares)}
        doc = {
            "meta": {"rehearsal": rehearsal},
            "steps": [{"name": "throughput", "status": "pass", "figures": figures}],
        }
        p = tmp_path / f"r{rehearsal}.json"
        p.write_text(json.dumps(doc))
        return str(p)

    assert kernel_efficiency_from_report(report(False, [0.5, 0.9, 0.8])) == 0.8
    with pytest.raises(ValueError, match="rehearsal"):
        kernel_efficiency_from_report(report(True, [0.5]))
