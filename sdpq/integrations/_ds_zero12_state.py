"""The ZeRO-1/2 adapter's checkpoint state (one `sdpq_rank*.pt` per rank, written and read by
_ds_checkpoint.wrap_engine as ZeRO-3's is).

What it holds: the step count and the groups whose next gather is exact (they decide which
collectives a step runs: the replica check, exact or difference gathers), each group's rounding
stream and version count, and the gradient exchange's rounding stream, call count and
error-feedback residuals. The weights and the fp32 masters are DeepSpeed's.

Note (invariant): every decision that chooses a collective is made from state every rank holds
alike. A rank whose file is missing, unreadable or saved for another run would otherwise keep its
own step count while the others take the saved one, and the next replica check would run on some
ranks only (gloo aborts: "Received data size doesn't match expected size"; NCCL hangs). So a load
is: read and validate (never raising) -> agree, the step counts and exact-gather sets included ->
load -> agree again. On any rank's problem every rank warns the same text and rebuilds the same
way (`_rebuild`: step count 0, every gather exact, the replicas compared at the next step, rounding
streams and residuals anew), as a run that starts from DeepSpeed's checkpoint without sdpq's.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import torch

from ..comm import OwnedReduceScatter, ReplicaDiffGather, Topology
from ..comm.device import comm_device
from ..config import Config
from ._ds_checkpoint import STATE_FILE, agree_on_problems, read_state, state_path

__all__ = ["Zero12StateMixin"]

_FORMAT = 2  # 2: with the config and DeepSpeed's partition and bucket settings (1 had neither)
# Weights settings a resumed run may change: the state holds nothing they shape.
_FREE = ("resync_every", "verify_every", "reference")
_SHOWN = 3  # files named per value when the ranks' files disagree


class Zero12StateMixin:
    """state_dict / load_state_dict and the checkpoint load of Zero12Adapter."""

    # Set by Zero12Adapter.__init__
    engine: Any
    config: Config
    topology: Topology
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

    def state_dict(self) -> dict:
        """Per-rank state for checkpoints (see the module docstring)."""
        return {
            "format": _FORMAT,
            "layout": self.topology.layout,
            "rank": self.topology.rank,
            "config": self.config.to_dict(),
            "deepspeed": self._deepspeed_shape(),
            "steps": self._steps,
            "exact_next": sorted(self._exact_next),
            "grads": None if self.grads is None else self.grads.state_dict(),
            "weights": {i: rg.state_dict() for i, rg in self.weights.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; ValueError if it does not fit this run. Not collective:
        a checkpoint load (`engine.load_checkpoint`) agrees across ranks around it."""
        problem = self._incompatible(state)
        if problem:
            raise ValueError(f"sdpq: {problem}")
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

    def _after_load(self, ckpt_dir: str) -> None:
        """DeepSpeed has loaded the weights and masters: restore this rank's sdpq state, or, if any
        rank cannot, rebuild it on every rank alike (see the module docstring)."""
        path = state_path(ckpt_dir, self.topology.rank)
        state, problem = read_state(path, ckpt_dir, self._incompatible)
        # Note: no rank may raise before the agreement (the others would wait in it).
        problems = self._agree(problem, self._schedule(state))
        if not problems and state is not None:  # (state is None only where there is a problem)
            try:
                self.load_state_dict(state)
            except Exception as e:  # passed the checks, yet does not load: partly loaded, rebuilt below
                problem = f"{path} does not load: {type(e).__name__}: {e}"
            problems = self._agree(problem)
        if problems:
            warnings.warn(
                f"sdpq: checkpoint {ckpt_dir}: {'; '.join(problems)}; every rank rebuilds sdpq's state: the "
                "next weight gathers are exact, the replicas are compared at the next step, and the rounding "
                "streams and error-feedback residuals start anew",
                RuntimeWarning,
                stacklevel=4,
            )
            self._rebuild()

    def _rebuild(self) -> None:
        """sdpq's state as a fresh engine's, on every rank alike, with every next gather exact."""
        self._steps = 0
        self._exact_next = set(range(len(self.hooks.flat_groups())))
        self.weights = {}  # rebuilt at their first gather: version 0, rounding streams from their seeds
        self.grads = self._new_grads()

    def _agree(self, problem: str | None, same: tuple[int, ...] = ()) -> list[str]:
        return agree_on_problems(
            problem, self.topology, comm_device(self.topology.world_group), same, differ=self._schedules_differ
        )

    def _schedule(self, state: dict | None) -> tuple[int, ...]:
        """What decides the collectives of the next steps: the step count and, per group, whether
        its next gather is exact. Every rank's must be the same (zeros where a rank has no state:
        its problem is reported instead)."""
        n = len(self.hooks.flat_groups())
        if state is None:
            return (0,) * (n + 1)
        exact = {int(i) for i in state["exact_next"]}
        return (int(state["steps"]), *(int(i in exact) for i in range(n)))

    def _schedules_differ(self, values: list[tuple[int, ...]]) -> str:
        """The ranks' files were saved at different steps (one from another checkpoint of the
        run?): which files at which step, the rarest first."""
        by_value: dict[tuple[int, ...], list[int]] = {}
        for r, v in enumerate(values):
            by_value.setdefault(v, []).append(r)
        parts = []
        for v, _ in sorted(Counter(values).items(), key=lambda kv: kv[1]):
            ranks = by_value[v]
            files = ", ".join(f"rank {r} ({STATE_FILE.format(rank=r)})" for r in ranks[:_SHOWN])
            more = f" and {len(ranks) - _SHOWN} more" if len(ranks) > _SHOWN else ""
            exact = [i for i, b in enumerate(v[1:]) if b]
            parts.append(f"step {v[0]}{f', exact gathers next {exact}' if exact else ''} in {files}{more}")
        return "the ranks' sdpq state files were saved at different steps: " + "; ".join(parts)

    def _incompatible(self, state: dict) -> str | None:
        """Why `state` cannot be this rank's (None: it can). Checks everything load_state_dict
        reads, so that a file of another run is a problem here and not a failure later, on one
        rank, inside a step."""
        name = STATE_FILE.format(rank=self.topology.rank)
        if state.get("format") != _FORMAT:
            return f"{name} has state format {state.get('format')!r}, expected {_FORMAT}"
        if (state.get("layout"), state.get("rank")) != (self.topology.layout, self.topology.rank):
            return (
                f"{name} was saved on rank {state.get('rank')} of layout {state.get('layout')}; this is rank "
                f"{self.topology.rank} of {self.topology.layout}"
            )
        saved_cfg, mine_cfg = state.get("config") or {}, self.config.to_dict()
        for section, free in (("weights", _FREE), ("gradients", ())):
            saved = saved_cfg.get(section) or {}
            for k, v in mine_cfg[section].items():
                if k not in free and saved.get(k) != v:
                    return f"{name} was saved with sdpq.{section}.{k} = {saved.get(k)!r}; this run has {v!r}"
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
