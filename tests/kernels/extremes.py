"""Inputs at the edges of the fp32 range, shared by the Triton and the C++ codec tests."""

import torch


def top_of_range_rows(bits: int) -> torch.Tensor:
    """[2, 512] fp32 rows of groups of 128 whose absmax lies within 2^-8 of the fp32 maximum
    (rounded up, their bf16 scales would decode the largest codes to inf), among values of 1e37."""
    top = torch.finfo(torch.float32).max
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(bits)) * 1e37
    x[0, 3], x[0, 300], x[1, 129] = top, -top * (1 - 2**-9), 3.3e38
    return x
