"""Communication statistics of this rank: ``sdpq.stats.summary() -> (table, dict)``.

Bytes per link class (intra, inter) and path (weights, gradients), call counts and sampled
relative quantization errors, recorded by every sdpq collective (see ``sdpq.comm.stats``).
"""

from .comm.stats import CommStats, default_recorder, reset, summary

__all__ = ["CommStats", "default_recorder", "reset", "summary"]
