"""Collectives on flat buffers over torch.distributed process groups (no DeepSpeed/FSDP here).

- `Topology.build(ranks_per_node)`: node layout and intra/inter-node groups (collective).
- `WeightGather(numel, topology, WeightsConfig)`: "my shard -> full bucket" (diff/direct/exact);
  `gather_coalesced` gathers several buckets with one collective per link.
- `GradReduceScatter(numel, topology, GradientsConfig)`: "full bucket -> my chunk", SUM.
- `GradAllReduce(numel, topology, GradientsConfig)`: "bucket -> the sum on every rank", bitwise
  the same everywhere (HSDP's replicate dimension).
- `stats`: bytes per link class and path, sampled errors (`CommStats`; read them through
  `sdpq.stats`).
"""

from . import stats as stats  # the implementation module; read the figures through sdpq.stats
from .allreduce import GradAllReduce
from .grads import GradReduceScatter
from .stats import CommStats
from .topology import Topology, TopologyError
from .weights import ReferenceMismatchWarning, WeightGather
from .weights_coalesced import gather_coalesced

__all__ = [
    "Topology",
    "TopologyError",
    "WeightGather",
    "gather_coalesced",
    "ReferenceMismatchWarning",
    "GradReduceScatter",
    "GradAllReduce",
    "CommStats",
]
