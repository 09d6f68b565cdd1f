"""Route every `deepspeed.initialize` through sdpq once sdpq is imported (no torch import here).

The Hugging Face Trainer, Accelerate and Lightning call `deepspeed.initialize` themselves, and
DeepSpeed ignores config keys it does not know, so without this an "sdpq" block in their config
would train uncompressed without a word. `import sdpq` therefore installs a post-import hook:
when `deepspeed` is (or already was) imported, its `initialize` is wrapped so that a config with
a non-empty "sdpq" block goes through `sdpq.deepspeed.initialize`; any other config reaches
DeepSpeed untouched. As a safety net, an engine built from a config with a block by a path that
bypassed the wrapper (an `initialize` bound before `import sdpq`) fails at start-up.

Why a hook and not a `.pth` file: only processes that import sdpq are touched, and the one line
(`import sdpq`) says in the user's script that sdpq is in the loop.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

__all__ = ["install"]

_TARGET = "deepspeed"


def _patch(module) -> None:
    from .deepspeed import wrap_deepspeed  # imports torch: deepspeed just did

    wrap_deepspeed(module)


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then patches the module it built."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch(module)


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
        _patch(sys.modules[_TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
