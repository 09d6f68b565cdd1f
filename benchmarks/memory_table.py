"""Per-GPU model-state memory of Llama-2 7B and 70B on nodes of 8 GPUs, 2 to 64 nodes, from
`sdpq plan`'s memory model (sdpq/plan/memory.py; checked kind by kind against live runs on the
CPU layouts by benchmarks/plan_check.py): plain bf16 FSDP2 / ZeRO-3, DeepSpeed ZeRO++ (hpZ +
qwZ + qgZ) and sdpq's configurations. Activations are not included (they are the same for all).

    .venv/bin/python benchmarks/memory_table.py          # writes results/memory_table.json and docs/memory.md's table
    .venv/bin/python benchmarks/memory_table.py --check  # exit 1 if docs/memory.md's table is not current
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.provenance import provenance  # noqa: E402

NODES = (2, 4, 8, 16, 32, 64)
PER_NODE = 8
MODELS = ("7b", "70b")
FRAMEWORKS = ("fsdp2", "zero3")
SHOWN = ("bf16", "ZeRO++ (hpZ+qwZ+qgZ)", "sdpq", "sdpq int8 reference", "sdpq stateless (direct)")


def compute() -> dict:
    from sdpq.plan import arms_for, rank_memory
    from sdpq.plan.shapes import PRESETS, from_config

    out: dict = {}
    for name in MODELS:
        model = from_config(PRESETS[name], name=f"Llama-2 {name}")
        for fw in FRAMEWORKS:
            table = out.setdefault(name, {}).setdefault(fw, {})
            for arm in arms_for(fw):
                if arm.name not in SHOWN:
                    continue
                table[arm.name] = {
                    str(n): sum(rank_memory(model.units, "zero3" if arm.zeropp else fw, n, PER_NODE, arm).values())
                    for n in NODES
                }
    return out


DOC = ROOT / "docs" / "memory.md"
BEGIN, END = "<!-- memory-table:begin (benchmarks/memory_table.py) -->", "<!-- memory-table:end -->"


def markdown(data: dict, frameworks: tuple[str, ...] = FRAMEWORKS) -> str:
    lines = []
    for name, per_fw in data.items():
        for fw, arms in per_fw.items():
            if fw not in frameworks:
                continue
            label = {"fsdp2": "FSDP2", "zero3": "ZeRO-3"}[fw]
            lines += [
                f"**Llama-2 {name}, {label}**, GB of model state per GPU (nodes of {PER_NODE} GPUs):",
                "",
                "| configuration | " + " | ".join(f"{n} nodes" for n in NODES) + " |",
                "|---|" + "---:|" * len(NODES),
            ]
            plain = arms["bf16"]
            for arm, by_nodes in arms.items():
                cells = []
                for n in NODES:
                    gb = by_nodes[str(n)] / 1e9
                    mark = "" if arm == "bf16" else (" **<**" if by_nodes[str(n)] < plain[str(n)] else " >")
                    cells.append(f"{gb:.1f}{mark}")
                lines.append(f"| {arm} | " + " | ".join(cells) + " |")
            lines.append("")
    lines.append("**<**: less than plain bf16 at that size; >: more.")
    return "\n".join(lines)


def doc_page(data: dict, page: str) -> str:
    """docs/memory.md with the ZeRO-3 tables between the markers (FSDP2's are the same to rounding)."""
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[:start] + "\n" + markdown(data, ("zero3",)) + "\n" + page[end:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory_table.json"))
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/memory.md's table differs")
    args = ap.parse_args(argv)
    data = compute()
    page = DOC.read_text()
    if args.check:
        if doc_page(data, page) != page:
            print(f"{DOC}: the memory table is not current; run benchmarks/memory_table.py", file=sys.stderr)
            return 1
        return 0
    record = {"args": {}, "meta": provenance(), "gpus_per_node": PER_NODE, "bytes": data}
    Path(args.out).write_text(json.dumps(record, indent=1))
    DOC.write_text(doc_page(data, page))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
