"""sdpq's state for one DeepSpeed ZeRO-1/2 engine: its collectives and when a gather is exact.

How each of DeepSpeed's ZeRO-1/2 optimizers is hooked (DeepSpeedZeroOptimizer; BF16_Optimizer
at stage 1 with fp32 gradient accumulation) is in _ds_zero12_internals.py, the one file that
names their private attributes; the checkpoint state is _ds_zero12_state.py; install and undo,
checkpoints and statistics are the adapters' base (_ds_base.py), shared with ZeRO-3. This adapter
owns the collectives the hooks call:

- gradients: an `OwnedReduceScatter` (the hooks pass each bucket's pieces with their owners);
- weights: a `ReplicaDiffGather` per parameter group, exact when a check finds the replicas
  differ (the first step, every `verify_every`), every `resync_every` versions, and after
  `mark_weights_changed()`.

Note (invariant): with `"mode": "exact"` for a path, that path's DeepSpeed code runs untouched,
so `{"weights": {"mode": "exact"}, "gradients": {"mode": "exact"}}` trains bitwise as plain ZeRO.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..comm import OwnedReduceScatter, ReplicaDiffGather
from ..comm.agreement import check_agreement
from ..comm.reference_health import ReferenceMismatchWarning
from ..comm.weights_replicated import replicas_agree
from ._ds_zero12_internals import hooks_for
from ._ds_zero12_state import Zero12StateMixin

__all__ = ["Zero12Adapter"]


class Zero12Adapter(Zero12StateMixin):
    """sdpq's state for one ZeRO-1/2 engine (``engine.sdpq``). Built by ``sdpq.deepspeed.initialize``;
    its lifecycle (install and undo, checkpoints, statistics) is the adapters' base (_ds_base.py)."""

    def _setup(self) -> None:
        from ._ds_config import IncompatibleConfigError

        hooks = hooks_for(self.engine, self)
        if hooks is None:
            raise IncompatibleConfigError(
                f'the "sdpq" block with ZeRO-1/2 needs DeepSpeed\'s DeepSpeedZeroOptimizer or BF16_Optimizer; '
                f"the engine has {type(self.optimizer).__name__}"
            )
        self.hooks = hooks
        self._check()
        # Note: every rank must build the same collectives; one agreement collective at start-up
        # (a rank that disagrees fails here, with the same error on every rank, not in a hook).
        check_agreement("sdpq.deepspeed (ZeRO-1/2)", self._shaping_settings(), self.topology.world_group)
        self.grads = self._new_grads()
        self.weights: dict[int, ReplicaDiffGather] = {}
        self._exact_next: set[int] = set()
        self._steps = 0
        self.exact_fallbacks = 0  # steps whose gathers were DeepSpeed's exact one (exact_fallback)

    def _install(self) -> None:
        if self.grads is not None:
            self.hooks.hook_gradients()
        if self.config.weights.mode == "diff":
            self.hooks.hook_weights()

    # ------------------------------------------------------------------ public API

    def mark_weights_changed(self, params=None, *, exact: bool = True) -> None:
        """The weights changed outside the optimizer step on some rank: the next gather of every
        group is exact, whatever `params` and `exact` say (ZeRO-1/2 keep no reference: a
        difference would be taken from weights that differ between ranks). Call on every rank."""
        self._exact_next.update(range(len(self.hooks.flat_groups())))

    def held_tensors(self):
        """(kind, tensor) of everything sdpq keeps between steps (sdpq.memory): nothing, or with
        `gradients.error_feedback` the residuals."""
        return iter(()) if self.grads is None else self.grads.held_tensors()

    # ------------------------------------------------------------------ what the hooks call

    def step_begins(self) -> None:
        """An optimizer step that goes ahead (once per step, after its gradient reductions and
        before its groups' gathers)."""
        self._steps += 1
        if self.grads is not None:
            self.grads.sweep()

    def prepare_gather(self, i: int) -> None:
        """Before group i's step changes any weights: is this step's gather exact? (collective
        when a check is due: every rank calls it at the same point)."""
        wc = self.config.weights
        due = self._steps == 1 or (wc.verify_every and self._steps % wc.verify_every == 0)
        if due and not replicas_agree(self.hooks.flat_groups()[i], self.topology.world_group):
            if self._steps > 1:
                warnings.warn(
                    f"sdpq ZeRO-1/2: the ranks' weights of parameter group {i} differ at step {self._steps} "
                    "(changed outside the optimizer on some ranks?); this step's gather is exact",
                    ReferenceMismatchWarning,
                    stacklevel=3,
                )
            self._exact_next.add(i)
        if wc.resync_every and self._steps % wc.resync_every == 0:
            self._exact_next.add(i)

    def exact_fallback(self, missing: str) -> None:
        """DeepSpeed's own exact all-gather ran in place of this step's gathers (the hooks lacked
        `missing`): every rank holds the masters rounded, so no gather is owed. Counted in
        `exact_fallbacks`; the first one warns (its bytes are DeepSpeed's, not in sdpq.stats)."""
        self.exact_fallbacks += 1
        self._exact_next.clear()
        if self.exact_fallbacks == 1:
            warnings.warn(
                f"sdpq ZeRO-1/2: at step {self._steps} the weight hooks lacked {missing}; DeepSpeed's exact "
                "all-gather ran instead of sdpq's differences (counted in engine.sdpq.exact_fallbacks; warned once)",
                RuntimeWarning,
                stacklevel=3,
            )

    def gather(self, i: int, own_old: torch.Tensor) -> None:
        """In place of DeepSpeed's all-gather of group i: every rank's flat weights move to the
        owners' new masters (own_old: this rank's partition as it was before the step)."""
        flat, master = self.hooks.flat_groups()[i], self.hooks.master(i)
        self._weight_gather(i).gather(flat, own_old, master, exact=i in self._exact_next)
        self._exact_next.discard(i)

    # ------------------------------------------------------------------ setup

    def _check(self) -> None:
        from ._ds_config import IncompatibleConfigError

        world = self.topology.world_size
        if any(dist.get_world_size(g) != world for g in self.hooks.dp_groups()) or self.hooks.has_moe_layers():
            raise IncompatibleConfigError(
                'the "sdpq" block with ZeRO-1/2 needs data parallelism over all ranks (no tensor, pipeline or '
                "sequence parallel group, no MoE expert groups)"
            )
        problems = self.hooks.problems()
        if problems:
            raise IncompatibleConfigError(f'the "sdpq" block with ZeRO-1/2: {problems[0]}')

    def _shaping_settings(self) -> dict:
        """What every rank must hold alike: the config, the layout, the partitions and the
        settings that cut gradient buckets."""
        return {"config": self.config.to_dict(), "layout": self.topology.layout, **self._deepspeed_shape()}

    def _new_grads(self) -> OwnedReduceScatter | None:
        if self.config.gradients.mode == "exact":
            return None
        c = self.config
        return OwnedReduceScatter(
            self.topology, c.gradients, device=self.engine.device, stats=c.stats, record_to=self.stats
        )

    def _weight_gather(self, i: int) -> ReplicaDiffGather:
        rg = self.weights.get(i)
        if rg is None:
            rg = self.weights[i] = ReplicaDiffGather(
                self.hooks.own_partition(i).numel(),
                self.topology,
                self.config.weights,
                max_elements=self.hooks.allgather_bucket_size(),
                device=self.engine.device,
                stats=self.config.stats,
                record_to=self.stats,
            )
        return rg
