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
        with pytest.warns(native.CppBuildWarning, match="no compiler in this test"):
            assert native.load("finite") is False
    finally:
        native.load.cache_clear()  # the next caller loads the real library again
    assert seen == [False]


def test_sdpq_cpp_switches_the_cpp_kernels_and_sdpq_native_still_does_with_a_warning(monkeypatch):
    import warnings

    monkeypatch.delenv("SDPQ_NATIVE", raising=False)
    monkeypatch.delenv("SDPQ_CPP", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.enabled()
        monkeypatch.setenv("SDPQ_CPP", "0")
        assert not native.enabled()
    monkeypatch.delenv("SDPQ_CPP")
    monkeypatch.setenv("SDPQ_NATIVE", "0")
    with pytest.warns(DeprecationWarning, match="SDPQ_NATIVE is deprecated: set SDPQ_CPP"):
        assert not native.enabled()
    monkeypatch.setenv("SDPQ_CPP", "1")  # the new name wins, and nothing warns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.enabled()
