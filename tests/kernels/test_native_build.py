"""The C++ kernels' first-use build (sdpq/kernels/native.py) survives a build that was killed."""

import pytest
from torch.utils import cpp_extension

from sdpq.kernels import native


def test_a_killed_build_does_not_hang_the_next(tmp_path, monkeypatch):
    """torch's build lock ("lock" in the build folder, waited on forever) stays behind when a
    build is killed; the next build must not wait on it. The compiler is not run here: the
    build call records whether the stale lock was still there, then fails (-> the warning)."""
    monkeypatch.setenv("SDPQ_CACHE", str(tmp_path))
    build = native.cache_dir() / f"sdpq_finite_{native._key('finite')}"
    build.mkdir(parents=True)
    (build / "lock").touch()  # what a build killed half-way leaves
    seen = []

    def build_call(**kwargs):
        seen.append((build / "lock").exists())
        raise RuntimeError("no compiler in this test")

    monkeypatch.setattr(cpp_extension, "load", build_call)
    native.load.cache_clear()
    try:
        with pytest.warns(native.NativeBuildWarning, match="no compiler in this test"):
            assert native.load("finite") is False
    finally:
        native.load.cache_clear()  # the next caller loads the real library again
    assert seen == [False]
