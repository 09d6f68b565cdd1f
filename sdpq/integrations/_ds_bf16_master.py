"""A ZeRO-3 workaround (`workarounds.deepspeed_alias_bf16_master`, opt-in): with sdpq's AdamW on
bf16 master partitions (MCF: the master is the bf16 high part), ZeRO-3 means to use the compute
partition itself as the master, but its check compares a torch.device with a device name string
(always unequal), so it keeps a second bf16 copy, refreshed from the first after every step:
2 bytes per parameter for nothing. `alias_bf16_master` points the master list at the compute
partitions before the first step (the same values at every step, so bitwise the same training)
and returns what undoes it."""

from __future__ import annotations

import functools
from collections.abc import Callable

__all__ = ["alias_bf16_master"]


def alias_bf16_master(z) -> list[Callable[[], None]]:
    """Alias ZeRO-3 optimizer `z`'s bf16 master partitions to its compute partitions where both
    are the same dtype, device and size; returns one undo per aliased group (none when `z` does
    not step sdpq's AdamW on device, or has stepped already)."""
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
