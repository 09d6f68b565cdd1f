"""Everything sdpq's ZeRO-1/2 adapter (and sdpq.memory, at stages 1-2) touches inside DeepSpeed
(checked against 0.19.8: `CHECKED_DEEPSPEED`).

DeepSpeed builds one of two optimizers at stages 1-2, and each gets a hooks class here:

- `DeepSpeedZeroOptimizer` (stage 2; stage 1 with bf16 or fp16 gradient accumulation):
  gradients in `average_tensor(tensor, dtype)`, which reduces every contiguous gradient bucket
  (at the accumulation boundary at stage 1, every micro-step at stage 2, overlap_comm on or
  off); weights in `_optimizer_step(i)` (keep the rank's partition as it was: the step
  overwrites it) and the module-level `stage_1_and_2.all_gather_dp_groups` (a dispatcher).
- `BF16_Optimizer` (stage 1 with `data_types.grad_accum_dtype` fp32): gradients accumulate in
  one fp32 buffer per parameter group, reduced at the boundary by the engine's
  `buffered_allreduce_fallback`; the global norm comes from `get_grads_for_norm`; weights in
  `update_lp_params` (called by `step()`; its other caller, a universal-checkpoint load, keeps
  DeepSpeed's exact gather).

Modules: `deepspeed.runtime.zero.stage_1_and_2` (DeepSpeedZeroOptimizer, all_gather_dp_groups),
`deepspeed.runtime.bf16_optimizer` (BF16_Optimizer). Private attributes besides
`_optimizer_step`: `_get_compact_grad_partition_slice` (where a piece's fp32 average goes with
fp32 gradient accumulation), `_uses_muon` (refused). A DeepSpeed release that renames one of the
names used here breaks here, nowhere else (docs/zero12.md lists them all;
tests/integrations/test_deepspeed_internals.py checks that no other sdpq file names a private
DeepSpeed module or attribute).

Note (contract of the gradient hooks): on return, the pieces of each partition hold, on the
partition's owner, the average over the data-parallel group; what other ranks hold there is not
read by DeepSpeed's step (for BF16_Optimizer: not by the step, whose norm the hook computes from
the owners' partitions, nor by clipping, which scales every element alike).

Note (hot path): the gradient reductions and the weight gathers run inside
`sdpq.comm.hotpath.hot_path` (no host read: on a GPU it would stall the thread that queues the
next work) and `hook_span` (their allocation peaks in `sdpq.memory`), as ZeRO-3's and FSDP2's
hooks do. The replica check that decides whether a gather is exact (`prepare_gather`, at the first
step and every `verify_every`) reads its verdict on the host by design and runs outside, once per
group and step, before the step changes the weights.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._memprobe import hook_span
from ..comm import Piece, flat_pieces
from ..comm.hotpath import hot_path
from ..quant import true_div
from ._ds_patch import ProcessPatch

__all__ = ["ALL_GATHER_DP_GROUPS", "CHECKED_DEEPSPEED", "framework_tensors", "hooks_for"]

CHECKED_DEEPSPEED = ("0.19.8",)

# id(the optimizer's list of flat bf16 groups) -> hooks; the dispatcher's lookup.
_GATHERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class _Hooks:
    """What the adapter needs from one DeepSpeed optimizer: where the weights are, and hooks.
    A subclass names the optimizer's lists of flat bf16 groups, of their N partitions, and of
    this rank's fp32 master partitions."""

    FLAT: str
    PARTITIONS: str
    MASTERS: str

    def __init__(self, engine, adapter):
        self.engine, self.opt, self.adapter = engine, engine.optimizer, adapter

    def problems(self) -> list[str]:
        """What this optimizer is configured with that the hooks do not handle (empty: fine)."""
        return []

    def flat_groups(self) -> list[torch.Tensor]:
        return getattr(self.opt, self.FLAT)

    def own_partition(self, i: int) -> torch.Tensor:
        rank = dist.get_rank(group=self.opt.real_dp_process_group[i])
        return getattr(self.opt, self.PARTITIONS)[i][rank]

    def master(self, i: int) -> torch.Tensor:
        return getattr(self.opt, self.MASTERS)[i]

    def dp_groups(self) -> list:
        return list(self.opt.real_dp_process_group)

    def has_moe_layers(self) -> bool:
        return bool(getattr(self.opt, "has_moe_layers", False))

    def allgather_bucket_size(self) -> int:
        """Elements per weight gather (ReplicaDiffGather's transient buffers scale with it)."""
        return int(self.opt.allgather_bucket_size)

    def bucket_settings(self) -> dict:
        return {n: str(getattr(self.opt, n, None)) for n in ("reduce_bucket_size", "allgather_bucket_size")}

    def hook_gradients(self) -> None:
        raise NotImplementedError

    def hook_weights(self) -> None:
        raise NotImplementedError


class ZeroOptimizerHooks(_Hooks):
    """DeepSpeedZeroOptimizer."""

    FLAT, PARTITIONS, MASTERS = (
        "bit16_groups_flat",
        "parallel_partitioned_bit16_groups",
        "single_partition_of_fp32_groups",
    )

    def problems(self) -> list[str]:
        out = []
        if not self.opt.contiguous_gradients:
            out.append(
                "zero_optimization.contiguous_gradients false is not supported (sdpq reduces the contiguous buckets)"
            )
        if self.opt.cpu_offload:
            out.append("zero_optimization.offload_optimizer is not supported with the block at stages 1-2 yet")
        return out

    # ------------------------------------------------------------------ gradients

    def hook_gradients(self) -> None:
        self._orig_average = self.adapter.patch(self.opt, "average_tensor", self._average_tensor)
        self._hook_step()  # error feedback's residuals are swept once per step

    def _pieces(self, tensor: torch.Tensor, dtype) -> dict[Piece, tuple[int, int]]:
        """The bucket's pieces (with their owners, as DeepSpeed's average_tensor cuts them) ->
        (parameter group, parameter id) of each, in bucket order."""
        opt = self.opt
        pieces: dict[Piece, tuple[int, int]] = {}
        at = 0
        for i, idx, param_id in opt.ipg_buckets[dtype].params:
            numel = opt.bit16_groups[i][idx].numel()
            starts = sorted(
                (opt.grad_start_offset[i][pid][param_id], pid) for pid in opt.param_to_partition_ids[i][param_id]
            )
            for k, (off, pid) in enumerate(starts):
                end = starts[k + 1][0] if k + 1 < len(starts) else numel
                pieces[Piece(at + off, end - off, pid)] = (i, param_id)
            at += numel
        if at != tensor.numel():
            raise RuntimeError(f"sdpq ZeRO-1/2: the bucket holds {tensor.numel()} elements, its parameters {at}")
        return pieces

    def _average_tensor(self, tensor: torch.Tensor, communication_data_type) -> None:
        opt = self.opt
        if opt.overlap_comm and tensor.is_cuda:  # the bucket may have been filled on several streams
            bucket, now = opt.ipg_buckets[communication_data_type], torch.cuda.current_stream()
            for producer in bucket.copy_streams or {now}:
                now.wait_stream(producer)
        pieces = self._pieces(tensor, communication_data_type)
        div = dist.get_world_size(opt.real_dp_process_group[0]) / float(getattr(opt, "sequence_parallel_size", 1))
        # the bucket's parameters name it (error feedback's residual is the bucket's)
        key = tuple((i, pid) for i, _, pid in opt.ipg_buckets[communication_data_type].params)
        with hot_path("DeepSpeed ZeRO-1/2 gradient reduction"), hook_span("zero12.reduce", tensor.device):
            for piece, total in self.adapter.grads(tensor, list(pieces), key=key):
                avg = true_div(total, div) if opt.gradient_average else total
                tensor.narrow(0, piece.offset, piece.numel).copy_(avg)
                i, param_id = pieces[piece]
                out = opt._get_compact_grad_partition_slice(i, piece.owner, param_id, piece.numel)
                if out is not None:  # fp32 gradient accumulation: the fp32 average, before any rounding
                    out.add_(avg.to(out.dtype))
        if opt.overlap_comm and tensor.is_cuda:  # DeepSpeed's copies that follow run on its reduction stream
            opt.reduction_stream.wait_stream(torch.cuda.current_stream())

    # ------------------------------------------------------------------ weights

    def hook_weights(self) -> None:
        self._old = {}  # group -> own partition before this step
        self._hook_step()
        self.adapter.on_remove(ALL_GATHER_DP_GROUPS.acquire())
        key = id(self.opt.bit16_groups_flat)
        _GATHERS[key] = self
        self.adapter.on_remove(lambda: _GATHERS.pop(key, None))

    _old: dict[int, torch.Tensor] | None = None  # with the weight path: own partitions before the step
    _stepped = False  # a step of ours ran since the last gather

    def _hook_step(self) -> None:
        if "_optimizer_step" not in self.opt.__dict__:
            self._orig_step = self.adapter.patch(self.opt, "_optimizer_step", self._optimizer_step)

    def _optimizer_step(self, i: int) -> None:
        if i == 0:
            self.adapter.step_begins()
        if self._old is not None:
            self._stepped = True
            self.adapter.prepare_gather(i)
            self._old[i] = self.own_partition(i).detach().clone()
        self._orig_step(i)

    def _gather_after_step(self, groups_flat, *args: Any, **kwargs: Any) -> bool:
        """In place of all_gather_dp_groups; False (DeepSpeed's own gather) if this call does not
        follow our own step (update_lp_params after a checkpoint load), or if it does but the old
        partitions of some group are missing: the differences cannot be taken, DeepSpeed's exact
        gather is right, and the adapter counts it (`exact_fallbacks`) and warns once."""
        if self._old is None or not self._stepped:
            return False
        self._stepped = False
        missing = [i for i in range(len(groups_flat)) if i not in self._old]
        if missing:
            self._old.clear()
            self.adapter.exact_fallback(f"the partitions of parameter group(s) {missing} as they were before the step")
            return False
        with hot_path("DeepSpeed ZeRO-1/2 weight gather"), hook_span("zero12.gather", groups_flat[0].device):
            for i in range(len(groups_flat)):
                self.adapter.gather(i, self._old.pop(i))
        return True


class Bf16OptimizerHooks(_Hooks):
    """BF16_Optimizer (ZeRO-1 with fp32 gradient accumulation)."""

    FLAT, PARTITIONS, MASTERS = "bf16_groups_flat", "bf16_partitioned_groups", "fp32_groups_flat_partition"

    def problems(self) -> list[str]:
        if getattr(self.opt, "_uses_muon", False):
            return ["a Muon optimizer is not supported (it exchanges whole matrices itself; use AdamW)"]
        return []

    def bucket_settings(self) -> dict:
        return {"reduce_bucket_size": str(self._cap()), "allgather_bucket_size": str(self.opt.allgather_bucket_size)}

    # ------------------------------------------------------------------ gradients

    def _cap(self) -> int:
        """Elements per exchange (the transient buffers scale with it): the config's reduce bucket."""
        return max(1, int(self.engine.zero_reduce_bucket_size()))

    def hook_gradients(self) -> None:
        opt = self.opt
        world = dist.get_world_size(opt.real_dp_process_group[0])
        self._windows = [
            flat_pieces([p.numel() for p in params], flat.numel() // world, self._cap())
            for params, flat in zip(opt.bf16_groups, opt.fp32_groups_gradients_flat)
        ]
        self._orig_reduce = self.adapter.patch(self.engine, "buffered_allreduce_fallback", self._reduce)
        self._orig_norm = self.adapter.patch(opt, "get_grads_for_norm", self._grads_for_norm)

    def _reduce(self, grads=None, elements_per_buffer: int = 500000000) -> None:
        if grads is not None:  # a caller with its own list: DeepSpeed's reduction
            return self._orig_reduce(grads=grads, elements_per_buffer=elements_per_buffer)
        eng, opt = self.engine, self.opt
        plain_itemsize = torch.empty(0, dtype=eng.communication_data_type).element_size()
        div = dist.get_world_size(opt.real_dp_process_group[0]) / float(eng.sequence_parallel_size)
        device = opt.fp32_groups_gradients_flat[0].device
        with hot_path("DeepSpeed ZeRO-1 gradient reduction (BF16_Optimizer)"), hook_span("zero12.reduce", device):
            for i, (flat, windows) in enumerate(zip(opt.fp32_groups_gradients_flat, self._windows)):
                for a, b, pieces in windows:
                    window = flat[a:b]
                    for piece, total in self.adapter.grads(window, pieces, plain_itemsize=plain_itemsize, key=(i, a)):
                        avg = true_div(total, div) if eng.gradient_average else total
                        window.narrow(0, piece.offset, piece.numel).copy_(avg)

    def _grads_for_norm(self, for_clipping: bool = False):
        """DeepSpeed's norm reads every rank's whole fp32 buffer, which now holds the average only
        in the rank's own partition: the norm over the owners' partitions instead, as one tensor
        whose norm is the global one (DeepSpeed then takes the norm of that)."""
        if for_clipping:
            return self._orig_norm(for_clipping=True)
        opt = self.opt
        q = float(opt.norm_type)
        # Note (memory): vector_norm reduces without a partition-sized temporary.
        norms = [torch.linalg.vector_norm(p, q, dtype=torch.float32) for p in opt.fp32_groups_gradient_flat_partition]
        if q == math.inf:
            local = torch.stack(norms).max()
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=opt.real_dp_process_group[0])
            return [local.reshape(1)], {}
        local = torch.stack(norms).pow(q).sum()
        dist.all_reduce(local, group=opt.real_dp_process_group[0])
        return [local.pow(1.0 / q).reshape(1)], {}

    # ------------------------------------------------------------------ weights

    def hook_weights(self) -> None:
        self._in_step = False
        self._orig_step = self.adapter.patch(self.opt, "step", self._step)
        self._orig_update = self.adapter.patch(self.opt, "update_lp_params", self._update_lp_params)

    def _step(self, closure=None):
        self._in_step = True
        try:
            return self._orig_step(closure)
        finally:
            self._in_step = False

    def _update_lp_params(self) -> None:
        """After the step (the bf16 partitions still hold last step's weights): the gathers."""
        if not self._in_step:
            return self._orig_update()
        self.adapter.step_begins()
        flat = self.opt.bf16_groups_flat
        for i in range(len(flat)):  # (each reads group i's weights only, which no gather of another group changes)
            self.adapter.prepare_gather(i)
        with hot_path("DeepSpeed ZeRO-1 weight gather (BF16_Optimizer)"), hook_span("zero12.gather", flat[0].device):
            for i in range(len(flat)):
                self.adapter.gather(i, self.own_partition(i))


def hooks_for(engine, adapter) -> _Hooks | None:
    """The hooks class for the engine's optimizer; None if it is neither of DeepSpeed's ZeRO-1/2 ones."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    kind = type(engine.optimizer)
    if kind is DeepSpeedZeroOptimizer:
        return ZeroOptimizerHooks(engine, adapter)
    if kind is BF16_Optimizer:
        return Bf16OptimizerHooks(engine, adapter)
    return None


def _stage_1_and_2():
    import deepspeed.runtime.zero.stage_1_and_2 as stage_1_and_2

    return stage_1_and_2


def _dispatcher(original):
    """stage_1_and_2.all_gather_dp_groups for the whole process: the hooks take the gathers that
    follow their optimizer's own step, DeepSpeed the rest."""

    def all_gather_dp_groups(groups_flat, *args: Any, **kwargs: Any):
        hooks = _GATHERS.get(id(groups_flat))
        if hooks is None or not hooks._gather_after_step(groups_flat):
            return original(groups_flat, *args, **kwargs)
        return None

    return all_gather_dp_groups


ALL_GATHER_DP_GROUPS = ProcessPatch(_stage_1_and_2, "all_gather_dp_groups", _dispatcher)


def framework_tensors(engine) -> Iterator[tuple[str, Any]]:
    """(sdpq.memory kind, tensor or None) of what DeepSpeed keeps at stages 1-2 (and for any other
    optimizer than ZeRO-3's, the module's gradients): the flat bf16 groups; the gradients (ZeRO-2's
    contiguous partition, the contiguous reduce buckets, BF16_Optimizer's fp32 buffers, the
    parameters' .grad); the fp32 master partitions (and their gradients)."""
    z = engine.optimizer
    hooks = next((h for h in (ZeroOptimizerHooks, Bf16OptimizerHooks) if hasattr(z, h.FLAT)), None)
    for t in getattr(z, hooks.FLAT, ()) if hooks else ():
        yield "parameters", t
    yield "gradients", getattr(z, "grads_in_partition", None)
    for bucket in getattr(z, "ipg_buckets", {}).values():
        for t in bucket.buffer:
            yield "gradients", t
    for t in getattr(z, "fp32_groups_gradients_flat", ()):
        yield "gradients", t
    for p in engine.module.parameters():
        yield "gradients", p.grad
    for t in getattr(z, hooks.MASTERS, ()) if hooks else ():
        yield "master", t
        yield "gradients", t.grad
