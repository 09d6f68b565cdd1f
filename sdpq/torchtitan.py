"""``sdpq.torchtitan``: sdpq for torchtitan (the hook lives in ``sdpq.integrations.torchtitan``)."""

from .integrations.torchtitan import *  # noqa: F401,F403
from .integrations.torchtitan import __all__  # noqa: F401
