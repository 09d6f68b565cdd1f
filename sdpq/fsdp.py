"""``sdpq.fsdp``: sdpq for PyTorch FSDP2 (the adapter lives in ``sdpq.integrations.fsdp``)."""

from .integrations.fsdp import *  # noqa: F401,F403
from .integrations.fsdp import __all__  # noqa: F401
