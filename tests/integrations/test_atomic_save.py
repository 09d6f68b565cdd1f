"""sdpq/integrations/_files.py: sdpq's own checkpoint files are written atomically, so a save that
fails midway (a full disk) leaves the previous file as it was and no temporary file behind."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from sdpq.integrations import _files


def _full_disk_after(n: int):
    """torch.save that writes n bytes, then fails as a full disk does."""

    def save(obj, f):
        f.write(b"\0" * n)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return save


def test_a_save_that_fails_midway_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "sdpq_rank00001.pt"
    _files.save_atomically({"steps": 2, "t": torch.arange(1000)}, str(path))
    before = path.read_bytes()
    monkeypatch.setattr(_files.torch, "save", _full_disk_after(len(before) // 2))
    with pytest.raises(OSError) as e:
        _files.save_atomically({"steps": 3, "t": torch.arange(1000) + 1}, str(path))
    assert e.value.errno == errno.ENOSPC
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [path.name], "no temporary file left"
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["steps"] == 2


def test_a_save_replaces_the_file_with_the_usual_permissions(tmp_path):
    path = tmp_path / "state.pt"
    path.write_bytes(b"old")
    _files.save_atomically({"steps": 5}, str(path))
    assert torch.load(path, weights_only=True) == {"steps": 5}
    assert os.listdir(tmp_path) == ["state.pt"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as torch.save's own file
