"""The node-resident weight reference R_l of a WeightGather in "diff" mode, in one of three
storages (`weights.reference`):

- "auto" (default): the compute dtype of the gathered weights, which are then R_l itself;
- "fp32": R_l as fp32 values, 4 bytes per element of R_l (4/L per parameter on a rank);
- "bf16" / "fp16": 2 bytes (2/L): bf16 compute weights need no more precision, and what the
  storage's rounding adds is carried into the next difference like the 4-bit error;
- "int8": R_l as the 8-bit wire rows of `sdpq.quant` (int8 codes + one fp32 scale per group of
  128, groups inside one parameter), 1 + 4/128 bytes (~1.03/L). The compute weights are then
  8-bit group-quantized values of the weights (what ZeRO++'s int8 weight gather gives), and the
  node's all-gather of R_l sends these rows (8.25 bits per element instead of 16).

R_l has `nodes` rows of C = shard_numel elements: row n' is shard n' * L + l. Every holder applies
the same gathered bytes with the same arithmetic, so every copy is bitwise equal.

Note (error feedback): the next difference is taken against the values R_l decodes to (not
against the last weights), so whatever a refresh lost - the 2-8-bit difference's rounding and
the storage's own (bf16 or int8) - is sent again by the next one: the reconstruction never
drifts from the weights by more than one refresh's error.

Note (layout): a float reference keeps each shard in its own layout ([nodes, C]); the int8 one
keeps it in the wire layout of the weight gather's placement (each parameter on whole groups),
so that its 8-bit groups never mix two parameters' scales.
"""

from __future__ import annotations

import torch

from ..kernels import decode_rows, encode_rows
from ..quant import QuantSpec
from .segments import BucketLayout

__all__ = ["Reference", "FloatReference", "Int8Reference", "REFERENCE_DTYPES", "make_reference", "reference_kind"]

REFERENCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT8_GROUP = 128  # elements per scale of the int8 reference (at most the placement's group)


class Reference:
    """Base: R_l of one WeightGather ([nodes, C] values, identical on every holder).

    spec: the weight difference's wire format; placement: where the shard's parameters lie on
    the wire (None: the shard as it is)."""

    kind = ""

    def __init__(self, nodes: int, numel: int, spec: QuantSpec, placement: BucketLayout | None, device):
        self.nodes, self.numel, self.spec, self.placement = nodes, numel, spec, placement
        self.wire_numel = numel if placement is None else placement.padded_chunk
        self.device = torch.device(device)

    # What a subclass provides.
    @property
    def tensor(self) -> torch.Tensor:
        """The storage (its bytes are what holders compare and checkpoints keep)."""
        raise NotImplementedError

    def load(self, t: torch.Tensor) -> None:
        """Restore the storage from a saved `tensor` (the same kind and shape)."""
        raise NotImplementedError

    def placed_row(self, node: int) -> torch.Tensor:
        """Row `node` as the encoder reads it: fp32 [1, wire_numel] in the wire layout."""
        raise NotImplementedError

    def add(self, rows: torch.Tensor) -> None:
        """Add the decoded difference rows [nodes, wire bytes] (fp32 math) to every row."""
        raise NotImplementedError

    def set(self, values: torch.Tensor) -> None:
        """Overwrite every row with `values` [nodes, C] (an exact refresh)."""
        raise NotImplementedError

    def payload(self, dtype: torch.dtype) -> torch.Tensor:
        """What the node's all-gather sends of R_l (1-D, never aliasing the storage)."""
        raise NotImplementedError

    def unpack_gathered(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The node's gathered payloads [L, payload] -> values [L, nodes, C] in `dtype`."""
        raise NotImplementedError

    def own_values(self, node: int) -> torch.Tensor:
        """Row `node` (this rank's own shard as every rank reconstructs it), fp32 [C]."""
        raise NotImplementedError

    # Shared.
    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def _pack(self, values: torch.Tensor) -> torch.Tensor:
        """fp32 [R, C] -> [R, wire_numel] in the wire layout (zeros where nothing is placed)."""
        return values if self.placement is None else self.placement.pack_rows(values)

    def _unpack(self, placed: torch.Tensor) -> torch.Tensor:
        """[R, wire_numel] -> [R, C] (the placement undone)."""
        if self.placement is None:
            return placed
        return self.placement.unpack(placed).view(placed.shape[0], self.numel)


class FloatReference(Reference):
    """R_l as fp32, bf16 or fp16 values [nodes, C]."""

    def __init__(self, nodes, numel, spec, placement, device, dtype: torch.dtype):
        super().__init__(nodes, numel, spec, placement, device)
        self.kind = {v: k for k, v in REFERENCE_DTYPES.items()}[dtype]
        self.dtype = dtype
        self._t = torch.zeros((nodes, numel), dtype=dtype, device=self.device)

    @property
    def tensor(self) -> torch.Tensor:
        return self._t

    def load(self, t: torch.Tensor) -> None:
        # Note: another float storage loads (its rounding is carried into the next difference like
        # this one's); the int8 rows do not.
        if not t.is_floating_point() or t.numel() != self.nodes * self.numel:
            raise ValueError(
                f"weight reference: saved {t.dtype} {tuple(t.shape)}; this gather keeps {self.kind} "
                f"[{self.nodes}, {self.numel}] (a checkpoint of weights.reference 'int8' loads into 'int8' only)"
            )
        self._t = t.to(self.device, self.dtype).clone().view(self.nodes, self.numel)

    def own_values(self, node: int) -> torch.Tensor:
        return self._t[node].float()

    def placed_row(self, node: int) -> torch.Tensor:
        return self._pack(self._t[node].view(1, -1).float())

    def add(self, rows: torch.Tensor) -> None:
        if self.placement is None:
            decode_rows(rows, self.spec, self.numel, self._t, add=True)  # in place, fp32 math
            return
        decoded = torch.empty((rows.shape[0], self.wire_numel), dtype=torch.float32, device=rows.device)
        decode_rows(rows, self.spec, self.wire_numel, decoded)
        # Note: the sum is taken in fp32 and rounded once to the storage dtype (as decode_rows's add).
        self._t.copy_(self._t.float().add_(self._unpack(decoded)))

    def set(self, values: torch.Tensor) -> None:
        self._t.copy_(values)

    def payload(self, dtype: torch.dtype) -> torch.Tensor:
        # Note: copy=True: the gathered output must never alias the reference (a refresh edits it).
        return self._t.to(dtype, copy=True).reshape(-1)

    def unpack_gathered(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return rows.view(rows.shape[0], self.nodes, self.numel)


class Int8Reference(Reference):
    """R_l as 8-bit wire rows [nodes, wire bytes]: int8 codes and fp32 group scales."""

    kind = "int8"

    def __init__(self, nodes, numel, spec, placement, device):
        super().__init__(nodes, numel, spec, placement, device)
        # Groups inside the weight gather's placement groups (a power of two that divides them).
        self.store_spec = QuantSpec(bits=8, group_size=min(INT8_GROUP, spec.group_size))
        self._rows = self._encode(torch.zeros((nodes, self.wire_numel), dtype=torch.float32, device=self.device))

    def _encode(self, placed: torch.Tensor) -> torch.Tensor:
        rows, _, _ = encode_rows(placed, self.store_spec)  # nearest: the same bytes on every holder
        return rows

    def _decode(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out = torch.empty((rows.shape[0], self.wire_numel), dtype=dtype, device=rows.device)
        return decode_rows(rows, self.store_spec, self.wire_numel, out)

    @property
    def tensor(self) -> torch.Tensor:
        return self._rows

    def load(self, t: torch.Tensor) -> None:
        if t.dtype != torch.uint8 or tuple(t.shape) != tuple(self._rows.shape):
            raise ValueError(
                f"int8 weight reference: saved {t.dtype} {tuple(t.shape)}, expected uint8 {tuple(self._rows.shape)}"
            )
        self._rows = t.to(self.device).clone()

    def own_values(self, node: int) -> torch.Tensor:
        return self._unpack(self._decode(self._rows[node : node + 1]))[0]

    def placed_row(self, node: int) -> torch.Tensor:
        return self._decode(self._rows[node : node + 1])

    def add(self, rows: torch.Tensor) -> None:
        v = self._decode(self._rows)
        decode_rows(rows, self.spec, self.wire_numel, v, add=True)  # in the wire layout: no unpacking
        self._rows = self._encode(v)

    def set(self, values: torch.Tensor) -> None:
        self._rows = self._encode(self._pack(values.float()))

    def payload(self, dtype: torch.dtype) -> torch.Tensor:
        return self._rows.reshape(-1)  # the rows are replaced, never edited, by a refresh

    def unpack_gathered(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        L = rows.shape[0]
        decoded = self._decode(rows.reshape(L * self.nodes, -1), dtype)
        return self._unpack(decoded).view(L, self.nodes, self.numel)


def reference_kind(kind: str, compute_dtype: torch.dtype) -> str:
    """The storage `weights.reference` names for a gather of `compute_dtype` ("auto": that dtype;
    a compute dtype without a float storage of its own: fp32)."""
    if kind != "auto":
        return kind
    return next((k for k, v in REFERENCE_DTYPES.items() if v == compute_dtype), "fp32")


def make_reference(
    kind: str, nodes: int, numel: int, spec: QuantSpec, placement: BucketLayout | None, device
) -> Reference:
    """A zero reference of a resolved kind ("fp32", "bf16", "fp16" or "int8")."""
    if kind == "int8":
        return Int8Reference(nodes, numel, spec, placement, device)
    if kind not in REFERENCE_DTYPES:
        raise ValueError(f"weight reference kind {kind!r}; allowed: 'bf16', 'fp16', 'fp32', 'int8'")
    return FloatReference(nodes, numel, spec, placement, device, REFERENCE_DTYPES[kind])
