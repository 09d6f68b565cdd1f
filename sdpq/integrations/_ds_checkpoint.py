"""sdpq's checkpoint files next to DeepSpeed's, for every stage: one `sdpq_rank*.pt` per rank in
DeepSpeed's tag directory, written by `engine.save_checkpoint` before DeepSpeed's files and read
by `engine.load_checkpoint` after them (`wrap_engine`); what the files hold is the stage's
(_ds_zero3_state.py, _ds_zero12_state.py), how a load decides is the adapters' base
(_ds_base.py).

A save is _files.save_agreed: every rank writes its file beside the previous one, the ranks agree
that all were written, and only then does each replace its previous file, atomically; so a write
that fails on one rank (a full disk) changes no rank's file and raises the same
`CheckpointSaveError` (_files.py's, re-exported) on every rank, before DeepSpeed writes anything;
a rank killed before its rename changes no file either, and the others, whose agreement fails,
discard their temporary files. A load reads and validates the file (`read_state`, never raising)
and the ranks agree on what they found (`agree_on_problems`). On another layout with the same
world size (2 x 2 saved, 4 x 1 loaded) DeepSpeed loads its partitions and sdpq's state is rebuilt
with a warning; another world size is refused by DeepSpeed's own loader.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..comm import all_gather_rows
from ._files import CheckpointSaveError, save_agreed

__all__ = [
    "STATE_FILE",
    "agree_on_problems",
    "read_state",
    "state_path",
    "wrap_engine",
]

STATE_FILE = "sdpq_rank{rank:05d}.pt"
_SHOWN = 3  # ranks whose problem a load warning spells out


def wrap_engine(adapter) -> None:
    """Wrap adapter.engine's save_checkpoint (sdpq's state written first, at the adapter's state
    path in the tag directory: so "latest" never points at a tag without it), load_checkpoint
    (`adapter._after_load(tag dir)` once DeepSpeed has loaded) and destroy (`adapter.remove()`
    first), each through `adapter.patch` (undone by `adapter.remove()`)."""
    eng = adapter.engine
    orig_save, orig_load, orig_destroy = eng.save_checkpoint, eng.load_checkpoint, getattr(eng, "destroy", None)

    def save_checkpoint(save_dir, tag=None, *args, **kwargs):
        if tag is None:
            tag = f"global_step{eng.global_steps}"  # DeepSpeed's default tag
        path = os.path.join(save_dir, str(tag))
        try:
            save_agreed(adapter.state_dict(), adapter._state_path(path), adapter._agree, f"sdpq: checkpoint {path}")
        except CheckpointSaveError as e:
            raise CheckpointSaveError(f"{e}; nothing of DeepSpeed's was written") from e.__cause__
        return orig_save(save_dir, tag, *args, **kwargs)

    def load_checkpoint(load_dir, *args, **kwargs):
        result = orig_load(load_dir, *args, **kwargs)
        if result is not None and result[0] is not None:
            adapter._after_load(os.path.dirname(result[0]))
        return result

    def destroy(*args, **kwargs):
        adapter.remove()
        return orig_destroy(*args, **kwargs)

    adapter.patch(eng, "save_checkpoint", save_checkpoint)
    adapter.patch(eng, "load_checkpoint", load_checkpoint)
    if orig_destroy is not None:
        adapter.patch(eng, "destroy", destroy)


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
