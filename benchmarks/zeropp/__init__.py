"""DeepSpeed's own ZeRO++ (qwZ, hpZ, qgZ) on CPU with gloo: the peer arm of sdpq's benchmarks.

ZeRO++ runs DeepSpeed's own code (its partitioning, hpZ secondary partitions, the
``all_to_all_quant_reduce`` two-hop gradient flow); only the CUDA-only pieces are replaced:

- ``install_cpu_kernels()``: the quantizer op module DeepSpeed loads through
  ``op_builder.QuantizerBuilder().load()`` becomes ``cpu_kernels.CPUQuantizerOps`` (same
  functions, same math, plain PyTorch) at its two load sites:
  ``partition_parameters.CUDAQuantizer.quantizer_cuda_module`` (qwZ / hpZ weight gathers) and
  ``coalesced_collectives.quantizer_module`` (qgZ). Both are "load once if None" caches, so
  filling them is all it takes; DeepSpeed's Python around the kernels is untouched, except that
  ``partition_parameters._dist_allgather_fn`` flattens its input first (gloo, unlike NCCL,
  refuses to all-gather the [groups, 1] scale tensor into a flat buffer; same bytes).
- ``simulate_nodes(L)``: DeepSpeed decides what a node is with ``get_accelerator().device_count()``
  (qgZ's ``local_{node}`` / ``global_{local rank}`` all-to-all groups, ``num_nodes`` in
  ``__avg_scatter_grads``). The CPU accelerator answers ``LOCAL_SIZE`` (set by the ``deepspeed``
  launcher), else the number of NUMA nodes (1 here). We set ``LOCAL_SIZE=L``. hpZ's secondary
  groups come from ``zero_hpz_partition_size`` alone (ranks ``[0..L-1], [L..2L-1], ...``), which
  ``zeropp_overrides(L)`` sets to L, so both agree with the simulated layout ``node = rank // L``.

``bytes.LinkBytes`` counts what every rank puts on intra- and inter-node links.
"""

from __future__ import annotations

import contextlib
import os

from .cpu_kernels import CPUQuantizerOps
from .groups import reset_deepspeed_groups  # shared with the DeepSpeed tests

__all__ = [
    "CPUQuantizerOps",
    "ZERO3_AT_SCALE",
    "install_cpu_kernels",
    "simulate_nodes",
    "zeropp_overrides",
    "reset_deepspeed_groups",
]


# ZeRO-3 behaving as it does on the models it exists for, applied to EVERY arm of a comparison.
# DeepSpeed's defaults keep a few-million-parameter model resident between forward and backward
# (prefetch bucket 5e7 elements, reuse distance 1e9 elements: everything is prefetched and never
# released), so backward would gather nothing and hpZ, whose point is the backward gather, would
# have nothing to do. No prefetch and reuse distance 0 release every parameter after use, so
# backward gathers again, as it must when the model is far larger than these buckets. Parameters
# under 1000 elements (biases, norms) stay persistent (gathered once per step, after the
# optimizer), like the small parameters under the default 1e5 threshold at scale.
ZERO3_AT_SCALE = {
    "zero_optimization": {
        "stage3_prefetch_bucket_size": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_param_persistence_threshold": 1000,
    }
}


def zeropp_overrides(ranks_per_node: int, *, qwz: bool = True, hpz: bool = True, qgz: bool = True) -> dict:
    """The "zero_optimization" keys that turn ZeRO++ on (merge into a ZeRO-3 config)."""
    return {
        "zero_optimization": {
            "zero_quantized_weights": qwz,
            "zero_hpz_partition_size": ranks_per_node if hpz else 1,
            "zero_quantized_gradients": qgz,
        }
    }


@contextlib.contextmanager
def install_cpu_kernels():
    """Put ``CPUQuantizerOps`` where DeepSpeed caches its loaded quantizer op (restored on exit)."""
    import deepspeed.runtime.comm.coalesced_collectives as cc
    import deepspeed.runtime.zero.partition_parameters as pp

    cuda_quantizer = getattr(pp, "CUDAQuantizer", None)
    if (
        cuda_quantizer is None
        or not hasattr(cuda_quantizer, "quantizer_cuda_module")
        or not hasattr(cc, "quantizer_module")
    ):
        import deepspeed

        raise RuntimeError(
            f"DeepSpeed {deepspeed.__version__}: partition_parameters.CUDAQuantizer."
            "quantizer_cuda_module / coalesced_collectives.quantizer_module not found; "
            "benchmarks.zeropp is written against DeepSpeed 0.19.8"
        )
    saved = (cuda_quantizer.quantizer_cuda_module, cc.quantizer_module, pp._dist_allgather_fn)
    cuda_quantizer.quantizer_cuda_module = CPUQuantizerOps
    cc.quantizer_module = CPUQuantizerOps
    pp._dist_allgather_fn = _flat_input_allgather(saved[2])
    try:
        yield CPUQuantizerOps
    finally:
        cuda_quantizer.quantizer_cuda_module, cc.quantizer_module, pp._dist_allgather_fn = saved


def _flat_input_allgather(orig):
    """qwZ all-gathers the quantizer's [groups, 1] scale tensor into a flat buffer. NCCL only
    checks numel(out) == k * numel(in); gloo also checks that each output chunk has the input's
    shape and refuses. Flattening the input (a view: same bytes on the wire) is the one gloo
    adaptation ZeRO++ needs; every other input of this function is already flat."""

    def allgather(input_tensor, output_tensor, group=None):
        return orig(input_tensor.reshape(-1), output_tensor, group)

    allgather.__wrapped__ = orig
    return allgather


@contextlib.contextmanager
def simulate_nodes(ranks_per_node: int):
    """Make DeepSpeed see ``ranks_per_node`` devices per node (``LOCAL_SIZE``; restored on exit).
    Needs the CPU accelerator: on a GPU machine the device count is real and cannot be faked."""
    from deepspeed.accelerator import get_accelerator

    saved = os.environ.get("LOCAL_SIZE")
    os.environ["LOCAL_SIZE"] = str(ranks_per_node)
    try:
        seen = get_accelerator().device_count()
        if seen != ranks_per_node:
            raise RuntimeError(
                f"DeepSpeed's accelerator {get_accelerator().device_name()!r} reports {seen} devices "
                f"per node with LOCAL_SIZE={ranks_per_node}; node simulation needs the CPU "
                "accelerator (DS_ACCELERATOR=cpu)"
            )
        yield
    finally:
        if saved is None:
            os.environ.pop("LOCAL_SIZE", None)
        else:
            os.environ["LOCAL_SIZE"] = saved
