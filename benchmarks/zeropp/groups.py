"""DeepSpeed's cached process groups, for sdpq's benchmarks and tests (not part of the library).

``reset_deepspeed_groups()`` forgets the process groups DeepSpeed caches in module globals
(``deepspeed.utils.groups``). A real job builds one engine per process. A process that builds
several one after another (a later benchmark arm, a reused test worker whose previous groups were
destroyed) must reset these caches first, or DeepSpeed reuses destroyed or stale hpZ /
all-to-all / data-parallel groups.
"""

from __future__ import annotations

__all__ = ["reset_deepspeed_groups"]

# Module globals holding one group (or the mpu / device mesh they came from).
_SINGLE = (
    "_WORLD_GROUP",
    "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
    "_DATA_PARALLEL_GROUP",
    "_MODEL_PARALLEL_GROUP",
    "_TENSOR_MODEL_PARALLEL_GROUP",
    "mpu",
    "mesh_device",
)
# Module globals holding dicts of groups (or of their ranks), keyed by group name.
_PER_NAME = (
    "_EXPERT_PARALLEL_GROUP",
    "_EXPERT_PARALLEL_GROUP_RANKS",
    "_EXPERT_DATA_PARALLEL_GROUP",
    "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
    "_ALL_TO_ALL_GROUP",
)


def reset_deepspeed_groups() -> None:
    """Make the next DeepSpeed engine in this process build its process groups afresh."""
    import deepspeed.utils.groups as G

    for n in _SINGLE:
        if hasattr(G, n):
            setattr(G, n, None)
    for n in _PER_NAME:
        getattr(G, n, {}).clear()
