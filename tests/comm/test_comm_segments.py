"""Groups and Hadamard blocks kept inside parameters (sdpq.comm.segments), and what it buys:
a gradient row that is zero on every rank comes out of the quantized collectives exactly zero."""

import pytest
import torch
from comm_reference import rs_error_bound

from sdpq.comm import GradAllReduce, GradReduceScatter, Topology
from sdpq.comm.chunks import chunk_layout
from sdpq.comm.segments import Segment, cut_segments, interleaved_segments, sharded_segments
from sdpq.config import GradientsConfig

# A model shaped like today's LLMs: 1-D parameters (a norm weight, biases) shift what follows
# off the block grid; odd widths (192, 320) are not multiples of the 128 block.
SHAPES = [(192,), (1000, 192), (320, 192), (320,), (700, 320), (7,)]
ZERO_ROWS = {1: range(1, 1000, 2), 4: range(0, 700, 3)}  # param index -> rows zero on every rank
LAYOUTS = [(2, 2), (4, 1), (1, 4), (3, 2)]  # (nodes, ranks per node)


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(SHAPES):
        t = torch.randn(shape, generator=g) * (10.0 if i == 0 else 1e-3)  # a norm's gradient is large
        for row in ZERO_ROWS.get(i, ()):
            t[row] = 0
        out.append(t)
    return out


def _fsdp_bucket(grads: list[torch.Tensor], N: int) -> tuple[torch.Tensor, list]:
    """FSDP2's reduce-scatter input: per rank r, every parameter's dim-0 shard r (padded rows)."""
    shards, rows = [], []
    for t in grads:
        R = t.shape[0]
        per = -(-R // N)
        padded = torch.zeros((per * N, *t.shape[1:]))
        padded[:R] = t
        rows.append(padded.view(N, -1))
        shards.append((rows[-1].shape[1], t.shape[-1] if t.dim() > 1 else 0))
    return torch.cat(rows, dim=1).reshape(-1), shards


def _zero_mask(N: int, layout: str) -> torch.Tensor:
    """True where the bucket holds a row that is zero on every rank (in the same layout)."""
    marks = [torch.zeros(s) for s in SHAPES]
    for i, rows in ZERO_ROWS.items():
        for row in rows:
            marks[i][row] = 1
    if layout == "fsdp":
        flat, _ = _fsdp_bucket(marks, N)
    else:
        flat = _ds_bucket(marks, N)
    return flat.bool()


def _ds_bucket(grads: list[torch.Tensor], N: int) -> torch.Tensor:
    """ZeRO-3's coalesced bucket: row r holds chunk r (ceil(numel / N)) of every flat tensor."""
    cols = []
    for t in grads:
        c = -(-t.numel() // N)
        p = torch.zeros(N * c)
        p[: t.numel()] = t.reshape(-1)
        cols.append(p.view(N, c))
    return torch.cat(cols, dim=1).reshape(-1)


def _ds_params() -> list[tuple[int, int]]:
    return [(torch.Size(s).numel(), s[-1] if len(s) > 1 else 0) for s in SHAPES]


def _reduce(ctx, layout: str, aligned: bool, hadamard: bool):
    N = ctx.world_size
    topo = Topology.build(ctx.ranks_per_node)
    grads = _grads(100 + ctx.rank)
    if layout == "fsdp":
        x, shards = _fsdp_bucket(grads, N)
        segs = sharded_segments(shards, N)
    else:
        x = _ds_bucket(grads, N)
        segs = interleaved_segments(_ds_params(), N)
    rs = GradReduceScatter(x.numel(), topo, GradientsConfig(hadamard=hadamard), segments=segs if aligned else None)
    out = rs(x)
    bucket = _fsdp_bucket if layout == "fsdp" else lambda g, n: (_ds_bucket(g, n), None)
    inputs = torch.stack([bucket(_grads(100 + r), N)[0] for r in range(N)])
    cn, rank = rs.chunk_numel, ctx.rank
    exact = torch.zeros(cn, dtype=torch.float64)
    mine = inputs.double().sum(0)[rank * cn : (rank + 1) * cn]
    exact[: mine.numel()] = mine
    zero = _zero_mask(N, layout)[rank * cn : (rank + 1) * cn]
    nonzero_of_zero = int((out[: zero.numel()][zero] != 0).sum())
    if not aligned:
        return nonzero_of_zero, None
    # the error of every Hadamard block (in the padded chunk) within the quantizer's bound
    bound, kind = rs_error_bound(inputs, rank, ctx.ranks_per_node, rs)
    err = torch.zeros(rs.padded_chunk, dtype=torch.float64)
    rs.placement.pack_chunk(out.double() - exact, rank, err)
    B = rs.hadamard_block
    e = err.view(-1, B).norm(dim=-1) if kind == "block_l2" else err.abs()
    ratio = torch.where(e == 0, 0.0, e / bound)  # an all-zero block must come back exactly zero
    return nonzero_of_zero, float(ratio.max())


@pytest.mark.parametrize("nodes,rpn", LAYOUTS, ids=[f"{n}x{l}" for n, l in LAYOUTS])
@pytest.mark.parametrize("layout", ["fsdp", "zero3"])
def test_zero_rows_stay_zero_in_the_reduce_scatter(dist, nodes, rpn, layout):
    res = dist.run(_reduce, nodes * rpn, rpn, layout, True, True, timeout=60)
    assert [n for n, _ in res] == [0] * (nodes * rpn)
    assert max(ratio for _, ratio in res) <= 1.0


def test_unaligned_blocks_leak_noise_into_zero_rows(dist):
    """What the alignment fixes: the same bucket without segments (blocks at fixed multiples)."""
    res = dist.run(_reduce, 4, 2, "fsdp", False, True, timeout=60)
    assert sum(n for n, _ in res) > 0


def _all_reduce(ctx, aligned: bool):
    topo = Topology.build(ctx.ranks_per_node)
    grads = _grads(200 + ctx.rank)
    x, shards = _fsdp_bucket(grads, 1)  # a shard buffer: the parameters one after another
    segs = sharded_segments(shards, 1)[0]
    ar = GradAllReduce(x.numel(), topo, GradientsConfig(), segments=segs if aligned else None)
    out = ar(x.clone())
    zero = _zero_mask(1, "fsdp")
    return int((out[zero] != 0).sum()), out


@pytest.mark.parametrize("nodes,rpn", [(4, 1), (2, 2), (3, 1)], ids=["4x1", "2x2", "3x1"])
def test_zero_rows_stay_zero_in_the_hsdp_all_reduce(dist, nodes, rpn):
    res = dist.run(_all_reduce, nodes * rpn, rpn, True, timeout=60)
    assert [n for n, _ in res] == [0] * (nodes * rpn)
    assert all(torch.equal(res[0][1], o) for _, o in res)  # replicas stay bitwise identical


# ---------------------------------------------------------------- the layout itself (no ranks)


@pytest.mark.parametrize("N", [2, 3, 4, 6])
@pytest.mark.parametrize("builder", ["sharded", "interleaved", "cut"])
def test_every_block_lies_in_one_row_of_one_parameter(N, builder):
    params = _ds_params()
    if builder == "interleaved":
        segs, numel = interleaved_segments(params, N), None
    elif builder == "sharded":
        _, shards = _fsdp_bucket([torch.zeros(s) for s in SHAPES], N)
        segs = sharded_segments(shards, N)
    else:
        flat = [Segment(sum(n for n, _ in params[:i]), n, w) for i, (n, w) in enumerate(params)]
        numel = sum(n for n, _ in params)
        segs = cut_segments(flat, numel, N)
    cn = max(s.start + s.length for c in segs for s in c)
    cfg = GradientsConfig()
    lay = chunk_layout(cn * N, N, 2 if N % 2 == 0 else 1, cfg, segs)
    b, placement = lay.hadamard_block, lay.placement
    assert b == 64  # widths 192 and 320: the largest power of two dividing both
    for r, segs_r in enumerate(segs):
        owner = {}  # block index -> (segment, row)
        for s, (src, dst, n) in zip(sorted(segs_r), placement.runs[r]):
            assert src == s.start and n == s.length
            for k in range(n):
                row = (s.phase + k) // s.width if s.width else 0
                who = owner.setdefault((dst + k) // b, (s, row))
                assert who == (s, row), f"block {(dst + k) // b} holds {who} and {(s, row)}"
            assert dst % 128 == (s.phase % b if s.width else 0)  # a fresh group per parameter
    # pack / unpack is the identity on the elements the segments cover, and zero elsewhere
    x = torch.randn(cn * N)
    covered = placement.unpack(placement.pack(torch.ones_like(x), x.numel())).bool()
    assert int(covered.sum()) == sum(s.length for c in segs for s in c)
    assert torch.equal(placement.unpack(placement.pack(x, x.numel())), x * covered)


def test_padding_cost_of_alignment():
    """The padding is counted: the aligned chunk is longer, by less than one group per segment."""
    N = 4
    _, shards = _fsdp_bucket([torch.zeros(s) for s in SHAPES], N)
    cn = sum(n for n, _ in shards)
    plain = chunk_layout(cn * N, N, 2, GradientsConfig())
    aligned = chunk_layout(cn * N, N, 2, GradientsConfig(), sharded_segments(shards, N))
    assert plain.padded_chunk <= aligned.padded_chunk < cn + 128 * len(shards) + 128


def test_segments_that_overlap_are_refused():
    with pytest.raises(ValueError, match="overlaps"):
        chunk_layout(200, 2, 1, GradientsConfig(), [[Segment(0, 60), Segment(50, 10)], []])


# ---------------------------------------------------------------- weights (FSDP2's all-gather bucket)


def _weights(ctx, aligned: bool):
    from sdpq.comm import WeightGather
    from sdpq.config import WeightsConfig

    topo = Topology.build(ctx.ranks_per_node)
    norm, matrix = 64, 8192  # a norm weight's shard, then a matrix's
    segs = [Segment(0, norm), Segment(norm, matrix, 256)]
    # An fp32 reference: what is measured is the difference's quantizer (a bf16 one would round
    # the norm's 1e-4 moves away, as bf16 compute weights do).
    cfg = WeightsConfig(bits=4, reference="fp32")
    wg = WeightGather((norm + matrix) * ctx.world_size, topo, cfg, segments=segs if aligned else None)
    g = torch.Generator().manual_seed(ctx.rank)
    w = torch.randn(norm + matrix, generator=g)
    wg.gather(w)  # the first refresh is exact
    delta = torch.randn(norm + matrix, generator=g)
    delta[:norm] *= 1e-4  # a norm moves little, a matrix a lot
    w = w + delta
    wg.mark_weights_changed(exact=False)
    full = wg.gather(w).view(ctx.world_size, -1)
    err = (full[ctx.rank] - w)[:norm].abs().max() / delta[:norm].abs().max()
    return float(err), wg.spec.group_size, wg.placement is not None and wg.placement.padded_chunk


def test_weight_groups_stay_inside_one_parameter(dist):
    aligned = dist.run(_weights, 4, 2, True, timeout=60)
    plain = dist.run(_weights, 4, 2, False, timeout=60)
    # The norm's difference is quantized at its own scale: within half a 4-bit step of it.
    assert all(err <= 0.5 / 7 * (1 + 1e-3) for err, _, _ in aligned), aligned
    assert all(err > 0.9 for err, _, _ in plain), plain  # at the matrix's scale its change rounds to 0
    # The smallest wire: groups of 256 (256 + 8192 codes + 33 scales: 4356 bytes) beat 2048
    # (2048 + 8192 codes + 5 scales: 5140 bytes), 512 (4612) and 128 (4368).
    assert {(g, n) for _, g, n in aligned} == {(256, 8448)}
