"""state_dict / load_state_dict / export for sdpq.optim.AdamW.

Saved state is exactly what is stored (so a resumed run is bitwise identical), with DTensor
wrappers carrying the parameter's placements so torch.distributed.checkpoint can reshard it.
Loading converts between formats (fp8 / bf16 / fp32 / pair / a plain torch AdamW state).
"""

from __future__ import annotations

import torch

from . import states
from .layout import from_saved, is_dtensor, local, to_global

FORMAT_KEYS = ("states", "master", "mcf_second_moment", "group_size", "v_format")
# torch.optim.AdamW group keys: exported with these values; on load, any other value is an
# option sdpq cannot honour.
TORCH_KEYS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}
NAMES = ("exp_avg", "exp_avg_sq")


def _index(opt) -> tuple[dict[int, int], list[dict]]:
    ids: dict[int, int] = {}
    groups = []
    for group in opt.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [ids.setdefault(id(p), len(ids)) for p in group["params"]]
        groups.append(packed)
    return ids, groups


def _wrap(key: str, value, p):
    if not isinstance(value, torch.Tensor) or key == "step" or not is_dtensor(p):
        return value
    return to_global(value, p, metadata=states.is_metadata_key(key))


def state_dict(opt) -> dict:
    ids, groups = _index(opt)
    packed = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                packed[ids[id(p)]] = {k: _wrap(k, v, p) for k, v in st.items()}
    return {"state": packed, "param_groups": groups}


def export_state_dict(opt) -> dict:
    ids, groups = _index(opt)
    out_groups = []
    for g in groups:
        out = {k: v for k, v in g.items() if k not in FORMAT_KEYS}
        out.update(TORCH_KEYS)
        out_groups.append(out)
    packed = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            entry = {"step": st["step"].clone()}
            for name, f8 in zip(NAMES, ("e4m3", group["v_format"])):
                entry[name] = to_global(states.decode(st, name, f8, group["group_size"]), p)
            packed[ids[id(p)]] = entry
    return {"state": packed, "param_groups": out_groups}


def _load_group(group: dict, saved: dict, gi: int) -> None:
    for key, value in saved.items():
        if key == "params" or key in FORMAT_KEYS:
            continue
        if key in TORCH_KEYS:
            if key in ("amsgrad", "maximize") and value:
                raise ValueError(f"param_groups[{gi}] has {key}={value!r}: sdpq.optim.AdamW does not support it")
            continue  # execution options (foreach, fused, ...) do not change the state
        group[key] = tuple(value) if key == "betas" else value


def _convert(opt, p, group: dict, saved_group: dict, entry: dict, where: str) -> dict:
    """The state of p in this optimizer's formats from a saved entry (any supported format)."""
    pl = local(p)
    loc = {k: (from_saved(v, p) if isinstance(v, torch.Tensor) and k != "step" else v) for k, v in entry.items()}
    step = loc.get("step", 0)
    new = {"step": torch.tensor(float(step), dtype=torch.float32)}
    G = group["group_size"]
    targets = zip(NAMES, opt.formats(p, group), ("e4m3", group["v_format"]))
    for name, fmt, f8 in targets:
        src = states.stored_format(loc, name)
        if src is None:
            raise KeyError(f"{where}: saved state has no {name!r} (keys: {sorted(loc)})")
        src_f8 = "e4m3" if name == "exp_avg" else saved_group.get("v_format", "e4m3")
        src_g = saved_group.get("group_size", G)
        if src == fmt and (fmt != "fp8" or (src_f8 == f8 and src_g == G)):
            for key in states.storage_keys(name, fmt):
                t = loc[key]
                if key in (name, name + "_codes", name + "_lo") and t.shape != pl.shape:
                    raise ValueError(f"{where}: saved {key} has shape {tuple(t.shape)}, parameter {tuple(pl.shape)}")
                new[key] = t.to(pl.device, copy=True)
            continue
        value = states.decode(loc, name, src_f8, src_g)
        if value.numel() != pl.numel():
            raise ValueError(f"{where}: saved {name} has {value.numel()} elements, parameter {pl.numel()}")
        states.encode(new, name, fmt, value.reshape(pl.shape).to(pl.device), f8, G)
    if group["master"] == "mcf":
        lo = loc.get("master_lo")
        ok = isinstance(lo, torch.Tensor) and lo.shape == pl.shape and lo.dtype == torch.bfloat16
        new["master_lo"] = lo.to(pl.device, copy=True) if ok and lo is not None else torch.zeros_like(pl)
    return new


def saved_key(idx, by_index: dict):
    """Saved parameters are matched by position, like torch: the saved keys may be integers
    (Optimizer.state_dict), FQN strings (torch.distributed.checkpoint's set_optimizer_state_dict)
    or integers turned into strings by a serializer."""
    if idx in by_index:
        return idx
    if isinstance(idx, str) and idx.isdigit() and int(idx) in by_index:
        return int(idx)
    raise KeyError(f"state_dict has state for parameter {idx!r}, which no param_groups entry lists")


def match_params(param_groups: list, saved_groups: list) -> dict:
    """{saved parameter index: (parameter, its group, the saved group, where)} for a state_dict's
    param_groups against an optimizer's; a ValueError when their group or parameter counts differ."""
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} parameter groups, the optimizer {len(param_groups)}")
    by_index = {}
    for gi, (group, saved) in enumerate(zip(param_groups, saved_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"param_groups[{gi}] has {len(saved['params'])} parameters in the state_dict "
                f"and {len(group['params'])} in the optimizer"
            )
        for pi, (idx, p) in enumerate(zip(saved["params"], group["params"])):
            by_index[idx] = (p, group, saved, f"param_groups[{gi}]['params'][{pi}]")
    return by_index


def load_state_dict(opt, sd: dict) -> None:
    saved_groups = sd["param_groups"]
    by_index = match_params(opt.param_groups, saved_groups)
    new_state = {}
    for idx, entry in sd["state"].items():
        p, group, saved, where = by_index[saved_key(idx, by_index)]
        new_state[p] = _convert(opt, p, group, saved, entry, where)
    for gi, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        _load_group(group, saved, gi)
    opt.state.clear()
    opt.state.update(new_state)
