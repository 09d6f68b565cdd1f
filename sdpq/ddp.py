"""``sdpq.ddp``: sdpq for DistributedDataParallel (the adapter lives in ``sdpq.integrations.ddp``)."""

from .integrations.ddp import *  # noqa: F401,F403
from .integrations.ddp import __all__  # noqa: F401
