"""DeepSpeedAdapter's checkpoint state: one `sdpq_rank*.pt` per rank in DeepSpeed's tag directory.

`engine.save_checkpoint` writes it before DeepSpeed's files, `engine.load_checkpoint` reads it
after them (hooks in _ds_adapter.py). On another layout with the same world size (2 x 2 saved,
4 x 1 or 1 x 4 loaded) DeepSpeed loads its partitions and the sdpq state is rebuilt (exact
reference refresh, residuals from zero) with a warning; another world size is refused by
DeepSpeed's own loader (ZeRO-3 partitions do not reshard). A file missing or unreadable (truncated,
overwritten) on any rank rebuilds the state on every rank alike, each warning with the file and the
error: no rank raises alone while the others wait. It holds every WeightGather's and GradReduceScatter's own
state_dict (references, pending refreshes, rounding streams, error feedback), so a resumed run
continues bit for bit. Parameters and buckets are named by position, not ds_id: ds_id numbering
continues across engines in one process.

Both DeepSpeed adapters (ZeRO-3 here, ZeRO-1/2 in _ds_zero12_state.py) save and load alike
(`wrap_engine`): every rank writes its file beside the previous one (_files.py), the ranks agree
that all were written, and only then does each replace its previous file, atomically; so a write
that fails on one rank (a full disk) changes no rank's file and raises the same
`CheckpointSaveError` on every rank, before DeepSpeed writes anything. A load reads and
validates the file (`read_state`, never raising), agrees (`agree_on_problems`), loads, and agrees
again, and on any rank's problem every rank rebuilds its state alike.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..comm import all_gather_rows
from ._ds_state import AdapterState
from ._files import write_pending

__all__ = [
    "CheckpointMixin",
    "CheckpointSaveError",
    "STATE_FILE",
    "agree_on_problems",
    "read_state",
    "state_path",
    "wrap_engine",
]

STATE_FILE = "sdpq_rank{rank:05d}.pt"
_FORMAT = 1
_SHOWN = 3  # ranks whose problem a load warning spells out


class CheckpointSaveError(RuntimeError):
    """sdpq's state could not be written on some rank: raised on every rank, before DeepSpeed
    writes anything, naming each failed rank, its file and the error."""


def wrap_engine(eng, state_dict, state_path, after_load, remove, agree: Callable[[str | None], list[str]]):
    """Wrap the engine's save_checkpoint (sdpq's state written first, at state_path(tag dir): so
    "latest" never points at a tag without it), load_checkpoint (after_load(tag dir) once
    DeepSpeed has loaded) and destroy (remove() first). agree(problem): the ranks' problems, the
    same list on every rank (`agree_on_problems`). Returns the undo."""
    orig_save, orig_load, orig_destroy = eng.save_checkpoint, eng.load_checkpoint, getattr(eng, "destroy", None)

    def save_checkpoint(save_dir, tag=None, *args, **kwargs):
        if tag is None:
            tag = f"global_step{eng.global_steps}"  # DeepSpeed's default tag
        path = os.path.join(save_dir, str(tag))
        file, problem, cause, pending = state_path(path), None, None, None
        outcome = "no rank's previous file of this tag was changed"
        try:
            os.makedirs(path, exist_ok=True)
            pending = write_pending(state_dict(), file)
        except Exception as e:  # every rank must reach the agreement below (DeepSpeed's save is collective)
            problem, cause = f"cannot write {file}: {type(e).__name__}: {e}", e
        # Note: every rank's new file is complete before any replaces its previous one, so a
        # failure on one rank leaves every rank's previous file of this tag as it was.
        problems = agree(problem)
        if not problems and pending is not None:
            try:
                pending.commit()
            except Exception as e:  # a rename that fails (rare): the tag's files now mix two saves
                problem, cause = f"cannot replace {file}: {type(e).__name__}: {e}", e
            problems = agree(problem)
            outcome = "the other ranks' files of this tag are the new ones: do not load this tag"
        if problems:
            if pending is not None:
                pending.discard()
            raise CheckpointSaveError(
                f"sdpq: checkpoint {path} not saved: {'; '.join(problems)}; {outcome}, and nothing of "
                "DeepSpeed's was written"
            ) from cause
        return orig_save(save_dir, tag, *args, **kwargs)

    def load_checkpoint(load_dir, *args, **kwargs):
        result = orig_load(load_dir, *args, **kwargs)
        if result is not None and result[0] is not None:
            after_load(os.path.dirname(result[0]))
        return result

    def destroy(*args, **kwargs):
        remove()
        return orig_destroy(*args, **kwargs)

    eng.save_checkpoint, eng.load_checkpoint = save_checkpoint, load_checkpoint
    if orig_destroy is not None:
        eng.destroy = destroy

    def undo():
        for n in ("save_checkpoint", "load_checkpoint", "destroy"):
            eng.__dict__.pop(n, None)

    return undo


def agree_on_problems(
    problem: str | None,
    topology,
    device,
    same: Sequence[int] = (),
    differ: Callable[[list[tuple[int, ...]]], str] | None = None,
) -> list[str]:
    """Every rank's problem ("rank r: ..."), the same list on every rank; empty when none has
    one. One all-gather of a flag on the world's communication device; the texts travel
    only when some rank has a problem. same: integers every rank must hold alike (as many on
    every rank), compared when no rank has a problem; if they differ, the one problem is
    differ(every rank's values)."""
    group = topology.world_group
    mine = torch.tensor([1 if problem else 0, *same], dtype=torch.int64, device=device)
    rows, work = all_gather_rows(mine, group)
    if work is not None:
        work.wait()
    rows = rows.view(topology.world_size, -1).cpu()
    if not bool(rows[:, 0].any()):
        values = [tuple(r) for r in rows[:, 1:].tolist()]
        if len(set(values)) > 1:
            return [differ(values) if differ is not None else f"the ranks hold different values: {values}"]
        return []
    texts: list = [None] * topology.world_size
    dist.all_gather_object(texts, problem, group=group)
    me = topology.rank
    # This rank's own problem first, then the others' (a few: every rank warns).
    bad = sorted((r for r, t in enumerate(texts) if t), key=lambda r: (r != me, r))
    shown = [f"rank {r}: {texts[r]}" for r in bad[:_SHOWN]]
    if len(bad) > _SHOWN:
        shown.append(f"and {len(bad) - _SHOWN} more rank(s)")
    return shown


def state_path(ckpt_dir: str, rank: int) -> str:
    """This rank's sdpq state file in a checkpoint's tag directory."""
    return os.path.join(ckpt_dir, STATE_FILE.format(rank=rank))


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
        return state_path(ckpt_dir, self.topology.rank)

    def _after_load(self, ckpt_dir: str) -> None:
        """The partitions were replaced: restore the references saved with them (bitwise resume)
        or, without a usable saved state on some rank (missing, unreadable, saved for another
        run), resync every reference exactly on every rank. Then re-gather the parameters
        DeepSpeed keeps gathered so they match the restored references."""
        path = self._state_path(ckpt_dir)
        state, problem = self._read_state(path, ckpt_dir)
        # Note: every rank must take the same decision, and each reads only its own file: no rank
        # may raise before this agreement (the others would wait in it until the timeout).
        problems = self._agree(problem)
        if not problems and state is not None:  # (state is None only where there is a problem)
            try:
                self.load_state_dict(state)
            except Exception as e:  # a file that passed the checks yet does not load
                problem = f"{os.path.basename(path)} in {ckpt_dir} does not load: {type(e).__name__}: {e}"
            problems = self._agree(problem)
        if problems:
            warnings.warn(
                f"sdpq: checkpoint {ckpt_dir}: {'; '.join(problems)}; the weight references are refreshed "
                "exactly at the first gather and the error-feedback residuals restart from zero",
                RuntimeWarning,
                stacklevel=4,
            )
            for grs in self.grads.values():
                grs.reset_error_feedback()
            self.mark_weights_changed(exact=True)
        self._regather_available()

    def _read_state(self, path: str, ckpt_dir: str) -> tuple[dict | None, str | None]:
        return read_state(path, ckpt_dir, self._incompatible)

    def _agree(self, problem: str | None) -> list[str]:
        return agree_on_problems(problem, self.topology, self._comm_device)

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


def read_state(path: str, ckpt_dir: str, incompatible: Callable[[dict], str | None]) -> tuple[dict | None, str | None]:
    """(this rank's saved state, None) or (None, why it cannot be used). Never raises: an
    unreadable file (truncated, overwritten) is a problem like a missing one, and so is a state
    that incompatible(state) finds a problem with (or raises on: not the structure sdpq writes)."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        return None, f"no {name} in {ckpt_dir} (not saved by sdpq)"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        return None, f"cannot read {path}: {type(e).__name__}: {_load_error(e)}"
    if not isinstance(state, dict):
        return None, f"{path} holds a {type(state).__name__}, not sdpq's state"
    try:
        problem = incompatible(state)
    except Exception as e:
        problem = f"{path} is not sdpq's state: {type(e).__name__}: {e}"
    return (None, problem) if problem else (state, None)


def _load_error(e: Exception) -> str:
    """torch.load's error in one line. The weights-only unpickler wraps the actual error in
    advice to load with weights_only=False, which is wrong for a damaged file: keep the error."""
    text = str(e)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = "weights-only unpickler: " + text.split(marker, 1)[1].split("Check the documentation", 1)[0]
    return " ".join(text.split())
