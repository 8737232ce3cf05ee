"""Device functions of the per-token / per-token-head dynamic and static int8 / fp8 K/V
quantisation, shared by every kernel that stores K/V that way (`store_kv_quant`, the fused RoPE
stores). The torch twin is `kvwrite.reference.kv_quant`; the C++ one `csrc/kvwrite/kv_quant.h`.

Formats (FMT): FMT_E4M3, FMT_E5M2 (fp8 codes by `fp8_bits`), FMT_INT8 (two's complement byte).
Rules (RULE), how x reaches the code once the fp32 scale s is known:
  RULE_RNE  (kvwrite's default): y = x / s (fp32, correctly rounded division); int8 code =
            RNE(clamp(y, -128, 127)); fp8 code = saturate + RNE (`fp8_bits`).
  RULE_VLLM (vLLM's per-token-head store): y = x * RN(1 / s); int8 code = trunc(clamp(RN(y +- 0.5),
            -128, 127)) (the +-0.5 is an fp32 add, half away from zero); fp8 as RULE_RNE on y.
NaN -> int8 0 (fp8: the format's NaN code); inputs read with DAZ (`daz`, the special-value policy).
Dynamic scale: max(amax / QMAX, 1e-6) in fp32 over the finite |x| (`finite_abs`).
"""
import triton
import triton.language as tl

from kvwrite.kernels._common import daz, finite_abs, fp8_bits

FMT_E4M3 = tl.constexpr(1)
FMT_E5M2 = tl.constexpr(2)
FMT_INT8 = tl.constexpr(3)
RULE_RNE = tl.constexpr(0)
RULE_VLLM = tl.constexpr(1)
SCALE_FLOOR = tl.constexpr(1e-6)   # as fp32: the smallest dynamic scale
_RNE_MAGIC = tl.constexpr(12582912.0)   # 1.5 * 2**23: (y + M) - M is RNE(y) for |y| <= 2**22


@triton.jit
def dynamic_scale(amax, QMAX: tl.constexpr):
    """max(amax / QMAX, 1e-6): fp32, correctly rounded division (amax from `finite_abs`)."""
    a = amax.to(tl.float32)
    return tl.maximum(tl.div_rn(a, tl.zeros_like(a) + QMAX), SCALE_FLOOR)


@triton.jit
def scaled(x, scale, RULE: tl.constexpr):
    """y = daz(x) / scale (RULE_RNE) or daz(x) * RN(1 / scale) (RULE_VLLM), fp32; `scale`
    broadcasts against x."""
    xs = daz(x)
    s = tl.zeros_like(xs) + scale
    if RULE == RULE_VLLM:
        return xs * tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    else:
        return tl.div_rn(xs, s)


@triton.jit
def int8_code(y, RULE: tl.constexpr):
    """The int8 code (as int32 in [-128, 127]) of a scaled fp32 value y under RULE; NaN -> 0."""
    y = tl.where(y != y, 0.0, y)
    if RULE == RULE_VLLM:
        t = tl.where(y >= 0, y + 0.5, y - 0.5)
        t = tl.minimum(tl.maximum(t, -128.0), 127.0)
        return t.to(tl.int32)   # truncation toward zero, as vLLM's float -> int8 store
    else:
        c = tl.minimum(tl.maximum(y, -128.0), 127.0)
        return ((c + _RNE_MAGIC) - _RNE_MAGIC).to(tl.int32)


@triton.jit
def quant_code(x, scale, FMT: tl.constexpr, RULE: tl.constexpr, FMAX: tl.constexpr,
               MANT: tl.constexpr, EMIN: tl.constexpr):
    """The stored byte (int32 in [0, 256)) of x under `scale`: int8 two's complement or the fp8
    code (FMAX/MANT/EMIN: `kvwrite.kernels._launch.fp8_constexprs`)."""
    y = scaled(x, scale, RULE)
    if FMT == FMT_INT8:
        return int8_code(y, RULE) & 0xFF
    else:
        return fp8_bits(y, FMAX, MANT, EMIN)


@triton.jit
def abs_for_scale(x):
    """|x| as the dynamic scale sees it: finite values only (NaN / +-inf count as 0)."""
    return finite_abs(x)


_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
_FMT = {"int8": 3, "float8_e4m3fn": 1, "float8_e5m2": 2}


def constexprs(cache_dtype, rule: int = 0) -> dict:
    """FMT, QMAX, RULE and the fp8 FMAX/MANT/EMIN constexprs of a torch int8 / e4m3fn / e5m2 cache."""
    from kvwrite.kernels._launch import fp8_constexprs

    name = str(cache_dtype).removeprefix("torch.")
    return dict(FMT=_FMT[name], QMAX=_QMAX[name], RULE=rule, **fp8_constexprs(cache_dtype))
