"""gather_coalesced on real gloo ranks: the one-by-one gathers' results, in fewer collectives."""

import hashlib
import json

import pytest
import torch

from sdpq.comm import CommStats, Topology, WeightGather, _exchange, gather_coalesced
from sdpq.config import WeightsConfig

# Buckets of several sizes: a tiny one (a bias), one that pads its last shard, a large one.
SIZES = [37, 1000, 4096 * 3 + 5]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class _CountCalls:
    """Counts the all-gathers sdpq.comm issues (its one all-gather entry point) while active."""

    def __enter__(self):
        self.calls = 0
        self._orig = _exchange._all_gather_single

        def counted(*a, **kw):
            self.calls += 1
            return self._orig(*a, **kw)

        _exchange._all_gather_single = counted
        return self

    def __exit__(self, *exc):
        _exchange._all_gather_single = self._orig


def _walks(steps: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for n in SIZES:
        w = [torch.randn(n, generator=g)]
        for _ in range(steps - 1):
            w.append(w[-1] + 1e-3 * torch.randn(n, generator=g))
        out.append([x.to(dtype) for x in w])
    return out


def _run(ctx, coalesced: bool, cfg_kwargs: dict, steps: int, dtype: torch.dtype, padded: bool):
    topo = Topology.build(ctx.ranks_per_node)
    rec = CommStats()
    cfg = WeightsConfig(**cfg_kwargs)
    gathers = [WeightGather(n, topo, cfg, dtype=dtype, record_to=rec) for n in SIZES]
    walks = _walks(steps, dtype)
    digests, calls = [], []
    for t in range(steps):
        if t > 0:
            for g in gathers:
                g.mark_weights_changed(exact=False)
        shards = [w[t][ctx.rank * g.shard_numel : (ctx.rank + 1) * g.shard_numel] for g, w in zip(gathers, walks)]
        outs = [torch.empty(g.padded_numel if padded else g.numel, dtype=dtype) for g in gathers]
        with _CountCalls() as counter:
            if coalesced:
                gather_coalesced(gathers, shards, outs)
            else:
                for g, s, o in zip(gathers, shards, outs):
                    g.gather(s, out=o)
        calls.append(counter.calls)
        digests.append([_digest(o[: g.numel]) for g, o in zip(gathers, outs)])
    refs = [_digest(g.reference) if g.reference is not None else None for g in gathers]
    return {
        "digests": digests,
        "refs": refs,
        "stats": rec.as_dict(),
        "calls": calls,
        "versions": [g.version for g in gathers],
        "gathers": [g.calls for g in gathers],
    }


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_coalesced_equals_one_by_one_in_two_collectives(dist, rounding):
    cfg = {"mode": "diff", "rounding": rounding, "verify_every": 3}  # verifications go one by one
    one = dist.run(_run, 4, 2, False, cfg, 6, torch.bfloat16, False)
    many = dist.run(_run, 4, 2, True, cfg, 6, torch.bfloat16, False)
    for a, b in zip(one, many):
        assert a["digests"] == b["digests"]  # every output, every step, bitwise
        assert a["refs"] == b["refs"] and a["versions"] == b["versions"] and a["gathers"] == b["gathers"]
        # the same bytes, elements and sampled errors recorded (as text: NaN, no sample, equals NaN)
        assert json.dumps(a["stats"], sort_keys=True) == json.dumps(b["stats"], sort_keys=True)
    assert all(r["digests"] == many[0]["digests"] for r in many)  # and the same on every rank
    k = len(SIZES)
    # Steady state: one inter-node and one intra-node collective instead of two per bucket
    # (+ one checksum all-gather per bucket at each verification, every third version).
    verify_steps = [t for t in range(1, 6) if t % 3 == 0]
    for t in range(1, 6):
        extra = k if t in verify_steps else 0
        assert one[0]["calls"][t] == 2 * k + extra
        assert many[0]["calls"][t] == 2 + extra


@pytest.mark.parametrize("padded", [False, True])
def test_int8_reference_and_one_node_coalesce(dist, padded):
    """The int8 reference (its 8-bit rows are the node payload) and one node (no reference: the
    shards are the payload) coalesce too, bitwise the one-by-one gathers, one collective per link."""
    k = len(SIZES)
    for cfg, rpn, per_step in [({"mode": "diff", "reference": "int8"}, 2, 2), ({"mode": "diff"}, 4, 1)]:
        one = dist.run(_run, 4, rpn, False, cfg, 3, torch.bfloat16, padded)
        many = dist.run(_run, 4, rpn, True, cfg, 3, torch.bfloat16, padded)
        for a, b in zip(one, many):
            assert a["digests"] == b["digests"] and a["refs"] == b["refs"]
            assert json.dumps(a["stats"], sort_keys=True) == json.dumps(b["stats"], sort_keys=True)
        assert all(r["digests"] == many[0]["digests"] for r in many)
        assert one[0]["calls"][1:] == [per_step * k] * 2 and many[0]["calls"][1:] == [per_step] * 2
        if rpn == 4:
            assert many[0]["refs"] == [None] * k  # one node keeps no reference


def test_padded_outputs_and_fallbacks(dist):
    # A padded output takes the node-interleaved rows directly; exact mode is not coalesced.
    one = dist.run(_run, 4, 2, False, {"mode": "diff"}, 3, torch.float32, True)
    many = dist.run(_run, 4, 2, True, {"mode": "diff"}, 3, torch.float32, True)
    assert [r["digests"] for r in one] == [r["digests"] for r in many]
    one = dist.run(_run, 4, 2, False, {"mode": "exact"}, 2, torch.float32, False)
    many = dist.run(_run, 4, 2, True, {"mode": "exact"}, 2, torch.float32, False)
    assert [r["digests"] for r in one] == [r["digests"] for r in many]
    assert many[0]["calls"] == one[0]["calls"] == [len(SIZES)] * 2


def test_length_mismatch_is_named():
    with pytest.raises(ValueError, match="2 gathers, 1 shards"):
        gather_coalesced([object(), object()], [torch.zeros(1)], [torch.zeros(1)])
