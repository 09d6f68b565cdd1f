"""sdpq's statistics in DeepSpeed's monitor: the TensorBoard / W&B / CSV / Comet writers that the
DeepSpeed config's "monitor" sections ("tensorboard", "wandb", "csv_monitor", "comet") turn on.

After every optimizer step the engine takes (`engine.step()` at a gradient-accumulation boundary)
this rank's figures since the previous step are written as events "sdpq/<path>/<link>/<figure>"
at DeepSpeed's `global_samples` (the x axis of its own "Train/Samples/..." events): bytes sent,
bits per element, the running mean of the sampled relative error; and "sdpq/skipped_steps". DeepSpeed's writers
keep rank 0's events only, so the figures are rank 0's (every rank sends alike).
"""

from __future__ import annotations

__all__ = ["step_events", "install_monitor"]


def step_events(now: dict, before: dict, x: int, skipped: int) -> list[tuple[str, float, int]]:
    """Events for the interval between two `CommStats.as_dict()` snapshots."""
    events = []
    for path, links in now.items():
        for link, d in links.items():
            prev = before.get(path, {}).get(link, {})
            sent, elems = d["bytes"] - prev.get("bytes", 0), d["elements"] - prev.get("elements", 0)
            tag = f"sdpq/{path}/{link}"
            events.append((f"{tag}/bytes", float(sent), x))
            if elems:
                events.append((f"{tag}/bits_per_element", 8.0 * sent / elems, x))
            if d["error_samples"] > prev.get("error_samples", 0):
                events.append((f"{tag}/relative_error_mean", d["relative_error_mean"], x))
    events.append(("sdpq/skipped_steps", float(skipped), x))
    return events


def install_monitor(adapter) -> None:
    """Wrap `adapter.engine.step` to write `step_events` when the engine's monitor is enabled."""
    eng = adapter.engine
    monitor = getattr(eng, "monitor", None)
    if monitor is None or not monitor.enabled:
        return
    orig_step = eng.step
    last: dict = {}

    def step(*args, **kwargs):
        boundary = eng.is_gradient_accumulation_boundary()
        out = orig_step(*args, **kwargs)
        if boundary and eng.global_rank == 0:
            now = adapter.stats.as_dict()
            monitor.write_events(step_events(now, last, eng.global_samples, int(getattr(eng, "skipped_steps", 0))))
            last.clear()
            last.update(now)
        return out

    adapter.patch(eng, "step", step)
