"""Writing sdpq's own checkpoint files so that a failed or interrupted save never damages the
previous one: a temporary file in the target's directory (same file system, so the rename is
atomic), flushed and fsynced, then `os.replace`d over the target, then the directory fsynced (so
the rename itself survives a crash). A save that fails midway (disk full, quota, a killed process)
leaves the previous file as it was; on an error the temporary file is removed. A process killed
before the rename can leave its temporary file (".<name>.<pid>.<random>.tmp", which no load reads)."""

from __future__ import annotations

import contextlib
import os
import secrets

import torch

__all__ = ["save_atomically"]


def save_atomically(obj: object, path: str) -> None:
    """torch.save(obj, path), atomically: afterwards `path` holds either its old bytes or all of
    the new ones, never a part. Raises what writing raised (OSError for a full disk)."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # Note: os.open with 0o666 gives the file torch.save's permissions (the umask applies);
    # tempfile.mkstemp would make it readable by its owner only.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


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
