"""The ZeRO-1/2 adapter's checkpoint state (one `sdpq_rank*.pt` per rank; saved and loaded by the
adapters' base, _ds_base.py, as ZeRO-3's is).

What it holds: the step count and the groups whose next gather is exact (they decide which
collectives a step runs: the replica check, exact or difference gathers), each group's rounding
stream and version count, and the gradient exchange's rounding stream, call count and
error-feedback residuals. The weights and the fp32 masters are DeepSpeed's.

What decides the next collectives (`_schedule`, agreed at a load): the step count (the replica
check runs at the first step and every `verify_every`) and the groups whose next gather is exact.
A rank whose file is missing, unreadable or saved for another run would otherwise keep its own
step count while the others take the saved one, and the next replica check would run on some
ranks only (gloo aborts: "Received data size doesn't match expected size"; NCCL hangs). On any
rank's problem every rank rebuilds the same way (`_rebuild`: step count 0, every gather exact, the
replicas compared at the next step, rounding streams and residuals anew), as a run that starts
from DeepSpeed's checkpoint without sdpq's.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import OwnedReduceScatter, ReplicaDiffGather
from ._ds_base import DeepSpeedAdapterBase

__all__ = ["Zero12StateMixin"]


class Zero12StateMixin(DeepSpeedAdapterBase):
    """The checkpoint state of Zero12Adapter."""

    FORMAT = 2  # 2: with the config and DeepSpeed's partition and bucket settings (1 had neither)
    FREE_WEIGHTS = ("resync_every", "verify_every", "reference")  # the state holds nothing they shape
    REBUILT = (
        "the next weight gathers are exact, the replicas are compared at the next step, and the rounding "
        "streams and error-feedback residuals start anew"
    )

    # Set by Zero12Adapter._setup
    hooks: Any  # _ds_zero12_internals._Hooks
    grads: OwnedReduceScatter | None
    weights: dict[int, ReplicaDiffGather]
    _exact_next: set[int]
    _steps: int

    def _weight_gather(self, i: int) -> ReplicaDiffGather:  # _ds_zero12.py
        raise NotImplementedError

    def _new_grads(self) -> OwnedReduceScatter | None:  # _ds_zero12.py
        raise NotImplementedError

    # ------------------------------------------------------------------ the state

    def _state(self) -> dict:
        return {
            "deepspeed": self._deepspeed_shape(),
            "steps": self._steps,
            "exact_next": sorted(self._exact_next),
            "grads": None if self.grads is None else self.grads.state_dict(),
            "weights": {i: rg.state_dict() for i, rg in self.weights.items()},
        }

    def _load(self, state: dict) -> None:
        self._steps, self._exact_next = int(state["steps"]), {int(i) for i in state["exact_next"]}
        if self.grads is not None:
            self.grads.load_state_dict(state["grads"])
        self.weights = {}  # a group the file does not hold (saved before its first gather) starts anew
        for i, s in state["weights"].items():
            self._weight_gather(int(i)).load_state_dict(s)

    def _deepspeed_shape(self) -> dict:
        """DeepSpeed's settings the state's meaning depends on (residuals are per bucket)."""
        n = len(self.hooks.flat_groups())
        return {
            "optimizer": type(self.engine.optimizer).__name__,
            "partitions": [int(self.hooks.own_partition(i).numel()) for i in range(n)],
            "buckets": self.hooks.bucket_settings(),
        }

    # ------------------------------------------------------------------ checkpoint load

    def _rebuild(self) -> None:
        """sdpq's state as a fresh engine's, on every rank alike, with every next gather exact."""
        self._steps = 0
        self._exact_next = set(range(len(self.hooks.flat_groups())))
        self.weights = {}  # rebuilt at their first gather: version 0, rounding streams from their seeds
        self.grads = self._new_grads()

    def _schedule(self, state: dict | None) -> tuple[int, ...]:
        """What decides the collectives of the next steps: the step count and, per group, whether
        its next gather is exact. Every rank's must be the same (zeros where a rank has no state:
        its problem is reported instead)."""
        n = len(self.hooks.flat_groups())
        if state is None:
            return (0,) * (n + 1)
        exact = {int(i) for i in state["exact_next"]}
        return (int(state["steps"]), *(int(i in exact) for i in range(n)))

    def _describe_schedule(self, value: tuple[int, ...]) -> str:
        exact = [i for i, b in enumerate(value[1:]) if b]
        return f"step {value[0]}{f', exact gathers next {exact}' if exact else ''}"

    def _state_problem(self, state: dict, name: str) -> str | None:
        if state.get("deepspeed") != self._deepspeed_shape():
            return (
                f"{name} was saved with other DeepSpeed partitions or buckets: {state.get('deepspeed')}; this run "
                f"has {self._deepspeed_shape()}"
            )
        return _malformed(state, len(self.hooks.flat_groups()), self.grads is not None, name)


def _malformed(state: dict, groups: int, grads: bool, name: str) -> str | None:
    """What in `state` is not the structure state_dict writes (None: nothing)."""

    def count(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    def stream(x: object) -> bool:
        return x is None or (isinstance(x, torch.Tensor) and x.dtype == torch.uint8)

    if not count(state.get("steps")):
        return f"{name}: steps {state.get('steps')!r}"
    exact = state.get("exact_next")
    if not isinstance(exact, list) or not all(isinstance(i, int) and 0 <= i < groups for i in exact):
        return f"{name}: exact_next {exact!r} (groups 0..{groups - 1})"
    g = state.get("grads")
    if (g is None) == grads:
        return f"{name}: gradient state {'missing' if grads else 'present'}"
    if g is not None:
        if not (isinstance(g, dict) and stream(g.get("generator")) and count(g.get("calls"))):
            return f"{name}: gradient state {type(g).__name__}"
        res = g.get("residuals", [])
        if not isinstance(res, list) or not all(
            isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[1], torch.Tensor) for kv in res
        ):
            return f"{name}: error-feedback residuals"
    w = state.get("weights")
    if not isinstance(w, dict):
        return f"{name}: weights {type(w).__name__}"
    for i, s in w.items():
        if not (isinstance(i, int) and 0 <= i < groups and isinstance(s, dict)):
            return f"{name}: weights of group {i!r}"
        if not (stream(s.get("generator")) and count(s.get("versions"))):
            return f"{name}: weight gather state of group {i}"
    return None
