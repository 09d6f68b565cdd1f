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
    bits=st.sampled_from([2, 3, 4, 8]),
    group=st.sampled_from([2, 8, 32, 128]),
    scale_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31),
)
def test_pack_unpack_exact_for_every_code(n, rows, bits, group, scale_dtype, seed):
    if bits < 4 and group % 8:
        return  # not a valid spec (8 codes must fill whole bytes)
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
    [
        (4, 2048, 1 << 20, 4.02),
        (4, 128, 1 << 20, 4.3),
        (8, 128, 1 << 20, 8.3),
        (3, 2048, 1 << 20, 3.02),
        (2, 128, 1 << 20, 2.3),
    ],  # fmt: skip
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


@pytest.mark.parametrize(
    "bits,codes,stream",
    [
        # element e in bits [e * bits, (e + 1) * bits), two's complement, little endian
        (4, [1, -1, 7, -7, 0, 2, -2, 3], [0xF1, 0x97, 0x20, 0x3E]),
        (3, [1, -1, 3, -3, 0, 2, -2, 1], [0xF9, 0x0A, 0x39]),  # one 24-bit word: 0x390AF9
        (2, [1, -1, 0, 1, -1, -1, 0, 0], [0x4D, 0x0F]),
    ],
)
def test_the_bit_stream_is_the_documented_layout(bits, codes, stream):
    """Fixed bytes: the layout the C++ and Triton kernels are held to through the reference."""
    spec = QuantSpec(bits=bits, group_size=8)
    q = Quantized(codes=torch.tensor([codes], dtype=torch.int8), scales=torch.ones(1, 1), numel=8)
    buf = pack(q, spec)
    assert buf[0, : spec.code_bytes(8)].tolist() == stream
    assert torch.equal(unpack(buf, spec, 8).codes, q.codes)
