"""``sdpq.torchft``: sdpq for torchft (the adapter lives in ``sdpq.integrations.torchft``)."""

from .integrations.torchft import *  # noqa: F401,F403
from .integrations.torchft import __all__  # noqa: F401
