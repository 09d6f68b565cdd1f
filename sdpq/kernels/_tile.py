"""Triton building blocks shared by the fused kernels: one register tile of whole groups.

Every helper works on a tile of ``M`` rows of ``K`` contiguous elements (a row = one quantization
group, or one Hadamard block) and repeats, operation for operation, the fp32 arithmetic of the
PyTorch reference in ``sdpq.quant`` so that kernel and reference agree bitwise:

- the scale is ``div_rn(absmax, qmax)`` rounded to the wire dtype, as ``quantize`` does;
- values are divided with ``div_rn`` (IEEE division; a plain ``/`` may compile to an
  approximate reciprocal on GPUs);
- round-half-to-even is computed from ``floor`` and the exact fractional part (``floor(y + 0.5)``
  is wrong just below 0.5, where ``y + 0.5`` rounds up to 1);
- the Walsh-Hadamard butterflies pair the same elements in the same order as ``_fwht``;
- stochastic rounding is not bitwise the reference (another random stream): it divides by the
  scale through one reciprocal per group, without the exact correction.

Scales are stored and loaded byte by byte: a row's scale region may start at any byte offset.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def exp2_approx(x, LIBDEVICE: tl.constexpr):
    """exp2 from the GPU's approximate instruction, subnormal results kept (``ex2.approx.f32``,
    relative error about 2^-22); numpy's in the interpreter.
    Note: not CUDA's math library: Triton links it with flush-to-zero on, and a flushed result
    (the geometric mean of a group below 2^-126) turns the group's metadata into inf and NaN."""
    if LIBDEVICE:
        y = tl.inline_asm_elementwise("ex2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.exp2(x)
    return y


@triton.jit
def round_half_even(y, LIBDEVICE: tl.constexpr):
    """Round to nearest, ties to even: IEEE's default rounding, so the hardware's rint (one FRND)
    gives the same bits; the interpreter spells it out from floor and the fractional part."""
    if LIBDEVICE:
        return libdevice.rint(y)
    fl = tl.floor(y)
    frac = y - fl  # exact for |y| < 2**23
    odd = (fl - 2.0 * tl.floor(fl * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, fl + 1.0, fl)


@triton.jit
def log2_approx(x, LIBDEVICE: tl.constexpr):
    """log2 from the GPU's approximate instruction (``lg2.approx.f32``: one MUFU.LG2 and a rescale
    of subnormal inputs; error below 2^-22 absolute for x in [0.5, 2], 2^-22 of the result
    elsewhere) where CUDA's math library spends ~25 instructions on a polynomial; numpy's in the
    interpreter. For values that are rounded to far fewer bits afterwards (an E4M3 code), not
    where a result must be torch's bits."""
    if LIBDEVICE:
        y = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.log2(x)
    return y


@triton.jit
def to_bf16_rne(v, LIBDEVICE: tl.constexpr, TORCH_NAN: tl.constexpr = True):
    """fp32 -> bf16, round to nearest even, NaN as torch's 0x7FC0 (TORCH_NAN; any NaN without it,
    for values that are only computed with). Compiled for a GPU: the conversion instruction (its
    NaN is 0x7FFF, replaced); Triton's interpreter truncates, so there the rounding is spelled out
    on the bits."""
    if LIBDEVICE:
        y = v.to(tl.bfloat16, fp_downcast_rounding="rtne")
        if TORCH_NAN:
            y = tl.where(v != v, tl.full(v.shape, 0x7FC0, tl.int16).to(tl.bfloat16, bitcast=True), y)
        return y
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(v != v, 0x7FC0, rounded)
    return (rounded & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def opaque_copy(x, LIBDEVICE: tl.constexpr):
    """x, unchanged. Compiled, an inline-asm move with side effects, which Triton's layout pass
    may convert between layouts but not recompute: without it the pass rebuilt the
    Walsh-Hadamard butterflies once per layout their consumers prefer (the group absmax, the
    codes, the own row), and the reduction with them."""
    if LIBDEVICE:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)
    return x


@triton.jit
def absmax(v, LIBDEVICE: tl.constexpr):
    """v: fp32 [M, G] -> each row's largest |v| [M], NaN where the row holds a NaN (as torch.amax).
    Note: tl.max drops NaN. Compiled, one reduction with a NaN-propagating max; Triton's
    interpreter runs a custom combine in Python per element (~100x slower than its builtin
    reductions), so there the NaN is found by a second, builtin reduction."""
    if LIBDEVICE:
        amax = tl.reduce(tl.abs(v), 1, _max_nan)
    else:
        has_nan = tl.max((v != v).to(tl.int32), 1) > 0
        amax = tl.where(has_nan, float("nan"), tl.max(tl.abs(v), 1))
    return amax


@triton.jit
def group_scales(v, QMAX: tl.constexpr, SCALE_BF16: tl.constexpr, LIBDEVICE: tl.constexpr):
    """v: fp32 [M, G] -> (scale fp32 [M] rounded to the wire dtype, finite mask [M])."""
    amax = absmax(v, LIBDEVICE)  # a NaN group gets a NaN scale, as torch.amax gives
    s = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
    if SCALE_BF16:  # rounded up to bf16 (as sdpq.quant.groupwise): top half of the bits, carried
        up = ((s.to(tl.int32, bitcast=True) + 0xFFFF) & -65536).to(tl.float32, bitcast=True)
        # capped so that QMAX * scale stays finite (groupwise.py's Note): fp32 max / QMAX, truncated
        fmax = tl.full(amax.shape, 3.4028234663852886e38, tl.float32)
        top = tl.math.div_rn(fmax, tl.full(amax.shape, QMAX, tl.float32))
        cap = (top.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
        s = tl.where((tl.abs(s) < float("inf")) & (up > cap), cap, up)
        s = tl.where(amax != amax, float("nan"), s)  # the carry would turn some NaN bits into inf
    finite = tl.abs(s) < float("inf")  # False for inf and NaN
    return s, finite


@triton.jit
def div_by_group(v, s, EXACT: tl.constexpr = True):
    """v [M, G] / s [M], correctly rounded (IEEE division, as torch), with one division per group.

    Markstein's theorem: with y = RN(1/b) and q within one ulp of a/b, r = a - b q is exact
    (one FMA) and RN(q + r y) = RN(a/b), unless a step overflows or leaves the normal range. So
    y is one IEEE division per group and each element costs a multiply and two FMAs (IEEE
    division per element costs ~11 instructions, with a range check and a branch to a slow
    path). The range: both operands are first multiplied by a power of two (exact) that puts
    the divisor in [2^-100, 2^100]; the quotients here are at most ~QMAX, and one the scaling
    pushes below the normal range (|v| < 2^-62 with a divisor over 2^100) is below 2^-162,
    which rounds to zero either way."""
    f = tl.where(s > 1.2676506002282294e30, 5.421010862427522e-20, 1.0)  # over 2^100: times 2^-64
    f = tl.where(s < 7.888609052210118e-31, 1.8446744073709552e19, f)  # below 2^-100: times 2^64
    b = s * f  # exact: a power of two, the result stays normal
    y = tl.math.div_rn(tl.full(b.shape, 1.0, tl.float32), b)
    a = v * f[:, None]
    q = a * y[:, None]
    if not EXACT:  # within 1.5 ulp of the quotient: where the rounding that follows is random
        return q
    r = tl.fma(-q, tl.broadcast_to(b[:, None], v.shape), a)
    return tl.fma(r, tl.broadcast_to(y[:, None], v.shape), q)


@triton.jit
def run_counters(p, M: tl.constexpr, G: tl.constexpr):
    """The random stream's counters of program p's tile [M, G] (p's tiles one after the other):
    one per run of eight elements (uniform_tile's unit), [M, G // 8], its position modulo 2^32
    (int32, as the fast 32-bit Philox takes it): draws repeat only 2^35 elements apart."""
    return (p * (M * G // 8) + tl.reshape(tl.arange(0, M * G // 8), [M, G // 8])).to(tl.int32)


@triton.jit
def uniform_tile(seed, c8, M: tl.constexpr, G: tl.constexpr):
    """[M, G] uniforms in (0, 1) from one Philox call per eight elements: c8 [M, G // 8] holds a
    distinct counter per run of eight (its element's position / 8). The call's four 32-bit draws
    give eight 16-bit halves h, and u = (h + 1/2) / 2^16. Stochastic rounding floor(y + u) then
    rounds up with probability frac(y) rounded to a multiple of 2^-16 (and y + u rounded to
    fp32): a bias below 2^-16 of a quantization step, of either sign. (Philox is ~60
    instructions a call: a call per four elements was a quarter of the gradient encode's
    issue budget.)"""
    r0, r1, r2, r3 = tl.randint4x(seed, c8)
    h = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # [M, G // 8, 2, 2]
    h = tl.join(h & 0xFFFF, h >> 16)  # uint32: a logical shift
    return tl.reshape(h.to(tl.float32) * (1.0 / 65536) + (0.5 / 65536), [M, G])


@triton.jit
def quantize_tile(v, s, finite, c8, seed, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr, LIBDEVICE: tl.constexpr):
    """fp32 [M, G] values with their group scales -> int32 codes in [-QMAX, QMAX].
    c8: the stochastic stream's counters, one per eight elements [M, G // 8] (see uniform_tile)."""
    safe = tl.where(finite & (s > 0), s, 1.0)
    if STOCHASTIC:  # the quotient's last bit moves the odds of rounding up by < 2^-16: not exact
        y = tl.floor(div_by_group(v, safe, EXACT=False) + uniform_tile(seed, c8, v.shape[0], v.shape[1]))
    else:
        y = round_half_even(div_by_group(v, safe), LIBDEVICE)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    y = tl.where(finite[:, None], y, 0.0)
    return y.to(tl.int32)


@triton.jit
def store_codes(row_ptr, codes, groups, G: tl.constexpr, BITS: tl.constexpr, mask):
    """int32 codes [M, G] of groups `groups` [M] -> packed bytes at row_ptr (two's complement;
    below 4 bits each 8 codes are one little-endian word of BITS bytes, as sdpq.quant.wire)."""
    if BITS < 4:
        M: tl.constexpr = codes.shape[0]
        fields = tl.reshape(codes & ((1 << BITS) - 1), [M, G // 8, 8]) << (tl.arange(0, 8) * BITS)[None, None, :]
        word = tl.sum(fields, axis=2)  # the fields do not overlap: the sum is their OR
        base = groups[:, None] * (G * BITS // 8) + tl.arange(0, G // 8)[None, :] * BITS
        for b in tl.static_range(BITS):
            tl.store(row_ptr + base + b, ((word >> (8 * b)) & 0xFF).to(tl.uint8), mask=mask[:, None])
    elif BITS == 4:
        lo, hi = tl.split(tl.reshape(codes, [codes.shape[0], G // 2, 2]))
        byte = (lo & 0x0F) | ((hi & 0x0F) << 4)
        col = groups[:, None] * (G // 2) + tl.arange(0, G // 2)[None, :]
        tl.store(row_ptr + col, byte.to(tl.uint8), mask=mask[:, None])
    else:
        col = groups[:, None] * G + tl.arange(0, G)[None, :]
        tl.store(row_ptr + col, (codes & 0xFF).to(tl.uint8), mask=mask[:, None])


@triton.jit
def load_codes(row_ptr, groups, G: tl.constexpr, BITS: tl.constexpr, mask):
    """Packed bytes -> fp32 codes [M, G] (sign-extended)."""
    if BITS < 4:
        M: tl.constexpr = groups.shape[0]
        base = groups[:, None] * (G * BITS // 8) + tl.arange(0, G // 8)[None, :] * BITS
        word = tl.zeros([M, G // 8], tl.int32)
        for b in tl.static_range(BITS):
            word |= tl.load(row_ptr + base + b, mask=mask[:, None], other=0).to(tl.int32) << (8 * b)
        fields = (word[:, :, None] >> (tl.arange(0, 8) * BITS)[None, None, :]) & ((1 << BITS) - 1)
        sign: tl.constexpr = 1 << (BITS - 1)
        c = tl.reshape((fields ^ sign) - sign, [M, G])
    elif BITS == 4:
        col = groups[:, None] * (G // 2) + tl.arange(0, G // 2)[None, :]
        b = tl.load(row_ptr + col, mask=mask[:, None], other=0).to(tl.int32)
        lo = ((b & 0x0F) ^ 8) - 8
        hi = ((b >> 4) ^ 8) - 8
        c = tl.reshape(tl.join(lo, hi), [groups.shape[0], G])
    else:
        col = groups[:, None] * G + tl.arange(0, G)[None, :]
        b = tl.load(row_ptr + col, mask=mask[:, None], other=0).to(tl.int32)
        c = ((b & 0xFF) ^ 0x80) - 0x80
    return c.to(tl.float32)


@triton.jit
def store_scales(ptr, s, groups, SCALE_BF16: tl.constexpr, mask):
    """fp32 scales [M] -> little-endian bytes of the wire dtype at ptr + group * itemsize."""
    if SCALE_BF16:
        bits = (s.to(tl.int32, bitcast=True) >> 16) & 0xFFFF  # exact: s is already a bf16 value
        for k in tl.static_range(2):
            tl.store(ptr + groups * 2 + k, ((bits >> (8 * k)) & 0xFF).to(tl.uint8), mask=mask)
    else:
        bits = s.to(tl.int32, bitcast=True)
        for k in tl.static_range(4):
            tl.store(ptr + groups * 4 + k, ((bits >> (8 * k)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def load_scales(ptr, groups, SCALE_BF16: tl.constexpr, mask):
    """Bytes of the wire dtype -> fp32 scales [M]."""
    if SCALE_BF16:
        bits = tl.zeros(groups.shape, tl.int32)
        for k in tl.static_range(2):
            bits |= tl.load(ptr + groups * 2 + k, mask=mask, other=0).to(tl.int32) << (8 * k)
        return (bits << 16).to(tl.float32, bitcast=True)
    bits = tl.zeros(groups.shape, tl.int32)
    for k in tl.static_range(4):
        bits |= tl.load(ptr + groups * 4 + k, mask=mask, other=0).to(tl.int32) << (8 * k)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def dequantize_tile(codes, s):
    """fp32 codes [M, G] x scales [M]; non-finite scales decode to NaN (as ``dequantize``):
    a NaN scale per group, so no element needs a test (code x NaN is NaN, code 0 too)."""
    s = tl.where(tl.abs(s) < float("inf"), s, float("nan"))
    return codes * s[:, None]


@triton.jit
def _butterfly_in_thread(x, H: tl.constexpr):
    """One butterfly stage of stride H (a power of two) on x [M, B]: pairs (j, j + H) of every run
    of 2H become (a + b, a - b), in place. The pair axis is split out and joined back, which
    stays in registers while each thread holds 2H neighbours."""
    M: tl.constexpr = x.shape[0]
    B: tl.constexpr = x.shape[1]
    a, b = tl.split(tl.permute(tl.reshape(x, [M, B // (2 * H), 2, H]), [0, 1, 3, 2]))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [M, B])


# Note: the largest Hadamard block whose butterflies take warp shuffles: for the strides from 8 on
# the compiler lays a row of up to 128 over one warp (32 lanes x 4 elements; strides 1-4 run
# before that on 8 neighbours a thread holds, one layout conversion between the two). Past
# 128 the partner of a stride may live in another warp, and
# tl.gather then goes through shared memory (compiled for sm_90: 2-4x the instructions of the
# rotating form, and minutes to compile at 4096).
SHUFFLE_MAX_BLOCK = tl.constexpr(128)


@triton.jit
def fwht(x, B: tl.constexpr, LOG2B: tl.constexpr):
    """Unnormalized Walsh-Hadamard transform of each row of x [M, B]: the butterflies of
    ``sdpq.quant.hadamard._fwht`` (strides 1, 2, 4, ..., pairs (j, j + h) -> (a + b, a - b)),
    the same operands in the same order, so the same bits."""
    if B <= SHUFFLE_MAX_BLOCK:
        x = _fwht_shuffled(x, B, LOG2B)
    else:
        x = _fwht_rotating(x, B, LOG2B)
    return x


@triton.jit
def _fwht_shuffled(x, B: tl.constexpr, LOG2B: tl.constexpr):
    """Strides 1, 2 and 4 pair neighbours a thread holds (split / join in registers). From stride
    8 on, the partner j ^ h lives in another lane of the warp: ``tl.gather`` along the row
    compiles to one warp shuffle per element, and one FMA gives a + b or a - b exactly
    (x * +-1 is exact): the lower element adds its partner, the upper one is subtracted from it."""
    IN_THREAD: tl.constexpr = min(LOG2B, 3)
    for i in tl.static_range(IN_THREAD):
        x = _butterfly_in_thread(x, 1 << i)
    j = tl.arange(0, B)[None, :]
    for i in tl.static_range(IN_THREAD, LOG2B):
        partner = tl.gather(x, tl.broadcast_to(j ^ (1 << i), x.shape), axis=1)
        sign = tl.where((j & (1 << i)) == 0, 1.0, -1.0)  # lower: x + partner; upper: partner - x
        x = tl.fma(x, tl.broadcast_to(sign, x.shape), partner)
    return x


@triton.jit
def _fwht_rotating(x, B: tl.constexpr, LOG2B: tl.constexpr):
    """Every stage has the same shapes ("constant geometry"): it pairs neighbours, i.e. elements
    whose positions differ in bit 0, and writes the sums to the first half of the row and the
    differences to the second half, so the positions' bits rotate right by one. Stage i then
    pairs the elements whose original positions differ in bit i (the reference's h = 2^i) with
    the same operands in the same order, and after LOG2B stages every bit is back in place.
    Compiled, each stage moves the row through shared memory (a barrier pair per stage).
    Note: a per-stage shape [M, B / 2h, 2, h] needs a constexpr h computed in the loop, which
    the interpreter takes but the compiler refuses (a constexpr cannot be reassigned)."""
    M: tl.constexpr = x.shape[0]
    for _ in tl.static_range(LOG2B):
        a, b = tl.split(tl.reshape(x, [M, B // 2, 2]))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 2, 1]), [M, B])
    return x


@triton.jit
def store_groups(vg, row_ptr, code_bytes, groups, gmask, c8, seed, flag_ptr,
                  G: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr,
                  SCALE_BF16: tl.constexpr, LIBDEVICE: tl.constexpr):  # fmt: skip
    """Quantize the [groups, G] values vg into a wire row (codes, then scales) and count the
    groups that held inf/NaN into flag_ptr. c8: the random stream's counters (one per eight elements)."""
    s, finite = group_scales(vg, QMAX, SCALE_BF16, LIBDEVICE)
    codes = quantize_tile(vg, s, finite, c8, seed, QMAX, STOCHASTIC, LIBDEVICE)
    store_codes(row_ptr, codes, groups, G, BITS, gmask)
    store_scales(row_ptr + code_bytes, s, groups, SCALE_BF16, gmask)
    bad = tl.sum((gmask & ~finite).to(tl.int32))
    if bad > 0:  # Note: a relaxed atomic, and none at all (no fence) in the common all-finite tile
        tl.atomic_add(flag_ptr, bad, sem="relaxed")


@triton.jit
def load_groups(row_ptr, code_bytes, groups, gmask, G: tl.constexpr, BITS: tl.constexpr, SCALE_BF16: tl.constexpr):
    """The dequantized [groups, G] values of a wire row."""
    return dequantize_tile(
        load_codes(row_ptr, groups, G, BITS, gmask), load_scales(row_ptr + code_bytes, groups, SCALE_BF16, gmask)
    )
