"""Writing sdpq's own checkpoint files so that a failed or interrupted save never damages the
previous one: a temporary file in the target's directory (same file system, so the rename is
atomic), flushed and fsynced, then `os.replace`d over the target, then the directory fsynced (so
the rename itself survives a crash). A save that fails midway (disk full, quota, a killed process)
leaves the previous file as it was; on an error the temporary file is removed. A process killed
before the rename can leave its temporary file (".<name>.<pid>.<random>.tmp", which no load reads).

The two halves are separate (`write_pending`, then `PendingFile.commit` or `.discard`) so that
the ranks of a job can agree that every rank's file is written before any of them replaces its
previous one (`save_agreed`; _ds_checkpoint.wrap_engine): one full disk then changes no rank's
file, and every rank raises the same `CheckpointSaveError`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = [
    "CheckpointLoadError",
    "CheckpointSaveError",
    "PendingFile",
    "every_rank_problem",
    "ranks_by_value",
    "save_agreed",
    "save_atomically",
    "write_pending",
]

_SHOWN = 3  # ranks whose problem an agreed error spells out


class CheckpointLoadError(ValueError):
    """A checkpoint's sdpq state cannot be loaded as it is: raised on every rank alike, before any
    rank restores anything, naming the ranks and what is wrong."""


class CheckpointSaveError(RuntimeError):
    """sdpq's state could not be written on some rank: raised on every rank alike, naming each
    failed rank, its file and the error; no rank's previous file was replaced (sdpq.ddp's and
    sdpq.deepspeed's save_checkpoint; DeepSpeed's then writes nothing of its own)."""


class PendingFile:
    """A complete, fsynced file beside its target, not yet in place."""

    def __init__(self, tmp: str, path: str):
        self.tmp, self.path = tmp, path

    def commit(self) -> None:
        """Put it in place of the target (atomic), durably."""
        os.replace(self.tmp, self.path)
        _fsync_dir(os.path.dirname(self.path))

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


def write_pending(obj: object, path: str) -> PendingFile:
    """torch.save(obj) into a temporary file beside `path`, flushed and fsynced. Raises what
    writing raised (OSError for a full disk), with the temporary file removed."""
    path = os.path.abspath(path)
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # Note: os.open with 0o666 gives the file torch.save's permissions (the umask applies);
    # tempfile.mkstemp would make it readable by its owner only.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    pending = PendingFile(tmp, path)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        pending.discard()
        raise
    return pending


def save_atomically(obj: object, path: str) -> None:
    """torch.save(obj, path), atomically: afterwards `path` holds either its old bytes or all of
    the new ones, never a part."""
    pending = write_pending(obj, path)
    try:
        pending.commit()
    except BaseException:
        pending.discard()
        raise


def every_rank_problem(problem: str | None, group=None) -> list[str]:
    """Every rank's problem ("rank r: ..."; a few spelled out), the same list on every rank of
    `group` (default: the world); empty when none has one. Collective."""
    texts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(texts, problem, group=group)
    bad = [r for r, t in enumerate(texts) if t]
    shown = [f"rank {r}: {texts[r]}" for r in bad[:_SHOWN]]
    return shown + ([f"and {len(bad) - _SHOWN} more rank(s)"] if len(bad) > _SHOWN else [])


def ranks_by_value(values: list, ranks: list[int] | None = None, what: str = "") -> str:
    """'5 on ranks 0, 2, 3; 3 on rank 1': which ranks hold which value (of `values`, one per
    rank of `ranks`, default 0, 1, ...), the most common value first."""
    ranks = list(range(len(values))) if ranks is None else ranks
    groups: dict = {}
    for r, v in zip(ranks, values):
        groups.setdefault(v, []).append(r)
    parts = []
    for v, rs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        who = ", ".join(str(r) for r in rs[:_SHOWN]) + (f" and {len(rs) - _SHOWN} more" if len(rs) > _SHOWN else "")
        parts.append(f"{what + ' ' if what else ''}{v} on rank{'s' if len(rs) > 1 else ''} {who}")
    return "; ".join(parts)


def save_agreed(obj: object, path: str, agree: Callable[[str | None], list[str]], what: str) -> None:
    """torch.save(obj, path) on every rank, all or none: every rank writes its file beside its
    previous one, the ranks agree that all were written (`agree(problem)`: every rank's problems,
    the same list on every rank), and only then does each replace its previous file. Any rank's
    failure raises the same CheckpointSaveError on every rank (`what`: the caller, for the
    message). Collective."""
    problem, cause, pending = None, None, None
    outcome = "no rank's previous file was changed"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        pending = write_pending(obj, path)
    except Exception as e:  # every rank must reach the agreement below
        problem, cause = f"cannot write {path}: {type(e).__name__}: {e}", e
    # Note: every rank's new file is complete before any replaces its previous one.
    try:
        problems = agree(problem)
        if not problems and pending is not None:
            try:
                pending.commit()
            except Exception as e:  # a rename that fails (rare): the ranks' files now mix two saves
                problem, cause = f"cannot replace {path}: {type(e).__name__}: {e}", e
            problems = agree(problem)
            outcome = "the other ranks' files are the new ones: do not load this checkpoint"
    except BaseException:  # the agreement itself failed (a peer died): leave no temporary file
        if pending is not None:
            pending.discard()
        raise
    if problems:
        if pending is not None:
            pending.discard()
        raise CheckpointSaveError(f"{what}: not saved: {'; '.join(problems)}; {outcome}") from cause


def _fsync_dir(directory: str) -> None:
    """Make the rename durable. Not every file system lets a directory be opened or fsynced
    (some network file systems refuse it): the file's own bytes are synced already."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
