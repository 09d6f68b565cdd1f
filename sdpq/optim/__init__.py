"""Optimizers with compressed states: AdamW (FP8 / bf16 states, MCF master weights) and a
wrapper that keeps any torch.optim optimizer's states compressed between steps."""

from .adamw import AdamW
from .memory import measure_peak, memory_report
from .wrapper import compress

__all__ = ["AdamW", "compress", "memory_report", "measure_peak"]
