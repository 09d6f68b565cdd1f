"""sdpq's communication statistics: one API for every integration.

``sdpq.stats.summary(target=None) -> (table, dict)``: bytes per path (weights, gradients) and link
class (intra, inter node), call counts and sampled relative quantization errors, as this rank
counted them. `target`: an FSDP2 model after ``sdpq.fsdp.apply``, a DeepSpeed engine from
``sdpq.deepspeed.initialize`` (each counts its own collectives, so two models in one process
stay apart), a ``CommStats``, or None for the process-wide figures (every sdpq collective of this
process). ``sdpq.stats.of(target)`` is the ``CommStats`` itself; ``reset(target)`` clears it.
"""

from __future__ import annotations

from .comm.stats import CommStats, holder_stats, process_stats

__all__ = ["CommStats", "of", "summary", "reset"]


def of(target=None) -> CommStats:
    """The counters of `target` (see the module docstring)."""
    if target is None:
        return process_stats()
    if isinstance(target, CommStats):
        return target
    stats = holder_stats(target)  # where the integration that built `target` keeps them
    if stats is not None:
        return stats
    raise TypeError(
        f"sdpq.stats: {type(target).__name__} has no sdpq statistics; expected an FSDP2 model "
        "after sdpq.fsdp.apply, a DeepSpeed engine from sdpq.deepspeed.initialize, a CommStats, "
        "or None (the process-wide figures)"
    )


def summary(target=None) -> tuple[str, dict]:
    """(a printable table, the same figures as {path: {link: {...}}}) of `target`."""
    return of(target).summary()


def reset(target=None) -> None:
    """Clear the counters of `target` (of a model or engine: its own, not the process-wide ones)."""
    of(target).reset()
