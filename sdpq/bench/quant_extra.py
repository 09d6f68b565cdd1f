"""FP8-expansion and MCF primitives for ``sdpq bench quant`` (filled in with sdpq.quant.fp8/mcf)."""

from __future__ import annotations


def primitives() -> dict:
    return {}
