"""The least-traffic recount of a study's byte figures (benchmarks/recount_bytes.py), for the
headline rows of benchmarks/results_ddp.py, benchmarks/results_zero12.py and
benchmarks/results_page.py. Standard library only."""

from __future__ import annotations


def study(recount, name: str) -> dict:
    """recount_bytes.py's record of results file `name` ({} when it has none, or no recount file)."""
    if recount is None or not recount.exists:
        return {}
    return recount.data["studies"].get(name, {})


def steady(recount, name: str, group: str) -> dict:
    """{arm: cross-node bytes per steady step} counted again for results file `name`, `group` its
    stage ("1", "2", "1-fp32") or framework ("ddp", "zero3"); {} when the recount has none."""
    return study(recount, name).get("steady", {}).get(group, {})


def how(recount, name: str) -> str:
    """How the recount counted: the seed, the study's step and the run lengths."""
    n = recount.data["args"]["steps"]
    rec = study(recount, name)
    return f"seed {recount.data['seed']}, a step is {rec['step']}; difference of {n}- and {2 * n}-step runs"
