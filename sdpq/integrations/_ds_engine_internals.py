"""Every DeepSpeed internal sdpq uses around the engine, whatever the ZeRO stage: reading a config
as `deepspeed.initialize` does, skipping the shared-memory op build, the engine class and the
config its constructor got. The two optimizer families have their own files
(_ds_zero3_internals.py, _ds_zero12_internals.py); nothing else in sdpq names a private DeepSpeed
module or attribute (tests/integrations/test_deepspeed_internals.py reads the source).

Checked against: DeepSpeed 0.19.8 (`CHECKED_DEEPSPEED`; sdpq.deepspeed refuses releases outside
`TESTED_DEEPSPEED` unless SDPQ_ALLOW_UNTESTED_DEEPSPEED=1). Names used:
- `deepspeed.runtime.tensor_parallel.init_utils.load_ds_config(path or dict)`;
- `deepspeed.comm.torch.build_shm_op` (replaced by a no-op while an engine starts);
- `deepspeed.runtime.engine.DeepSpeedEngine.__init__` (wrapped process-wide, _ds_hook.py) and
  its `config_class` argument's `_param_dict` (the config dict HF Accelerate passes that way).

No torch or DeepSpeed import at module level (_ds_hook.py imports this at `import sdpq`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["CHECKED_DEEPSPEED", "KEEP_SHM_ENV", "engine_class", "engine_init_config", "is_engine", "read_config",
           "no_shm_op_build"]  # fmt: skip

CHECKED_DEEPSPEED = ("0.19.8",)
KEEP_SHM_ENV = "SDPQ_DEEPSPEED_SHM_OP"


def read_config(value: Any) -> dict:
    """A DeepSpeed config (a path, a JSON string or a dict) read as deepspeed.initialize reads it."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return load_ds_config(value)


@contextlib.contextmanager
def no_shm_op_build() -> Iterator[None]:
    """The first DeepSpeed communication backend JIT-builds a shared-memory all-reduce op (~40 s
    on CPU) that only inference all-reduce uses; ZeRO training never needs it. Skip the build
    (unless SDPQ_DEEPSPEED_SHM_OP=1)."""
    mod: Any = importlib.import_module("deepspeed.comm.torch")  # Note: the attribute `deepspeed.comm.torch` is PyTorch
    if os.environ.get(KEEP_SHM_ENV, "") not in ("", "0") or not hasattr(mod, "build_shm_op"):
        yield
        return
    orig = mod.build_shm_op
    mod.build_shm_op = lambda: None
    try:
        yield
    finally:
        mod.build_shm_op = orig


def engine_class() -> type:
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine


def engine_init_config(kwargs: Mapping[str, Any]) -> Any:
    """The config dict `DeepSpeedEngine.__init__(**kwargs)` is built from (None if unknown)."""
    return getattr(kwargs.get("config_class"), "_param_dict", None) or kwargs.get("config")


def is_engine(obj: object) -> bool:
    """Whether obj is a DeepSpeed engine (False, without importing DeepSpeed, when it is not imported)."""
    mod = sys.modules.get("deepspeed.runtime.engine")
    return mod is not None and isinstance(obj, mod.DeepSpeedEngine)
