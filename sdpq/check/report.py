"""The check's two report files: `gpu_report.json` (every step, its status, checks and figures)
and `gpu_report.md` (the same for a person: a status table, then each step's figures)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write_report", "passed"]


def passed(records: list[dict]) -> bool:
    """Every step passed or was skipped for a stated reason ("skipped" for the budget is a failure)."""
    return all(r["status"] in ("pass", "skip") for r in records)


def write_report(out: Path, meta: dict, records: list[dict]) -> list[Path]:
    doc = {"meta": meta, "steps": records, "passed": passed(records)}
    paths = [out / "gpu_report.json", out / "gpu_report.md"]
    paths[0].write_text(json.dumps(doc, indent=1, default=str))
    paths[1].write_text(_markdown(doc))
    return paths


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and len(v) > 8:
        return (
            "[" + ", ".join(_fmt(x) for x in v[:3]) + ", ..., " + ", ".join(_fmt(x) for x in v[-2:]) + f"] ({len(v)})"
        )
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def _figure_lines(figures: dict, prefix: str = "") -> list[str]:
    lines = []
    for k, v in figures.items():
        if isinstance(v, dict):
            lines += _figure_lines(v, f"{prefix}{k}.")
        else:
            lines.append(f"- `{prefix}{k}`: {_fmt(v)}")
    return lines


def _markdown(doc: dict) -> str:
    m = doc["meta"]
    kind = "rehearsal on the CPU (Triton interpreter, small sizes)" if m["rehearsal"] else "GPU run"
    out = [
        "# sdpq GPU check",
        "",
        f"{kind}; {m['total_s']} s of a {m['budget_s']:.0f} s budget; host {m['host']}, CPU {m['cpu']}, "
        f"Python {m['python']}. Overall: **{'pass' if doc['passed'] else 'FAIL'}**.",
        "",
        "| step | status | seconds | note |",
        "|---|---|---|---|",
    ]
    for r in doc["steps"]:
        note = (r.get("error") or "").replace("|", "/").replace("\n", " ")[:160]
        out.append(f"| {r['name']} | {r['status']} | {r.get('seconds', 0):.1f} | {note} |")
    for r in doc["steps"]:
        out += ["", f"## {r['name']}: {r['status']}", ""]
        out += _figure_lines(r.get("figures") or {})
        failed = [c for c in r.get("checks", []) if not c["ok"]]
        passed = len(r.get("checks", [])) - len(failed)
        if r.get("checks"):
            out.append(f"- checks: {passed} passed, {len(failed)} failed")
        for c in failed:
            out.append(f"  - FAILED {c['check']} {c['detail']}")
        for n in r.get("notes", []):
            out.append(f"- note: {n}")
        if r["status"] not in ("pass", "skip", "skipped") and r.get("log_tail"):
            out += ["", "```text", r["log_tail"][-2000:], "```"]
    return "\n".join(out) + "\n"
