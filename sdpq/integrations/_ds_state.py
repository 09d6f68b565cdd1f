"""What the parts of DeepSpeedAdapter share (_ds_adapter.py, _ds_grads.py, _ds_zero3_state.py):
declared once here, for readers and for the type checker."""

from __future__ import annotations

from typing import Any

import torch

from ..comm import GradReduceScatter, WeightGather
from ..comm.device import comm_device
from ._ds_base import DeepSpeedAdapterBase

__all__ = ["AdapterState"]


class AdapterState(DeepSpeedAdapterBase):
    """The attributes DeepSpeedAdapter._setup sets and the methods each part provides."""

    params: dict[int, Any]  # ds_id -> parameter
    weights: dict[int, WeightGather]  # ds_id -> its gather
    grads: dict[tuple, GradReduceScatter]  # ((ds_ids), (numels)) -> the bucket's reduce-scatter
    _index: dict[int, int]  # ds_id -> position (checkpoints name parameters by position)
    _ds_id: list[int]  # position -> ds_id

    @property
    def _device(self) -> torch.device:
        """Where sdpq's weight gathers, gradient buckets and their state live: the world group's
        communication device (NCCL: this rank's current GPU, which is DeepSpeed's too; gloo on
        the CPU: the CPU), whatever device the partitions are on (the CPU with offload_param).

        Note: one exception, gloo with DeepSpeed on an accelerator (several ranks sharing one
        GPU, the GPU check): the buffers stay on DeepSpeed's device (``engine.device``) and
        sdpq's exchanges stage them through the host (sdpq.comm._exchange)."""
        comm, engine = comm_device(self.topology.world_group), torch.device(self.engine.device)
        return engine if engine.type != "cpu" and comm.type == "cpu" else comm

    def _weight_gather(self, p: Any) -> WeightGather:  # _ds_adapter.py
        raise NotImplementedError

    def _build_weight_gathers(self) -> dict[int, WeightGather]:  # _ds_adapter.py
        raise NotImplementedError

    def _grad_rs(self, key: tuple) -> GradReduceScatter:  # _ds_grads.py
        raise NotImplementedError

    def _regather_available(self) -> None:  # _ds_adapter.py
        raise NotImplementedError
