"""Where a bucket's parameters lie, and a wire layout that keeps every quantization group and
Hadamard block inside one parameter (pure functions of shapes; no torch.distributed).

A collective cuts a flat bucket into N chunks (chunk r goes to rank r). Without more knowledge
it cuts each chunk into groups and Hadamard blocks at fixed multiples: a block then mixes the
end of one parameter with the start of the next (a norm weight's gradient with an embedding's),
and the rows of a parameter whose shard starts mid-block. A Hadamard block that mixes an
all-zero row with a non-zero one gives the zero row quantization noise, and Adam turns any
non-zero gradient into a full-size update.

Given each chunk's `Segment`s (runs of one parameter's elements), `aligned_layout` places every
segment at the start of a fresh group (plus its phase within the Hadamard block, so that blocks
start at the parameter's row boundaries) and pads its end to a whole group. Padding is zeros on
the wire; the collectives count its bytes in their statistics.

Note (guarantee): with `block` chosen by `row_block`, a Hadamard block holds elements of one
parameter only, and of one row of it when the row width is a multiple of the block. So a row
that is zero on every rank (an absent token's embedding) comes back exactly zero. Rows narrower
than 32 elements, or of a width that is not a multiple of 32, share blocks with neighbouring
rows of the same parameter (never with another parameter's).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..quant import QuantSpec

__all__ = [
    "Segment",
    "BucketLayout",
    "aligned_layout",
    "aligned_group_spec",
    "row_block",
    "sharded_segments",
    "interleaved_segments",
    "cut_segments",
]

# The smallest block `row_block` shrinks to for a row width: below it, a width's blocks span
# several rows of its parameter instead (smaller blocks smooth too little).
MIN_ROW_BLOCK = 32


class Segment(NamedTuple):
    """A run of one parameter's elements inside a chunk."""

    start: int  # offset in the chunk
    length: int
    width: int = 0  # the parameter's row width (last dim); 0 for a 1-D parameter
    phase: int = 0  # offset of the segment's first element within its row


class BucketLayout(NamedTuple):
    """Where each chunk's elements sit in the padded chunk that travels on the wire."""

    chunk_numel: int
    padded_chunk: int
    block: int  # the Hadamard block the layout keeps inside rows (1: no transform)
    runs: tuple[tuple[tuple[int, int, int], ...], ...]  # per chunk: (src offset, dst offset, length)

    def digest(self) -> str:
        """A short fingerprint, for the agreement check (every rank must place alike)."""
        return hashlib.sha256(repr(self.runs).encode()).hexdigest()[:16]

    @property
    def shared(self) -> bool:
        """Every chunk has the same runs (FSDP2's buckets): one copy per run for all chunks."""
        return all(r == self.runs[0] for r in self.runs[1:])

    def pack(self, x: torch.Tensor, numel: int) -> torch.Tensor:
        """The flat bucket x (chunk r = x[r*cn : (r+1)*cn], the last ones possibly short) ->
        [N, padded_chunk] rows in x's dtype, zero where nothing is placed."""
        N, cn, C = len(self.runs), self.chunk_numel, self.padded_chunk
        rows = torch.zeros((N, C), dtype=x.dtype, device=x.device)
        if self.shared and N * cn == numel:
            xv = x.view(N, cn)
            for src, dst, n in self.runs[0]:
                rows[:, dst : dst + n] = xv[:, src : src + n]
            return rows
        for r in range(N):
            self.pack_chunk(x[r * cn : min(numel, (r + 1) * cn)], r, rows[r])
        return rows

    def pack_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A one-chunk layout (a weight gather's): every row of x [R, chunk_numel] placed alike
        -> [R, padded_chunk], zero where nothing is placed."""
        if len(self.runs) != 1:
            raise ValueError(f"pack_rows: a layout of one chunk only, this one has {len(self.runs)}")
        rows = torch.zeros((x.shape[0], self.padded_chunk), dtype=x.dtype, device=x.device)
        for src, dst, n in self.runs[0]:
            rows[:, dst : dst + n] = x[:, src : src + n]
        return rows

    def pack_chunk(self, chunk: torch.Tensor, r: int, row: torch.Tensor) -> None:
        """Chunk r (at most chunk_numel elements) -> its padded row (pad positions untouched)."""
        for src, dst, n in self.runs[r]:
            k = max(0, min(n, chunk.numel() - src))
            if k:
                row[dst : dst + k] = chunk[src : src + k]

    def unpack_chunk(self, row: torch.Tensor, r: int, out: torch.Tensor) -> None:
        """The padded row of chunk r -> out (chunk_numel elements; zero where no segment is).
        A layout of one chunk unpacks any row with it (r is then ignored)."""
        runs = self.runs[r if len(self.runs) > 1 else 0]
        for src, dst, n in runs:
            out[src : src + n] = row[dst : dst + n]
        _zero_gaps(runs, out)

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, padded_chunk] -> [N * chunk_numel] in chunk order (a one-chunk layout: every row
        unpacked alike, one copy per run for all rows)."""
        N, cn = rows.shape[0], self.chunk_numel
        out = torch.empty((N, cn), dtype=rows.dtype, device=rows.device)
        if len(self.runs) == 1 and N > 1:
            for src, dst, n in self.runs[0]:
                out[:, src : src + n] = rows[:, dst : dst + n]
            _zero_gaps(self.runs[0], out)
            return out.view(-1)
        for r in range(N):
            self.unpack_chunk(rows[r], r, out[r])
        return out.view(-1)


def _zero_gaps(runs: tuple[tuple[int, int, int], ...], out: torch.Tensor) -> None:
    """Zero what no run covers along out's last dim (runs are sorted by source offset)."""
    end = 0
    for src, _, n in runs:
        if src > end:
            out[..., end:src] = 0
        end = src + n
    out[..., end:] = 0


def row_block(block: int, chunks: Sequence[Sequence[Segment]]) -> int:
    """The largest power of two <= block that divides every row width of at least MIN_ROW_BLOCK
    (a block then never straddles a row of those parameters)."""
    for segs in chunks:
        for s in segs:
            low = s.width & -s.width
            if s.width and MIN_ROW_BLOCK <= low < block:
                block = low
    return block


def aligned_layout(
    chunks: Sequence[Sequence[Segment]], chunk_numel: int, align: int, block: int, slices: int
) -> tuple[BucketLayout, int]:
    """Place each chunk's segments: each starts a fresh `align`-element unit (plus its phase
    modulo `block` when it has rows, so blocks start at row boundaries) and is padded to whole
    units. -> (layout, slices), the padded chunk a multiple of align * slices, where slices is
    reduced so that each slice holds at least one unit."""
    runs, longest = [], 0
    for r, segs in enumerate(chunks):
        pos, out, end = 0, [], 0
        for s in sorted(segs):
            if s.start < end or s.length < 0 or s.start + s.length > chunk_numel:
                raise ValueError(
                    f"chunk {r}: segment {tuple(s)} overlaps another or leaves the chunk of {chunk_numel} elements"
                )
            end = s.start + s.length
            pos = -(-pos // align) * align + (s.phase % block if s.width and s.width % block == 0 else 0)
            out.append((s.start, pos, s.length))
            pos += s.length
        runs.append(tuple(out))
        longest = max(longest, -(-pos // align) * align)
    slices = max(1, min(slices, longest // align))
    step = align * slices
    padded = max(step, -(-longest // step) * step)
    return BucketLayout(chunk_numel, padded, block, tuple(runs)), slices


def sharded_segments(shards: Sequence[tuple[int, int]], world_size: int) -> list[list[Segment]]:
    """FSDP2's buckets: every chunk is the concatenation of each parameter's (padded) shard,
    given as (elements, row width); a shard holds whole rows, so every phase is 0."""
    segs, off = [], 0
    for numel, width in shards:
        segs.append(Segment(off, numel, width))
        off += numel
    return [segs] * world_size


def interleaved_segments(params: Sequence[tuple[int, int]], world_size: int) -> list[list[Segment]]:
    """ZeRO-3's coalesced buckets: chunk r holds elements [r*c, (r+1)*c) of every parameter's
    flat tensor (c = ceil(elements / N)), given as (elements, row width)."""
    out = []
    for r in range(world_size):
        segs, off = [], 0
        for numel, width in params:
            c = -(-numel // world_size)
            segs.append(Segment(off, c, width, (r * c) % width if width else 0))
            off += c
        out.append(segs)
    return out


def cut_segments(segments: Sequence[Segment], numel: int, world_size: int) -> list[list[Segment]]:
    """A flat bucket of `numel` elements described by `segments` (offsets in the bucket), cut
    into chunks of ceil(numel / N) (HSDP's all-reduce of a shard buffer)."""
    cn = -(-numel // world_size)
    out = []
    for r in range(world_size):
        lo, hi, segs = r * cn, (r + 1) * cn, []
        for s in segments:
            a, b = max(lo, s.start), min(hi, s.start + s.length)
            if a < b:
                phase = (s.phase + a - s.start) % s.width if s.width else 0
                segs.append(Segment(a - lo, b - a, s.width, phase))
        out.append(segs)
    return out


def aligned_group_spec(
    spec: QuantSpec, segments: Sequence[Segment], shard_numel: int
) -> tuple[QuantSpec, BucketLayout]:
    """One shard (a weight gather's: the same segments on every rank) with every group inside one
    parameter: each parameter's run starts a fresh group.
    Of the group sizes from the configured one down to 32, the one that sends the fewest bytes
    (small parameters, norms and biases, waste less padding on smaller groups; a smaller group
    is never less precise)."""
    best = None
    g = spec.group_size
    while g >= 32:
        placement, _ = aligned_layout([segments], shard_numel, g, 1, 1)
        s = dataclasses.replace(spec, group_size=g)
        cost = s.wire_bytes(placement.padded_chunk)
        if best is None or cost < best[0]:
            best = (cost, s, placement)
        g //= 2
    assert best is not None
    return best[1], best[2]
