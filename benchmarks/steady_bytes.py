"""Steady bytes a step from two runs of a study's protocol: a run of n steps and one of 2n.

The first steps carry one-off traffic (the exact weight refresh, DeepSpeed's first gathers), so a
study's bytes a step are the difference of the two totals over n: what every later step sends.
Shared by `long_bytes.py` (the long-run study) and `recount_bytes.py` (the DDP, ZeRO-1/2 and
ZeRO++ studies).
"""

from __future__ import annotations

import argparse


def short_protocol(study: dict, n: int, timeout: float) -> argparse.Namespace:
    """The study's recorded arguments with `n` steps, a one-step warm-up (the learning rate moves
    no byte) and no evaluation."""
    return argparse.Namespace(**{**study, "steps": n, "warmup": 1, "eval_batches": 0, "timeout": timeout})


def steady_and_start(short, long, n: int):
    """Totals of the n- and 2n-step runs (numbers, or dicts of them nested alike) -> (steady bytes
    a step, the first steps' extra over n steady steps), nested as the totals are."""
    if isinstance(short, dict):
        pairs = {k: steady_and_start(short[k], long[k], n) for k in short}
        return {k: p[0] for k, p in pairs.items()}, {k: p[1] for k, p in pairs.items()}
    steady = (long - short) / n
    return steady, short - n * steady
