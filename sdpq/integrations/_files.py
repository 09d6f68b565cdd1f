"""Writing sdpq's own checkpoint files so that a failed or interrupted save never damages the
previous one: a temporary file in the target's directory (same file system, so the rename is
atomic), flushed and fsynced, then `os.replace`d over the target, then the directory fsynced (so
the rename itself survives a crash). A save that fails midway (disk full, quota, a killed process)
leaves the previous file as it was; on an error the temporary file is removed. A process killed
before the rename can leave its temporary file (".<name>.<pid>.<random>.tmp", which no load reads).

The two halves are separate (`write_pending`, then `PendingFile.commit` or `.discard`) so that
the ranks of a job can agree that every rank's file is written before any of them replaces its
previous one (_ds_checkpoint.wrap_engine): one full disk then changes no rank's file.
"""

from __future__ import annotations

import contextlib
import os
import secrets

import torch

__all__ = ["PendingFile", "save_atomically", "write_pending"]


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
