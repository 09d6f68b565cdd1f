"""sdpq for torchtitan: a `ModelSpec.post_optimizer_build_fn` that applies `sdpq.fsdp` to the model.

torchtitan's trainer calls `post_optimizer_build_fn(optimizers, model_parts, parallel_dims)` once the
model parts are sharded (fully_shard), initialised and their optimizers built: where
`sdpq.fsdp.apply` belongs. This hook, per model part:

- calls the spec's own hook first (`chain`; MoE models register their load balancing there);
- applies sdpq on the groups FSDP2 already runs on (torchtitan's `fsdp` / `dp_shard` mesh);
- HSDP (`parallel_dims.dp_replicate > 1`, torchtitan's 2-D mesh): takes the replicate all-reduce
  over with sdpq's quantized one (`sdpq.fsdp.apply(replicate="mesh")`);
- torchft (its trainer has set an all-reduce hook on the FSDP modules, across replica groups):
  leaves that all-reduce to torchft, and, when torchtitan's torchft optimizer container is used,
  makes the weight gathers exact again after torchft loads a healing replica's state;
- hooks the optimizers inside torchtitan's container, so a step torchft does not commit marks no
  weights changed.

    spec = model_registry("8B")
    spec.post_optimizer_build_fn = post_optimizer_build_fn(sdpq.Config(), chain=spec.post_optimizer_build_fn)
    # or: spec = model_spec_with_sdpq(model_registry("8B"))

The configs users name with `--module` are in `sdpq/torchtitan_configs.py`; see docs/torchtitan.md.

This module imports nothing of torchtitan. What it reads of torchtitan 0.3.0's objects:
`ParallelDims.dp_replicate`, `.dp_shard`, `.cp`, `.ep`; `OptimizersContainer.optimizers` (the
optimizers it steps); `TorchFTOptimizersContainer._ft_optimizer` (torchft's OptimizerWrapper, whose
`.manager` is the Manager) and `._use_ft_optimizer` (False under semi-synchronous training).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..config import Config
from . import _fsdp_internals as fsdp_internals
from . import fsdp as sdpq_fsdp
from ._config_arg import as_config

__all__ = ["post_optimizer_build_fn", "model_spec_with_sdpq", "SdpqHook", "RECOVERY_KEY"]

# The key under which the hook registers with torchft's Manager: what a healing replica loads.
RECOVERY_KEY = "sdpq.torchtitan"

PostOptimizerBuildFn = Callable[[Any, list, Any], None]


@dataclasses.dataclass(frozen=True)
class SdpqHook:
    """torchtitan's `post_optimizer_build_fn(optimizers, model_parts, parallel_dims)`: calls
    `chain` (the spec's previous hook, if any), then applies sdpq with `config` to every model part."""

    config: Config
    chain: PostOptimizerBuildFn | None = None

    def __call__(self, optimizers, model_parts: list[nn.Module], parallel_dims) -> None:
        if self.chain is not None:
            self.chain(optimizers, model_parts, parallel_dims)
        _apply(self.config, optimizers, model_parts, parallel_dims)


def post_optimizer_build_fn(
    config: Config | Mapping[str, Any] | None = None, *, chain: PostOptimizerBuildFn | None = None
) -> SdpqHook:
    """The hook for `ModelSpec.post_optimizer_build_fn`: sdpq with `config` (a sdpq.Config, a dict,
    or None for the defaults; checked now, a ConfigError naming the key), after `chain`."""
    cfg = as_config(config, "sdpq.torchtitan.post_optimizer_build_fn")
    if chain is not None and not callable(chain):
        raise TypeError(f"sdpq.torchtitan.post_optimizer_build_fn: chain must be callable or None, got {chain!r}")
    return SdpqHook(cfg, chain)


def model_spec_with_sdpq(spec, config: Config | Mapping[str, Any] | None = None):
    """A copy of torchtitan's `ModelSpec` whose post_optimizer_build_fn applies sdpq after the
    spec's own hook."""
    hook = post_optimizer_build_fn(config, chain=spec.post_optimizer_build_fn)
    return dataclasses.replace(spec, post_optimizer_build_fn=hook)


# ----------------------------------------------------------------------------- the hook's work


def _apply(cfg: Config, optimizers, model_parts: list[nn.Module], parallel_dims) -> None:
    shard = parallel_dims.dp_shard * parallel_dims.cp  # torchtitan's fsdp mesh: dp_shard x cp
    if shard == 1 and parallel_dims.dp_replicate == 1:
        return  # no data parallelism: nothing crosses a data-parallel link for sdpq to shrink
    _check_layout(parallel_dims, shard)
    torchft = any(fsdp_internals.has_all_reduce_hook(pg) for part in model_parts for pg in _param_groups(part))
    if torchft and parallel_dims.dp_replicate > 1:
        raise ValueError(
            "sdpq.torchtitan: the FSDP modules already have an all-reduce hook (torchft's, or your own) and "
            f"parallelism.data_parallel_replicate_degree={parallel_dims.dp_replicate}; torchft replicates across its "
            "replica groups instead: set data_parallel_replicate_degree=1"
        )
    manager = _torchft_manager(optimizers)
    replicate = "mesh" if parallel_dims.dp_replicate > 1 else None
    inner = _inner_optimizers(optimizers)
    for part in model_parts:
        owned = {id(p) for p in part.parameters()}
        opts = [o for o in inner if any(id(p) in owned for g in o.param_groups for p in g["params"])]
        sdpq_fsdp.apply(part, cfg, optimizer=opts, replicate=replicate)
    if manager is not None:
        _mark_exact_after_healing(manager, model_parts)


def _check_layout(parallel_dims, shard: int) -> None:
    """torchtitan layouts sdpq cannot run, in torchtitan's own option names."""
    if parallel_dims.ep > 1:
        raise ValueError(
            f"sdpq.torchtitan: parallelism.expert_parallel_degree={parallel_dims.ep}: torchtitan then shards the "
            "routed experts on their own mesh inside each block's FSDP module (per-parameter meshes), where FSDP2 "
            "refuses custom collectives; use expert_parallel_degree=1 (experts sharded with the block)"
        )
    if shard == 1:
        raise ValueError(
            f"sdpq.torchtitan: parallelism.data_parallel_replicate_degree={parallel_dims.dp_replicate} with "
            "data_parallel_shard_degree=1 (pure replication): sdpq's HSDP needs a shard group of 2 or more "
            "ranks; use data_parallel_shard_degree >= 2 (e.g. the ranks of a node)"
        )


def _param_groups(part: nn.Module) -> list:
    return [pg for m in part.modules() if isinstance(m, FSDPModule) for pg in fsdp_internals.param_groups(m)]


def _inner_optimizers(optimizers) -> list[torch.optim.Optimizer]:
    """The optimizers whose steps change the weights. Note: torchtitan's OptimizersContainer
    steps the optimizers it holds (`.optimizers`); its torchft subclass steps them only when the
    replicas commit, so the weights are marked changed only after a step that ran."""
    inner = getattr(optimizers, "optimizers", None)
    if inner is None:
        inner = [optimizers]
    for o in inner:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(
                f"sdpq.torchtitan: expected torchtitan's OptimizersContainer or torch optimizers, not {type(o)}"
            )
    return list(inner)


def _torchft_manager(optimizers):
    """torchft's Manager when torchtitan's torchft optimizer container steps through it, else None.
    Refuses torchft's semi-synchronous training (DiLoCo, LocalSGD): its outer step rewrites the
    weights outside the optimizers sdpq hooks, so the weight references would go stale."""
    ft = getattr(optimizers, "_ft_optimizer", None)  # TorchFTOptimizersContainer (torchtitan 0.3.0)
    if ft is None:
        return None
    if not getattr(optimizers, "_use_ft_optimizer", True):
        raise ValueError(
            "sdpq.torchtitan: fault_tolerance.semi_sync_method (diloco / local_sgd) rewrites the weights in its "
            "outer step, which sdpq's weight gathers would not see; unset it (per-step torchft) to use sdpq"
        )
    return ft.manager


def _mark_exact_after_healing(manager, model_parts: list[nn.Module]) -> None:
    """A healing replica loads a healthy replica's weights (a jump, not a small step): the next
    gather of every module exchanges them exactly. Nothing of sdpq's is sent (the references are
    rebuilt by that exact gather)."""

    def load(_state: object) -> None:
        for part in model_parts:
            sdpq_fsdp.mark_weights_changed(part, exact=True)

    manager.register_state_dict_fn(RECOVERY_KEY, load, lambda: {})
