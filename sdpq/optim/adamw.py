"""AdamW with compressed states (FP8 with COAT expansion, bf16, or fp32) and optional MCF
master weights (Collage): see docs/architecture.md, "One training step".

The update is torch.optim.AdamW's (decoupled weight decay, bias correction, same operation
order), evaluated in fp32 chunk by chunk: decode m and v, update them, encode them back, apply
the step. ``states="fp32", master="native"`` therefore reproduces torch.optim.AdamW. This
PyTorch path is the reference; on CPU each parameter's step runs as one C++ kernel instead
(``sdpq.kernels.adamw_ops``: bitwise equal without FP8 states, within log2 / exp2 rounding with
them), on CUDA the default layout as one Triton kernel.

State is keyed by the parameter tensor itself, like every torch optimizer: DeepSpeed ZeRO-3
puts the same flat partition tensor into ``param_groups`` for each step() (and reads
``optimizer.state[partition]`` itself); a (group, position) key would collide between its
sub-groups, which share group index and position 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..config import ADAMW_HYPERPARAMETERS, OptimizerConfig, check_adamw_hyperparameters
from ..kernels import uses_triton
from ..quant import mcf, true_div
from . import checkpoint, guard, states
from .layout import chunk_numel, chunks, fp8_groups_ok, local, rows
from .native_args import KERNEL_DTYPES, NativeArgs

__all__ = ["AdamW"]

_OPTIONS = OptimizerConfig()  # the defaults of the options (states, master, ...)
_HP = ADAMW_HYPERPARAMETERS
_PATH = "sdpq.optim.AdamW"  # where argument errors say they come from


def _check_group(group: dict) -> None:
    """A parameter group's options and hyperparameters, through the config's own checks."""
    OptimizerConfig.from_dict({k: group[k] for k in _OPTIONS.adamw_options()}, path=_PATH)
    check_adamw_hyperparameters(_PATH, **{k: group[k] for k in ADAMW_HYPERPARAMETERS})
    if group["master"] == "mcf":
        for p in group["params"]:
            _check_mcf_param(p)


def _check_mcf_param(p: Tensor) -> None:
    if p.dtype != torch.bfloat16:
        raise ValueError(
            f"master='mcf' needs bfloat16 parameters (the parameter is the high part of the "
            f"pair), got {p.dtype} for a parameter of shape {tuple(p.shape)}; use "
            f"master='native' for {p.dtype} parameters"
        )


class AdamW(torch.optim.Optimizer):
    """AdamW whose m and v live in FP8 / bf16 / fp32 and whose master weights are native or MCF.

    states: "fp8" (m E4M3, v ``v_format``, per-group expansion metadata), "bf16" or "fp32".
    master: "mcf" = the bf16 parameter is the high part, a bf16 compensation buffer the low
        part; updates are applied with Grow so updates below half an ulp are kept.
        "native" = the parameter's own dtype is the master (e.g. fp32 FSDP2/DeepSpeed shards).
    mcf_second_moment: keep v as a bf16 pair with an exact beta2 product (Collage "plus").
        Plain bf16 cannot hold v's per-step change when 1 - beta2 is below its half ulp
        (2^-9): with beta2 = 0.999, v only ratchets up (+6% after 1000 steps in the tests).
        FP8 v is re-gridded by its group metadata every step and scatters without drifting.
    on_nonfinite: "skip" (whole step skipped, ``skipped_steps`` += 1, warning) or "raise".
    sync_group: process group that must agree on skipping (e.g. ZeRO-3's data-parallel group;
        the meshes of DTensor parameters are always included).
    DTensor parameters whose last dim is sharded, or 1-D DTensors, keep fp32 states when
    states="fp8" (their FP8 groups would depend on the shard boundaries).
    """

    def __init__(
        self,
        params,
        lr: float = _HP["lr"],
        betas: tuple[float, float] = _HP["betas"],
        eps: float = _HP["eps"],
        weight_decay: float = _HP["weight_decay"],
        *,
        states: str = _OPTIONS.states,
        master: str = _OPTIONS.master,
        mcf_second_moment: bool = _OPTIONS.mcf_second_moment,
        group_size: int = _OPTIONS.group_size,
        v_format: str = _OPTIONS.v_format,
        on_nonfinite: str = "skip",
        sync_group=None,
    ):
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            states=states,
            master=master,
            mcf_second_moment=mcf_second_moment,
            group_size=group_size,
            v_format=v_format,
        )
        self.on_nonfinite = guard.check_on_nonfinite(on_nonfinite)
        self.sync_group = sync_group
        self.skipped_steps = 0
        # One fused kernel per parameter: on CPU every layout (C++, sdpq.kernels.adamw_ops), on
        # CUDA the default one (Triton, sdpq.kernels.adamw); False forces the PyTorch path (the
        # reference; benchmarks time both).
        self.kernels_enabled = True
        super().__init__(params, defaults)

    @classmethod
    def from_config(cls, params, config: OptimizerConfig, **hyperparameters: Any) -> AdamW:
        """The AdamW that an sdpq config's `optimizer` section describes; `hyperparameters`: lr,
        betas, eps, weight_decay (and on_nonfinite, sync_group)."""
        return cls(params, **hyperparameters, **config.adamw_options())

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])

    # ------------------------------------------------------------------ state layout
    def _init_state(self, p: Tensor, group: dict) -> dict:
        pl = local(p)
        if not pl.is_contiguous():
            raise ValueError(
                f"parameter of shape {tuple(p.shape)} is not contiguous: sdpq.optim.AdamW updates "
                "the storage in place through a flat view"
            )
        st = self.state[p]
        st["step"] = torch.tensor(0.0)
        fm, fv = self.formats(p, group)
        G = group["group_size"]
        states.allocate(st, "exp_avg", fm, pl.shape, pl.device, "e4m3", G)
        states.allocate(st, "exp_avg_sq", fv, pl.shape, pl.device, group["v_format"], G)
        if group["master"] == "mcf":
            _check_mcf_param(p)
            st["master_lo"] = torch.zeros_like(pl)
        return st

    def _state_for(self, p: Tensor, group: dict) -> dict:
        st = self.state.get(p)
        if not st:
            return self._init_state(p, group)
        ref = st.get("exp_avg_codes", st.get("exp_avg"))
        if ref is not None and ref.numel() != local(p).numel():
            raise ValueError(
                f"state of a parameter has {ref.numel()} elements but the parameter now has "
                f"{local(p).numel()}: a flat partition was resized or replaced by a different one"
            )
        return st

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo, names = [], []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError(
                            f"param_groups[{gi}]['params'][{pi}] has a sparse gradient: "
                            "sdpq.optim.AdamW supports dense gradients only"
                        )
                    todo.append((p, group))
                    names.append(f"param_groups[{gi}]['params'][{pi}]")
        every = [p for g in self.param_groups for p in g["params"]]
        bad = guard.nonfinite_index([p for p, _ in todo], every, self.sync_group)
        if bad is not None:
            self.skipped_steps += 1
            guard.handle(bad, names, self.on_nonfinite, self.skipped_steps)
            return loss
        native: list[tuple[NativeArgs, Tensor, int]] = []  # the C++ steps of the current group
        try:
            for i, (p, group) in enumerate(todo):
                call = self._update(p, group, self._state_for(p, group))
                if call is not None:
                    native.append(call)
                if native and (i + 1 == len(todo) or todo[i + 1][1] is not group):
                    batch, native = native, []  # taken first: a call that raises is not retried
                    self._native_step(group, batch)
        finally:  # a parameter that raised: those before it are stepped, as one by one
            if native:
                self._native_step(group, native)
        return loss

    def _update(self, p: Tensor, group: dict, st: dict) -> tuple[NativeArgs, Tensor, int] | None:
        """Steps p, or returns what its C++ step needs: those run together (_native_step)."""
        grad = p.grad
        assert grad is not None  # step() updates only parameters with a gradient
        st["step"] += 1
        pl = local(p)
        if pl.numel() == 0:
            return None
        step = int(st["step"])  # a CPU tensor, as in torch: no device sync
        grad = local(grad)
        native = self._native_args(p, pl, grad, group, st)
        if native is not None:
            return native, grad.reshape(native.param.shape).contiguous(), step
        if self._fused_applies(pl, group, st):
            self._triton_step(pl, grad, group, st, step)
        else:
            self._reference_step(pl, grad, group, st, float(step))
        return None

    def _triton_step(self, pl: Tensor, grad: Tensor, group: dict, st: dict, step: int) -> None:
        """The default layout (FP8 states, MCF master) as one Triton kernel (CUDA)."""
        from ..kernels.adamw import adamw_fp8_mcf_step

        def moment(name):
            codes = rows(st[name + "_codes"])
            return (codes,) + tuple(st[name + s].reshape(codes.shape[0], -1) for s in ("_scale", "_k", "_gm"))

        b1, b2 = group["betas"]
        adamw_fp8_mcf_step(
            rows(pl),
            rows(st["master_lo"]),
            grad.reshape(rows(pl).shape),
            moment("exp_avg"),
            moment("exp_avg_sq"),
            lr=float(group["lr"]),
            b1=b1,
            b2=b2,
            eps=group["eps"],
            wd=group["weight_decay"],
            step=step,
            group_size=group["group_size"],
        )

    def _reference_step(self, pl: Tensor, grad: Tensor, group: dict, st: dict, step: float) -> None:
        """The PyTorch path: every layout, chunk by chunk in fp32 (the reference of the kernels)."""
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        b1, b2 = group["betas"]
        G, vf8 = group["group_size"], group["v_format"]
        bias_correction2_sqrt = (1 - b2**step) ** 0.5
        step_size = lr / (1 - b1**step)
        fm, fv = states.stored_format(st, "exp_avg"), states.stored_format(st, "exp_avg_sq")
        assert fm is not None and fv is not None  # _state_for created both
        if fv == "pair":
            b2_hi, b2_lo = mcf.split_scalar(b2)
        P, Gr = rows(pl), grad.reshape(rows(pl).shape)
        lo = rows(st["master_lo"]) if "master_lo" in st else None
        for r, c in chunks(P.shape[0], P.shape[1], G, chunk_numel(pl.device)):
            g = Gr[r, c]
            g = g if g.dtype == torch.float32 else g.float()
            m = states.read(st, "exp_avg", fm, r, c, "e4m3", G)
            m.lerp_(g, 1 - b1)
            states.write(st, "exp_avg", fm, m, r, c, "e4m3", G)
            if fv == "pair":
                v_hi, v_lo = states.pair_views(st, "exp_avg_sq", r, c)
                mcf.mul_(v_hi, v_lo, b2_hi, b2_lo)
                mcf.grow_(v_hi, v_lo, torch.mul(g, g).mul_(1 - b2))
                v = mcf.value(v_hi, v_lo)
            else:
                v = states.read(st, "exp_avg_sq", fv, r, c, vf8, G)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                states.write(st, "exp_avg_sq", fv, v, r, c, vf8, G)
            denom = true_div(v.sqrt(), bias_correction2_sqrt).add_(eps)  # IEEE on every device
            w = P[r, c]
            if lo is not None:  # MCF master: one Grow with the decay and the Adam step together
                d = torch.div(m, denom).mul_(-step_size)
                if wd != 0:
                    d.add_(mcf.value(w, lo[r, c]), alpha=-lr * wd)
                mcf.grow_(w, lo[r, c], d)
            else:
                x = w if w.dtype == torch.float32 else w.float()
                if wd != 0:
                    x.mul_(1 - lr * wd)
                x.addcdiv_(m, denom, value=-step_size)
                if x is not w:
                    w.copy_(x)

    def _native_args(self, p: Tensor, pl: Tensor, grad: Tensor, group: dict, st: dict) -> NativeArgs | None:
        """The C++ step's arguments (sdpq.kernels.adamw_ops), or None where it does not apply:
        it covers every layout on CPU once built and leaves out only foreign state dtypes (e.g.
        fp16 states loaded from a checkpoint) and parameters or gradients that are not fp32 /
        bf16 / fp16. Kept per parameter while current (see sdpq.optim.native_args)."""
        if not (self.kernels_enabled and grad.dtype in KERNEL_DTYPES):
            return None
        # set here, not in __init__: torch's __setstate__ restores defaults, state, param_groups
        cache = self.__dict__.setdefault("_native_cache", {})
        args = cache.get(id(p))
        if args is None or not args.current(pl, st, group["v_format"]):
            args = NativeArgs.build(pl, st, group["v_format"])
            if args is not None:
                # Note: keyed by id (torch's weak-key dictionaries cost ~7 us of Python per
                # lookup). self.state keeps its parameters alive, so an id is reused only after
                # a parameter left the state; a reused id meets other state tensors and
                # rebuilds, and the entries of parameters gone are dropped here.
                cache[id(p)] = args
                if len(cache) > len(self.state):
                    live = {id(q) for q in self.state}
                    for k in [k for k in cache if k not in live]:
                        del cache[k]
        return args

    def _native_step(self, group: dict, calls: list[tuple[NativeArgs, Tensor, int]]) -> None:
        """The C++ steps of a group's parameters in one adamw_step_many call per kind of master
        (MCF or native: its param_lo list is all or nothing)."""
        b1, b2 = group["betas"]
        hyper = (float(group["lr"]), float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]))
        for mcf_master in (True, False):
            batch = [c for c in calls if (c[0].param_lo is not None) == mcf_master]
            if not batch:
                continue
            m_tensors, v_tensors = [], []
            for a, _, _ in batch:
                m_tensors += a.exp_avg
                v_tensors += a.exp_avg_sq
            torch.ops.sdpq.adamw_step_many(
                [a.param for a, _, _ in batch],
                [a.param_lo for a, _, _ in batch] if mcf_master else [],
                [g for _, g, _ in batch],
                m_tensors,
                v_tensors,
                [a.m_format for a, _, _ in batch],
                [a.v_format for a, _, _ in batch],
                *hyper,
                [s for _, _, s in batch],
                group["group_size"],
            )

    def _fused_applies(self, pl: Tensor, group: dict, st: dict) -> bool:
        """The one-kernel step (sdpq.kernels.adamw) covers the default layout on CUDA: E4M3
        m and v with expansion, MCF master, a power-of-two group size."""
        G = group["group_size"]
        return (
            self.kernels_enabled
            and uses_triton(pl)
            and "master_lo" in st
            and group["v_format"] == "e4m3"
            and G & (G - 1) == 0
            and states.stored_format(st, "exp_avg") == "fp8"
            and states.stored_format(st, "exp_avg_sq") == "fp8"
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Exact state: compressed tensors as stored (DTensors with the parameter's placements
        for DTensor parameters). Tensors are references, as in torch: copy before stepping on."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load an sdpq state_dict (exact when the formats match) or a standard torch AdamW /
        Adam state_dict (exp_avg, exp_avg_sq, step): states are converted to this optimizer's
        formats. Hyperparameters (lr, betas, eps, weight_decay, ...) come from the checkpoint;
        the storage options (states, master, ...) stay this optimizer's."""
        checkpoint.load_state_dict(self, state_dict)
        self.__dict__.pop("_native_cache", None)  # release the views of the states just replaced

    def export_state_dict(self) -> dict:
        """A torch.optim.AdamW state_dict (fp32 exp_avg / exp_avg_sq, DTensors where the
        parameters are): load it into torch.optim.AdamW to leave sdpq. The MCF compensation
        (< half a bf16 ulp of each weight) has no place there and is dropped."""
        return checkpoint.export_state_dict(self)

    def formats(self, p: Tensor, group: dict) -> tuple[str, str]:
        """(m format, v format) this optimizer uses for parameter p."""
        fmt = group["states"] if (group["states"] != "fp8" or fp8_groups_ok(p)) else "fp32"
        return fmt, ("pair" if group["mcf_second_moment"] else fmt)
