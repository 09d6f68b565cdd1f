"""The hot-path guard, as the hooks and collectives import it: `hot_path`, `host_read`,
`HostSyncError` and the switches tests use (`enable_guard`, `disable_guard`, `guard_enabled`,
environment variable SDPQ_HOTPATH_GUARD=1). Implemented in `sdpq/_hotpath.py` (see there), below
every layer, because the math layer uses it too.
"""

from .._hotpath import *  # noqa: F403 - one implementation, re-exported for the layers above
from .._hotpath import __all__  # noqa: F401
