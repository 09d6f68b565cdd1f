"""Division by a Python number that rounds the same on every device."""

from __future__ import annotations

import torch

__all__ = ["true_div"]


def true_div(x: torch.Tensor, d: float) -> torch.Tensor:
    """x / d correctly rounded on every device (fp32 x; d as an fp32).

    Note: on CUDA, ``tensor / python_scalar`` multiplies by the scalar's rounded reciprocal (one
    bit may be lost; the CPU divides). Dividing by a tensor of d keeps the IEEE quotient the
    compiled kernels compute, so the reference is the same function on CPU and GPU."""
    return x / torch.tensor(d, dtype=torch.float32, device=x.device)  # 0-dim: no full-size temporary
