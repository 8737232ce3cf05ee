"""Paged K+V store with static int8 or dynamic per-token / per-token-head int8 / fp8 scales.

One program owns BLOCK_T tokens and the whole [H, D] row of each (a dynamic scale needs every
element it covers): it loads a [BLOCK_T, H_PAD, D_PAD] tile, takes the amax per head or per
token, writes the fp32 scale to the scale cache row the codes go to, and stores the codes
(`kvwrite.kernels._quant`). NHD and HND caches are one kernel with different strides.
"""
import triton
import triton.language as tl

from kvwrite.kernels._common import block_tokens, claim_tile
from kvwrite.kernels._quant import abs_for_scale, dynamic_scale, quant_code

QUANT_STATIC = tl.constexpr(1)
QUANT_TOKEN = tl.constexpr(2)
QUANT_HEAD = tl.constexpr(3)


@triton.jit
def _quant_side(src_ptr, dst_ptr, scale_ptr, sc_ptr, tok, write, page, offset, num_heads,
                s_n, s_h, c_sp, c_so, c_sh, scale_h, sc_sp, sc_so, sc_sh,
                D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr, QUANT: tl.constexpr,
                FMT: tl.constexpr, RULE: tl.constexpr, QMAX: tl.constexpr, FMAX: tl.constexpr,
                MANT: tl.constexpr, EMIN: tl.constexpr):
    """Quantise the [H, D] rows of the tokens in `write` into their cache rows (and scales)."""
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    hmask = h < num_heads
    h64 = h.to(tl.int64)
    mask = write[:, None, None] & hmask[None, :, None] & (d < D)[None, None, :]
    src = tok.to(tl.int64)[:, None, None] * s_n + (h64 * s_h)[None, :, None] + d[None, None, :]
    x = tl.load(src_ptr + src, mask=mask, other=0.0)
    if QUANT == QUANT_STATIC:
        s = tl.load(scale_ptr + h64 * scale_h, mask=hmask, other=1.0)[None, :, None]
    else:
        amax = tl.max(abs_for_scale(x), axis=2)          # [BLOCK_T, H_PAD]; masked lanes are 0
        row = page * sc_sp + offset * sc_so
        if QUANT == QUANT_TOKEN:
            st = dynamic_scale(tl.max(amax, axis=1), QMAX)   # [BLOCK_T]
            tl.store(sc_ptr + row, st, mask=write)
            s = st[:, None, None]
        else:
            sh = dynamic_scale(amax, QMAX)                   # [BLOCK_T, H_PAD]
            tl.store(sc_ptr + row[:, None] + (h64 * sc_sh)[None, :], sh,
                     mask=write[:, None] & hmask[None, :])
            s = sh[:, :, None]
    code = quant_code(x, s, FMT, RULE, FMAX, MANT, EMIN)
    dst = (page * c_sp + offset * c_so)[:, None, None] + (h64 * c_sh)[None, :, None] + d[None, None, :]
    tl.store(dst_ptr + dst, code.to(tl.uint8), mask=mask)


@triton.jit
def store_kv_quant_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, ksc_ptr, vsc_ptr, addr, num_heads,
    k_sn, k_sh, v_sn, v_sh, kc_sp, kc_so, kc_sh, vc_sp, vc_so, vc_sh, ks_sh, vs_sh,
    ksc_sp, ksc_so, ksc_sh, vsc_sp, vsc_so, vsc_sh,
    DK: tl.constexpr, DV: tl.constexpr, H_PAD: tl.constexpr, DK_PAD: tl.constexpr,
    DV_PAD: tl.constexpr, QUANT: tl.constexpr, FMT: tl.constexpr, RULE: tl.constexpr,
    QMAX: tl.constexpr, FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
    CHECK: tl.constexpr, OP: tl.constexpr, BLOCK_T: tl.constexpr,
):
    tok, page, offset, write = claim_tile(addr, BLOCK_T, CHECK, OP)
    _quant_side(k_ptr, kc_ptr, ks_ptr, ksc_ptr, tok, write, page, offset, num_heads, k_sn, k_sh,
                kc_sp, kc_so, kc_sh, ks_sh, ksc_sp, ksc_so, ksc_sh, DK, H_PAD, DK_PAD, QUANT, FMT,
                RULE, QMAX, FMAX, MANT, EMIN)
    _quant_side(v_ptr, vc_ptr, vs_ptr, vsc_ptr, tok, write, page, offset, num_heads, v_sn, v_sh,
                vc_sp, vc_so, vc_sh, vs_sh, vsc_sp, vsc_so, vsc_sh, DV, H_PAD, DV_PAD, QUANT, FMT,
                RULE, QMAX, FMAX, MANT, EMIN)


def launch(a) -> None:
    """Launch store_kv_quant_kernel for a validated `kvwrite.ops.kv.KVStore`."""
    import torch

    from kvwrite.kernels import _quant
    from kvwrite.kernels._launch import launch as run, loc_args

    n, h, dk = a.k.shape
    dv = a.v.shape[2]
    h_pad, dk_pad, dv_pad = (triton.next_power_of_2(x) for x in (h, dk, dv))
    block_t = block_tokens(n, h_pad * max(dk_pad, dv_pad))
    kc, vc = a.k_cache.view(torch.uint8), a.v_cache.view(torch.uint8)
    static = a.k_scale is not None
    ks, vs = (a.k_scale, a.v_scale) if static else (a.k_scale_cache, a.v_scale_cache)
    ksc, vsc = (a.k_scale_cache, a.v_scale_cache) if not static else (a.k_scale, a.v_scale)

    def sc_strides(t):
        return (t.stride(0), t.stride(1), t.stride(2) if t.shape[2] > 1 else 0) if not static else (0, 0, 0)

    (ksp, kso, ksh), (vsp, vso, vsh) = sc_strides(ksc), sc_strides(vsc)
    run(store_kv_quant_kernel, (triton.cdiv(n, block_t),), a,
        k_ptr=a.k, v_ptr=a.v, kc_ptr=kc, vc_ptr=vc, ks_ptr=ks, vs_ptr=vs, ksc_ptr=ksc, vsc_ptr=vsc,
        num_heads=h, k_sn=a.k.stride(0), k_sh=a.k.stride(1), v_sn=a.v.stride(0), v_sh=a.v.stride(1),
        kc_sp=kc.stride(0), kc_so=kc.stride(1), kc_sh=kc.stride(2),
        vc_sp=vc.stride(0), vc_so=vc.stride(1), vc_sh=vc.stride(2),
        ks_sh=1 if static and ks.numel() > 1 else 0, vs_sh=1 if static and vs.numel() > 1 else 0,
        ksc_sp=ksp, ksc_so=kso, ksc_sh=ksh, vsc_sp=vsp, vsc_so=vso, vsc_sh=vsh,
        DK=dk, DV=dv, H_PAD=h_pad, DK_PAD=dk_pad, DV_PAD=dv_pad, QUANT=a.quant,
        **_quant.constexprs(a.k_cache.dtype, a.rule), BLOCK_T=block_t, enable_fp_fusion=False,
        **loc_args(a))


def variants():
    """(name, kernel, pointer dtypes, constexprs) of every variant, for compile_check."""
    import torch

    from kvwrite.kernels import _quant

    # (cache, QUANT, RULE): int8 every mode and rule, fp8 a dynamic mode of each rule / format
    modes = [(torch.int8, 1, 0), (torch.int8, 2, 0), (torch.int8, 2, 1), (torch.int8, 3, 0), (torch.int8, 3, 1),
             (torch.float8_e4m3fn, 2, 0), (torch.float8_e4m3fn, 3, 1), (torch.float8_e5m2, 3, 0)]
    for check in (0, 1, 2):
        for dtype in (torch.float16, torch.bfloat16):
            for cache, quant, rule in modes:
                pointers = dict(k_ptr=dtype, v_ptr=dtype, kc_ptr=torch.uint8, vc_ptr=torch.uint8,
                                loc_ptr=torch.int64, ks_ptr=torch.float32, vs_ptr=torch.float32,
                                ksc_ptr=torch.float32, vsc_ptr=torch.float32,
                                err_ptr=torch.int64, loc_map_ptr=torch.int32)
                constexprs = dict(DK=128, DV=128, H_PAD=8, DK_PAD=128, DV_PAD=128, QUANT=quant,
                                  **_quant.constexprs(cache, rule), HAS_MAP=False, HAS_DCP=False,
                                  CHECK=check, OP=0, BLOCK_T=4)
                name = f"{str(dtype)[6:]}->{str(cache)[6:]} q{quant} r{rule}"
                yield name, store_kv_quant_kernel, pointers, constexprs
