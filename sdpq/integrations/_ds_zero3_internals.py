"""Everything sdpq's ZeRO-3 adapter touches inside DeepSpeed's ZeRO-3 (`DeepSpeedZeroOptimizer_Stage3`
and its parameters), behind named functions: a DeepSpeed release that renames one of the names
below breaks here, nowhere else (tests/integrations/test_deepspeed_internals.py checks that no
other sdpq file names a private DeepSpeed module or attribute).

Checked against: DeepSpeed 0.19.8 (`CHECKED_DEEPSPEED`), deepspeed/runtime/zero/stage3.py,
partition_parameters.py, runtime/utils.py. Names used:
- `deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3` and its module-level
  `reduce_scatter_coalesced` (the name `__avg_scatter_grads` calls; replaced process-wide by a
  dispatcher, `REDUCE_SCATTER`);
- the optimizer's `_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(params, dtype)` and
  `_reassign_or_swap_out_partitioned_parameters(sub_group_id)` (wrapped per instance),
  `fp16_groups`, `fp16_partitioned_groups_flat`, `fp32_partitioned_groups_flat`,
  `grad_partitions_flat_buffer`, `dp_process_group`, `optimizer`, `offload_optimizer`,
  `swap_optimizer`, `params_in_nvme_and_cpu`, and the bucket settings `reduce_bucket_size`,
  `contiguous_gradients`, `reduce_scatter`, `communication_data_type`;
- every parameter's own `all_gather_coalesced`, `all_gather`, `partition` closures (set in
  `Init._convert_to_deepspeed_param`; replaced per parameter), `ds_process_group`, and
  `deepspeed.runtime.zero.partition_parameters.ZeroParamStatus`;
- `deepspeed.runtime.utils.assert_ints_same_as_other_ranks` (a gather's safe mode).

The adapter also reads the parameters' `ds_id`, `ds_numel`, `ds_shape`, `ds_tensor`, `ds_persist`,
`ds_status` and `ds_summary()`: ZeRO-3's parameter attributes, which Transformers and
Accelerate read too.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

from ._ds_patch import ProcessPatch

__all__ = [
    "CHECKED_DEEPSPEED",
    "REDUCE_SCATTER",
    "GatherDone",
    "alias_bf16_master",
    "assert_same_on_every_rank",
    "bucket_settings",
    "framework_tensors",
    "hook_gradient_buckets",
    "hook_param",
    "is_zero3",
    "on_partitions_written",
    "param_status",
    "process_groups",
]

CHECKED_DEEPSPEED = ("0.19.8",)

Patch = Callable[[Any, str, Any], Any]  # the adapter's per-instance patch(obj, name, fn) -> what obj.name was


def is_zero3(engine) -> bool:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)


# ---------------------------------------------------------------------------- weights


def param_status():
    """ZeRO-3's parameter states (NOT_AVAILABLE, INFLIGHT, AVAILABLE)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return ZeroParamStatus


class GatherDone:
    """The handle `all_gather_coalesced` returns, for a gather that already finished: wait()
    makes the parameters AVAILABLE."""

    def __init__(self, params):
        self.params = params
        self.complete = False

    def wait(self, handle_dependency: bool = True) -> None:
        if self.complete:
            return
        status = param_status()
        for p in self.params:
            assert p.ds_status == status.INFLIGHT, p.ds_summary()
            p.ds_status = status.AVAILABLE
        self.complete = True


def assert_same_on_every_rank(ints: list[int]) -> None:
    from deepspeed.runtime.utils import assert_ints_same_as_other_ranks

    assert_ints_same_as_other_ranks(ints)


def hook_param(patch: Patch, p, gather_coalesced: Callable, gather: Callable, partition: Callable) -> None:
    """Replace p's fetch closures: `p.all_gather_coalesced(params, ...)` by
    gather_coalesced(params, ...), `p.all_gather(...)` by gather(DeepSpeed's, p, ...),
    `p.partition(...)` by partition(DeepSpeed's, p, ...)."""
    patch(p, "all_gather_coalesced", gather_coalesced)
    patch(p, "all_gather", functools.partial(gather, p.all_gather, p))
    patch(p, "partition", functools.partial(partition, p.partition, p))


def on_partitions_written(patch: Patch, opt, written: Callable[[list], None]) -> None:
    """Call written(parameters) each time the optimizer step has written a sub-group's partitions
    (before `_post_step` re-gathers the persistent ones)."""
    orig = opt._reassign_or_swap_out_partitioned_parameters

    def reassign(sub_group_id, *a, **kw):
        ret = orig(sub_group_id, *a, **kw)
        written(opt.fp16_groups[sub_group_id])
        return ret

    patch(opt, "_reassign_or_swap_out_partitioned_parameters", reassign)


def bucket_settings(opt) -> dict[str, str]:
    """The optimizer's settings that cut gradient buckets."""
    names = ("reduce_bucket_size", "contiguous_gradients", "reduce_scatter", "communication_data_type")
    return {n: str(getattr(opt, n, None)) for n in names}


def process_groups(engine, params) -> list:
    """The groups ZeRO-3 shards `params` and the optimizer's data over (None where unset)."""
    groups = [getattr(p, "ds_process_group", None) for p in params]
    return [*groups, getattr(engine.optimizer, "dp_process_group", None)]


# ---------------------------------------------------------------------------- gradients

# (reduce, bucket key) while a hooked optimizer's __avg_scatter_grads runs; read by the dispatcher.
_ACTIVE_BUCKET: contextvars.ContextVar = contextvars.ContextVar("sdpq_ds_bucket", default=None)
_AVG_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"


def _stage3():
    import deepspeed.runtime.zero.stage3 as stage3

    return stage3


def _dispatcher(original: Callable) -> Callable:
    def reduce_scatter_coalesced(tensors, group=None):
        active = _ACTIVE_BUCKET.get()
        if active is None:
            return original(tensors, group)
        reduce, key = active
        return reduce(key, tensors, group)

    return reduce_scatter_coalesced


REDUCE_SCATTER = ProcessPatch(_stage3, "reduce_scatter_coalesced", _dispatcher)


def hook_gradient_buckets(patch: Patch, opt, reduce: Callable) -> Callable[[], None]:
    """While opt averages and scatters a gradient bucket, its reduce-scatter is
    reduce(bucket key: the parameters' ds_ids, tensors, group), with DeepSpeed's layout and
    return value. Returns the release of the process-wide dispatcher."""
    release = REDUCE_SCATTER.acquire()
    orig = getattr(opt, _AVG_SCATTER)

    def avg_scatter_grads(params_to_reduce, communication_data_type, *a, **kw):
        token = _ACTIVE_BUCKET.set((reduce, tuple(p.ds_id for p in params_to_reduce)))
        try:
            return orig(params_to_reduce, communication_data_type, *a, **kw)
        finally:
            _ACTIVE_BUCKET.reset(token)

    patch(opt, _AVG_SCATTER, avg_scatter_grads)
    return release


# ---------------------------------------------------------------------------- optimizer memory


def framework_tensors(engine) -> Iterator[tuple[str, Any]]:
    """(sdpq.memory kind, tensor or None) of what ZeRO-3 keeps: the compute partitions, the
    gradient partitions, the master partitions (and their gradients)."""
    z = engine.optimizer
    for t in z.fp16_partitioned_groups_flat:
        yield "parameters", t
    yield "gradients", getattr(z, "grad_partitions_flat_buffer", None)
    for t in z.fp32_partitioned_groups_flat:
        yield "master", t
        yield "gradients", t.grad


def alias_bf16_master(z) -> list[Callable[[], None]]:
    """The `workarounds.deepspeed_alias_bf16_master` workaround: with sdpq's AdamW on bf16 master
    partitions (MCF: the master is the bf16 high part), ZeRO-3 means to use the compute partition
    itself as the master, but its check compares a torch.device with a device name string (always
    unequal), so it keeps a second bf16 copy, refreshed from the first after every step: 2 bytes
    per parameter for nothing. Point the master list at the compute partitions where both are the
    same dtype, device and size, before the first step (the same values at every step, so bitwise
    the same training); returns one undo per aliased group (none when `z` does not step sdpq's
    AdamW on device, or has stepped already)."""
    from ..optim import AdamW

    if (
        not isinstance(getattr(z, "optimizer", None), AdamW)
        or z.optimizer.state
        or z.offload_optimizer
        or getattr(z, "swap_optimizer", False)
        or getattr(z, "params_in_nvme_and_cpu", False)
    ):
        return []
    undo: list[Callable[[], None]] = []
    for i, (lp, hp) in enumerate(zip(z.fp16_partitioned_groups_flat, z.fp32_partitioned_groups_flat)):
        if lp is None or lp is hp or lp.dtype != hp.dtype or lp.device != hp.device or lp.shape != hp.shape:
            continue
        undo.append(functools.partial(_unalias, z, i, hp, lp, getattr(lp, "ds_id", None), lp.requires_grad))
        lp.ds_id = hp.ds_id
        lp.requires_grad = True
        z.fp32_partitioned_groups_flat[i] = lp
    return undo


def _unalias(z, i: int, master, compute, ds_id, requires_grad: bool) -> None:
    """Undo one aliasing of `alias_bf16_master`: the separate master partition comes back with
    the compute partition's values (they were one tensor since) and its optimizer state (DeepSpeed
    hands the optimizer fp32_partitioned_groups_flat[i] at every step; the state is keyed by it)."""
    master.data.copy_(compute.data)
    z.fp32_partitioned_groups_flat[i] = master
    if compute in z.optimizer.state:
        z.optimizer.state[master] = z.optimizer.state.pop(compute)
    if ds_id is None:
        if hasattr(compute, "ds_id"):
            delattr(compute, "ds_id")
    else:
        compute.ds_id = ds_id
    compute.requires_grad = requires_grad
