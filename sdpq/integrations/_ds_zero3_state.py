"""The ZeRO-3 adapter's checkpoint state (one `sdpq_rank*.pt` per rank; saved and loaded by the
adapters' base, _ds_base.py).

What it holds: DeepSpeed's step count at the save, every WeightGather's state (the reference, its
version, the pending refresh, the rounding stream) and every gradient bucket's GradReduceScatter
state (error-feedback residuals, rounding stream), so a resumed run continues bit for bit.
Parameters and buckets are named by position, not ds_id: ds_id numbering continues across
engines in one process.

What decides the next collectives (`_schedule`): the step count and, per parameter, the version
and whether a refresh is pending (an exact refresh, a checksum verification and a difference
refresh are different collectives); compared across ranks at a load, so that files of different
saves are found. Not compared: a pending exact refresh (`force_exact`), which the holders of one
reference agree on but the ranks of a node need not (each holds another reference). On any
rank's problem every rank rebuilds alike (`_rebuild`): new weight
gathers (version 0: the first refresh exact; rounding streams from their seeds), no gradient
state (residuals from zero), every reference refreshed exactly.
"""

from __future__ import annotations

import zlib

from ._ds_state import AdapterState

__all__ = ["Zero3StateMixin"]


class Zero3StateMixin(AdapterState):
    """The checkpoint part of DeepSpeedAdapter."""

    FORMAT = 2  # 2: with DeepSpeed's step count (1 had none; still read)
    READS = (1,)
    REBUILT = (
        "the weight references are refreshed exactly at the first gather, the weight versions and rounding "
        "streams start anew, and the error-feedback residuals restart from zero"
    )

    def _state(self) -> dict:
        weights = {self._index[i]: wg.state_dict() for i, wg in self.weights.items()}
        grads = {
            (tuple(self._index[i] for i in ids), numels): g.state_dict() for (ids, numels), g in self.grads.items()
        }
        steps = int(self.engine.global_steps)
        return {"steps": steps, "num_params": len(self._ds_id), "weights": weights, "grads": grads}

    def _state_problem(self, state: dict, name: str) -> str | None:
        steps = state.get("steps", -1 if state.get("format") == 1 else None)
        if not isinstance(steps, int) or isinstance(steps, bool):
            return f"{name}: steps {steps!r}"
        if state.get("num_params") != len(self._ds_id):
            return f"{name} was saved for {state.get('num_params')} parameters, this model has {len(self._ds_id)}"
        for n, s in state.get("weights", {}).items():
            numel = self.params[self._ds_id[n]].ds_numel
            if s.get("numel") != numel:
                return f"{name}: parameter #{n} has {numel} elements, saved {s.get('numel')}"
        for (idx, numels), _ in state.get("grads", {}).items():
            if tuple(self.params[self._ds_id[n]].ds_numel for n in idx) != tuple(numels):
                return f"{name}: a gradient bucket does not match this model"
        return None

    def _load(self, state: dict) -> None:
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

    def _schedule(self, state: dict | None) -> tuple[int, ...]:
        if state is None:
            return (0, 0)
        pending = sorted((n, s.get("version"), s.get("dirty")) for n, s in state["weights"].items())
        return (int(state.get("steps", -1)), zlib.crc32(repr(pending).encode()))

    def _describe_schedule(self, value: tuple[int, ...]) -> str:
        return f"step {value[0]} (weight versions {value[1]:08x})"

    def _rebuild(self) -> None:
        self.weights = self._build_weight_gathers()
        self.grads = {}  # built again at each bucket's first use
        self.mark_weights_changed(exact=True)

    def _loaded(self) -> None:
        self._regather_available()
