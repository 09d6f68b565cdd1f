"""ZeRO-3's gradient reduce-scatter on sdpq's collective (a part of DeepSpeedAdapter, see
_ds_adapter.py for what is patched and why; the patching itself is _ds_zero3_internals.py's
`hook_gradient_buckets`): DeepSpeed's layout and averaging, sdpq's two-level exchange.

Note (hot path): the reduce-scatter runs inside `hot_path` and runs no collective but the data
exchange. ZeRO-3 cuts buckets at run time, so a bucket's GradReduceScatter is built at its first
use, under `agreed_at_setup`: initialize agreed on everything it is built from (config, layout,
every parameter's size, the bucket-cutting settings; see `_shaping_settings`), so every rank
builds the same one for the same bucket. Like DeepSpeed's own reduce-scatter, sdpq relies on
every rank forming the same buckets (the same backward order).
"""

from __future__ import annotations

import torch

from .._memprobe import hook_span
from ..comm import GradReduceScatter
from ..comm.agreement import agreed_at_setup
from ..comm.hotpath import hot_path
from ..comm.segments import interleaved_segments
from . import _ds_zero3_internals
from ._ds_state import AdapterState

__all__ = ["GradientsMixin"]


def _row_width(p) -> int:
    """A parameter's row width (its last dim), 0 for a 1-D one."""
    shape = tuple(getattr(p, "ds_shape", p.shape))
    return int(shape[-1]) if len(shape) > 1 else 0


class GradientsMixin(AdapterState):
    """The gradient part of DeepSpeedAdapter."""

    def _grad_rs(self, key: tuple) -> GradReduceScatter:
        grs = self.grads.get(key)
        if grs is None:
            N = self.topology.world_size
            numel = N * sum(-(-n // N) for n in key[1])
            # Row r of the bucket holds chunk r of every parameter (see _reduce_scatter_bucket):
            # groups and Hadamard blocks are kept inside one parameter and one row of it.
            widths = [_row_width(self.params[i]) for i in key[0]]
            segments = interleaved_segments(list(zip(key[1], widths)), N)
            # The gradients' device (the accelerator, even with offload_param: the partitions are
            # on the CPU, the gradients are not): residuals and rounding generators restored from
            # a checkpoint must live where the gradients are reduced.
            with agreed_at_setup():  # by initialize: no collective, no host read here (see above)
                grs = GradReduceScatter(
                    numel,
                    self.topology,
                    self.config.gradients,
                    device=self._device,
                    stats=self.config.stats,
                    record_to=self.stats,
                    segments=segments,
                )
            self.grads[key] = grs
        return grs

    def _reduce_scatter_coalesced(self, key, tensors, group):
        """DeepSpeed's reduce_scatter_coalesced (same layout, same averaging) on sdpq's collective."""
        with hot_path("DeepSpeed ZeRO-3 gradient reduce-scatter"), hook_span("zero3.reduce_scatter", tensors[0].device):
            return self._reduce_scatter_bucket(key, tensors, group)

    def _reduce_scatter_bucket(self, key, tensors, group):
        self.topology.check_group(group)
        N, rank = self.topology.world_size, self.topology.rank
        numels = tuple(t.numel() for t in tensors)
        grs = self._grad_rs((key, numels))
        chunks = [-(-n // N) for n in numels]
        total = sum(chunks)
        # Note: the bucket is built on the group's communication device (the gradients are
        # already there on an accelerator; nothing is copied then).
        dtype, device = tensors[0].dtype, self._device
        # Interleave: row r holds chunk r of every tensor, zero-padded (DeepSpeed pads with garbage;
        # a quantization group must not see it).
        flat = torch.zeros((N, total), dtype=dtype, device=device)
        off = 0
        for t, c in zip(tensors, chunks):
            src = t.reshape(-1)
            padded = torch.zeros(N * c, dtype=dtype, device=device)
            padded[: src.numel()] = src
            flat[:, off : off + c] = padded.view(N, c)
            off += c
        flat = flat.view(-1)
        if self.config.gradients.mode == "exact":
            flat.div_(N)  # Note: DeepSpeed's pre-division, in the gradient dtype: bitwise its average
            out = grs(flat)
        else:
            out32 = torch.empty(total, dtype=torch.float32, device=device)
            grs(flat, out=out32)
            out = out32.div_(N).to(dtype)  # sum in fp32, divide once
        res, off = [], 0
        for n, c in zip(numels, chunks):
            res.append(out.narrow(0, off, max(0, min(c, n - rank * c))))
            off += c
        return res

    def _install_grads(self) -> None:
        hook = _ds_zero3_internals.hook_gradient_buckets
        self.on_remove(hook(self.patch, self.optimizer, self._reduce_scatter_coalesced))
