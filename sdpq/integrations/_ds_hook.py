"""Route every `deepspeed.initialize` through sdpq once sdpq is imported (no torch import here).

The Hugging Face Trainer, Accelerate and Lightning call `deepspeed.initialize` themselves, and
DeepSpeed ignores config keys it does not know, so without this an "sdpq" block in their config
would train uncompressed without a word. `import sdpq` therefore installs a post-import hook:
when `deepspeed` is (or already was) imported, its `initialize` is wrapped (`INITIALIZE`) so that
a config with a non-empty "sdpq" block goes through `sdpq.deepspeed.initialize`; any other config
reaches DeepSpeed untouched. As a safety net (`ENGINE_GUARD`), an engine built from a config with
a block by a path that bypassed the wrapper (an `initialize` bound before `import sdpq`) fails at
start-up.

Both are `ProcessPatch`es (_ds_patch.py): the hook holds one reference to each, and `uninstall()`
releases them, which puts DeepSpeed's own functions back (and drops the import hook).

Why a hook and not a `.pth` file: only processes that import sdpq are touched, and the one line
(`import sdpq`) says in the user's script that sdpq is in the loop.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable

from ._ds_engine_internals import engine_class
from ._ds_patch import ProcessPatch

__all__ = ["ENGINE_GUARD", "INITIALIZE", "install", "uninstall"]

_TARGET = "deepspeed"


def _deepspeed():
    return sys.modules[_TARGET]


def _wrap_initialize(original: Callable) -> Callable:
    from .deepspeed import initialize_wrapper  # imports torch: deepspeed did already

    return initialize_wrapper(original)


def _guard_engine_init(original: Callable) -> Callable:
    from .deepspeed import engine_init_guard

    return engine_init_guard(original)


INITIALIZE = ProcessPatch(_deepspeed, "initialize", _wrap_initialize)
ENGINE_GUARD = ProcessPatch(engine_class, "__init__", _guard_engine_init)
_HELD: list[Callable[[], None]] = []  # the hook's releases


def _hold() -> None:
    """The hook's one reference to each patch (idempotent)."""
    if not _HELD:
        _HELD.extend((INITIALIZE.acquire(), ENGINE_GUARD.acquire()))


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then patches the module it built."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _hold()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:  # the spec the other finders would give, loader wrapped
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Idempotent: patch an imported deepspeed now, or the one imported later."""
    if _TARGET in sys.modules:
        _hold()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def uninstall() -> None:
    """Undo what `import sdpq` (install) did: drop the import hook and release its patches
    (DeepSpeed's own `initialize` and `DeepSpeedEngine.__init__` are back once no one else holds them).
    Idempotent. Engines sdpq already built keep their adapters (`engine.sdpq.remove()`)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
    while _HELD:
        _HELD.pop()()
