"""Reference math for the comm tests: deterministic inputs, exact sums and the error bound of
the two-level reduce-scatter (derived from the quantizers, see `rs_error_bound`)."""

from __future__ import annotations

import torch

from sdpq.quant import hadamard


def make_input(rank: int, numel: int, kind: str = "normal", seed: int = 0) -> torch.Tensor:
    """fp32 input of `rank`; every rank can rebuild every other rank's input."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if kind == "normal":
        return torch.randn(numel, generator=g)
    if kind in ("tiny", "huge"):  # gradients of 1e-7 are ordinary in large models
        return torch.randn(numel, generator=g) * (1e-7 if kind == "tiny" else 1e6)
    if kind == "integer":  # exact in fp32 sums: checks bitwise equality with the fp64 sum
        return torch.randint(-1000, 1000, (numel,), generator=g).float()
    if kind == "student_t":  # heavy tails, df = 2
        z = torch.randn(numel, generator=g)
        chi2 = torch.randn(2, numel, generator=g).pow(2).sum(0)
        return z / (chi2 / 2).sqrt()
    if kind == "outliers":
        # Outlier channels: the bucket as rows of a [*, 1024] weight gradient whose input
        # channels 3 and 700 are 50x larger, at the same positions on every rank.
        x = torch.randn(numel, generator=g)
        x[(torch.arange(numel) % 1024 == 3) | (torch.arange(numel) % 1024 == 700)] *= 50.0
        return x
    raise ValueError(kind)


def all_inputs(world_size: int, numel: int, kind: str = "normal", seed: int = 0) -> torch.Tensor:
    return torch.stack([make_input(r, numel, kind, seed) for r in range(world_size)])


def exact_chunk(inputs: torch.Tensor, rank: int) -> torch.Tensor:
    """fp64 sum over ranks of chunk `rank` (c = ceil(numel / N), zero past the end)."""
    N, numel = inputs.shape
    c = -(-numel // N)
    full = torch.zeros(N * c, dtype=torch.float64)
    full[:numel] = inputs.double().sum(0)
    return full[rank * c : (rank + 1) * c]


def rs_error_bound(inputs: torch.Tensor, rank: int, ranks_per_node: int, rs) -> tuple[torch.Tensor, str]:
    """Bound on |out - exact| for `rank`'s chunk of the two-level reduce-scatter `rs` (without
    error feedback). Returns (bound, kind): kind "elementwise" bounds every element; kind
    "block_l2" bounds the L2 norm of the error of every Hadamard block of the chunk.

    Derivation. Let Y_p be rank p's padded input (transformed by H if enabled), chunk d of it
    Y_p[d], delta = 1/2 for nearest and 1 for stochastic rounding (|round(y) - y| <= delta).
    A group g of G values quantized with scale s_g = max_g |v| / qmax has |deQ(Q(v)) - v| <=
    delta * s_g per element. Quantization groups never straddle a chunk (chunks are padded to
    a multiple of every group size), so the groups seen by chunk d are its own aligned groups.
      stage 1 (intra, qmax1): node n's partial of chunk d carries the errors of the L-1 peers that
        are not the receiver: E1_n <= sum_{p in n, p != receiver} delta * max_g|Y_p[d]| / qmax1;
      stage 2 (inter, qmax2): the partial P_n = sum_{p in n} Y_p[d] + e1 sent by node n != n_d
        has scale <= (max_g |sum_p Y_p[d]| + max_g E1_n) / qmax2, error <= delta * that.
      total (transformed domain): T = sum_n E1_n + sum_{n != n_d} delta * s2_n, elementwise.
    The inverse D H is sqrt(B) times an orthonormal map, so the L2 error of each block after it
    is <= sqrt(B) ||T_block||.
    A relative slack of 1e-5 * sum_p |Y_p[d]| covers the fp32 sums and transforms.
    """
    cfg = rs.config
    N, numel = inputs.shape
    cn, C = rs.chunk_numel, rs.padded_chunk
    if rs.placement is not None:  # the chunks as they travel: parameters placed on whole groups
        Xp = torch.stack([rs.placement.pack(inputs[p].float(), numel).float() for p in range(N)])
    else:
        X = torch.zeros(N, N * cn)
        X[:, :numel] = inputs
        X = X.view(N, N, cn)
        Xp = torch.zeros(N, N, C)
        Xp[:, :, :cn] = X
    Y = hadamard(Xp, rs.hadamard_block, cfg.seed).double() if cfg.hadamard else Xp.double()
    return two_level_bound(Y[:, rank, :], rank, ranks_per_node, cfg, rs.intra_spec, rs.inter_spec, rs.hadamard_block)


def two_level_bound(Yd: torch.Tensor, rank: int, L: int, cfg, intra_spec, inter_spec, block: int):
    """The bound of `rs_error_bound` from what every source sends for `rank`'s result: Yd
    [N sources, C] fp64, already transformed (C a multiple of both group sizes and the block)."""
    N, C = Yd.shape
    nodes = N // L
    delta = 0.5 if cfg.rounding == "nearest" else 1.0

    def group_max(v: torch.Tensor, G: int) -> torch.Tensor:
        return v.abs().view(*v.shape[:-1], -1, G).amax(-1, keepdim=True).expand(*v.shape[:-1], -1, G).reshape(v.shape)

    # bf16 scales are rounded up: at most 2^-8 larger than max / qmax (relative).
    q1 = intra_spec.qmax / (1 + 2**-7 if intra_spec.scale_dtype == torch.bfloat16 else 1)
    q2 = inter_spec.qmax / (1 + 2**-7 if inter_spec.scale_dtype == torch.bfloat16 else 1)
    n_d, l_d = rank // L, rank % L
    T = torch.zeros(C, dtype=torch.float64)
    for n in range(nodes):
        members = [n * L + k for k in range(L)]
        e1 = torch.zeros(C, dtype=torch.float64)
        if L > 1:
            for p in members:
                if p % L != l_d:
                    e1 += delta * group_max(Yd[p], intra_spec.group_size) / q1
        T += e1
        if nodes > 1 and n != n_d:
            partial = Yd[members].sum(0)
            G2 = inter_spec.group_size
            s2 = (group_max(partial, G2) + group_max(e1, G2)) / q2
            T += delta * s2
    T = T * (1 + 1e-5) + 1e-5 * Yd.abs().sum(0)
    if cfg.hadamard:
        return T.view(-1, block).norm(dim=-1) * block**0.5, "block_l2"
    return T, "elementwise"


def check_bound(out: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, kind: str, block: int) -> float:
    """max(error / bound) over elements or blocks (<= 1 means the bound holds)."""
    C = bound.numel() * (block if kind == "block_l2" else 1)
    err = torch.zeros(C, dtype=torch.float64)
    err[: out.numel()] = out.double() - exact
    if kind == "block_l2":
        err = err.view(-1, block).norm(dim=-1)
    else:
        err = err.abs()
    return float((err / bound.clamp_min(1e-300)).max())
