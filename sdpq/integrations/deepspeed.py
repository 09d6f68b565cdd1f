"""DeepSpeed ZeRO integration (exposed as ``sdpq.deepspeed``).

``sdpq.deepspeed.initialize(...)`` takes the arguments of ``deepspeed.initialize`` and returns
what it returns. It reads the top-level ``"sdpq"`` block of the DeepSpeed config (strictly, via
``sdpq.Config.from_deepspeed``); a missing or empty block is plain DeepSpeed. With a block:

- weights: ZeRO-3's parameter all-gathers go through ``sdpq.comm.WeightGather`` (``diff``:
  2-bit differences by default, up to 8, against a node-resident reference; ``direct`` int8;
  ``exact``);
- gradients: ZeRO-3's gradient reduce-scatter goes through ``sdpq.comm.GradReduceScatter``
  (two-level 8-bit intra-node / 4-bit inter-node, or ``exact``), DeepSpeed's averaging kept;
- optimizer (``"optimizer": {"enabled": true}``, the default): ``sdpq.optim.AdamW`` built from
  the DeepSpeed ``"optimizer"`` block's hyperparameters runs on ZeRO-3's flat partitions;
  ``master: "mcf"`` turns on DeepSpeed's ``bf16_master_weights_and_grads`` and
  ``bf16_optimizer_states`` (the flat partition is then the bf16 high part of the MCF pair).

A section left out of the block takes its defaults (the full method); switch a path off with
``"weights": {"mode": "exact"}``, ``"gradients": {"mode": "exact"}``,
``"optimizer": {"enabled": false}``. ``engine.sdpq`` is the installed adapter (statistics,
``config``: the config it runs with, ``mark_weights_changed``, ``remove``); ``save_checkpoint`` /
``load_checkpoint`` also save / restore sdpq's per-rank state (``sdpq_rank*.pt`` in the tag
directory), so a resumed run continues bit for bit. Both adapters share one lifecycle
(_ds_base.py); every private DeepSpeed name they use is in _ds_zero3_internals.py,
_ds_zero12_internals.py or _ds_engine_internals.py.

ZeRO stages 1 and 2 (``Zero12Adapter``, _ds_zero12.py; DeepSpeed's two ZeRO-1/2 optimizers are hooked in
_ds_zero12_internals.py): every rank holds the full weights, so
the weight path needs no reference: each owner sends 2-bit differences between its new master
partition and the weights everyone holds (``sdpq.comm.ReplicaDiffGather``); each gradient bucket
goes to the owners of its pieces through the two-level quantized exchange
(``sdpq.comm.OwnedReduceScatter``); sdpq's AdamW keeps a native fp32 master there
(``engine.sdpq.config.optimizer.master`` says so). Stage 0 is an error
(``IncompatibleConfigError``), as are the options docs/zero12.md lists.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from ..config import Config, ConfigError
from . import _ds_engine_internals as engine_internals
from . import _ds_zero3_internals, _ds_zero12_internals
from ._ds_adapter import STATE_FILE, DeepSpeedAdapter
from ._ds_base import DeepSpeedAdapterBase
from ._ds_config import IncompatibleConfigError, check_config, prepare_config
from ._ds_zero12 import Zero12Adapter
from ._files import CheckpointSaveError

__all__ = [
    "initialize",
    "init_distributed",
    "get_adapter",
    "check_deepspeed_version",
    "DeepSpeedAdapter",
    "DeepSpeedVersionError",
    "IncompatibleConfigError",
    "check_config",
    "ConfigError",
    "TESTED_DEEPSPEED",
    "STATE_FILE",
    "CheckpointSaveError",
]

TESTED_DEEPSPEED = ("0.19.8", "0.20")  # lowest tested version, first version outside the range
ALLOW_UNTESTED_ENV = "SDPQ_ALLOW_UNTESTED_DEEPSPEED"


class DeepSpeedVersionError(RuntimeError):
    """The installed DeepSpeed is outside the range sdpq's hooks are tested with."""


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion:
        return tuple(int(x) for x in version.split("+")[0].split(".")[:3] if x.isdigit())


def check_deepspeed_version(version: str | None = None) -> str:
    """Raise DeepSpeedVersionError unless `version` (default: the installed one) is in
    TESTED_DEEPSPEED; with SDPQ_ALLOW_UNTESTED_DEEPSPEED=1 warn instead. Returns the version."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    lo, hi = TESTED_DEEPSPEED
    if not (_release(lo) <= _release(version) < _release(hi)):
        msg = (
            f"sdpq.deepspeed is tested with DeepSpeed >={lo},<{hi}, but DeepSpeed {version} is installed. "
            f"sdpq replaces ZeRO-3 internals (parameter gathers, stage3.reduce_scatter_coalesced) that change "
            f"between releases. Install a tested version (pip install 'deepspeed>={lo},<{hi}') or set "
            f"{ALLOW_UNTESTED_ENV}=1 to try this one anyway."
        )
        if os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0"):
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        else:
            raise DeepSpeedVersionError(msg)
    return version


def get_adapter(engine) -> DeepSpeedAdapterBase | None:
    """The sdpq adapter installed on a DeepSpeed engine, or None (plain DeepSpeed)."""
    return engine.__dict__.get("sdpq")


def init_distributed(*args, **kwargs):
    """``deepspeed.init_distributed`` (same arguments; MPI discovery for mpirun included) without
    the shared-memory op JIT build that its first call would otherwise do."""
    import deepspeed

    with engine_internals.no_shm_op_build():
        return deepspeed.init_distributed(*args, **kwargs)


def _load_config(a: dict) -> tuple[dict | None, str | None]:
    """The DeepSpeed config as deepspeed.initialize would find it: (dict, where it came from)."""
    args = a.get("args")
    for where, value in (
        ("config", a.get("config")),
        ("config_params", a.get("config_params")),
        ("args.deepspeed_config", getattr(args, "deepspeed_config", None)),
    ):
        if value is not None:
            return (dict(value) if isinstance(value, Mapping) else engine_internals.read_config(value)), where
    return None, None


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with the config's ``"sdpq"`` block applied (same arguments, same
    return value: ``(engine, optimizer, training_dataloader, lr_scheduler)``). Once sdpq is
    imported, ``deepspeed.initialize`` itself does this (see _ds_hook.py)."""
    import deepspeed

    original = getattr(deepspeed.initialize, "__sdpq_original__", deepspeed.initialize)
    return _initialize(original, *_read_arguments(original, args, kwargs))


def _block(ds: Mapping | None):
    """The config's "sdpq" block, None when absent."""
    return None if ds is None else ds.get("sdpq")


def _read_arguments(ds_initialize, args: tuple, kwargs: dict) -> tuple[dict, dict | None, str | None]:
    """deepspeed.initialize's arguments by name, and the config they point to (read once)."""
    a = dict(inspect.signature(ds_initialize).bind(*args, **kwargs).arguments)
    return (a, *_load_config(a))


def _initialize(ds_initialize, a: dict, ds: dict | None, where: str | None):
    block = _block(ds)
    with engine_internals.no_shm_op_build():
        if ds is None or block is None or (isinstance(block, Mapping) and len(block) == 0):
            if ds is not None and block is not None:  # an empty block: plain DeepSpeed, without the unknown key
                a["config"] = {k: v for k, v in ds.items() if k != "sdpq"}
                _drop_other_sources(a, where)
            return ds_initialize(**a)
        cfg = Config.from_deepspeed(ds)  # ConfigError names the key path of a typo
        assert cfg is not None  # the block is not empty
        check_deepspeed_version()
        a["config"], cfg = prepare_config(ds, cfg, a)  # cfg: what sdpq runs with at this stage
        _drop_other_sources(a, where)
        result = ds_initialize(**a)
    engine = result[0]
    if _ds_zero3_internals.is_zero3(engine):
        DeepSpeedAdapter(engine, cfg)
    else:  # stages 1-2: DeepSpeedZeroOptimizer or BF16_Optimizer (anything else is refused there)
        Zero12Adapter(engine, cfg)
    return result


def initialize_wrapper(original):
    """What `import sdpq` puts in place of deepspeed.initialize (_ds_hook.INITIALIZE): a config
    with a non-empty "sdpq" block goes through sdpq, every other config to `original` untouched."""

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        a, ds, where = _read_arguments(original, args, kwargs)
        if not _block(ds):
            return original(*args, **kwargs)
        return _initialize(original, a, ds, where)

    return initialize


def engine_init_guard(original):
    """What `import sdpq` puts in place of DeepSpeedEngine.__init__ (_ds_hook.ENGINE_GUARD): an
    engine built from a config that still holds a block (it bypassed the initialize wrapper)
    fails at start-up instead of ignoring the block."""

    @functools.wraps(original)
    def guarded_init(self, *args, **kwargs):
        # Note: sdpq's own path removes the block before DeepSpeed sees the config.
        ds = engine_internals.engine_init_config(kwargs)
        if isinstance(ds, Mapping) and _block(ds):
            raise IncompatibleConfigError(
                'this DeepSpeed config has an "sdpq" block, but the engine is being built without sdpq '
                "(deepspeed.initialize was bound before `import sdpq`, or DeepSpeedEngine is built directly), "
                "so the block would be ignored: import sdpq before deepspeed, or call "
                "sdpq.deepspeed.initialize"
            )
        original(self, *args, **kwargs)

    return guarded_init


def framework_tensors(engine) -> Iterator[tuple[str, Any]]:
    """(sdpq.memory kind, tensor or None) of what DeepSpeed keeps for a ZeRO engine: its
    parameters, gradients and masters, in that order (sdpq.memory counts a shared storage once,
    where it first sees it)."""
    internals = _ds_zero3_internals if _ds_zero3_internals.is_zero3(engine) else _ds_zero12_internals
    return internals.framework_tensors(engine)


def stepped_optimizer(engine) -> Any:
    """The torch optimizer DeepSpeed's ZeRO optimizer steps (None if there is none)."""
    return getattr(engine.optimizer, "optimizer", None)


def model_numel(engine) -> int:
    """The model's parameter count (ZeRO-3: the full parameters, not this rank's partitions)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())


is_engine = engine_internals.is_engine


def _drop_other_sources(a: dict, where: str | None) -> None:
    a.pop("config_params", None)
    if where == "args.deepspeed_config":
        args = copy.copy(a["args"])
        args.deepspeed_config = None
        a["args"] = args
