"""Collectives on flat buffers over torch.distributed process groups (no DeepSpeed/FSDP here).

- `Topology.build(ranks_per_node)`: node layout and intra/inter-node groups (collective).
- `WeightGather(numel, topology, WeightsConfig)`: "my shard -> full bucket" (diff/direct/exact);
  `gather_coalesced` gathers several buckets with one collective per link.
- `GradReduceScatter(numel, topology, GradientsConfig)`: "full bucket -> my chunk", SUM.
- `GradAllReduce(numel, topology, GradientsConfig)`: "bucket -> the sum on every rank", bitwise
  the same everywhere (HSDP's replicate dimension).
- `OwnedReduceScatter(topology, GradientsConfig)`: "bucket -> the sums of the pieces this rank
  owns", pieces of any sizes (ZeRO-1/2's buckets).
- `ReplicaDiffGather(partition_numel, topology, WeightsConfig)`: after a step over full
  replicas, every rank's weights moved by the owners' quantized differences (ZeRO-1/2).
- `direct_group.DirectGroup(pg, rank, size)`: a group object outside torch.distributed's registry
  (no default group needed); `GradAllReduce` and `GradReduceScatter` run on a `Topology` built
  with such groups.
- `all_gather_rows`, `all_gather_flat`, `reduce_scatter_flat`, `group_device`: the plain
  (unquantized) collectives sdpq's own run on, for baselines and small bookkeeping exchanges.
- `stats`: bytes per link class and path, sampled errors (`CommStats`; read them through
  `sdpq.stats`).
- `link_bytes.LinkBytes`: an independent meter of what every process-group collective sends
  across the (simulated) node boundary, whoever calls it; it reads none of `stats`. Benchmarks,
  tests and `python -m sdpq.train --count-bytes meter` count with it.
"""

from . import stats as stats  # the implementation module; read the figures through sdpq.stats
from ._exchange import all_gather_flat, all_gather_rows, group_device, reduce_scatter_flat
from .allreduce import GradAllReduce
from .grads import GradReduceScatter
from .grads_owned import OwnedReduceScatter, Piece, flat_pieces
from .stats import CommStats
from .topology import Topology, TopologyError
from .weights import ReferenceMismatchWarning, WeightGather
from .weights_coalesced import gather_coalesced
from .weights_replicated import ReplicaDiffGather

__all__ = [
    "Topology",
    "TopologyError",
    "WeightGather",
    "gather_coalesced",
    "ReferenceMismatchWarning",
    "GradReduceScatter",
    "GradAllReduce",
    "OwnedReduceScatter",
    "Piece",
    "flat_pieces",
    "ReplicaDiffGather",
    "CommStats",
    "all_gather_rows",
    "all_gather_flat",
    "reduce_scatter_flat",
    "group_device",
]
