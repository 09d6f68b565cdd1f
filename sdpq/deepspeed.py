"""``sdpq.deepspeed``: sdpq for DeepSpeed ZeRO-1, -2 and -3 (the adapters live in ``sdpq.integrations.deepspeed``)."""

from .integrations.deepspeed import *  # noqa: F401,F403
from .integrations.deepspeed import __all__  # noqa: F401
