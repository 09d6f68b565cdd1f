"""Shared output of the benchmarks: a rich table of records and a timing helper."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from rich.console import Console
from rich.table import Table

__all__ = ["print_table", "seconds_per_call"]


def seconds_per_call(fn: Callable[[], object], min_run_time: float = 0.2) -> float:
    """Median seconds of ``fn()`` (torch.utils.benchmark synchronises CUDA and picks repeats)."""
    from torch.utils.benchmark import Timer

    return Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def paired_seconds(
    a: Callable[[], object], b: Callable[[], object], min_run_time: float = 0.2, rounds: int = 3
) -> tuple[float, float]:
    """Seconds per call of ``a`` and ``b``, timed in alternation for `rounds` rounds; each the
    fastest of its round medians. A ratio of the two then compares runs that saw the same machine
    state (page cache, other load), not one lucky run against one unlucky one."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(seconds_per_call(a, min_run_time / rounds))
        tb.append(seconds_per_call(b, min_run_time / rounds))
    return min(ta), min(tb)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_table(records: Sequence[dict], title: str, columns: Sequence[str] | None = None) -> None:
    if not records:
        print(f"{title}: no records")
        return
    # The given columns that these records have; else every key but the long "assumptions" text.
    columns = [c for c in columns or () if c in records[0]] or [c for c in records[0] if c != "assumptions"]
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right" if isinstance(records[0].get(c), (int, float)) else "left")
    for r in records:
        table.add_row(*(_fmt(r.get(c, "")) for c in columns))
    Console(width=max(120, 14 * len(columns))).print(table)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
