"""Wire format: pack/unpack are exact and the bits-per-element figure counts every byte."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdpq.quant import Quantized, QuantSpec, decode, dequantize, encode, pack, quantize, unpack


@settings(deadline=None, max_examples=80)
@given(
    n=st.integers(1, 1500),
    rows=st.integers(1, 4),
    bits=st.sampled_from([4, 8]),
    group=st.sampled_from([2, 32, 128]),
    scale_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31),
)
def test_pack_unpack_exact_for_every_code(n, rows, bits, group, scale_dtype, seed):
    spec = QuantSpec(bits=bits, group_size=group, scale_dtype=scale_dtype)
    g = torch.Generator().manual_seed(seed)
    groups = spec.groups(n)
    codes = torch.randint(-spec.qmax, spec.qmax + 1, (rows, groups * group), generator=g, dtype=torch.int8)
    scales = torch.rand(rows, groups, generator=g).to(scale_dtype).float()
    q = Quantized(codes=codes, scales=scales, numel=n)
    buf = pack(q, spec)
    assert buf.dtype == torch.uint8 and buf.shape == (rows, spec.wire_bytes(n))
    back = unpack(buf, spec, n)
    assert torch.equal(back.codes, codes) and torch.equal(back.scales, scales)


@pytest.mark.parametrize(
    "bits,group,numel,limit",
    [(4, 2048, 1 << 20, 4.02), (4, 128, 1 << 20, 4.3), (8, 128, 1 << 20, 8.3)],
)
def test_wire_bits_per_element_counts_the_buffer(bits, group, numel, limit):
    spec = QuantSpec(bits=bits, group_size=group)
    buf = encode(torch.randn(numel), spec)
    measured = 8 * buf.numel() / numel
    assert measured == spec.wire_bits_per_element(numel) == bits + 32 / group
    assert measured <= limit


def test_padding_costs_are_counted():
    spec = QuantSpec(bits=4, group_size=128)
    assert spec.wire_bytes(129) == 2 * 64 + 2 * 4  # two padded groups of codes, two scales
    assert spec.wire_bits_per_element(129) == 8 * 136 / 129


def test_encode_decode_matches_quantize_dequantize():
    x = torch.randn(3, 777, dtype=torch.bfloat16)
    spec = QuantSpec(bits=4, group_size=128)
    assert torch.equal(decode(encode(x, spec), spec, 777), dequantize(quantize(x, spec)))


def test_unpack_rejects_a_wrong_buffer():
    spec = QuantSpec(bits=4, group_size=128)
    with pytest.raises(ValueError, match="numel=100"):
        unpack(torch.zeros(10, dtype=torch.uint8), spec, 100)
