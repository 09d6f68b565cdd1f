"""What a run's settings are, resolved in one place for every backend (and the demo's jobs).

Order, for every setting: an explicit command-line flag > an explicit value in the ``--config``
file > the launcher's environment (for ``"auto"``) > the default. A flag overrides the file for
that one setting only; each such override is listed (`Resolved.overrides`) and printed once at
start-up. ``--config`` is a DeepSpeed JSON config or a file holding just an sdpq block:

- DeepSpeed backend: the DeepSpeed config runs as written (every key DeepSpeed reads), with the
  overrides applied key by key (`Resolved.deepspeed`).
- FSDP2 backend: the same file gives the "sdpq" block, the optimizer's parameters
  (``optimizer.params``: lr, betas, eps, weight_decay), mixed precision (``"bf16": {"enabled":
  true}`` = bf16 compute with an fp32 reduce; with sdpq's MCF master the parameters are bf16, as
  sdpq makes DeepSpeed's master partition bf16) and ``gradient_clipping``. A key the file leaves
  out means what it means to DeepSpeed (no clipping, no bf16); optimizer parameters it leaves out
  are torch.optim.AdamW's defaults (what DeepSpeed's ``torch_adam`` builds).

``ranks_per_node``: the flag, else the sdpq block's integer, else the launcher's ranks per node
(sdpq.comm.topology.LOCAL_SIZE_VARIABLES), else one node. An integer in the file that
contradicts an integer flag is an error naming both (a layout is not something to override
silently); the flag ``auto`` defers to the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..comm.topology import LOCAL_SIZE_VARIABLES, ranks_per_node_from_env
from ..config import Config, ConfigError
from .model import MODELS, ModelConfig
from .run import RunSpec

__all__ = [
    "EXACT",
    "Override",
    "Resolved",
    "load_config",
    "model_config",
    "resolve",
    "resolve_ranks_per_node",
    "layout",
]

# sdpq's exact collectives with the framework's own optimizer: bitwise the plain framework
# (tests/integrations assert it), and counted by the same statistics as sdpq's own, so a run
# without an sdpq block counts its cross-node bytes with it (RunSpec.count_bytes) and every
# cross-node ratio compares like with like.
EXACT: dict[str, Any] = {"weights": {"mode": "exact"}, "gradients": {"mode": "exact"}, "optimizer": {"enabled": False}}

# sdpq.train's defaults where no file is given (RunSpec's).
_DEFAULT = RunSpec()
# torch.optim.AdamW's defaults: what DeepSpeed builds (torch_adam) from an optimizer block
# that leaves a parameter out.
_ADAMW_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 1e-2}
# The optimizer a DeepSpeed file without one gets: sdpq.train's AdamW, as torch's (DeepSpeed's
# fused Adam is a JIT build on first use, as in the config ds_config builds from a spec).
_DEFAULT_OPTIMIZER = {
    "type": "AdamW",
    "params": {
        "lr": _DEFAULT.lr,
        "betas": list(_DEFAULT.betas),
        "eps": _DEFAULT.eps,
        "weight_decay": _DEFAULT.weight_decay,
        "torch_adam": True,
    },
}
_MISSING = object()
# Keys that make a --config file a DeepSpeed config (DeepSpeed needs a batch size; "optimizer" is
# an sdpq section too, so it does not count).
_DEEPSPEED_KEYS = (
    "sdpq",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
    "bf16",
    "fp16",
)


@dataclass(frozen=True)
class Override:
    """A setting that is not what the file says: a flag given on the command line (or, with
    `flag` None, a default filled in where the file has no value the run needs)."""

    flag: str | None  # "--lr 0.001"
    key: str  # the key path in the file, "optimizer.params.lr"
    old: Any  # the file's value (None where in_file is False)
    new: Any
    in_file: bool = True  # False: the file has no value at `key`

    def __post_init__(self) -> None:
        if self.old is _MISSING:
            object.__setattr__(self, "old", None)
            object.__setattr__(self, "in_file", False)

    def line(self, path: str) -> str:
        old = json.dumps(self.old) if self.in_file else "(not set)"
        who = self.flag if self.flag is not None else "default"
        return f"{who} overrides {self.key} {old} from {path}" + ("" if self.flag else f" with {json.dumps(self.new)}")


@dataclass(frozen=True)
class Resolved:
    spec: RunSpec
    overrides: tuple[Override, ...]
    config_path: str | None
    ranks_per_node_from: str = "default (one node)"  # the flag, the file, a launcher variable

    def lines(self) -> list[str]:
        return [o.line(self.config_path or "(no --config)") for o in self.overrides]


def load_config(path: str) -> tuple[dict | None, dict | None]:
    """(the DeepSpeed config or None, the sdpq block or None) of a --config file; a file with none
    of _DEEPSPEED_KEYS is a bare sdpq block, (None, block), where a typo fails with its key path.
    Validates the block."""
    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ConfigError(f"--config {path}: expected a JSON object, got {type(cfg).__name__}")
    if any(k in cfg for k in _DEEPSPEED_KEYS):
        block = Config.from_deepspeed(cfg)  # validates; None when the block is absent or empty
        return cfg, (None if block is None else dict(cfg["sdpq"]))
    Config.from_dict(cfg)  # a bare sdpq block: validate it now, with key paths in the error
    return None, (cfg or None)  # empty = baseline, as an empty "sdpq" block in a DeepSpeed config


def _get(d: Mapping | None, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(d, Mapping) or part not in d:
            return _MISSING
        d = d[part]
    return d


def _set(d: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        d[part] = dict(d.get(part) or {})
        d = d[part]
    d[last] = value


def _flag(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no-{name}"
    return f"--{name} {value}"


def resolve_ranks_per_node(
    flag: int | str | None, file_value: Any, env: Mapping[str, str], world: int | None, where: str = "--config"
):
    """(ranks per node, where it came from) in the shared order; an integer flag that
    contradicts an integer in the file is an error naming both."""
    if flag not in (None, "auto") and not (str(flag).isdigit() and int(flag) >= 1):
        raise ConfigError(f"--ranks-per-node: {flag!r}; allowed: a positive integer or 'auto'")
    flag = None if flag in (None, "auto") else int(flag)
    from_file = None if file_value in (_MISSING, None, "auto") else file_value
    if flag is not None and from_file is not None and flag != from_file:
        raise ConfigError(
            f"--ranks-per-node {flag} contradicts sdpq.topology.ranks_per_node {from_file} in {where}: "
            "give one of them, or the same value in both"
        )
    if flag is not None:
        return flag, "--ranks-per-node"
    if from_file is not None:
        return from_file, "sdpq.topology.ranks_per_node"
    from_env = ranks_per_node_from_env(env)
    if from_env is not None:
        var = next(v for v in LOCAL_SIZE_VARIABLES if env.get(v))
        return from_env, var
    return (world if world else "auto"), "default (one node)"


def layout(world: int, ranks_per_node: int) -> str:
    """ "nodes x ranks_per_node", as sdpq.comm.Topology.layout writes it."""
    return f"{world // ranks_per_node}x{ranks_per_node}"


def _bf16_from_flags(bf16: bool | None, mixed: str | None) -> bool | None:
    """DeepSpeed's bf16.enabled as the flags say (None: no flag given)."""
    if bf16 is None and mixed is None:
        return None
    return bool(bf16) or mixed == "bf16"


# Settings the DeepSpeed config holds: flag name, RunSpec field, key in the file.
_FLAGGED = (
    ("micro-batch", "micro_batch", "train_micro_batch_size_per_gpu"),
    ("grad-accum", "grad_accum", "gradient_accumulation_steps"),
    ("grad-clip", "grad_clip", "gradient_clipping"),
    ("lr", "lr", "optimizer.params.lr"),
    ("weight-decay", "weight_decay", "optimizer.params.weight_decay"),
)


def resolve(args: Any, env: Mapping[str, str] | None = None) -> Resolved:
    """The RunSpec of parsed `python -m sdpq.train` arguments (flags left out are None), with the
    overrides of the --config file it contains."""
    env = os.environ if env is None else env
    world = int(env["WORLD_SIZE"]) if env.get("WORLD_SIZE") else None
    ds, block = load_config(args.config) if args.config else (None, None)
    overrides: list[Override] = []
    effective = _effective_file(ds, overrides)
    values = _flagged_values(args, effective, overrides)
    values.update(_optimizer_from_file(effective))
    values.update(_batch_from_file(effective, values, world))
    values.update(_precision(args, effective, block, overrides))
    rpn, source, block = _topology(args, block, effective, env, world, overrides)
    spec = RunSpec(
        backend=args.backend,
        model=model_config(args),
        sdpq=block,
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
        data=args.data,
        ranks_per_node=rpn,
        checkpoint_dir=args.checkpoint_dir,
        save_at=args.save_at,
        resume=args.resume,
        log_every=args.log_every,
        eval_batches=args.eval_batches,
        timing=args.timing,
        count_bytes=args.count_bytes,
        deepspeed=effective if args.backend == "deepspeed" else None,
        **_with_defaults(values, effective),
    )
    return Resolved(spec, tuple(overrides), args.config, source)


def _effective_file(ds: dict | None, overrides: list[Override]) -> dict | None:
    """A deep copy of the DeepSpeed config (the file stays as read), with the optimizer DeepSpeed
    would otherwise not build (the training loop needs one)."""
    if ds is None:
        return None
    effective = json.loads(json.dumps(ds))
    if "optimizer" not in effective:
        overrides.append(Override(None, "optimizer", _MISSING, _DEFAULT_OPTIMIZER))
        effective["optimizer"] = json.loads(json.dumps(_DEFAULT_OPTIMIZER))
    return effective


def _flagged_values(args: Any, effective: dict | None, overrides: list[Override]) -> dict[str, Any]:
    """The settings both a flag and the file may give: the flag wins (and is written into the
    effective file, recorded as an override), else the file's value (_MISSING: neither)."""
    values: dict[str, Any] = {}
    for name, field_, key in _FLAGGED:
        given = getattr(args, field_)
        in_file = _get(effective, key)
        if given is not None and effective is not None and in_file != given:
            overrides.append(Override(_flag(name, given), key, in_file, given))
            _set(effective, key, given)
        values[field_] = given if given is not None else in_file
    return values


def _topology(
    args: Any, block: dict | None, effective: dict | None, env: Mapping[str, str], world: int | None, overrides
) -> tuple[Any, str, dict | None]:
    """(ranks per node, where it came from, the sdpq block with a --ranks-per-node flag written in)."""
    flag = getattr(args, "ranks_per_node", None)
    in_block = _get(block, "topology.ranks_per_node")
    rpn, source = resolve_ranks_per_node(flag, in_block, env, world, args.config)
    if block is not None and flag not in (None, "auto") and in_block != rpn:
        overrides.append(Override(_flag("ranks-per-node", rpn), "sdpq.topology.ranks_per_node", in_block, rpn))
        block = json.loads(json.dumps(block))
        _set(block, "topology.ranks_per_node", rpn)
        if effective is not None:
            effective["sdpq"] = block
    return rpn, source, block


def _with_defaults(values: dict[str, Any], effective: dict | None) -> dict[str, Any]:
    """Without a file: sdpq.train's defaults for what no flag gave; with one: DeepSpeed's meaning
    of a key it leaves out."""
    if effective is None:
        return {k: (getattr(_DEFAULT, k) if v is _MISSING or v is None else v) for k, v in values.items()}
    out = {k: v for k, v in values.items() if v is not _MISSING and v is not None}
    out.setdefault("grad_clip", 0.0)
    out.setdefault("grad_accum", 1)
    for k in ("lr", "weight_decay"):  # what DeepSpeed's torch_adam builds without them
        out.setdefault(k, _ADAMW_DEFAULTS[k])
    return out


def model_config(args: Any) -> ModelConfig:
    """The config of the model --model names (sdpq.train.model.MODELS), shaped by the model flags
    (flags only: a --config file holds no model); --n-kv-head is the Llama model's."""
    if args.model not in MODELS:
        raise ConfigError(f"--model: {args.model!r}; allowed: {', '.join(map(repr, MODELS))}")
    dims: dict[str, Any] = dict(seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model)
    if args.n_kv_head is not None:
        if args.model != "llama":
            raise ConfigError(f"--n-kv-head: grouped-query attention is an option of --model llama, not {args.model!r}")
        dims["n_kv_head"] = args.n_kv_head
    return MODELS[args.model](**dims)


def _optimizer_from_file(ds: dict | None) -> dict[str, Any]:
    """betas and eps of the file's optimizer block (the FSDP2 backend builds AdamW with them)."""
    if ds is None:
        return {}
    opt = ds["optimizer"]
    kind = str(opt.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        raise ConfigError(f"optimizer.type: {opt.get('type')!r}; sdpq.train trains with AdamW; allowed: Adam, AdamW")
    params = opt.get("params", {})
    out = {k: params.get(k, _ADAMW_DEFAULTS[k]) for k in ("betas", "eps")}
    out["betas"] = tuple(out["betas"])
    return out


def _batch_from_file(ds: dict | None, values: dict, world: int | None) -> dict[str, Any]:
    """The micro batch of a file that gives only train_batch_size (DeepSpeed derives it so)."""
    if ds is None or values.get("micro_batch") not in (None, _MISSING):
        return {}
    total, accum = ds.get("train_batch_size"), values.get("grad_accum")
    accum = 1 if accum in (None, _MISSING) else accum
    if total is None or not world:
        raise ConfigError(
            "train_micro_batch_size_per_gpu: not in --config (nor train_batch_size); give one, or --micro-batch"
        )
    return {"micro_batch": total // (accum * world)}


def _precision(args: Any, ds: dict | None, block: dict | None, overrides: list[Override]) -> dict[str, Any]:
    """RunSpec.bf16 / mixed_precision, and the file's bf16.enabled as the flags set it."""
    bf16, mixed = args.bf16, args.mixed_precision
    mixed = None if mixed in (None, "none") else mixed
    wanted = _bf16_from_flags(args.bf16, args.mixed_precision)
    in_file = _get(ds, "bf16.enabled")
    if ds is not None and wanted is not None and bool(in_file is True) != wanted:
        flags = " ".join(
            f
            for f in (
                None if args.bf16 is None else _flag("bf16", args.bf16),
                None if args.mixed_precision is None else f"--mixed-precision {args.mixed_precision}",
            )
            if f
        )
        overrides.append(Override(flags, "bf16.enabled", in_file, wanted))
        _set(ds, "bf16.enabled", wanted)
    if ds is None:  # flags only; no flag: fp32
        return {"bf16": bool(bf16), "mixed_precision": mixed}
    enabled = _get(ds, "bf16.enabled") is True
    if _get(ds, "fp16.enabled") is True and args.backend != "deepspeed":
        raise ConfigError(f"fp16.enabled: the {args.backend} backend trains in bf16 or fp32; allowed: bf16.enabled")
    # From the file: bf16 compute; bf16 parameters where sdpq's MCF master keeps them (on
    # DeepSpeed it makes the master partition bf16 the same way).
    opt = None if block is None else Config.from_dict(block).optimizer
    mcf = opt is not None and opt.enabled and opt.master == "mcf"
    return {
        "bf16": bool(bf16) if bf16 is not None else (enabled and mcf),
        "mixed_precision": mixed if args.mixed_precision is not None else ("bf16" if enabled else None),
    }


def with_ranks_per_node(spec: RunSpec, world: int) -> RunSpec:
    """`spec` with ranks_per_node an integer (the launcher's, else one node), for a spec built
    without a job's environment."""
    if spec.ranks_per_node != "auto":
        return spec
    rpn, _ = resolve_ranks_per_node(None, _get(spec.sdpq, "topology.ranks_per_node"), os.environ, world)
    return replace(spec, ranks_per_node=rpn)
