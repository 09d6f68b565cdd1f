"""Two-level quantized reduce of owner-uneven buckets (sdpq.comm.grads_owned, ZeRO-1/2)."""

import pytest
import torch
from comm_reference import all_inputs, check_bound, two_level_bound

from sdpq.comm import CommStats, OwnedReduceScatter, Piece, Topology
from sdpq.comm.grads_owned import flat_pieces, pack_layout
from sdpq.config import GradientsConfig
from sdpq.quant import hadamard

LAYOUTS = [(2, 2), (1, 4), (4, 1)]
IDS = [f"{n}x{l}" for n, l in LAYOUTS]


def _pieces(kind: str, numel: int, N: int) -> list[Piece]:
    """How a DeepSpeed bucket splits among owners: "one" (all of it one owner's partition),
    "two" (the end of owner 1's partition, the start of owner 2's), "all" (every owner, unequal
    shares, parameters of odd sizes)."""
    if kind == "one":
        return [Piece(0, 300, 2), Piece(300, numel - 300, 2)]
    if kind == "two":
        return [Piece(0, 1000, 1), Piece(1000, 77, 1), Piece(1077, numel - 1077, 2)]
    cuts = [0, 5, 400, 1500, 1533, 2600, numel]
    return [Piece(a, b - a, (i * 3) % N) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]


def _owned_case(ctx, numel, kind, cfg_kwargs, dtype):
    topo = Topology.build(ctx.ranks_per_node)
    rec = CommStats()
    ors = OwnedReduceScatter(topo, GradientsConfig(**cfg_kwargs), record_to=rec)
    inputs = all_inputs(ctx.world_size, numel, "normal", 4).to(dtype)
    pieces = _pieces(kind, numel, ctx.world_size)
    got = ors(inputs[ctx.rank].clone(), pieces)
    exact = inputs.double().sum(0)
    res = {"pieces": [(p, v.clone()) for p, v in got], "stats": rec.as_dict(), "ratio": None}
    if ors.config.mode == "two_level" and got:
        # the bound of the two-level reduce-scatter, on what every source sends for this owner
        lay = ors.layout(pieces)
        lo, n = lay.starts[ctx.rank], lay.sizes[ctx.rank]
        Y = torch.zeros(ctx.world_size, lay.total)
        for p, at in lay.runs:
            Y[:, at : at + p.numel] = inputs[:, p.offset : p.offset + p.numel].float()
        if ors.config.hadamard:
            Y = hadamard(Y, ors.block, ors.config.seed)
        Yd = Y[:, lo : lo + n].double()
        bound, bkind = two_level_bound(
            Yd, ctx.rank, ctx.ranks_per_node, ors.config, ors.intra_spec, ors.inter_spec, ors.block
        )
        out, want = torch.zeros(n), torch.zeros(n, dtype=torch.float64)
        for p, v in got:
            at = next(a for q, a in lay.runs if q == p) - lo
            out[at : at + p.numel] = v
            want[at : at + p.numel] = exact[p.offset : p.offset + p.numel]
        res["ratio"] = check_bound(out, want, bound, bkind, ors.block)
    res["exact"] = exact
    return res


@pytest.mark.parametrize("nodes,rpn", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("kind", ["one", "two", "all"])
def test_each_owner_gets_its_pieces_within_the_bound(dist, nodes, rpn, kind):
    N = nodes * rpn
    res = dist.run(_owned_case, N, rpn, 3000, kind, {}, torch.bfloat16)
    owned = {}
    for r, out in enumerate(res):
        for p, v in out["pieces"]:
            assert p.owner == r
            owned[p] = v
            rel = float((v.double() - out["exact"][p.offset : p.offset + p.numel]).norm())
            assert rel <= 0.25 * float(out["exact"][p.offset : p.offset + p.numel].norm()) + 1e-6
        if out["ratio"] is not None:
            assert out["ratio"] <= 1.0, (r, out["ratio"])
    assert sorted(owned) == sorted(p for p in _pieces(kind, 3000, N) if p.numel)  # every piece, once


def test_bytes_are_those_of_a_balanced_reduce_scatter(dist):
    """All of a bucket owned by one rank: each element leaves each rank once at the stage's
    width, the owner receives it from every other rank, nothing padded to the other owners."""
    numel = 128 * 40
    res = dist.run(_owned_case, 4, 2, numel, "one", {"hadamard": False}, torch.bfloat16)
    per = [out["stats"] for out in res]
    intra_sent = [s["gradients"]["intra"]["bytes"] for s in per]
    inter_sent = [s["gradients"]["inter"]["bytes"] for s in per]
    padded = 384 + 4864  # the two parameters (300 and 4820 elements) on whole groups of 128
    row8, row4 = padded + 2 * (padded // 128), padded // 2 + 2 * (padded // 128)  # codes + bf16 scales
    # owner 2 = node 1, local 0: its node peer (rank 3) and the other node's local 0 (rank 0)
    # send it 8-bit rows; rank 0 sums node 0's partial (rank 1's row) and sends it 4-bit.
    assert intra_sent == [0, row8, 0, row8]
    assert inter_sent == [row4, 0, 0, 0]


def test_a_parameter_zero_on_every_rank_comes_back_zero(dist):
    """Groups and Hadamard blocks never mix two pieces: a parameter whose gradient is zero on
    every rank (a frozen or unused one) gets exact zeros, not its neighbours' noise."""
    for r, got in enumerate(dist.run(_zero_piece_case, 4, 2)):
        zero = [v for p, v in got if p.numel == 77]
        assert all(torch.count_nonzero(v) == 0 for v in zero), r


def _zero_piece_case(ctx):
    topo = Topology.build(ctx.ranks_per_node)
    ors = OwnedReduceScatter(topo, GradientsConfig(), record_to=CommStats())
    x = all_inputs(ctx.world_size, 3000, "normal", 5)[ctx.rank]
    x[1000:1077] = 0
    pieces = [Piece(0, 1000, 1), Piece(1000, 77, 1), Piece(1077, 1923, 1)]
    return [(p, v.clone()) for p, v in ors(x, pieces)]


def _feedback_case(ctx, ef: bool, calls: int):
    """The same bucket reduced `calls` times (nearest rounding, so each call's error repeats):
    -> the norm of (sum of the owner's outputs - calls x the exact sums), per call count."""
    topo = Topology.build(ctx.ranks_per_node)
    ors = OwnedReduceScatter(topo, GradientsConfig(rounding="nearest", error_feedback=ef), record_to=CommStats())
    inputs = all_inputs(ctx.world_size, 3000, "normal", 6)
    pieces = _pieces("all", 3000, ctx.world_size)
    exact = inputs.double().sum(0)
    acc: dict = {}
    errs = []
    for k in range(1, calls + 1):
        for p, v in ors(inputs[ctx.rank].clone(), pieces, key="bucket"):
            acc[p] = acc.get(p, 0) + v.double()
        errs.append(sum(float((acc[p] - k * exact[p.offset : p.offset + p.numel]).norm() ** 2) for p in acc) ** 0.5)
    held = sum(t.numel() for _, t in ors.held_tensors())
    state = ors.state_dict()
    twin = OwnedReduceScatter(topo, ors.config, record_to=CommStats())
    twin.load_state_dict(state)
    again = [v for _, v in ors(inputs[ctx.rank].clone(), pieces, key="bucket")]
    same = [v for _, v in twin(inputs[ctx.rank].clone(), pieces, key="bucket")]
    ors.sweep()  # "bucket" was reduced since the last sweep: kept; then not: dropped
    kept = len(ors.residuals)
    ors.sweep()
    return errs, held, all(torch.equal(a, b) for a, b in zip(again, same)), (kept, len(ors.residuals))


def test_error_feedback_keeps_the_inter_node_error_from_accumulating(dist):
    """2 nodes x 1 (the inter-node stage alone): without feedback 8 calls' sums carry 8 times one
    call's error; with it, the residual carries each call's error into the next, and the total
    stays within about one call's error. The residual is one bucket's rows to the other node, a
    reloaded state continues bitwise, and a sweep drops the residual of a bucket not reduced since
    the last one."""
    plain = dist.run(_feedback_case, 2, 1, False, 8)
    fed = dist.run(_feedback_case, 2, 1, True, 8)
    for (e0, held0, _, _), (e1, held1, same, swept) in zip(plain, fed):
        assert e0[-1] > 7 * e0[0] > 0  # deterministic rounding: the error repeats
        assert e1[-1] <= 1.5 * e1[0], e1
        assert held0 == 0 and held1 > 0 and same and swept == (1, 0)
    with pytest.raises(ValueError, match="key"):
        topo = Topology(world_size=1, ranks_per_node=1, rank=0)
        OwnedReduceScatter(topo, GradientsConfig(error_feedback=True))(torch.zeros(8), [Piece(0, 8, 0)])


def test_exact_mode_is_refused():
    """ZeRO-1/2's exact mode is DeepSpeed's own reduction; this class is the quantized one."""
    with pytest.raises(ValueError, match="two_level"):
        OwnedReduceScatter(Topology(world_size=1, ranks_per_node=1, rank=0), GradientsConfig(mode="exact"))


def test_pack_layout_aligns_every_piece():
    lay = pack_layout([Piece(0, 5, 1), Piece(5, 130, 0), Piece(135, 1, 1)], 2, 128)
    assert lay.starts == (0, 256) and lay.sizes == (256, 256) and lay.valid == (130, 6)
    assert [at for _, at in lay.runs] == [0, 256, 384] and lay.total == 512
    with pytest.raises(ValueError, match="owner"):
        pack_layout([Piece(0, 5, 2)], 2, 128)


@pytest.mark.parametrize("cap", [1, 6, 7, 100])
def test_flat_pieces_cover_the_buffer_once_each_piece_one_tensor_one_owner(cap):
    """A flat fp32 gradient buffer (DeepSpeed's BF16_Optimizer): tensors of sizes 5, 0, 7, 3 and
    padding to 2 partitions of 8, reduced in windows of at most `cap` elements."""
    sizes, P = [5, 0, 7, 3], 8
    bounds = [0, 5, 5, 12, 15]
    windows = flat_pieces(sizes, P, cap)
    covered = []
    for a, b, pieces in windows:
        assert 0 < b - a <= cap and sum(p.numel for p in pieces) == b - a
        for p in pieces:
            lo, hi = a + p.offset, a + p.offset + p.numel
            covered.extend(range(lo, hi))
            assert p.owner == lo // P == (hi - 1) // P, "one owner per piece"
            assert sum(lo >= t and hi <= u for t, u in zip(bounds, bounds[1:]) if u > t) == 1, "one tensor per piece"
    assert covered == list(range(15))
    with pytest.raises(ValueError, match="cap"):
        flat_pieces(sizes, P, 0)
