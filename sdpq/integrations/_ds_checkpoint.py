"""DeepSpeedAdapter's checkpoint state: one `sdpq_rank*.pt` per rank in DeepSpeed's tag directory.

`engine.save_checkpoint` writes it before DeepSpeed's files, `engine.load_checkpoint` reads it
after them (hooks in _ds_adapter.py). On another layout with the same world size (2 x 2 saved,
4 x 1 or 1 x 4 loaded) DeepSpeed loads its partitions and the sdpq state is rebuilt (exact
reference refresh, residuals from zero) with a warning; another world size is refused by
DeepSpeed's own loader (ZeRO-3 partitions do not reshard). It holds every WeightGather's and GradReduceScatter's own
state_dict (references, pending refreshes, rounding streams, error feedback), so a resumed run
continues bit for bit. Parameters and buckets are named by position, not ds_id: ds_id numbering
continues across engines in one process.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from ._ds_state import AdapterState

__all__ = ["CheckpointMixin", "STATE_FILE"]

STATE_FILE = "sdpq_rank{rank:05d}.pt"
_FORMAT = 1


class CheckpointMixin(AdapterState):
    """The checkpoint part of DeepSpeedAdapter."""

    def state_dict(self) -> dict:
        """Per-rank sdpq state: weight references (+ dirty flags), gradient error feedback and
        rounding streams. Saved next to DeepSpeed's files by engine.save_checkpoint."""
        weights = {self._index[i]: wg.state_dict() for i, wg in self.weights.items()}
        grads = {
            (tuple(self._index[i] for i in ids), numels): g.state_dict() for (ids, numels), g in self.grads.items()
        }
        return {
            "format": _FORMAT,
            "layout": self.topology.layout,
            "rank": self.topology.rank,
            "config": self.config.to_dict(),
            "num_params": len(self._ds_id),
            "weights": weights,
            "grads": grads,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; raises ValueError if it does not fit this run."""
        problem = self._incompatible(state)
        if problem:
            raise ValueError(f"sdpq state does not fit this run: {problem}")
        restored = set()
        for n, s in state["weights"].items():
            # Note: earlier versions stored dirty / calls / generator / force_exact next to the
            # WeightGather state under these same keys, so their files load the same way.
            self._weight_gather(self.params[self._ds_id[n]]).load_state_dict(s)
            restored.add(self._ds_id[n])
        # References this process built that the checkpoint does not know: resync them.
        self.mark_weights_changed([self.params[i] for i in self.weights if i not in restored], exact=True)
        keys = set()
        for (idx, numels), s in state["grads"].items():
            key = (tuple(self._ds_id[n] for n in idx), tuple(numels))
            self._grad_rs(key).load_state_dict(s)
            keys.add(key)
        for key, grs in self.grads.items():
            if key not in keys:
                grs.reset_error_feedback()

    def _state_path(self, ckpt_dir: str) -> str:
        return os.path.join(ckpt_dir, STATE_FILE.format(rank=self.topology.rank))

    def _after_load(self, ckpt_dir: str) -> None:
        """The partitions were replaced: restore the references saved with them (bitwise resume)
        or, without a usable saved state, resync every reference exactly. Then re-gather the
        parameters DeepSpeed keeps gathered so they match the restored references."""
        path = self._state_path(ckpt_dir)
        state, problem = None, None
        if os.path.isfile(path):
            state = torch.load(path, map_location="cpu", weights_only=True)
            problem = self._incompatible(state)
        else:
            problem = f"no {os.path.basename(path)} in {ckpt_dir} (not saved by sdpq)"
        # Every rank must take the same decision (each reads its own file).
        ok = torch.tensor([0 if problem else 1], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() and state is not None:  # (state is None only where ok is 0)
            self.load_state_dict(state)
        else:
            if self.topology.rank == 0:
                warnings.warn(
                    f"sdpq: checkpoint {ckpt_dir}: {problem or 'another rank cannot use its sdpq state'}; "
                    "the weight references are refreshed exactly at the first gather and the "
                    "error-feedback residuals restart from zero",
                    RuntimeWarning,
                    stacklevel=4,
                )
            for grs in self.grads.values():
                grs.reset_error_feedback()
            self.mark_weights_changed(exact=True)
        self._regather_available()

    def _incompatible(self, state: dict) -> str | None:
        if state.get("format") != _FORMAT:
            return f"state format {state.get('format')!r}, expected {_FORMAT}"
        if state.get("layout") != self.topology.layout or state.get("rank") != self.topology.rank:
            return (
                f"saved on rank {state.get('rank')} of layout {state.get('layout')}, loading on rank "
                f"{self.topology.rank} of {self.topology.layout}"
            )
        saved_w, mine_w = state.get("config", {}).get("weights"), self.config.weights.to_dict()
        for k in ("mode", "bits", "group_size"):
            if (saved_w or {}).get(k) != mine_w[k]:
                return f"sdpq.weights.{k} was {(saved_w or {}).get(k)!r}, now {mine_w[k]!r}"
        if state.get("num_params") != len(self._ds_id):
            return f"saved for {state.get('num_params')} parameters, this model has {len(self._ds_id)}"
        for n, s in state.get("weights", {}).items():
            if s.get("numel") != self.params[self._ds_id[n]].ds_numel:
                return f"parameter #{n} has {self.params[self._ds_id[n]].ds_numel} elements, saved {s.get('numel')}"
        for (idx, numels), _ in state.get("grads", {}).items():
            if tuple(self.params[self._ds_id[n]].ds_numel for n in idx) != tuple(numels):
                return "a gradient bucket does not match this model"
        return None
