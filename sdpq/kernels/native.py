"""Build and load sdpq's C++ CPU kernels (``sdpq/csrc/<name>.cpp``), once per machine.

Each source file is one shared library that registers CPU kernels for operators defined in
Python (``torch.library``; see ``codec_ops`` and ``adamw_ops``). It is compiled at first use with
``torch.utils.cpp_extension`` into a persistent cache (``$SDPQ_CACHE`` or
``~/.cache/sdpq/native``), keyed by the source, torch's version and the CPU's instruction
sets, so later processes (every rank of every run) only load it. The first build was measured
once on a 2-core machine at ~15 s for the codec and ~20 s for AdamW (benchmarks/RESULTS.md,
Kernels); ranks started together wait on one file lock, an ``flock`` the kernel releases when its
holder dies.

Note: torch's own build lock (a ``lock`` file in the build folder, waited on forever) stays
behind when a build is killed (Ctrl-C, a timeout, a killed rank), and every later process would
hang on it. Under sdpq's ``flock`` nobody else is building in that folder, so such a file is
stale and is removed before building.

Without a working C++ compiler, or with ``SDPQ_CPP=0``, ``load`` warns once and returns
False: callers then run the PyTorch reference, which computes the same thing more slowly.

Note: kernels are compiled with ``-march=native``; the cache key includes the CPU flags so a
library built for another processor is never loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import warnings
from pathlib import Path

import torch

__all__ = ["load", "enabled", "cache_dir", "CppBuildWarning", "NativeBuildWarning", "ENV_VAR"]

_CSRC = Path(__file__).resolve().parent.parent / "csrc"


class CppBuildWarning(RuntimeWarning):
    """The C++ kernels could not be built or loaded; the PyTorch reference path is used."""


NativeBuildWarning = CppBuildWarning  # the earlier name, kept for code that filters it

# Note: "native" names one thing in sdpq, the optimizer's master="native" (the parameter's own
# dtype); the compiled CPU kernels are "cpp" (SDPQ_CPP, uses_cpp). SDPQ_NATIVE, the switch's
# earlier name, still works and warns.
ENV_VAR = "SDPQ_CPP"
_OLD_ENV_VAR = "SDPQ_NATIVE"


def _env(suffix: str = "") -> str | None:
    """$SDPQ_CPP<suffix>, else the deprecated $SDPQ_NATIVE<suffix> (with a DeprecationWarning)."""
    value = os.environ.get(ENV_VAR + suffix)
    if value is None and os.environ.get(_OLD_ENV_VAR + suffix) is not None:
        warnings.warn(
            f"{_OLD_ENV_VAR + suffix} is deprecated: set {ENV_VAR + suffix} instead (same values)",
            DeprecationWarning,
            stacklevel=3,
        )
        value = os.environ[_OLD_ENV_VAR + suffix]
    return value


def enabled() -> bool:
    """False when SDPQ_CPP=0 (force the PyTorch reference on CPU)."""
    return _env() != "0"


def cache_dir() -> Path:
    root = os.environ.get("SDPQ_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sdpq")
    return Path(root) / "native"


# Part of the cache key: a build with other flags is another library. -ffp-contract=off: no FMA
# the reference lacks (bitwise equality).
_CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _key(name: str) -> str:
    h = hashlib.sha256()
    for path in sorted(_CSRC.glob("*.h")) + [_CSRC / f"{name}.cpp"]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(torch.__version__.encode())
    h.update(platform.machine().encode())
    h.update(_cpu_flags().encode())
    h.update(" ".join(_CFLAGS).encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(build: Path):
    """One builder per folder at a time, across processes; released by the kernel if the holder
    dies (unlike torch's lock file)."""
    with open(build / ".sdpq-build.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.cache
def load(name: str) -> bool:
    """Build (first use) and load ``csrc/<name>.cpp``; True when its kernels are registered."""
    if not enabled():
        return False
    source = _CSRC / f"{name}.cpp"
    try:
        from torch.utils import cpp_extension

        lib = f"sdpq_{name}_{_key(name)}"
        build = cache_dir() / lib
        build.mkdir(parents=True, exist_ok=True)
        so = build / f"{lib}.so"
        if so.exists():  # built before: no compiler needed, no ninja check
            torch.ops.load_library(str(so))
            return True
        with _build_lock(build):
            if so.exists():  # another process built it while this one waited
                torch.ops.load_library(str(so))
                return True
            (build / "lock").unlink(missing_ok=True)  # torch's baton, left by a killed build
            cpp_extension.load(
                name=lib,
                sources=[str(source)],
                extra_include_paths=[str(_CSRC)],
                extra_cflags=list(_CFLAGS),
                extra_ldflags=[],
                build_directory=str(build),
                is_python_module=False,
                verbose=_env("_VERBOSE") == "1",
            )
        return True
    except Exception as e:  # no compiler, no ninja, a failed build: the reference path still works
        warnings.warn(
            f"sdpq: the C++ CPU kernels '{name}' could not be built or loaded ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[-1] if str(e).strip() else e!r}); using the PyTorch "
            "reference path (same results, slower). Install a C++ compiler (g++) and ninja, "
            f"or set {ENV_VAR}=0 to silence this.",
            CppBuildWarning,
            stacklevel=2,
        )
        return False
