"""``sdpq.deepspeed``: sdpq for DeepSpeed ZeRO-3 (the adapter lives in ``sdpq.integrations.deepspeed``)."""

from .integrations.deepspeed import *  # noqa: F401,F403
from .integrations.deepspeed import __all__  # noqa: F401
