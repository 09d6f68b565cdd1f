"""``sdpq.hf``: sdpq's statistics in the Hugging Face Trainer (see ``sdpq.integrations.hf``)."""

from .integrations.hf import *  # noqa: F401,F403
from .integrations.hf import __all__  # noqa: F401
