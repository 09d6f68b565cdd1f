"""``compress(optimizer)``: compressed states for any torch.optim optimizer.

Between steps the floating-point state tensors of every parameter are held as FP8 (E4M3 with
COAT expansion) or bf16. step() runs the wrapped optimizer one parameter at a time (the
DeepSpeed ZeRO-3 pattern: only that parameter in ``param_groups``), decompressing that
parameter's state just before and compressing it right after, so at most one parameter's
state is ever uncompressed. Checkpoints follow sdpq.optim.AdamW's rules: exact state_dict with
DTensors carrying the parameter's placements, and ``export_state_dict`` gives the wrapped
optimizer's own (uncompressed) format, which ``load_state_dict`` also accepts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import guard, states
from .checkpoint import match_params, saved_key
from .layout import fp8_groups_ok, from_saved, is_dtensor, local, rows, to_global

__all__ = ["compress", "CompressedOptimizer"]

_FORMATS = ("fp8", "bf16")
_DTYPE = "_dtype"  # 0-d tensor of the original dtype marks a compressed state: tensors only


def compress(
    optimizer: torch.optim.Optimizer,
    states: str = "fp8",
    group_size: int = 128,
    on_nonfinite: str = "skip",
    sync_group=None,
) -> CompressedOptimizer:
    """Wrap ``optimizer`` so its floating-point states stay compressed between steps."""
    return CompressedOptimizer(optimizer, states, group_size, on_nonfinite, sync_group)


class CompressedOptimizer(torch.optim.Optimizer):
    """See ``compress``. ``inner`` is the wrapped optimizer; param_groups are shared with it."""

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        states: str = "fp8",
        group_size: int = 128,
        on_nonfinite: str = "skip",
        sync_group=None,
    ):
        if not isinstance(inner, torch.optim.Optimizer) or isinstance(inner, CompressedOptimizer):
            raise TypeError(
                f"optimizer is a {type(inner).__name__}: compress() takes an uncompressed torch.optim.Optimizer"
            )
        if states not in _FORMATS:
            raise ValueError(f"states={states!r}: allowed values are {_FORMATS}")
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size={group_size!r}: must be a positive integer")
        self.inner = inner
        self.compress_format = states
        self.group_size = group_size
        self.on_nonfinite = guard.check_on_nonfinite(on_nonfinite)
        self.sync_group = sync_group
        self.skipped_steps = 0
        self._ready = False
        super().__init__(inner.param_groups, inner.defaults)
        self.param_groups = inner.param_groups  # one list: schedulers and add_param_group see both
        self.defaults = inner.defaults
        self._ready = True
        for p in list(inner.state):  # wrapping mid-training compresses the existing state
            if isinstance(p, Tensor):
                self._shrink(p)

    def add_param_group(self, param_group: dict) -> None:
        if self._ready:
            self.inner.add_param_group(param_group)
        else:
            super().add_param_group(param_group)

    # ------------------------------------------------------------------ (de)compression
    def _format(self, p: Tensor, v) -> str | None:
        """How state tensor v of parameter p is stored, or None to keep it as is."""
        if not isinstance(v, Tensor) or not v.is_floating_point() or v.dim() == 0:
            return None
        if is_dtensor(v) != is_dtensor(p):
            return None
        if v.shape != p.shape or (is_dtensor(v) and is_dtensor(p) and tuple(v.placements) != tuple(p.placements)):
            return None  # not a per-element state (e.g. Adafactor's factored row/col statistics: tiny)
        if self.compress_format == "fp8":
            return "fp8" if fp8_groups_ok(v) else None
        return None if v.dtype == torch.bfloat16 else "bf16"

    def _shrink(self, p: Tensor) -> None:
        st = self.inner.state.pop(p, None)
        if st is None:
            return
        old = self.state.get(p, {})
        new = {}
        for name, v in st.items():
            fmt = self._format(p, v)
            if fmt is None:
                new[name] = v
                continue
            vl = local(v)
            keys = states.storage_keys(name, fmt)
            if all(k in old for k in keys) and old[keys[0]].shape == vl.shape:  # reuse buffers in place
                for k in keys:
                    new[k] = old[k]
                if vl.numel():
                    states.write(new, name, fmt, rows(vl.contiguous()).float(), group_size=self.group_size)
            else:
                states.encode(new, name, fmt, vl, group_size=self.group_size)
            new[name + _DTYPE] = torch.zeros((), dtype=vl.dtype)
        self.state[p] = new

    def _expand(self, p: Tensor) -> None:
        cst = self.state.get(p)
        if not cst or p in self.inner.state:
            return
        st = {}
        for name in _compressed_names(cst):
            value = states.decode(cst, name, group_size=self.group_size).to(cst[name + _DTYPE].dtype)
            st[name] = to_global(value, p)
        covered = _storage_of(cst)
        st.update({k: v for k, v in cst.items() if k not in covered})
        self.inner.state[p] = st

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        todo = [
            (group, p, f"param_groups[{gi}]['params'][{pi}]")
            for gi, group in enumerate(groups)
            for pi, p in enumerate(group["params"])
            if p.grad is not None
        ]
        every = [p for g in groups for p in g["params"]]
        bad = guard.nonfinite_index([p for _, p, _ in todo], every, self.sync_group)
        if bad is not None:
            self.skipped_steps += 1
            guard.handle(bad, [n for _, _, n in todo], self.on_nonfinite, self.skipped_steps)
            return loss
        saved = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = []
            for group, p, _ in todo:
                group["params"] = [p]  # the wrapped optimizer sees this one parameter only
                self._expand(p)
                self.inner.step()
                self._shrink(p)
                group["params"] = []
        finally:
            for g, lst in zip(groups, saved):
                g["params"] = lst
        return loss

    # ------------------------------------------------------------------ checkpoints
    def _packed_groups(self, extra: bool) -> tuple[dict[int, int], list[dict]]:
        ids: dict[int, int] = {}
        out = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            if extra:
                packed.update(sdpq_states=self.compress_format, sdpq_group_size=self.group_size)
            packed["params"] = [ids.setdefault(id(p), len(ids)) for p in group["params"]]
            out.append(packed)
        return ids, out

    def _entries(self):
        for group in self.param_groups:
            for p in group["params"]:
                if self.state.get(p) or p in self.inner.state:
                    yield p

    def state_dict(self) -> dict:
        """Exact compressed state (references, as in torch); DTensors for DTensor parameters."""
        ids, groups = self._packed_groups(extra=True)
        packed = {}
        for p in self._entries():
            self._shrink(p)  # an interrupted step may have left one parameter expanded
            cst = self.state[p]
            meta = {n + s for n in _compressed_names(cst) for s in states.METADATA_SUFFIXES}
            covered = _storage_of(cst)
            packed[ids[id(p)]] = {
                k: (to_global(v, p, k in meta) if k in covered and not k.endswith(_DTYPE) else v)
                for k, v in cst.items()
            }
        return {"state": packed, "param_groups": groups}

    def export_state_dict(self) -> dict:
        """The wrapped optimizer's own state_dict format, states decompressed."""
        ids, groups = self._packed_groups(extra=False)
        packed = {}
        for p in self._entries():
            self._expand(p)
            packed[ids[id(p)]] = {
                k: (v.clone() if isinstance(v, Tensor) else v) for k, v in self.inner.state[p].items()
            }
            self._shrink(p)
        return {"state": packed, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict of this wrapper (any compression) or of the wrapped optimizer."""
        saved_groups = state_dict["param_groups"]
        by_index = match_params(self.param_groups, saved_groups)
        self.state.clear()
        self.inner.state.clear()
        for idx, entry in state_dict["state"].items():
            p, _, saved, _ = by_index[saved_key(idx, by_index)]
            names = _compressed_names(entry)
            covered = _storage_of(entry)
            want = "fp8" if self.compress_format == "fp8" else "bf16"
            same = saved.get("sdpq_group_size", self.group_size) == self.group_size
            if (
                names
                and same
                and all(states.stored_format(entry, n) == want for n in names)
                and not any(self._format(p, v) for k, v in entry.items() if k not in covered)
            ):
                # exactly this wrapper's storage: copy it (re-encoding decoded values would not
                # reproduce the same codes, and a resumed run would not be bitwise identical)
                self.state[p] = {
                    k: (
                        from_saved(v, p).clone()
                        if k in covered and not k.endswith(_DTYPE)
                        else (v.clone() if isinstance(v, Tensor) else v)
                    )
                    for k, v in entry.items()
                }
                continue
            st = {}
            for name in names:
                loc = {
                    k: from_saved(entry[k], p)
                    for k in states.storage_keys(name, states.stored_format(entry, name) or "bf16")
                }
                value = states.decode(loc, name, group_size=saved.get("sdpq_group_size", self.group_size))
                st[name] = to_global(value.to(entry[name + _DTYPE].dtype), p)
            for k, v in entry.items():
                if k not in covered:  # as torch does: state tensors to the parameter's device
                    st[k] = (v.to(local(p).device, copy=True) if v.dim() else v.clone()) if isinstance(v, Tensor) else v
            self.inner.state[p] = st
            self._shrink(p)
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params" and not k.startswith("sdpq_")})


def _compressed_names(cst: dict) -> list[str]:
    return [k[: -len(_DTYPE)] for k, v in cst.items() if k.endswith(_DTYPE) and isinstance(v, Tensor) and v.dim() == 0]


def _storage_of(cst: dict) -> set[str]:
    """Keys holding compressed states (storage and dtype markers)."""
    keys = set()
    for name in _compressed_names(cst):
        keys.add(name + _DTYPE)
        keys.update(states.storage_keys(name, states.stored_format(cst, name) or "bf16"))
    return keys
