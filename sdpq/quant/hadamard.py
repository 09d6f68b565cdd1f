"""Randomized blockwise Walsh-Hadamard transform: y = H_B D x / B per block of B values.

H_B is the +-1 Walsh-Hadamard matrix of a power-of-two size B (H_B H_B = B I), D a diagonal of
random +-1 signs drawn from ``seed`` (every rank must pass the same seed). The transform is
linear, so partial sums can be added in the transformed domain and inverted once at the end
(x = D H_B y); it spreads an outlier over its block so absmax groups of 4-bit codes lose less.

Note: the forward transform scales by 1/B first (the signs times 1/B, a power of two: exact
for |x| >= 2^-119) and then runs the unnormalized butterflies, so no intermediate value exceeds
max|x| and no finite input overflows: after s stages a value is a signed sum of 2^s inputs of
at most max|x| / B. (The sums of an unnormalized butterfly of x itself reach B max|x|, and an
orthonormal output can still reach sqrt(B) max|x|.) Powers of two commute with rounding short
of subnormals, so this is the unnormalized transform of x times 1/B, rounded once per add. The
inverse needs no scaling, and its stages stay within max|x| for y = H_B D x / B: after
s stages they hold 2^s H_(other stages) x / B, whose entries are at most 2^s 2^(k-s) max|x| / B. SDP4Bit uses a
fixed, un-randomized 32x32 matrix; the random signs here make the spreading independent of how
the outliers line up with the Hadamard rows.

Cost: log2(B) butterfly passes over the data, O(n log B), never a dense B x B matmul.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["hadamard", "inverse_hadamard", "signs"]


@functools.lru_cache(maxsize=64)
def _cpu_signs(block: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (block,), generator=gen, dtype=torch.int8).float().mul_(2).sub_(1)


def signs(block: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The +-1 diagonal D (fp32 [block]) of every rank using `seed` (shared: never write to it)."""
    return _device_signs(block, seed, torch.device(device))


@functools.lru_cache(maxsize=64)
def _device_signs(block: int, seed: int, device: torch.device) -> torch.Tensor:
    # Note: cached per device, so the hot path does not copy the signs host-to-device per call.
    return _cpu_signs(block, seed).to(device)


@functools.lru_cache(maxsize=64)
def _scaled_signs(block: int, seed: int, device: torch.device) -> torch.Tensor:
    return _device_signs(block, seed, device) / block  # D / B, exact: B is a power of two


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if block < 1 or block & (block - 1):
        raise ValueError(f"hadamard: block={block}; allowed: a power of two")
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(
            f"hadamard: last dimension {tuple(x.shape)[-1:] or 'scalar'} must be a multiple of block={block} "
            "(pad the buffer first)"
        )
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform of the last dim (a power of two)."""
    *lead, B = x.shape
    h = 1
    while h < B:
        # Pairs (j, j + h) inside each run of 2h values become (a + b, a - b).
        v = x.view(*lead, B // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).view(*lead, B)
        h *= 2
    return x


def hadamard(x: torch.Tensor, block: int, seed: int) -> torch.Tensor:
    """fp32 ``H_B D x / B`` over the last dim (a multiple of ``block``), same shape as ``x``."""
    xb = _blocks(x, block)
    y = _fwht(xb * _scaled_signs(block, seed, x.device))
    return y.view(x.shape)


def inverse_hadamard(y: torch.Tensor, block: int, seed: int) -> torch.Tensor:
    """fp32 ``D H_B y``: the inverse of `hadamard` (H_B H_B = B I)."""
    yb = _blocks(y, block)
    x = _fwht(yb) * signs(block, seed, y.device)
    return x.view(y.shape)
