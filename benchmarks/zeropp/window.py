"""Count only DeepSpeed's training steps with the process-group meter (sdpq.comm.link_bytes)."""

from __future__ import annotations

import contextlib

from sdpq.comm.link_bytes import LinkBytes

__all__ = ["training_window"]


@contextlib.contextmanager
def training_window(counter: LinkBytes, steps: int):
    """Count only DeepSpeed training steps: the window opens at the first forward of an engine in
    train mode and closes after the optimizer step that makes ``engine.global_steps == steps``;
    every optimizer step (gradient-accumulation boundary) is a ``counter.snapshot()``. Engine
    construction, evaluation and result gathering stay outside. Patches ``DeepSpeedEngine``'s
    ``forward`` and ``step`` for the duration."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    fwd, stp = DeepSpeedEngine.forward, DeepSpeedEngine.step
    state = {"open": False, "done": False}
    counter.enabled = False

    def forward(self, *args, **kwargs):
        if self.module.training and not state["open"] and not state["done"]:
            state["open"] = True
            counter.enabled = True
        return fwd(self, *args, **kwargs)

    def step(self, *args, **kwargs):
        before = self.global_steps
        out = stp(self, *args, **kwargs)
        if state["open"] and self.global_steps != before:
            counter.snapshot()
            if self.global_steps >= steps:
                state["open"], state["done"] = False, True
                counter.enabled = False
        return out

    DeepSpeedEngine.forward, DeepSpeedEngine.step = forward, step
    try:
        yield state
    finally:
        DeepSpeedEngine.forward, DeepSpeedEngine.step = fwd, stp
        counter.enabled = False
