"""What one rank keeps, by kind (the kinds of `sdpq.memory`), computed from parameter shapes
before launch: the same bytes `sdpq.memory.report` counts on a live run of sdpq.train's setups.

Frameworks and their precision (what users run, and what sdpq.train runs):
- "fsdp2" / "hsdp": `fully_shard` per block and at the root (HSDP: on the L ranks of a node,
  replicated across nodes), `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` on fp32
  parameters and torch's AdamW. With sdpq's AdamW (FP8 states, MCF master) the parameters are
  bf16. FSDP2 pads each parameter's dim 0 to a multiple of the shard group; rank r holds rows
  [r c, (r + 1) c) of c = ceil(rows / shards), its storage padded to c rows.
- "zero3": DeepSpeed ZeRO-3 with `"bf16": {"enabled": true}`: bf16 partitions, fp32 master
  partitions and moments, bf16 gradient partitions; each parameter's partition is
  ceil(numel / N). sdpq's AdamW keeps a bf16 master (aliased to the compute partition with
  `workarounds.deepspeed_alias_bf16_master`, else a second bf16 copy).
- "zero1" / "zero2": DeepSpeed ZeRO-1/2 with bf16: every rank holds the whole flat bf16 group
  (padded to a multiple of 2N) and the fp32 master and moments of its partition P = padded / N;
  gradients are the full bf16 set at stage 1 (accumulated per parameter until the boundary) and
  the rank's bf16 partition at stage 2 (the gradient buckets are transient). sdpq keeps no
  weight reference there (every rank holds the weights) and its AdamW a native fp32 master.

Note: FP8 moments keep three fp32 numbers (scale, k, gm) per group of `optimizer.group_size`
along the last dimension of each local tensor; every optimizer state has a 4-byte step counter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..comm.chunks import chunk_layout
from ..comm.reference import INT8_GROUP
from ..comm.segments import aligned_group_spec, sharded_segments
from ..config import Config
from ..integrations import zero3_weight_group
from ..quant import QuantSpec
from ..quant.groupwise import SCALE_DTYPES

__all__ = ["FRAMEWORKS", "Arm", "rank_memory"]

FRAMEWORKS = ("fsdp2", "hsdp", "zero3", "zero1", "zero2")
Shape = tuple[int, ...]
# "auto" is the compute dtype: bf16 in every setup planned here (see the module docstring).
REFERENCE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "auto": 2}


@dataclass(frozen=True)
class Arm:
    """One configuration to plan: plain (sdpq None), ZeRO++ (hpZ's secondary bf16 copy on top of
    plain ZeRO-3), or an sdpq block."""

    name: str
    sdpq: Config | None = None
    zeropp: bool = False


def _local_rows(rows: int, shards: int, rank: int) -> tuple[int, int]:
    """(rows rank holds, rows its storage is padded to) of a dim-0 shard."""
    c = -(-rows // shards)
    return max(0, min(c, rows - rank * c)), c


def _fp8_metadata(shape: Shape, group: int) -> int:
    """Bytes of one FP8 moment's scale, k and gm for a local tensor of `shape`."""
    if not shape or 0 in shape:
        return 0
    rows = math.prod(shape[:-1])
    return rows * -(-shape[-1] // group) * 3 * 4


def _optimizer(shape: Shape, cfg: Config | None) -> tuple[int, int]:
    """(master bytes, optimizer-state bytes) of one local tensor (sdpq's AdamW when enabled)."""
    n = math.prod(shape)
    if cfg is None or not cfg.optimizer.enabled:
        return 0, 8 * n + 4  # torch AdamW: fp32 exp_avg and exp_avg_sq, step
    o = cfg.optimizer
    per = {"fp8": 1, "bf16": 2, "fp32": 4}[o.states]
    states = 2 * per * n + 4
    if o.states == "fp8":
        states += 2 * _fp8_metadata(shape, o.group_size)
    if o.mcf_second_moment:
        states += 2 * n  # v's bf16 compensation
    return (2 * n if o.master == "mcf" else 0), states


def _mcf(cfg: Config | None) -> bool:
    return cfg is not None and cfg.optimizer.enabled and cfg.optimizer.master == "mcf"


def _reference_bytes(cfg: Config | None, nodes: int, shard: int, segments=None, group_cap: int | None = None) -> int:
    """R_l of one bucket whose shard has `shard` elements (0 without a reference)."""
    if cfg is None or cfg.weights.mode != "diff" or nodes == 1:
        return 0
    w = cfg.weights
    if w.reference != "int8":
        return nodes * shard * REFERENCE_BYTES[w.reference]
    spec = QuantSpec(bits=w.bits, group_size=w.group_size, scale_dtype=SCALE_DTYPES[w.scale_dtype])
    if group_cap is not None and group_cap < spec.group_size:
        spec = QuantSpec(bits=w.bits, group_size=group_cap, scale_dtype=spec.scale_dtype)
    width = shard
    if segments is not None:
        spec, placement = aligned_group_spec(spec, segments, shard)
        width = placement.padded_chunk
    return nodes * QuantSpec(bits=8, group_size=min(INT8_GROUP, spec.group_size)).wire_bytes(width)


def _error_feedback(cfg: Config | None, numel: int, world: int, per_node: int) -> int:
    if cfg is None or not cfg.gradients.error_feedback or world // per_node == 1:
        return 0
    return (world // per_node) * chunk_layout(numel, world, per_node, cfg.gradients).padded_chunk * 4


def _fsdp(units: Sequence[Sequence[Shape]], shards: int, nodes: int, arm: Arm, rank: int, per_node: int) -> dict:
    cfg = arm.sdpq
    pbytes = 2 if _mcf(cfg) else 4
    out = dict.fromkeys(("parameters", "gradients", "master", "optimizer_states", "weight_reference"), 0)
    out["error_feedback"] = 0
    for shapes in units:
        padded_numels = []
        for s in shapes:
            held, padded = _local_rows(s[0], shards, rank)
            rest = math.prod(s[1:])
            padded_numels.append(padded * rest)
            out["parameters"] += padded * rest * pbytes
            master, states = _optimizer((held, *s[1:]), cfg)
            out["master"] += master
            out["optimizer_states"] += states
        shard = sum(padded_numels)
        out["gradients"] += shard * pbytes  # one flat reduce-scatter output per module, in the parameter dtype
        segments = sharded_segments([(n, 0) for n in padded_numels], 1)[0]
        out["weight_reference"] += _reference_bytes(cfg, nodes, shard, segments)
        out["error_feedback"] += _error_feedback(cfg, shard * shards, shards, per_node)
    return out


def _zero3(units: Sequence[Sequence[Shape]], world: int, nodes: int, arm: Arm, per_node: int) -> dict:
    cfg = arm.sdpq
    parts = [-(-math.prod(s) // world) for shapes in units for s in shapes]
    flat = sum(parts)
    out = {"parameters": 2 * flat, "gradients": 2 * flat}
    if _mcf(cfg):
        aliased = cfg is not None and cfg.workarounds.deepspeed_alias_bf16_master
        master, states = _optimizer((flat,), cfg)
        out["master"] = master + (0 if aliased else 2 * flat)
    else:
        master, states = _optimizer((flat,), cfg)
        out["master"] = 4 * flat
    out["optimizer_states"] = states
    out["weight_reference"] = sum(
        _reference_bytes(cfg, nodes, p, group_cap=zero3_weight_group(p, cfg.weights.group_size) if cfg else None)
        for p in parts
    )
    if arm.zeropp:  # hpZ: a bf16 secondary partition of the model inside the node
        out["weight_reference"] += 2 * sum(-(-math.prod(s) // per_node) for shapes in units for s in shapes)
    out["error_feedback"] = 0  # per gradient bucket, cut at run time; not planned
    return out


def _zero12(units: Sequence[Sequence[Shape]], nodes: int, per_node: int, stage: int, arm: Arm) -> dict:
    world = nodes * per_node
    total = sum(math.prod(s) for shapes in units for s in shapes)
    padded = -(-total // (2 * world)) * 2 * world  # DeepSpeed's alignment of the flat group
    part = padded // world
    _, states = _optimizer((part,), arm.sdpq)
    g = arm.sdpq.gradients if arm.sdpq is not None else None
    # error feedback: each bucket's rows to other nodes in fp32 (pieces padded to whole groups: not planned)
    on = g is not None and g.mode != "exact" and g.error_feedback and nodes > 1
    ef = 4 * -(-total // per_node) * (nodes - 1) // nodes if on else 0
    return {
        "parameters": 2 * padded,
        "gradients": 2 * (total if stage == 1 else part),
        "master": 4 * part,
        "optimizer_states": states,
        "weight_reference": 0,
        "error_feedback": ef,
    }


def rank_memory(
    units: Sequence[Sequence[Shape]], framework: str, nodes: int, per_node: int, arm: Arm, rank: int = 0
) -> dict[str, int]:
    """Bytes rank `rank` keeps per kind (sdpq.memory's kinds, sdpq_buffers left out: a few
    bytes). `units`: the parameter shapes of every FSDP module (a block, the root's own)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework {framework!r}; allowed: {', '.join(FRAMEWORKS)}")
    if framework in ("zero1", "zero2"):
        return _zero12(units, nodes, per_node, int(framework[-1]), arm)
    world = nodes * per_node
    if framework == "zero3":
        return _zero3(units, world, nodes, arm, per_node)
    if framework == "hsdp":  # sharded on the node's L ranks; nothing is gathered across nodes
        out = _fsdp(units, per_node, 1, arm, rank % per_node, per_node)
        # The replicate all-reduce's residual (error feedback): its reduce-scatter across nodes.
        shards = [sum(_local_rows(s[0], per_node, 0)[1] * math.prod(s[1:]) for s in u) for u in units]
        out["error_feedback"] = sum(_error_feedback(arm.sdpq, n, nodes, 1) for n in shards)
        return out
    return _fsdp(units, world, nodes, arm, rank, per_node)
