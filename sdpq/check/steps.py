"""The steps of the GPU check: what each runs, and its time limit on the GPU and in rehearsal.

Each step is `fn(ctx) -> dict` with "status" ("pass", "fail" or "skip" with a reason),
"figures" (numbers for the report) and "checks" (named pass/fail lines). The limits add up to
less than the check's budget on the GPU (6 minutes; the H200 run of the first seven steps took
106 s), so a second run fits in a 15-minute lease.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch

__all__ = ["STEPS", "Ctx", "Step", "Checks"]


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What a step runs on. rehearse: CPU tensors through Triton's interpreter, small sizes."""

    rehearse: bool

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.rehearse else torch.device("cuda", torch.cuda.current_device())

    def sync(self) -> None:
        if not self.rehearse:
            torch.cuda.synchronize()


class Checks:
    """Named pass/fail lines of a step; the step passes when every line does."""

    def __init__(self) -> None:
        self.lines: list[dict] = []

    def add(self, name: str, ok: bool, detail: str = "") -> bool:
        self.lines.append({"check": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    @property
    def ok(self) -> bool:
        return all(line["ok"] for line in self.lines)

    def result(self, figures: dict, notes: list[str] | None = None) -> dict:
        failed = [line["check"] for line in self.lines if not line["ok"]]
        return {
            "status": "pass" if not failed else "fail",
            "error": f"failed: {', '.join(failed)}" if failed else "",
            "checks": self.lines,
            "figures": figures,
            "notes": notes or [],
        }


@dataclasses.dataclass(frozen=True)
class Step:
    title: str
    target: str  # "module:function"
    gpu_limit_s: float
    rehearse_limit_s: float

    def limit_s(self, rehearse: bool) -> float:
        return self.rehearse_limit_s if rehearse else self.gpu_limit_s

    def fn(self) -> Callable[[Ctx], dict]:
        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)


_K = "sdpq.check.kernel_steps"
_T = "sdpq.check.train_steps"
_S = "sdpq.check.speed_steps"
STEPS: dict[str, Step] = {
    "env": Step("device, driver, versions, copy bandwidth", f"{_K}:env", 20, 60),
    "codec": Step(
        "codec kernels vs the PyTorch reference (odd sizes, 64 MiB-1 GiB, > 2^31 elements)", f"{_K}:codec", 40, 150
    ),
    "adamw": Step(
        "AdamW kernel vs the PyTorch path (odd shapes, 70000 rows, 64 MiB-1 GiB)",
        "sdpq.check.adamw_step:adamw",
        40,
        150,
    ),
    "throughput": Step(
        "kernel GB/s next to a copy of the same bytes, speedup over PyTorch", f"{_K}:throughput", 35, 90
    ),
    "adamw_speed": Step("sdpq's AdamW step vs torch's fused AdamW", f"{_S}:adamw_speed", 25, 90),
    "step_share": Step("sdpq's codec + AdamW over a 1.3B / 7B block's forward + backward", f"{_S}:step_share", 50, 150),
    "train_fsdp": Step("FSDP2 + sdpq + AdamW, 4 ranks on one device, losses vs the CPU", f"{_T}:train_fsdp", 70, 240),
    "train_zero3": Step("ZeRO-3 + sdpq, 4 ranks on one device (if DeepSpeed is there)", f"{_T}:train_zero3", 50, 240),
}
