"""The hooks that route DeepSpeed ZeRO-1/2's collectives through sdpq.comm (see deepspeed.py).

What is patched, and why there (DeepSpeed 0.19.8, `DeepSpeedZeroOptimizer`):

- gradients: `average_tensor(tensor, dtype)` (per instance) reduces every gradient bucket, at
  the accumulation boundary (ZeRO-1) or every micro-step (ZeRO-2), with overlap_comm on or off,
  and for a parameter larger than the bucket alone. Its contract: on return, the pieces of
  `tensor` this rank owns hold the average over the data-parallel group (the rest is not read),
  and with fp32 gradient accumulation the compact fp32 partition buffer has them added. The
  owners are computed as DeepSpeed does (`param_to_partition_ids`, `grad_start_offset`), the
  pieces go through an `OwnedReduceScatter`, the fp32 sums are divided once by the group size.
- weights: `_optimizer_step(i)` (per instance) keeps the rank's bf16 partition of group i as it
  was before the step (the step overwrites it) and checks, when due, that every rank holds the
  same weights; `step()` then calls the module-level `all_gather_dp_groups`, replaced by a
  dispatcher that runs a `ReplicaDiffGather` per group for this optimizer's flat groups after
  its own step, and DeepSpeed's function otherwise (other engines, `update_lp_params` after a
  checkpoint load: exact, as plain DeepSpeed).
- exact gathers: when a check finds the replicas differ (the first step, every
  `verify_every`), every `resync_every` versions, and after `mark_weights_changed()`.

Note (invariant): with `"mode": "exact"` for a path, that path's DeepSpeed code runs untouched,
so `{"weights": {"mode": "exact"}, "gradients": {"mode": "exact"}}` trains bitwise as plain ZeRO.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..comm import CommStats, OwnedReduceScatter, Piece, ReplicaDiffGather, Topology
from ..comm.agreement import check_agreement
from ..comm.device import comm_device
from ..comm.reference_health import ReferenceMismatchWarning
from ..comm.stats import process_stats, register_holder
from ..comm.weights_replicated import replicas_agree
from ..config import Config
from ..quant import true_div
from ._ds_checkpoint import agree_on_problems, state_path, wrap_engine
from ._ds_monitor import install_monitor

__all__ = ["Zero12Adapter"]

_FORMAT = 1
_ADAPTERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(bit16_groups_flat) -> adapter


class Zero12Adapter:
    """sdpq's state for one ZeRO-1/2 engine (``engine.sdpq``). Built by ``sdpq.deepspeed.initialize``."""

    def __init__(self, engine, config: Config):
        self.engine, self.config = engine, config
        self.optimizer = opt = engine.optimizer
        self.stats = CommStats(config=config.stats, parent=process_stats())
        self.topology = Topology.build(config.topology)
        self._check(opt)
        # Note: every rank must build the same collectives; one agreement collective at start-up
        # (a rank that disagrees fails here, with the same error on every rank, not in a hook).
        check_agreement("sdpq.deepspeed (ZeRO-1/2)", self._shaping_settings(opt), self.topology.world_group)
        self.grads = (
            None
            if config.gradients.mode == "exact"
            else OwnedReduceScatter(
                self.topology, config.gradients, device=engine.device, stats=config.stats, record_to=self.stats
            )
        )
        self.weights: dict[int, ReplicaDiffGather] = {}
        self._old: dict[int, torch.Tensor] = {}  # group -> own partition before this step
        self._exact_next: set[int] = set()
        self._steps = 0
        self._undo: list = []
        self._orig: dict = {}  # name -> the optimizer's own method
        try:
            if self.grads is not None:
                self._patch(opt, "average_tensor", self._average_tensor)
            if config.weights.mode == "diff":
                self._patch(opt, "_optimizer_step", self._optimizer_step)
                _install_dispatcher()
                _ADAPTERS[id(opt.bit16_groups_flat)] = self
                self._undo.append(lambda: _ADAPTERS.pop(id(opt.bit16_groups_flat), None))
            self._install_engine()
            install_monitor(self)
            engine.sdpq = self
        except BaseException:
            self.remove()
            raise

    # ------------------------------------------------------------------ public API

    def mark_weights_changed(self) -> None:
        """The weights changed outside the optimizer step on some rank: the next gather of every
        group is exact. Call on every rank."""
        self._exact_next.update(range(len(self.optimizer.bit16_groups)))

    def held_tensors(self):
        """(kind, tensor) of everything sdpq keeps between steps (sdpq.memory): nothing."""
        return iter(())

    def remove(self) -> None:
        """Undo every hook (DeepSpeed behaves as if sdpq was never installed). Idempotent."""
        while self._undo:
            self._undo.pop()()
        if getattr(self.engine, "sdpq", None) is self:
            del self.engine.sdpq

    # ------------------------------------------------------------------ setup

    def _check(self, opt) -> None:
        from ._ds_config import IncompatibleConfigError

        world = self.topology.world_size
        groups = list(opt.real_dp_process_group)
        if any(dist.get_world_size(g) != world for g in groups) or getattr(opt, "has_moe_layers", False):
            raise IncompatibleConfigError(
                'the "sdpq" block with ZeRO-1/2 needs data parallelism over all ranks (no tensor, pipeline or '
                "sequence parallel group, no MoE expert groups)"
            )
        if not opt.contiguous_gradients:
            raise IncompatibleConfigError(
                'the "sdpq" block with ZeRO-1/2 reduces the contiguous gradient buckets: remove '
                "zero_optimization.contiguous_gradients false"
            )
        if opt.cpu_offload:
            raise IncompatibleConfigError(
                'zero_optimization.offload_optimizer with ZeRO-1/2 and the "sdpq" block is not supported'
            )

    def _shaping_settings(self, opt) -> dict:
        """What every rank must hold alike: the config, the layout, the partitions and the
        settings that cut gradient buckets."""
        return {
            "config": self.config.to_dict(),
            "layout": self.topology.layout,
            "partitions": [int(p[0].numel()) for p in opt.parallel_partitioned_bit16_groups],
            "buckets": {n: str(getattr(opt, n, None)) for n in ("reduce_bucket_size", "allgather_bucket_size")},
        }

    def _patch(self, obj, name: str, fn) -> None:
        """obj.name = fn on the instance (the class's method is back once the attribute goes)."""
        self._orig[name] = getattr(obj, name)
        setattr(obj, name, fn)
        self._undo.append(lambda: obj.__dict__.pop(name, None))

    # ------------------------------------------------------------------ gradients

    def _pieces(self, tensor: torch.Tensor, dtype) -> dict[Piece, tuple[int, int]]:
        """The bucket's pieces (with their owners, as DeepSpeed's average_tensor cuts them) ->
        (parameter group, parameter id) of each, in bucket order."""
        opt = self.optimizer
        bucket = opt.ipg_buckets[dtype]
        pieces: dict[Piece, tuple[int, int]] = {}
        at = 0
        for i, idx, param_id in bucket.params:
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
        opt = self.optimizer
        assert self.grads is not None
        pieces = self._pieces(tensor, communication_data_type)
        div = self.topology.world_size / float(getattr(opt, "sequence_parallel_size", 1))
        for piece, total in self.grads(tensor, list(pieces)):
            avg = true_div(total, div) if opt.gradient_average else total
            tensor.narrow(0, piece.offset, piece.numel).copy_(avg)
            i, param_id = pieces[piece]
            out = opt._get_compact_grad_partition_slice(i, piece.owner, param_id, piece.numel)
            if out is not None:  # fp32 gradient accumulation: the fp32 average, before any rounding
                out.add_(avg.to(out.dtype))
        if opt.overlap_comm and tensor.is_cuda:  # DeepSpeed's copies that follow run on its reduction stream
            opt.reduction_stream.wait_stream(torch.cuda.current_stream())

    # ------------------------------------------------------------------ weights

    def _optimizer_step(self, i: int) -> None:
        opt = self.optimizer
        if i == 0:
            self._steps += 1
        wc = self.config.weights
        due = self._steps == 1 or (wc.verify_every and self._steps % wc.verify_every == 0)
        if due and not replicas_agree(opt.bit16_groups_flat[i], self.topology.world_group):
            if self._steps > 1:
                warnings.warn(
                    f"sdpq ZeRO-1/2: the ranks' weights of parameter group {i} differ at step {self._steps} "
                    "(changed outside the optimizer on some ranks?); this step's gather is exact",
                    ReferenceMismatchWarning,
                    stacklevel=2,
                )
            self._exact_next.add(i)
        if wc.resync_every and self._steps % wc.resync_every == 0:
            self._exact_next.add(i)
        rank = dist.get_rank(group=opt.real_dp_process_group[i])
        self._old[i] = opt.parallel_partitioned_bit16_groups[i][rank].detach().clone()
        self._orig["_optimizer_step"](i)

    def _weight_gather(self, i: int) -> ReplicaDiffGather:
        rg = self.weights.get(i)
        if rg is None:
            opt = self.optimizer
            rank = dist.get_rank(group=opt.real_dp_process_group[i])
            rg = self.weights[i] = ReplicaDiffGather(
                opt.parallel_partitioned_bit16_groups[i][rank].numel(),
                self.topology,
                self.config.weights,
                max_elements=int(opt.allgather_bucket_size),
                device=self.engine.device,
                stats=self.config.stats,
                record_to=self.stats,
            )
        return rg

    def _gather(self) -> None:
        """In place of all_gather_dp_groups after this optimizer's step."""
        opt = self.optimizer
        for i, flat in enumerate(opt.bit16_groups_flat):
            master = opt.single_partition_of_fp32_groups[i]
            rg = self._weight_gather(i)
            rg.gather(flat, self._old.pop(i), master, exact=i in self._exact_next)
            self._exact_next.discard(i)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Per-rank state for checkpoints: rounding streams and the check/resync schedule. The
        weights every rank holds and the masters are DeepSpeed's (its checkpoint restores both, so
        the differences continue from where they were)."""
        return {
            "format": _FORMAT,
            "layout": self.topology.layout,
            "rank": self.topology.rank,
            "steps": self._steps,
            "exact_next": sorted(self._exact_next),
            "grads": None if self.grads is None else self.grads.state_dict(),
            "weights": {i: rg.state_dict() for i, rg in self.weights.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != _FORMAT or (state.get("layout"), state.get("rank")) != (
            self.topology.layout,
            self.topology.rank,
        ):
            raise ValueError(
                f"sdpq state saved on rank {state.get('rank')} of layout {state.get('layout')} (format "
                f"{state.get('format')}); this is rank {self.topology.rank} of {self.topology.layout}"
            )
        self._steps, self._exact_next = int(state["steps"]), set(state["exact_next"])
        if self.grads is not None and state["grads"] is not None:
            self.grads.load_state_dict(state["grads"])
        for i, s in state["weights"].items():
            self._weight_gather(int(i)).load_state_dict(s)

    def _after_load(self, ckpt_dir: str) -> None:
        """Restore this rank's state; if any rank cannot (no file: saved without sdpq; another
        layout), every rank warns and the next gathers are exact (rounding streams start anew)."""
        problem = None
        try:
            self.load_state_dict(torch.load(self._state_path(ckpt_dir), map_location="cpu", weights_only=True))
        except Exception as e:  # every rank must reach the agreement below
            problem = f"{type(e).__name__}: {e}"
        problems = agree_on_problems(problem, self.topology, comm_device(self.topology.world_group))
        if problems:
            warnings.warn(
                f"sdpq: checkpoint {ckpt_dir}: {'; '.join(problems)}; the next weight gathers are exact",
                RuntimeWarning,
                stacklevel=3,
            )
            self.mark_weights_changed()

    def _install_engine(self) -> None:
        self._undo.append(wrap_engine(self.engine, self.state_dict, self._state_path, self._after_load, self.remove))

    def _state_path(self, ckpt_dir: str) -> str:
        return state_path(ckpt_dir, self.topology.rank)


def _install_dispatcher() -> None:
    """Replace stage_1_and_2.all_gather_dp_groups by a dispatcher (once per process): this
    module's adapters take the gathers that follow their own step, DeepSpeed the rest."""
    from deepspeed.runtime.zero import stage_1_and_2 as mod

    if getattr(mod.all_gather_dp_groups, "__sdpq_original__", None) is not None:
        return
    original = mod.all_gather_dp_groups

    def all_gather_dp_groups(groups_flat, *args: Any, **kwargs: Any):
        adapter = _ADAPTERS.get(id(groups_flat))
        if adapter is None or len(adapter._old) != len(groups_flat):  # not after its own step
            return original(groups_flat, *args, **kwargs)
        return adapter._gather()

    all_gather_dp_groups.__sdpq_original__ = original  # type: ignore[attr-defined]
    mod.all_gather_dp_groups = all_gather_dp_groups


def _engine_stats(engine: object) -> CommStats | None:
    adapter = getattr(engine, "sdpq", None)
    return adapter.stats if isinstance(adapter, Zero12Adapter) else None


register_holder(_engine_stats)
