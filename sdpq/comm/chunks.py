"""How a gradient bucket is cut for the two-level reduce-scatter, as a pure function: what
GradReduceScatter sends, and what the scaling model (sdpq.bench.scaling_model) counts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ..config import GradientsConfig
from .segments import BucketLayout, Segment, aligned_layout, row_block

__all__ = ["ChunkLayout", "chunk_layout"]


class ChunkLayout(NamedTuple):
    chunk_numel: int  # ceil(numel / N): the elements each rank gets
    padded_chunk: int  # the chunk on the wire: whole groups, Hadamard blocks and pipeline slices
    slices: int
    hadamard_block: int  # 1 without Hadamard
    placement: BucketLayout | None = None  # where parameters lie in a padded chunk (segments given)


def chunk_layout(
    numel: int,
    world_size: int,
    ranks_per_node: int,
    c: GradientsConfig,
    segments: Sequence[Sequence[Segment]] | None = None,
) -> ChunkLayout:
    """How a bucket of `numel` elements is cut on `world_size` ranks (ranks_per_node per node):
    what GradReduceScatter sends, as a pure function (the scaling model counts bytes with it).
    With `segments` (per chunk, where its parameters lie; sdpq.comm.segments), every group and
    Hadamard block is kept inside one parameter, at the cost of padding each one."""
    N, L = world_size, ranks_per_node
    cn = -(-numel // N)
    groups = max(c.intra_group_size if L > 1 else 1, c.inter_group_size if N // L > 1 else 1)
    # Note: a Hadamard block larger than the chunk would pad every chunk up to the block (a
    # 4096 block on 256-element chunks sends ~16x the bytes); it is clamped to the chunk
    # rounded up to a power of two (never below the groups). Every rank derives the same block.
    block = min(c.hadamard_block, max(groups, 1 << max(0, cn - 1).bit_length())) if c.hadamard else 1
    if segments is not None and c.mode == "two_level":
        if len(segments) != N:
            raise ValueError(f"segments: {len(segments)} chunks given for {N} ranks")
        block = row_block(block, segments) if c.hadamard else 1
        placement, slices = aligned_layout(segments, cn, max(groups, block), block, c.pipeline_chunks)
        return ChunkLayout(cn, placement.padded_chunk, slices, block, placement)
    align = max(groups, block)
    # Fewer slices for small buckets: each slice must hold at least one aligned block.
    slices = max(1, min(c.pipeline_chunks, -(-cn // align)))
    step = align * slices
    padded = -(-cn // step) * step if c.mode == "two_level" else cn
    return ChunkLayout(cn, padded, slices, block)
