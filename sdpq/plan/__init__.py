"""`sdpq plan`: per-GPU memory by kind, cross-node bytes per step and a predicted step time for
plain bf16 training, DeepSpeed ZeRO++ and sdpq's configurations, before launch; and the
configuration with the fewest cross-node bytes that fits in the GPU's memory.

    sdpq plan --preset 70b --nodes 8 --gpus-per-node 8 --gpu-memory 80 --link-gbit 400 --framework zero3

The memory of each kind is computed from the model's parameter shapes as sdpq.train's setups
keep it (`sdpq/plan/memory.py`), the figure `sdpq.memory.report` measures on a live run
(`benchmarks/plan_check.py` compares them); bytes and times come from `sdpq bench scaling`'s
model (`sdpq/plan/traffic.py`). Activations are not planned: `--reserve` keeps a share of the
GPU's memory for them.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field, replace

from ..bench.scaling_model import Constants
from ..config import Config
from ..integrations import deepspeed_config_at_stage
from .memory import FRAMEWORKS, Arm, rank_memory
from .shapes import PRESETS, ModelShape, from_config, from_hf_config, from_params
from .traffic import Link, cross_node_bytes, step_seconds

__all__ = ["Arm", "Link", "PlanRow", "arms_for", "plan", "recommend", "rank_memory", "add_arguments", "main"]

GB = 1e9


def arms_for(framework: str) -> list[Arm]:
    """The configurations a plan compares (ZeRO-3 runs sdpq with its bf16-master workaround,
    ZeRO-1/2 with a native fp32 master)."""
    extra: dict = {"workarounds": {"deepspeed_alias_bf16_master": True}} if framework == "zero3" else {}

    def sdpq(**weights) -> Config:
        cfg = Config.from_dict({"weights": weights, **extra})
        # The config sdpq.deepspeed runs with at this stage (ZeRO-1/2: a native fp32 master).
        return deepspeed_config_at_stage(cfg, int(framework[-1])) if framework.startswith("zero") else cfg

    arms = [Arm("bf16")]
    if framework in ("zero1", "zero2"):  # full replicas: no reference to store, no ZeRO++ (ZeRO-3's)
        return [*arms, Arm("sdpq", sdpq()), Arm("sdpq 4-bit weights", sdpq(bits=4))]
    if framework != "hsdp":
        arms.append(Arm("ZeRO++ (hpZ+qwZ+qgZ)", zeropp=True))
    arms += [
        Arm("sdpq", sdpq()),
        Arm("sdpq int8 reference", sdpq(reference="int8")),
        Arm("sdpq stateless (direct)", sdpq(mode="direct", bits=8)),
        Arm("sdpq 4-bit weights", sdpq(bits=4)),
    ]
    return arms


@dataclass(frozen=True)
class PlanRow:
    arm: str
    memory: dict[str, int]  # bytes per kind on the rank that keeps the most
    cross_node: dict[str, float]  # bytes per step over one node's link
    seconds: dict[str, float]  # the time model's step and parts
    fits: bool
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.memory.values())


def plan(
    model: ModelShape,
    framework: str,
    nodes: int,
    per_node: int,
    *,
    gpu_memory_gb: float,
    link: Link,
    reserve: float = 0.3,
    arms: list[Arm] | None = None,
    constants: Constants | None = None,
) -> list[PlanRow]:
    """One row per configuration; `reserve`: the share of the GPU's memory left for activations
    and the gathered layers; `constants`: the time model's (default: `default_constants()`)."""
    k = constants or default_constants()
    rows = []
    for arm in arms or arms_for(framework):
        fw = "zero3" if arm.zeropp else framework
        mem = rank_memory(model.units, fw, nodes, per_node, arm)
        total = sum(mem.values())
        notes = ["DeepSpeed only"] if arm.zeropp and framework != "zero3" else []
        rows.append(
            PlanRow(
                arm.name,
                mem,
                cross_node_bytes(model, fw, nodes, per_node, arm),
                step_seconds(model, fw, nodes, per_node, arm, link, k),
                total <= (1 - reserve) * gpu_memory_gb * GB,
                notes,
            )
        )
    return rows


@functools.lru_cache(maxsize=1)
def default_constants() -> Constants:
    """The time model's constants fitted on the published 100 Gbit/s InfiniBand cluster (16 nodes
    of 4 A100s): an mfu and the share of the nominal link bandwidth a collective gets."""
    from ..bench.scaling_model import A100, fit

    return fit(A100)


def recommend(rows: list[PlanRow]) -> PlanRow | None:
    """The sdpq configuration with the fewest cross-node bytes that fits (then the least memory)."""
    ok = [r for r in rows if r.fits and r.arm.startswith("sdpq")]
    return min(ok, key=lambda r: (r.cross_node["total"], r.total), default=None)


def table(rows: list[PlanRow]) -> str:
    kinds = ("parameters", "gradients", "master", "optimizer_states", "weight_reference", "error_feedback")
    short = ("params", "grads", "master", "states", "ref", "EF")
    head = (
        f"{'configuration':<26}"
        + "".join(f"{s:>8}" for s in short)
        + f"{'total':>8}{'x-node GB':>11}{'(ring)':>8}{'step s':>8}  fits"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        cells = "".join(f"{r.memory.get(k, 0) / GB:>8.2f}" for k in kinds)
        cross = f"{r.cross_node['total'] / GB:>11.2f}{r.cross_node['ring_total'] / GB:>8.2f}"
        line = f"{r.arm:<26}{cells}{r.total / GB:>8.2f}{cross}{r.seconds['total']:>8.2f}"
        out.append(line + f"  {'yes' if r.fits else 'NO'}" + (f" ({'; '.join(r.notes)})" if r.notes else ""))
    return "\n".join(out)


def _number(kind: type, low: float, high: float | None = None, *, low_in: bool = False, high_in: bool = False):
    """An argparse type: a number of `kind` between `low` and `high` (each end included when
    `low_in` / `high_in`), with an error that says what is allowed."""
    allowed = f"{'>=' if low_in else '>'} {low:g}"
    if high is not None:
        allowed += f" and {'<=' if high_in else '<'} {high:g}"

    def parse(text: str):
        try:
            value = kind(float(text)) if kind is int and float(text).is_integer() else kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; allowed: {allowed}") from None
        above = value >= low if low_in else value > low
        below = high is None or (value <= high if high_in else value < high)
        if not (above and below):
            raise argparse.ArgumentTypeError(f"{text}; allowed: {allowed}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    positive, count, share = _number(float, 0), _number(int, 1, low_in=True), _number(float, 0, 1, high_in=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS), help="a Llama 2 shape")
    src.add_argument("--hf-config", metavar="CONFIG_JSON", help="a Llama-family Hugging Face config.json")
    src.add_argument("--params", type=_number(float, 1, low_in=True), help="a bare parameter count (e.g. 7e9)")
    src.add_argument("--model", choices=["gpt", "llama"], help="sdpq.train's model, with the flags below")
    p.add_argument("--d-model", type=count, default=256)
    p.add_argument("--layers", type=count, default=4)
    p.add_argument("--heads", type=count, default=4)
    p.add_argument("--seq-len", type=count, default=128)
    p.add_argument("--framework", choices=FRAMEWORKS, default="fsdp2")
    p.add_argument("--nodes", type=count, required=True)
    p.add_argument("--gpus-per-node", type=count, default=8)
    p.add_argument("--gpu-memory", type=positive, default=80.0, help="GB per GPU (default 80)")
    p.add_argument("--link-gbit", type=positive, default=400.0, help="inter-node Gbit/s per node (default 400)")
    p.add_argument("--batch-per-gpu", type=count, default=1, help="sequences per GPU and step (time model)")
    p.add_argument(
        "--reserve",
        type=_number(float, 0, 1, low_in=True),
        default=0.3,
        help="share of GPU memory kept for activations",
    )
    p.add_argument("--mfu", type=share, help="time model: compute efficiency (default: fitted, see --help)")
    p.add_argument("--link-efficiency", type=share, help="time model: share of the link's bandwidth")
    p.add_argument("--json", action="store_true")


def model_from_args(args: argparse.Namespace) -> ModelShape:
    if args.preset:
        return from_config(PRESETS[args.preset], name=f"Llama-2 {args.preset}")
    if args.hf_config:
        return from_hf_config(args.hf_config)
    if args.params is not None:
        return from_params(args.params)
    from ..train.model import MODELS

    cfg = MODELS[args.model](d_model=args.d_model, n_layer=args.layers, n_head=args.heads, seq_len=args.seq_len)
    return from_config(cfg)


def main(args: argparse.Namespace) -> int:
    import json

    model = model_from_args(args)
    link = Link(args.link_gbit, batch_per_gpu=args.batch_per_gpu)
    k = default_constants()
    k = replace(k, mfu=args.mfu or k.mfu, link_efficiency=args.link_efficiency or k.link_efficiency)
    rows = plan(
        model, args.framework, args.nodes, args.gpus_per_node, gpu_memory_gb=args.gpu_memory, link=link,
        reserve=args.reserve, constants=k,
    )  # fmt: skip
    best = recommend(rows)
    if args.json:
        out = [dict(r.__dict__, total=r.total) for r in rows]
        print(json.dumps({"model": model.name, "params": model.params, "rows": out, "recommended": best and best.arm}))
        return 0
    gpus = args.nodes * args.gpus_per_node
    print(
        f"{model.name} ({model.params / 1e9:.2f}B parameters), {args.framework}, {args.nodes} nodes x "
        f"{args.gpus_per_node} GPUs ({gpus}), {args.gpu_memory:g} GB each, {args.link_gbit:g} Gbit/s per node\n"
        "memory: GB per GPU of model state (activations not planned); x-node: GB per step over one node's link,\n"
        "the least traffic of each collective (ring: what NCCL's ring would carry, context);\n"
        f"step: the time model's (mfu {k.mfu:g}, link efficiency {k.link_efficiency:g}, "
        f"{args.batch_per_gpu} sequence(s) of {model.seq} per GPU)\n"
    )
    print(table(rows))
    fits = f"{(1 - args.reserve) * args.gpu_memory:g} GB ({1 - args.reserve:.0%} of the GPU)"
    print(
        f"\nrecommended: {best.arm}" if best else f"\nno sdpq configuration fits in {fits}: more GPUs or nodes",
    )
    return 0
