"""The hooks that route DeepSpeed ZeRO-3's collectives through sdpq.comm (see deepspeed.py).

What is patched, and why there (DeepSpeed 0.19.8):

- weights: every ZeRO-3 parameter carries its own `all_gather_coalesced` / `all_gather` /
  `partition` closures (set in `Init._convert_to_deepspeed_param`); the coordinator calls
  `params[0].all_gather_coalesced(params)` for every forward/backward fetch, `_post_step` and
  `checkpoint_event_epilogue` call `persistent[0].all_gather(persistent)`. Replacing these
  per-parameter attributes touches only this engine's parameters, and is undone by restoring
  them. `all_gather` takes the sdpq path for persistent parameters only: other callers
  (GatheredParameters, 16-bit state-dict export) read weights and get DeepSpeed's exact gather.
  One `WeightGather` per parameter (keyed by `ds_id`, built by `initialize`) holds
  that parameter's node-resident reference: ZeRO-3 gathers a parameter alone or in groups that
  change with prefetching, so the parameter is the only stable "bucket". The parameters of one
  fetch still travel together (`gather_coalesced`): one inter-node collective for their pending
  differences and one intra-node collective for their references, not two per parameter.
- weight versions: the reference of a parameter is marked dirty when its partition changes:
  `optimizer._reassign_or_swap_out_partitioned_parameters(sub_group)` (the one place the
  optimizer step writes the partitions, before `_post_step` re-gathers the persistent ones),
  `param.partition(has_been_updated=True)` (GatheredParameters(modifier_rank=...) and other
  edits outside training: exact resync), and `engine.load_checkpoint` (saved references are
  restored, or everything resyncs exactly). `DeepSpeedAdapter.mark_weights_changed()` covers
  edits DeepSpeed does not see (writing into `ds_tensor` directly).
- gradients: `stage3.reduce_scatter_coalesced` is the module-level name `__avg_scatter_grads`
  calls; it is replaced (a ProcessPatch: DeepSpeed's function is back once no engine holds it)
  by a dispatcher that uses sdpq while this engine's
  `__avg_scatter_grads` (wrapped per instance, to learn which parameters are in the bucket)
  runs, and DeepSpeed's function otherwise. DeepSpeed's averaging is kept bit for bit: the
  same pre-division by the group size in the gradient dtype (exact mode), or the SUM in fp32
  divided once afterwards (quantized mode); its pre/post-scaling factors stay its own.
- hot path: the gather and reduce-scatter hooks run sdpq's part inside
  `sdpq.comm.hotpath.hot_path` and never run a collective other than the data exchange: every
  `WeightGather` is built by `initialize`, where one agreement collective checks all of them
  together with the config, the layout, every parameter's sizes and the DeepSpeed settings that
  cut gradient buckets (bucket size, contiguous gradients, communication dtype). A bucket's
  `GradReduceScatter` is a function of those alone (its size is the sum of its parameters'
  padded sizes), so the reduce-scatter hook builds it at the bucket's first use without a check
  of its own (`agreed_at_setup`). The optimizer step's part (`mark_weights_changed`, which reads
  what the last refreshes flagged on the device) runs between steps, like FSDP2's step hook.
- devices: the buffers sdpq hands a collective, the gathered parameters and the restored
  references and residuals live on DeepSpeed's accelerator (`engine.device`; with NCCL also the
  world group's communication device). With `offload_param` the partitions are on the CPU:
  like DeepSpeed's own gather, each is copied to the accelerator first.
- optimizer memory, opt-in (`workarounds.deepspeed_alias_bf16_master`): with sdpq AdamW on bf16
  master partitions (MCF), the master partition list is pointed at the compute partitions
  (`_ds_zero3_internals.alias_bf16_master`), the aliasing ZeRO-3 intends but misses (it compares
  a torch.device with a string), saving a redundant bf16 copy.

Every DeepSpeed name the hooks use is in _ds_zero3_internals.py; the lifecycle (install and undo,
checkpoints, statistics) is the adapters' base (_ds_base.py), the checkpoint state
_ds_zero3_state.py.
"""

from __future__ import annotations

import dataclasses

import torch

from .._memprobe import hook_span
from ..comm import GradReduceScatter, WeightGather, gather_coalesced
from ..comm.agreement import agreement_batch, check_agreement
from ..comm.hotpath import hot_path
from . import _ds_zero3_internals as ds3
from ._ds_base import engine_stats as _engine_stats  # noqa: F401  (the holder sdpq.stats keeps)
from ._ds_checkpoint import STATE_FILE
from ._ds_config import zero3_weight_group
from ._ds_grads import GradientsMixin
from ._ds_zero3_state import Zero3StateMixin

__all__ = ["DeepSpeedAdapter", "STATE_FILE"]


class DeepSpeedAdapter(GradientsMixin, Zero3StateMixin):
    """sdpq's state for one ZeRO-3 engine (``engine.sdpq``): topology, the per-parameter weight
    gathers, the per-bucket gradient reduce-scatters, and the installed hooks.

    Built by ``sdpq.deepspeed.initialize`` on every rank (collective: it creates the node groups).
    Its gradient path is in _ds_grads.py, its checkpoint state in _ds_zero3_state.py.
    """

    def _setup(self) -> None:
        self.params = {}
        for p in self.engine.module.parameters():
            self.params.setdefault(p.ds_id, p)
        # Checkpoints name parameters by position: ds_id numbering continues across engines.
        self._index = {i: n for n, i in enumerate(self.params)}
        self._ds_id = list(self.params)
        self.grads: dict[tuple, GradReduceScatter] = {}
        self.weights = self._build_weight_gathers()
        self._check_partitions()

    def _install(self) -> None:
        self._install_weights()
        self._install_grads()
        if self.config.workarounds.deepspeed_alias_bf16_master:
            for undo in ds3.alias_bf16_master(self.optimizer):
                self.on_remove(undo)

    # ------------------------------------------------------------------ public API

    def mark_weights_changed(self, params=None, *, exact: bool = True) -> None:
        """The partitions of `params` (default: all) changed outside DeepSpeed's view: their next
        gather refreshes the reference, exactly by default (see WeightGather.mark_weights_changed;
        the step hook passes exact=False). Call on every rank."""
        for p in self.params.values() if params is None else params:
            wg = self.weights.get(p.ds_id)
            if wg is not None:
                wg.mark_weights_changed(exact=exact)

    def held_tensors(self):
        """(kind, tensor) of everything sdpq keeps for this engine between steps (sdpq.memory)."""
        for wg in self.weights.values():
            yield from wg.held_tensors()
        for rs in self.grads.values():
            yield from rs.held_tensors()

    # ------------------------------------------------------------------ weights

    def _shaping_settings(self) -> dict:
        """What every rank must hold alike for the collectives built here and at run time: the
        config, the layout, every parameter's sizes (in ds_id order) and the ZeRO-3 settings that
        cut gradient buckets. Given these, a bucket's GradReduceScatter follows from its parameters."""
        return {
            "config": self.config.to_dict(),
            "layout": self.topology.layout,
            "params": [(p.ds_numel, p.ds_tensor.ds_numel, str(p.ds_tensor.dtype)) for p in self.params.values()],
            "buckets": ds3.bucket_settings(self.optimizer),
        }

    def _build_weight_gathers(self) -> dict[int, WeightGather]:
        """Every parameter's gather, version 0 (at set-up, and when a checkpoint load rebuilds).
        Note: one agreement collective for the engine and every WeightGather (the hooks build
        none; a rank that disagrees fails here, with the same error on every rank)."""
        world = self.topology.world_group
        with agreement_batch("sdpq.deepspeed.initialize", world):
            check_agreement("engine", self._shaping_settings(), world)
            return {p.ds_id: self._build_weight_gather(p) for p in self.params.values()}

    def _build_weight_gather(self, p) -> WeightGather:
        """The parameter's gather (at initialize; its agreement check is collected there)."""
        wcfg = self.config.weights
        group = zero3_weight_group(p.ds_tensor.ds_numel, wcfg.group_size)
        if group != wcfg.group_size:
            wcfg = dataclasses.replace(wcfg, group_size=group)
        return WeightGather(
            p.ds_numel,
            self.topology,
            wcfg,
            dtype=p.ds_tensor.dtype,
            device=self._device,
            stats=self.config.stats,
            record_to=self.stats,
        )

    def _check_partitions(self) -> None:
        """Raise unless ZeRO's partitions are the shards sdpq gathers. After the agreement: the
        sizes are agreed, so every rank raises alike."""
        for p in self.params.values():
            wg = self.weights[p.ds_id]
            if wg.shard_numel != p.ds_tensor.ds_numel:
                raise RuntimeError(
                    f"sdpq: parameter ds_id={p.ds_id} has ZeRO partitions of {p.ds_tensor.ds_numel} "
                    f"elements, sdpq expected {wg.shard_numel}"
                )

    def _weight_gather(self, p) -> WeightGather:
        wg = self.weights.get(p.ds_id)
        if wg is None:
            raise RuntimeError(
                f"sdpq: parameter ds_id={p.ds_id} is not one of the engine's parameters sdpq.deepspeed.initialize "
                "set up (parameters added to the module after initialize are not supported)"
            )
        return wg

    def _gather_into(self, params) -> None:
        """Gathers params (the same list, in the same order, on every rank) into their .data:
        one inter-node and one intra-node collective for the whole list (gather_coalesced)."""
        gathers, shards, outs = [], [], []
        device = self._device
        for p in params:
            wg = self._weight_gather(p)
            shard = p.ds_tensor.data
            valid = max(0, min(wg.shard_numel, p.ds_numel - self.topology.rank * wg.shard_numel))
            gathers.append(wg)
            # Note: only the valid part of the last partitions: padding must not enter quantization groups.
            # Like DeepSpeed's own gather, a partition offloaded to the CPU (offload_param) is
            # copied to the accelerator first; the gathered parameter lives there.
            shards.append(shard.narrow(0, 0, valid).to(device))
            outs.append(torch.empty(p.ds_numel, dtype=shard.dtype, device=device))
        # Note: the outputs are the gathered parameters DeepSpeed keeps; the span measures sdpq's own.
        with hook_span("zero3.all_gather", device):
            gather_coalesced(gathers, shards, outs)
        for p, out in zip(params, outs):
            p.data = out.view(p.ds_shape)

    def _all_gather_coalesced(self, params, safe_mode: bool = False, quantize: bool = False):
        status = ds3.param_status()
        params = list(params)
        if quantize:
            raise RuntimeError("sdpq: a quantized ZeRO++ gather was requested while sdpq owns the weight path")
        for p in params:
            if p.ds_status != status.NOT_AVAILABLE:
                raise RuntimeError(p.ds_summary())
            p.ds_status = status.INFLIGHT
        params.sort(key=lambda p: p.ds_id)
        if safe_mode:
            ds3.assert_same_on_every_rank([p.ds_id for p in params])
        with hot_path("DeepSpeed ZeRO-3 parameter all-gather"):
            self._gather_into(params)
        return ds3.GatherDone(params)

    def _all_gather(self, orig, owner, param_list=None, async_op=False, hierarchy=0):
        # Persistent parameters (gathered after every step and at checkpoint epilogues) take the
        # sdpq path; others are gathered here only by GatheredParameters / state-dict export,
        # which must see the exact weights: DeepSpeed's own gather.
        status = ds3.param_status()
        plist = [owner] if param_list is None else list(param_list)
        ours = [p for p in plist if p.ds_persist and p.ds_status == status.NOT_AVAILABLE and p.ds_id in self.params]
        mine = {id(p) for p in ours}
        rest = [p for p in plist if id(p) not in mine]
        ret = orig(param_list=rest, async_op=async_op, hierarchy=hierarchy) if rest else ([] if async_op else None)
        ours.sort(key=lambda p: p.ds_id)
        with hot_path("DeepSpeed ZeRO-3 persistent parameter all-gather"):
            self._gather_into(ours)
        for p in ours:
            p.ds_status = status.AVAILABLE
        return ret

    def _partition(self, orig, owner, *args, **kwargs):
        ret = orig(*args, **kwargs)
        names = ("param_list", "hierarchy", "has_been_updated", "free_data")
        bound = dict(zip(names, args), **kwargs)
        if bound.get("has_been_updated"):
            plist = bound.get("param_list") or [owner]
            self.mark_weights_changed(plist, exact=True)
        return ret

    def _install_weights(self) -> None:
        for group in ds3.process_groups(self.engine, self.params.values()):
            # sdpq's node groups span the world: ZeRO must shard every parameter over all ranks
            # (no model parallelism, MiCS or hpZ sub-groups). Raises TopologyError otherwise.
            self.topology.check_group(group)
        for p in self.params.values():
            ds3.hook_param(self.patch, p, self._all_gather_coalesced, self._all_gather, self._partition)
        # The step just wrote these partitions; _post_step re-gathers the persistent ones next.
        ds3.on_partitions_written(self.patch, self.optimizer, lambda ps: self.mark_weights_changed(ps, exact=False))

    def _regather_available(self) -> None:
        """Re-gather the parameters DeepSpeed keeps gathered (after their references changed)."""
        status = ds3.param_status()
        available = [p for p in self.params.values() if p.ds_status == status.AVAILABLE]
        self._gather_into(sorted(available, key=lambda p: p.ds_id))
