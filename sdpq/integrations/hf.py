"""sdpq's statistics in the Hugging Face Trainer's logs (exposed as ``sdpq.hf``).

``sdpq.hf.log_stats(trainer)`` adds, to every log the Trainer writes (console, TensorBoard,
W&B, ... whatever ``report_to`` says), this rank's sdpq figures since the previous log:
"sdpq/<path>/<link>/bytes" per optimizer step, ".../bits_per_element" and the running mean of
the sampled ".../relative_error_mean". Importing this module imports transformers.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import TrainerCallback

from ..comm.stats import CommStats, process_stats
from ._ds_monitor import step_events

__all__ = ["StatsCallback", "log_stats"]


class StatsCallback(TrainerCallback):
    """Adds sdpq's communication statistics to the Trainer's logs (see the module). `stats`: the
    counters to report, or a callable returning them at each log (the engine exists only once
    training has started)."""

    def __init__(self, stats: CommStats | Callable[[], CommStats] = process_stats):
        self._stats = stats
        self._last: dict = {}
        self._last_step = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or state.global_step == self._last_step:  # e.g. the end-of-training summary
            return
        now = (self._stats() if callable(self._stats) else self._stats).as_dict()
        steps = state.global_step - self._last_step
        for name, value, _ in step_events(now, self._last, state.global_step, 0)[:-1]:  # no skipped-step count here
            logs[name] = value / steps if name.endswith("/bytes") else value
        self._last, self._last_step = now, state.global_step


def log_stats(trainer) -> StatsCallback:
    """Report the counters of the DeepSpeed engine the Trainer builds (the process-wide ones
    until it exists, or without DeepSpeed). The callback goes ahead of the Trainer's reporting
    callbacks (they receive the logs after the callbacks before them have added to them; a
    callback passed to `Trainer(callbacks=)` runs after them, too late)."""

    def engine_stats() -> CommStats:
        adapter = getattr(getattr(trainer, "model_wrapped", None), "sdpq", None)
        return getattr(adapter, "stats", None) or process_stats()

    callback = StatsCallback(engine_stats)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
