"""Checkpointing a collective's stochastic-rounding stream (its torch.Generator).

The collectives create their generator lazily with a per-rank seed. A saved state restores it
exactly; a saved None means "not created yet", so the restored collective creates it at its
first draw with the same seed, as the uninterrupted run does.
"""

from __future__ import annotations

import torch

__all__ = ["generator_state", "per_rank_generator", "restore_generator"]


def per_rank_generator(seed: int, rank: int, device: torch.device) -> torch.Generator:
    """A rank's own stochastic-rounding stream for a collective seeded `seed`: independent
    streams per rank, so that the ranks' rounding errors cancel."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank + 1)


def generator_state(gen: torch.Generator | None) -> torch.Tensor | None:
    return None if gen is None else gen.get_state()


def restore_generator(
    gen: torch.Generator | None, state: torch.Tensor | None, device: torch.device
) -> torch.Generator | None:
    """The generator to use after loading `state` (reuses `gen`, keeping its device, if any)."""
    if state is None:
        return None
    if gen is None:
        gen = torch.Generator(device=device)
    gen.set_state(state)
    return gen
