"""`ProcessPatch`: the one way sdpq replaces something process-wide inside DeepSpeed.

Three attributes are replaced for the whole process, not per engine: ZeRO-3's
`stage3.reduce_scatter_coalesced` and ZeRO-1/2's `stage_1_and_2.all_gather_dp_groups` (module
functions DeepSpeed's optimizers call by name: dispatchers that take sdpq's path for the engines
that installed it and DeepSpeed's for every other caller), and `deepspeed.initialize` with
`DeepSpeedEngine.__init__` (what `import sdpq` wraps, see _ds_hook.py). Each is a `ProcessPatch`
that its users acquire and release: installed at the first acquire, the original put back at the
last release, so DeepSpeed is exactly as it was once nothing holds it. No torch or DeepSpeed
import here (_ds_hook.py runs at `import sdpq`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ProcessPatch"]


class ProcessPatch:
    """A process-wide replacement of `owner().name` (a module's or a class's attribute), shared
    by reference count. `owner` is called at the first acquire (so that building one imports
    nothing); `make(original)` returns the replacement, which carries the original as
    `__sdpq_original__`.

    Note: not thread-safe; sdpq installs and removes from the thread that builds engines.
    Note: if something replaced the attribute again after sdpq (another library wrapping the same
    function), the last release leaves that chain alone: restoring sdpq's original would drop
    their wrapper. sdpq's replacements pass every call through when no engine of sdpq uses them
    (the dispatchers find no engine; the initialize wrapper finds no "sdpq" block)."""

    def __init__(self, owner: Callable[[], Any], name: str, make: Callable[[Any], Callable]):
        self._owner, self.name, self._make = owner, name, make
        self._holders = 0
        self._target: Any = None
        self._replacement: Callable | None = None
        self._original: Any = None
        self._own = False  # the original was the owner's own attribute (not inherited)

    @property
    def holders(self) -> int:
        return self._holders

    @property
    def original(self) -> Any:
        """What the attribute was before the replacement (None while not installed)."""
        return self._original

    def acquire(self) -> Callable[[], None]:
        """One more holder (installing the replacement if it is the first); returns the release,
        which takes effect once however often it is called."""
        if self._holders == 0:
            self._install()
        self._holders += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release()

        return release

    def _install(self) -> None:
        target = self._owner()
        original = getattr(target, self.name)
        replacement = self._make(original)
        replacement.__sdpq_original__ = original  # type: ignore[attr-defined]
        self._target, self._original, self._replacement = target, original, replacement
        self._own = self.name in vars(target)
        setattr(target, self.name, replacement)

    def _release(self) -> None:
        self._holders -= 1
        if self._holders:
            return
        target, name = self._target, self.name
        if vars(target).get(name) is self._replacement:  # still ours: put DeepSpeed's back
            if self._own:
                setattr(target, name, self._original)
            else:
                delattr(target, name)
        self._target = self._replacement = self._original = None
