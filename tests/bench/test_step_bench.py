"""`sdpq bench step`: the timing spans (sdpq.comm.timing), the per-step split, and smoke runs."""

from __future__ import annotations

import json
import time
import types

import pytest

from sdpq.bench import step as step_bench
from sdpq.comm import timing


@pytest.fixture
def spans():
    prev = timing.enable()
    timing.reset()
    yield timing
    timing.enable(prev)
    timing.reset()


def test_disabled_records_nothing_and_is_one_shared_object():
    assert not timing.enabled()
    timing.reset()
    with timing.span("a"):
        with timing.span("b"):
            pass
    assert timing.snapshot() == {}
    assert timing.span("a") is timing.span("b")  # no allocation per call while off


def test_spans_nest_and_accumulate(spans):
    for _ in range(2):
        with spans.span("outer"):
            time.sleep(0.02)
            with spans.span("inner"):
                time.sleep(0.03)
                with spans.span("leaf"):
                    time.sleep(0.01)
    rec = spans.take()
    assert rec["outer"][2] == rec["inner"][2] == rec["leaf"][2] == 2
    incl = {k: v[0] for k, v in rec.items()}
    own = {k: v[1] for k, v in rec.items()}
    assert incl["outer"] >= incl["inner"] >= incl["leaf"] >= 0.02
    # self = inclusive minus the direct children; the self times add up to the outermost span
    assert own["outer"] == pytest.approx(incl["outer"] - incl["inner"])
    assert own["inner"] == pytest.approx(incl["inner"] - incl["leaf"])
    assert own["leaf"] == incl["leaf"]
    assert sum(own.values()) == pytest.approx(incl["outer"])
    assert own["outer"] >= 0.035 and own["inner"] >= 0.055
    assert spans.take() == {}  # take() cleared it


def test_span_records_when_the_body_raises(spans):
    with pytest.raises(ValueError):
        with spans.span("boom"):
            raise ValueError
    with spans.span("after"):
        pass
    rec = spans.snapshot()
    assert rec["boom"][2] == 1 and rec["after"][1] == rec["after"][0]  # the stack was unwound


def test_instrument_times_collectives_once_and_restores():
    class Work:
        waited = 0

        def wait(self):
            Work.waited += 1
            time.sleep(0.01)
            return True

        def is_completed(self):
            return True

    mod = types.SimpleNamespace(all_reduce=lambda x, async_op=False: Work() if async_op else None, barrier=lambda: None)
    orig = mod.all_reduce
    undo = timing.instrument(mod, ["all_reduce", "missing"], wrap_work=True)
    prev = timing.enable()
    timing.reset()
    try:
        assert mod.all_reduce(1) is None
        w = mod.all_reduce(1, async_op=True)
        assert w.wait() is True and w.is_completed()  # the proxy delegates
        with timing.span("comm.grads"):  # already inside a comm span: not timed again
            mod.all_reduce(1)
            mod.all_reduce(1, async_op=True).wait()
        rec = timing.take()
    finally:
        timing.enable(prev)
        timing.reset()
        undo()
    assert mod.all_reduce is orig
    assert rec["comm.other"][2] == 3  # two calls + one wait, outside comm.grads
    assert rec["comm.other"][0] >= 0.01
    assert rec["comm.grads"][1] == pytest.approx(rec["comm.grads"][0])  # no nested span in it
    assert Work.waited == 2


def _step(total, **own):
    d = {"train.step": [total, total - sum(own.values()), 1]}
    d.update({k: [v, v, 1] for k, v in own.items()})
    return d


def test_breakdown_and_aggregate_add_up():
    s = _step(
        1.0,
        **{
            "train.fwd_bwd": 0.4,
            "weights.encode": 0.05,
            "grads.reduce": 0.1,
            "comm.grads": 0.2,
            "comm.other": 0.05,
            "train.optim": 0.1,
        },
    )
    row = step_bench.breakdown(s)
    assert row["comm_wait"] == pytest.approx(0.25) and row["rest"] == pytest.approx(0.1)
    assert sum(row[c] for c in step_bench.PARTS) + row["rest"] == pytest.approx(row["total"])
    # 2 ranks x 6 steps; step 0 is warm-up, one slow step is trimmed away
    slow = _step(9.0, **{"train.fwd_bwd": 8.0})
    timing_ = [[slow] + [s] * 4 + [slow], [_step(5.0)] + [s] * 5]
    agg = step_bench.aggregate(timing_, warmup=1)
    assert agg["steps_measured"] == 5 and agg["steps_used"] == 3
    assert agg["total"] == pytest.approx(1.0) and agg["fwd_bwd"] == pytest.approx(0.4)
    assert agg["step_median"] == pytest.approx(1.0)


def _check_rows(records, backends):
    assert [(r["backend"], r["kind"]) for r in records] == [(b, k) for b in backends for k in ("plain", "sdpq")]
    for r in records:
        parts = sum(r[c] for c in step_bench.PARTS)
        assert all(r[c] >= 0 for c in step_bench.PARTS), r
        assert 0 < parts <= r["total"] * (1 + 1e-9), r
        assert r["rest"] == pytest.approx(r["total"] - parts)
        assert r["fwd_bwd"] > 0 and r["optimizer"] > 0 and r["comm_wait"] > 0, r
    for base, ours in zip(records[::2], records[1::2]):
        assert base["w_encode"] == base["g_encode"] == base["g_reduce"] == 0  # plain framework: no sdpq spans
        assert ours["w_encode"] > 0 and ours["w_decode"] > 0 and ours["g_encode"] > 0 and ours["g_reduce"] > 0
        assert ours["vs_baseline"] == pytest.approx(ours["total"] / base["total"]) and base["vs_baseline"] == 1.0


def test_bench_step_cli_smoke_fsdp2(capsys):
    """Tiny GPT, 2 ranks as 2 nodes x 1 (inter-node paths), 3 steps: both rows, parts <= total."""
    from sdpq.cli import main

    rc = main(
        [
            "bench",
            "step",
            "--json",
            "--backends",
            "fsdp2",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--ranks",
            "2",
            "--ranks-per-node",
            "1",
            "--d-model",
            "32",
            "--n-layer",
            "1",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
        ]
    )
    assert rc == 0
    records = json.loads(capsys.readouterr().out)
    _check_rows(records, ["fsdp2"])


def _ds_timing(ctx, block):
    from benchmarks.zeropp.groups import reset_deepspeed_groups
    from sdpq.train import deepspeed_backend
    from sdpq.train.model import GPTConfig
    from sdpq.train.run import RunSpec

    reset_deepspeed_groups()
    spec = RunSpec(
        backend="deepspeed",
        model=GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=32),
        sdpq=block,
        steps=3,
        micro_batch=2,
        warmup=1,
        eval_batches=0,
        log_every=0,
        ranks_per_node=1,
        mixed_precision="bf16",
        bf16=block is not None,
        timing=True,
    )
    r = deepspeed_backend.train(spec)
    assert not timing.enabled()  # restored after the run
    return r.extra["timing"]


def test_deepspeed_timing_plain_and_sdpq(dist):
    pytest.importorskip("deepspeed")
    rows = []
    for block in (None, {"weights": {}, "gradients": {}, "optimizer": {}}):
        t = dist.run(_ds_timing, 2, 1, block, timeout=120)[0]
        assert len(t) == 2 and all(len(per_rank) == 3 for per_rank in t)
        rows.append(
            dict(backend="deepspeed", kind="plain" if block is None else "sdpq", **step_bench.aggregate(t, warmup=1))
        )
    rows[0]["vs_baseline"], rows[1]["vs_baseline"] = 1.0, rows[1]["total"] / rows[0]["total"]
    _check_rows(rows, ["deepspeed"])
