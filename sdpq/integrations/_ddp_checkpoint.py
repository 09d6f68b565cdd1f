"""sdpq.ddp's checkpoints: this rank's state (per bucket: the error-feedback residual, the rounding
stream and the call count; the iteration count), as a dict or as one file per rank.

    sdpq.ddp.save_checkpoint(model, directory)     # every rank; then save the model and optimizer
    ...
    model.module.load_state_dict(...); optimizer.load_state_dict(...)
    sdpq.ddp.load_checkpoint(model, directory)     # every rank, after the model's weights

Note (invariant): every rank takes the same decision from a checkpoint. What a rank loads decides
the collectives of its next steps (the iteration count picks DDP's exact first iteration or the
quantized all-reduce; each saved bucket's all-reduce is built, collectively, at the load), and DDP
keeps the replicas equal only if they start equal. So a load is: read and check this rank's state
(never raising) -> the ranks agree, on their problems and on what they must hold alike -> load ->
agree again. The replicas differing (a rank loaded another model) raises one
`CheckpointLoadError` on every rank: sdpq cannot repair the model. Any other problem (a file
missing, unreadable, of another rank, config or layout, or of another save) rebuilds sdpq's state
on every rank alike, with the same warning: the next iteration is all-reduced exactly, each
bucket's all-reduce is built anew at its first quantized use (residuals zero, rounding streams
from their seeds), as in a new run.

A save writes every rank's file beside its previous one, the ranks agree that all were written,
and only then does each replace its previous file (_files.save_agreed): a rank that cannot write
(a full disk) or a process killed during the save leaves every rank's previous file as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm.reference_health import checksum
from ..comm.segments import Segment
from ._files import CheckpointLoadError, CheckpointSaveError, every_rank_problem, ranks_by_value, save_agreed

__all__ = [
    "STATE_FILE",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "load_checkpoint",
    "load_state_dict",
    "save_checkpoint",
    "state_dict",
]

STATE_FILE = "sdpq_ddp_rank{rank:05d}.pt"
_FORMAT = 2  # 2: with the rank and the gradients settings (1 had neither)


def _ddp():
    from . import ddp  # Note: ddp.py re-exports this module's functions; imported late, not in a cycle

    return ddp


def state_dict(model: nn.Module) -> dict:
    """This rank's sdpq state (per bucket: error-feedback residual, rounding stream, call count;
    the iteration count), for `save_checkpoint` or your own file of this rank."""
    state = _ddp()._state_of(model)
    return {
        "format": _FORMAT,
        "rank": state.topology.rank,
        "layout": state.topology.layout,
        "gradients": dataclasses.asdict(state.config.gradients),
        "iteration": state.iteration,
        "buckets": [
            {
                "key": list(key),
                "segments": None if (lay := state.layouts[key]).segments is None else [list(s) for s in lay.segments],
                "params": list(lay.params),
                "state": ar.state_dict(),
            }
            for key, ar in state.reducers.items()
        ],
    }


def save_checkpoint(model: nn.Module, directory: str | os.PathLike) -> str:
    """Write this rank's sdpq state to `directory`/sdpq_ddp_rank<rank>.pt; returns the file.
    Collective, all or none: every rank writes its new file beside its previous one and replaces
    it only once every rank's is written, so a full disk on one rank or a process killed during
    the save leaves every rank's previous file as it was. Raises CheckpointSaveError on every rank,
    naming each rank that could not write, its file and the error."""
    state = _ddp()._state_of(model)
    path = os.path.join(os.fspath(directory), STATE_FILE.format(rank=state.topology.rank))
    group = state.topology.world_group
    save_agreed(state_dict(model), path, lambda p: every_rank_problem(p, group), "sdpq.ddp.save_checkpoint")
    return path


def load_checkpoint(model: nn.Module, directory: str | os.PathLike) -> None:
    """Load what save_checkpoint wrote into `directory`, after the model and optimizer (collective).
    A rank's file missing, unreadable or not this run's (another rank, configuration, layout or
    save) rebuilds sdpq's state on every rank alike, with one warning naming the rank and the file;
    replicas that differ raise CheckpointLoadError on every rank."""
    state = _ddp()._state_of(model)
    path = os.path.join(os.fspath(directory), STATE_FILE.format(rank=state.topology.rank))
    saved, problem = None, None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        problem = f"no {path}"
    except Exception as e:  # truncated, overwritten: reported by every rank below
        first = (str(e).strip().splitlines() or [""])[0][:200]
        problem = f"cannot read {path}: {type(e).__name__}: {first}"
    where = f"checkpoint {os.fspath(directory)}"
    _agreed_load(model, saved, problem, path, where, "their files (sdpq_ddp_rank*.pt)")


def load_state_dict(model: nn.Module, saved: Mapping[str, Any]) -> None:
    """Restore `state_dict`'s output (collective; as load_checkpoint, from a dict you loaded)."""
    _agreed_load(model, saved, None, "its state", "sdpq.ddp.load_state_dict", "the states")


# ----------------------------------------------------------------------------- the agreed load


def _agreed_load(model: nn.Module, saved: Any, problem: str | None, source: str, where: str, files: str) -> None:
    """source: what this rank read (its own problems name it); where, files: the load and what
    the ranks read, in the texts every rank shares."""
    state = _ddp()._state_of(model)
    group = state.topology.world_group
    # Note: no rank may raise or load before the agreement (the others would wait in it).
    problem = problem or _unfit(state, saved, source, _ddp()._device(model))
    problems = every_rank_problem(problem, group)
    facts: list = [None] * dist.get_world_size(group)
    mine = (_replica(model), None if problems else _schedule(saved))
    dist.all_gather_object(facts, mine, group=group)
    replicas = [f[0] for f in facts]
    common = max(set(replicas), key=replicas.count)
    odd = [r for r, v in enumerate(replicas) if v != common]
    if odd:
        raise CheckpointLoadError(
            f"sdpq.ddp: {where}: the replicas differ (the parameters of rank(s) {odd} are not the other ranks'): "
            "DDP keeps them equal only if they start equal; load the same model and optimizer on every rank, then "
            "sdpq's state"
        )
    if not problems and len({f[1] for f in facts}) > 1:
        iterations = [f[1][0] for f in facts]
        which = [f"iteration {i}" for i in iterations]
        if len(set(iterations)) == 1:
            which = [f"buckets {f[1][1][:8]}" for f in facts]
        problems = [
            f"the ranks' sdpq states were saved at different points ({ranks_by_value(which)}): "
            f"{files} are not of one save"
        ]
    if not problems:
        try:
            _restore(state, saved, _ddp()._device(model))
        except Exception as e:  # passed the checks, yet does not load: rebuilt below
            problem = f"{source} does not load: {type(e).__name__}: {e}"
        problems = every_rank_problem(problem, group)
    if problems:
        warnings.warn(
            f"sdpq.ddp: {where}: {'; '.join(problems)}; every rank rebuilds sdpq's state: the next iteration is "
            "all-reduced exactly and each bucket's all-reduce starts anew (error-feedback residuals zero, rounding "
            "streams from their seeds)",
            RuntimeWarning,
            stacklevel=3,
        )
        _rebuild(state)


def _replica(model: nn.Module) -> tuple[int, ...]:
    """A checksum of every parameter: equal on every rank exactly when the replicas are."""
    total = torch.zeros(2, dtype=torch.int64)
    for p in model.parameters():
        total += checksum(p.detach()).cpu()
    return tuple(total.tolist())


def _schedule(saved: Mapping[str, Any]) -> tuple:
    """What every rank must hold alike: the iteration and the buckets (each is built collectively)."""
    buckets = [(b["key"], b["segments"], b["params"]) for b in saved["buckets"]]
    return int(saved["iteration"]), hashlib.sha256(repr(buckets).encode()).hexdigest()


def _unfit(state, saved: Any, source: str, device: torch.device) -> str | None:
    """Why `saved` cannot be this rank's state (None: it can); never raises."""
    if not isinstance(saved, Mapping):
        return f"{source} holds a {type(saved).__name__}, not sdpq.ddp's state"
    topo, mine = state.topology, dataclasses.asdict(state.config.gradients)
    if saved.get("format", 1) not in (1, _FORMAT):
        return f"{source} has state format {saved.get('format')!r}, expected {_FORMAT}"
    if saved.get("layout") != topo.layout:
        return f"{source} was saved on layout {saved.get('layout')!r}; this run is {topo.layout!r}"
    if saved.get("rank", topo.rank) != topo.rank:
        return f"{source} was saved on rank {saved.get('rank')}; this is rank {topo.rank}"
    grads = saved.get("gradients", mine)
    grads = grads if isinstance(grads, Mapping) else {}
    for k, v in mine.items():
        if grads.get(k) != v:
            return f"{source} was saved with sdpq.gradients.{k} = {grads.get(k)!r}; this run has {v!r}"
    iteration, buckets = saved.get("iteration"), saved.get("buckets")
    if not isinstance(iteration, int) or iteration < 0 or not isinstance(buckets, list):
        return f"{source}: iteration {iteration!r}, buckets {type(buckets).__name__}"
    for i, b in enumerate(buckets):
        why = _bad_bucket(b, device)
        if why:
            return f"{source}: bucket {i}: {why}"
    return None


def _bad_bucket(b: Any, device: torch.device) -> str | None:
    def ints(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(i, int) for i in x)

    if not isinstance(b, Mapping):
        return type(b).__name__
    key, segments, s = b.get("key"), b.get("segments"), b.get("state")
    if not (isinstance(key, list) and len(key) == 4 and ints(key[:2]) and all(isinstance(k, str) for k in key[2:])):
        return f"key {key!r}"
    segments_ok = segments is None or (
        isinstance(segments, list) and all(ints(x) and 2 <= len(x) <= len(Segment._fields) for x in segments)
    )
    if not segments_ok or not ints(b.get("params")):
        return "segments or parameters"
    if not isinstance(s, Mapping) or not (s.get("residual") is None or isinstance(s.get("residual"), torch.Tensor)):
        return "all-reduce state"
    gen = s.get("generator")
    if gen is not None:
        try:
            torch.Generator(device=device).set_state(gen)
        except Exception as e:
            return f"rounding stream ({type(e).__name__}: {e})"
    return None


def _restore(state, saved: Mapping[str, Any], device: torch.device) -> None:
    """Build each saved bucket's all-reduce (collective: the ranks agreed on the buckets) and load
    its state; raises ValueError for a residual of another shape."""
    _layout = _ddp()._Layout
    for b in saved["buckets"]:
        segments = None if b["segments"] is None else [Segment(*x) for x in b["segments"]]
        ar = state.reducer(_layout(tuple(b["key"]), segments, tuple(b["params"])), device)
        r, rs = b["state"].get("residual"), ar.reduce_scatter
        if r is not None and tuple(r.shape) != (rs.topology.nodes, rs.padded_chunk):
            raise ValueError(f"bucket {b['key']}: residual of shape {tuple(r.shape)}")
        ar.load_state_dict(b["state"])
    state.iteration = int(saved["iteration"])
    # Note: DDP's first iteration after a restart runs on its initial buckets; one that holds
    # other parameters than every saved bucket is all-reduced exactly then (see ddp.py).
    state.exact_until = state.iteration + 1


def _rebuild(state) -> None:
    """sdpq's state as a new run's, on every rank alike."""
    state.reducers.clear()
    state.layouts.clear()
    state.iteration, state.exact_until = 0, 1
