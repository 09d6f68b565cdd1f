"""``sdpq demo``: the four-arm comparison a new user runs first.

A small byte-level GPT (``--model llama``: the Llama-shaped model of sdpq/train/llama.py) trained
on the Python standard library's source on 4 CPU ranks as 2 simulated nodes x 2, four arms on
the same seed and data: FSDP2 baseline, FSDP2 + sdpq, ZeRO-3 baseline, ZeRO-3 + sdpq. The
baselines are what users run: bf16 mixed precision (FSDP2
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on fp32 parameters, ZeRO-3
``"bf16": {"enabled": true}``); every ratio the demo prints is against them. Two optional arms,
``fsdp2-fp32`` and ``zero3-fp32`` (``--arms``), train in fp32 as context only; ``zero1`` /
``zero2`` and their ``+sdpq`` arms run DeepSpeed ZeRO-1 / ZeRO-2 instead (their cross-node
bytes from the process-group meter in both arms: plain ZeRO-1/2 runs DeepSpeed's own
collectives, which sdpq's statistics never see). Each arm is its own
``torchrun`` job of ``python -m sdpq.train`` (so no framework state leaks between arms). Prints
one table, writes ``loss.png`` and ``results.json`` (one record per arm) under ``--out``
(default ``runs/demo``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .train.model import MODELS
from .train.settings import EXACT

__all__ = ["add_arguments", "main", "ARMS", "DEFAULT_ARMS", "PAIRS", "Arm", "arm_command"]

# The baselines run sdpq's "exact" collectives with the framework's own optimizer: bitwise equal
# to plain FSDP2 / ZeRO-3 (tests/integrations assert it), and their bytes are counted by the same
# statistics as sdpq's, so the cross-node ratio compares like with like (EXACT, from
# sdpq.train.settings: python -m sdpq.train counts a run without a block the same way).

# The library's defaults, spelled out (an empty block would mean plain DeepSpeed): 2-bit weight
# differences, 8/4-bit gradients with Hadamard and bf16 scales, FP8 states + MCF master (which needs bf16); with
# ZeRO-3, the opt-in workaround that drops its redundant bf16 master copy (FSDP2 ignores it).
FULL: dict[str, dict] = {
    **{section: {} for section in ("weights", "gradients", "optimizer")},
    "workarounds": {"deepspeed_alias_bf16_master": True},
}


# ZeRO-1/2: the defaults, with DeepSpeed's own fp32 master ("native", the default there: sdpq's MCF
# master needs DeepSpeed's bf16 master-weights mode, which stages 1-2 run only with CPU offload),
# so the parameters start fp32 as in the baseline.
FULL_ZERO12: dict[str, dict] = {"weights": {}, "gradients": {}, "optimizer": {"master": "native"}}


@dataclass(frozen=True)
class Arm:
    backend: str  # "fsdp2" | "deepspeed"
    sdpq: dict | None  # the sdpq block (None: none, the plain framework)
    bf16: bool  # bf16 parameters (sdpq's MCF master keeps bf16 weights + a bf16 compensation)
    mixed_precision: str | None  # "bf16": bf16 compute policy (python -m sdpq.train --mixed-precision)
    precision: str  # shown in the table
    zero_stage: int | None = None  # 1 or 2: a DeepSpeed config naming it, bytes from the meter

    def train_args(self) -> list[str]:
        return (["--bf16"] if self.bf16 else []) + (
            ["--mixed-precision", self.mixed_precision] if self.mixed_precision else []
        )


# Baselines: bf16 mixed precision as users run it. The sdpq arms compute with the same policy
# (FSDP2: on bf16 parameters param_dtype=bf16 is a no-op and the fp32 reduce dtype applies, so
# forward/backward run in bf16 and the gradients reach the reduce-scatter in fp32 in both arms).
ARMS = {
    "fsdp2": Arm("fsdp2", EXACT, False, "bf16", "bf16 mixed"),
    "fsdp2+sdpq": Arm("fsdp2", FULL, True, "bf16", "bf16 + sdpq"),
    "zero3": Arm("deepspeed", EXACT, False, "bf16", "bf16 mixed"),
    "zero3+sdpq": Arm("deepspeed", FULL, True, "bf16", "bf16 + sdpq"),
    # fp32 parameters and compute: context only, never a ratio's denominator unless labelled so.
    "fsdp2-fp32": Arm("fsdp2", EXACT, False, None, "fp32 (context)"),
    "zero3-fp32": Arm("deepspeed", EXACT, False, None, "fp32 (context)"),
    "zero1": Arm("deepspeed", None, False, "bf16", "bf16 mixed", zero_stage=1),
    "zero1+sdpq": Arm("deepspeed", FULL_ZERO12, False, "bf16", "bf16 + sdpq", zero_stage=1),
    "zero2": Arm("deepspeed", None, False, "bf16", "bf16 mixed", zero_stage=2),
    "zero2+sdpq": Arm("deepspeed", FULL_ZERO12, False, "bf16", "bf16 + sdpq", zero_stage=2),
}
DEFAULT_ARMS = ["fsdp2", "fsdp2+sdpq", "zero3", "zero3+sdpq"]
# sdpq arm -> (its baseline, its fp32 context arm)
PAIRS = {
    "fsdp2+sdpq": ("fsdp2", "fsdp2-fp32"),
    "zero3+sdpq": ("zero3", "zero3-fp32"),
    "zero1+sdpq": ("zero1", None),
    "zero2+sdpq": ("zero2", None),
}
_STEP = re.compile(r"^step\s+(\d+)\s+loss\S*\s+([0-9.]+)")


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's layout and model options (shared with `sdpq bench step`, which runs its arms)."""
    p.add_argument("--ranks", type=int, default=4, help="total ranks (processes)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="simulated node size")
    p.add_argument("--model", choices=list(MODELS), default="gpt", help="gpt, or llama (python -m sdpq.train --model)")
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", help="directory for results.json and loss.png")
    p.add_argument("--steps", type=int, default=60)
    add_job_arguments(p)
    p.add_argument(
        "--arms",
        nargs="+",
        choices=list(ARMS),
        default=DEFAULT_ARMS,
        help="default: the two bf16 baselines and their sdpq arms; fsdp2-fp32 / zero3-fp32 add fp32 runs as "
        "context; zero1, zero1+sdpq, zero2, zero2+sdpq: DeepSpeed ZeRO-1 / ZeRO-2",
    )
    p.add_argument("--tail", type=int, default=10, help="final loss = mean of the last N steps")


def arm_command(
    name: str, args: argparse.Namespace, out: Path, *, block: dict | None | str = "arm", extra: Sequence[str] = ()
) -> list[str]:
    """The torchrun command line of arm `name` (its result goes to out/NAME.json). `args` holds the
    demo's model and layout options; block: the sdpq block ("arm" = the arm's own, None = no block,
    i.e. the plain framework, uncounted: --count-bytes off); extra: more python -m sdpq.train
    arguments. Every setting is a flag, so it wins over any file (sdpq.train.settings' order)."""
    arm = ARMS[name]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.ranks}",
        "-m",
        "sdpq.train",
        "--backend",
        arm.backend,
        "--steps",
        str(args.steps),
        "--model",
        args.model,
        "--d-model",
        str(args.d_model),
        "--n-layer",
        str(args.n_layer),
        "--seq-len",
        str(args.seq_len),
        "--micro-batch",
        str(args.micro_batch),
        "--lr",
        str(args.lr),
        "--ranks-per-node",
        str(args.ranks_per_node),
        "--log-every",
        "1",
        "--out",
        str(out / f"{name}.json"),
    ]
    block = arm.sdpq if block == "arm" else block
    if arm.zero_stage is not None:  # both arms counted by the meter (plain ZeRO-1/2 is DeepSpeed's own)
        ds: dict = {"zero_optimization": {"stage": arm.zero_stage}, "bf16": {"enabled": True}}
        if block is not None:
            ds["sdpq"] = block
        cfg = out / f"{name}.ds.json"
        cfg.write_text(json.dumps(ds))
        cmd += ["--config", str(cfg), "--count-bytes", "meter"]
    elif block is not None:
        cfg = out / f"{name}.sdpq.json"
        cfg.write_text(json.dumps(block))
        cmd += ["--config", str(cfg)]
    else:
        cmd += ["--count-bytes", "off"]
    return cmd + arm.train_args() + list(extra)


def _run_arm(name: str, args: argparse.Namespace, out: Path, progress: Progress, task) -> dict:
    cmd = arm_command(name, args, out)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = (out / f"{name}.log").open("w", buffering=1)  # line-buffered: `tail -f` works
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None  # stdout=PIPE
    for line in proc.stdout:
        log.write(line)
        m = _STEP.match(line)
        if m:
            progress.update(task, completed=int(m.group(1)), description=f"{name:<11} loss {float(m.group(2)):.3f}")
    log.close()
    if proc.wait() != 0:
        raise SystemExit(f"sdpq demo: arm {name} failed (exit {proc.returncode}); see {out / (name + '.log')}")
    return json.loads((out / f"{name}.json").read_text())


def _record(name: str, r: dict, tail: int) -> dict:
    losses = r["losses"]
    comm = r.get("comm", {}).get("total", {})
    bits = {
        f"{path}_{link}_bits": v.get("bits_per_element")
        for path, links in comm.items()
        for link, v in links.items()
        if isinstance(v, dict) and v.get("bits_per_element") is not None
    }
    return dict(
        arm=name,
        precision=ARMS[name].precision,
        final_loss=sum(losses[-tail:]) / len(losses[-tail:]),
        val_loss=r["val_loss"],
        cross_node_bytes_per_step=r["cross_node_bytes_per_step"],
        optimizer_bytes_per_param=r["optimizer_bytes_per_param"],
        step_seconds=r["step_seconds"],
        **bits,
        losses=losses,
    )


def _plot(records: list[dict], path: Path) -> bool:
    """The loss curves as a PNG; False (nothing written) without matplotlib, which is the
    optional `plot` extra: the table and results.json need nothing beyond the base install."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in records:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["arm"], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (bytes, nats)")
    ax.set_title("sdpq demo: 4 ranks = 2 simulated nodes x 2")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _table(records: list[dict], console: Console) -> None:
    t = Table(
        title="sdpq demo (train loss = mean of the last steps; bytes and bits from sdpq.stats, ZeRO-1/2 arms' "
        "bytes from the process-group meter)"
    )
    cols = [
        "arm",
        "precision",
        "final_loss",
        "val_loss",
        "cross_node_bytes_per_step",
        "optimizer_bytes_per_param",
        "step_seconds",
    ]
    heads = ["arm", "precision", "train loss", "val loss", "cross-node B/step", "optim B/param", "s/step"]
    extra = sorted({k for r in records for k in r if k.endswith("_bits")})
    for c, h in zip(cols + extra, heads + [e.removesuffix("_bits").replace("_", " ") + " bits" for e in extra]):
        t.add_column(h, justify="left" if c in ("arm", "precision") else "right")
    for r in records:
        t.add_row(*(f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols + extra))
    console.print(t)
    by = {r["arm"]: r for r in records}

    def ratios(o: dict, b: dict) -> str:
        def r(key: str) -> float:
            return o[key] / b[key] if b[key] else float("nan")

        return (
            f"cross-node bytes ratio {r('cross_node_bytes_per_step'):.3f}, step time ratio "
            f"{r('step_seconds'):.2f}, optimizer bytes/param {o['optimizer_bytes_per_param']:.2f} vs "
            f"{b['optimizer_bytes_per_param']:.2f}"
        )

    for ours, (base, context) in PAIRS.items():
        if ours not in by:
            continue
        o = by[ours]
        if base in by:
            b = by[base]
            console.print(
                f"{ours} vs {base} (bf16 mixed precision): final loss ratio "
                f"{o['final_loss'] / b['final_loss']:.4f}, val loss ratio "
                f"{o['val_loss'] / b['val_loss']:.4f}, " + ratios(o, b)
            )
        if context in by:
            console.print(f"{ours} vs {context} (fp32, context only): " + ratios(o, by[context]))


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=max(Console().width, 150))
    console.print(
        f"[bold]sdpq demo[/]: {args.model}, {len(args.arms)} arms x {args.steps} steps, {args.ranks} ranks as "
        f"{args.ranks // args.ranks_per_node} simulated nodes x {args.ranks_per_node}; output in {out}/"
    )
    records = []
    cols = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*cols, console=console) as progress:
        for name in args.arms:
            task = progress.add_task(f"{name:<11}", total=args.steps)
            records.append(_record(name, _run_arm(name, args, out, progress, task), args.tail))
    _table(records, console)
    (out / "results.json").write_text(json.dumps(records, indent=1))
    if _plot(records, out / "loss.png"):
        console.print(f"wrote {out / 'results.json'} and {out / 'loss.png'}")
    else:
        console.print(f"wrote {out / 'results.json'} (no loss.png: matplotlib is missing; pip install 'sdpq[plot]')")
    return 0
