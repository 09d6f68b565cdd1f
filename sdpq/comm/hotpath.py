"""The hot-path guard, as the hooks and collectives import it: `hot_path`, `host_read`,
`HostSyncError` and the switches tests use (`enable_guard`, `disable_guard`, `guard_enabled`,
environment variable SDPQ_HOTPATH_GUARD=1). Implemented in `sdpq/_hotpath.py` (see there), below
every layer, because the math layer uses it too.
"""

from .._hotpath import (
    ENV_VAR,
    HostSyncError,
    disable_guard,
    enable_guard,
    guard_enabled,
    host_read,
    hot_path,
    is_guard_enabled,
)

__all__ = [
    "ENV_VAR",
    "HostSyncError",
    "hot_path",
    "host_read",
    "enable_guard",
    "disable_guard",
    "guard_enabled",
    "is_guard_enabled",
]
