"""NVFP4 device functions shared by the NVFP4 stores (MHA `store_kv_nvfp4`, MLA `store_mla`'s
"nvfp4" rows). A block is 16 consecutive elements of a row, handled as its 8 even and 8 odd
elements ([T, B, 8] tensors), so that byte i of the block is code(2i) | code(2i + 1) << 4.

The format and its error bound are documented in `kvwrite.reference.nvfp4` (the torch twin of
this file). Every step is bit-exact on every backend: amax is exact, the two divisions use
`tl.div_rn` (GPU `/` is approximate), the e4m3 block scale is rounded by `fp8_bits` (saturating,
round to nearest even), e2m1 rounding is a comparison ladder with ties to the even code.
"""
import triton
import triton.language as tl

from kvwrite.kernels._common import daz, finite_abs, fp8_bits


@triton.jit
def e4m3_value(code):
    """fp32 value of an e4m3fn code (int32 in [0, 256); never 0x7F/0xFF, NaN: `fp8_bits` of a
    finite amax)."""
    e = (code >> 3) & 0xF
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    return tl.where((code & 0x80) != 0, -mag, mag)


@triton.jit
def e2m1_code(y):
    """4-bit e2m1 code (int32) of fp32 y: nearest of 0, .5, 1, 1.5, 2, 3, 4, 6, ties to the even
    code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4), saturating; sign kept."""
    a = tl.abs(y)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    return code | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _element_codes(x, d, zero):
    """e2m1 codes of x / d (ties to even, +-inf -> +-6); where `zero` (d == 0) the sign alone;
    NaN -> 0 (e2m1 has no NaN: the block's scale carries it)."""
    sign = (x.to(tl.int32, bitcast=True) >> 28) & 8
    code = tl.where(zero, sign, e2m1_code(tl.div_rn(x, d)))
    return tl.where(x != x, 0, code)


@triton.jit
def quantize_blocks(x_even, x_odd, g, HAS_GLOBAL: tl.constexpr):
    """NVFP4-quantise blocks of 16: `x_even`/`x_odd` [T, B, 8] fp32 hold elements 2i and 2i+1 of
    each block, `g` the fp32 global scale (ignored unless HAS_GLOBAL). Returns (bytes [T, B, 8]
    int32: code(2i) | code(2i+1) << 4, e4m3 scale codes [T, B] int32)."""
    x_even = daz(x_even)
    x_odd = daz(x_odd)
    amax = tl.maximum(tl.max(finite_abs(x_even), axis=2), tl.max(finite_abs(x_odd), axis=2))
    has_nan = (tl.max((x_even != x_even).to(tl.int32), axis=2)
               + tl.max((x_odd != x_odd).to(tl.int32), axis=2)) > 0
    s = tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
    if HAS_GLOBAL:
        s = tl.div_rn(s, tl.full(amax.shape, 1.0, tl.float32) * g)
    code = fp8_bits(s, 448.0, 3, -6)
    d = e4m3_value(code)
    if HAS_GLOBAL:
        d = d * g
    d = tl.broadcast_to(d[:, :, None], x_even.shape)
    zero = d == 0  # an all-zero block (or a global scale that underflows it): codes +-0
    d = tl.where(zero, 1.0, d)
    lo = _element_codes(x_even, d, zero)
    hi = _element_codes(x_odd, d, zero)
    return lo | (hi << 4), tl.where(has_nan, 0x7F, code)  # a NaN makes the block scale NaN


@triton.jit
def store_blocks(x_even, x_odd, g, dst_ptr, byte_off, sc_ptr, scale_off, mask,
                 HAS_GLOBAL: tl.constexpr):
    """Quantise blocks (`quantize_blocks`) and store their bytes at `byte_off` [T, B, 8] and
    their e4m3 scale codes at `scale_off` [T, B] (int64 offsets), where `mask` [T, B]."""
    packed, code = quantize_blocks(x_even, x_odd, g, HAS_GLOBAL)
    tl.store(dst_ptr + byte_off, packed.to(tl.uint8), mask=mask[:, :, None])
    tl.store(sc_ptr + scale_off, code.to(tl.uint8), mask=mask)
