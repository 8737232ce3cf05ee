"""store_kv's int4 format (vLLM's INT4_PER_TOKEN_HEAD): rotate, quantise and pack each (token,
head) row. The formulas are on `kvwrite.reference.kv_int4` (the torch twin); the C++ one is
`csrc/kvwrite/kv_int4.h`.

One program owns BLOCK_T tokens: a [BLOCK_T * H_PAD, D_PAD] tile a side (K, then V). The
rotation is the radix-2 butterfly on the tile (stage h: reshape to [rows, D_PAD / 2h, 2, h],
split the pair, join (u + w, u - w)), D_PAD a multiple of the block b so the padding is whole
blocks that are masked out. bf16 rounding is bit arithmetic (the interpreter's cast truncates).
"""
import triton
import triton.language as tl

from kvwrite.kernels._common import block_tokens, claim_tile, daz
from kvwrite.kernels.store_mla import _bf16_bits

IN_F16 = tl.constexpr(1)
IN_BF16 = tl.constexpr(2)
LEVELS = tl.constexpr(15.0)
SCALE_FLOOR = tl.constexpr(1e-6)
FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _stage(y, R: tl.constexpr, D: tl.constexpr, h: tl.constexpr):
    """One butterfly stage: (u, w) -> (u + w, u - w) for elements j and j + h of each 2h-run."""
    t = tl.permute(tl.reshape(y, (R, D // (2 * h), 2, h)), (0, 1, 3, 2))
    u, w = tl.split(t)
    t = tl.permute(tl.join(u + w, u - w), (0, 1, 3, 2))
    return tl.reshape(t, (R, D))


@triton.jit
def _round_input(y, IN: tl.constexpr):
    """fp32 y rounded to the input dtype (RNE) and read back as fp32."""
    if IN == IN_BF16:
        return (_bf16_bits(y) << 16).to(tl.float32, bitcast=True)
    elif IN == IN_F16:
        return y.to(tl.float16).to(tl.float32)
    else:
        return y


@triton.jit
def _code(t):
    """trunc(clamp(t, 0, 15) + 0.5) as int32 (t not NaN)."""
    c = tl.minimum(tl.maximum(t, 0.0), LEVELS)
    return (c + 0.5).to(tl.int32)


@triton.jit
def _int4_side(src_ptr, dst_ptr, sc_ptr, signs_ptr, tok, write, page, offset, num_heads, s_n, s_h,
               c_sp, c_so, c_sh, sc_sp, sc_so, sc_sh, D: tl.constexpr, LOG_B: tl.constexpr,
               H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr, IN: tl.constexpr):
    """Rotate, quantise and store the [H, D] rows of the tokens in `write` (one side)."""
    R: tl.constexpr = BLOCK_T * H_PAD
    r = tl.arange(0, R)
    t = r // H_PAD
    h = r % H_PAD
    d = tl.arange(0, D_PAD)
    tok_r = tl.reshape(tl.broadcast_to(tok[:, None], (BLOCK_T, H_PAD)), (R,)).to(tl.int64)
    write_r = tl.reshape(tl.broadcast_to(write[:, None], (BLOCK_T, H_PAD)), (R,)) & (h < num_heads)
    page_r = tl.reshape(tl.broadcast_to(page[:, None], (BLOCK_T, H_PAD)), (R,))
    off_r = tl.reshape(tl.broadcast_to(offset[:, None], (BLOCK_T, H_PAD)), (R,))
    h64 = h.to(tl.int64)
    dmask = d < D
    mask = write_r[:, None] & dmask[None, :]
    x = tl.load(src_ptr + (tok_r * s_n + h64 * s_h)[:, None] + d[None, :], mask=mask, other=0.0)
    B: tl.constexpr = 1 << LOG_B
    s = tl.load(signs_ptr + (d % B))
    y = daz(x) * s[None, :]
    for k in tl.static_range(LOG_B):
        y = _stage(y, R, D_PAD, 1 << k)
    y = _round_input(y, IN)
    fin = tl.abs(y) <= FLT_MAX
    valid = dmask[None, :] & fin
    any_fin = tl.sum(valid.to(tl.int32), axis=1) > 0
    mn = tl.where(any_fin, tl.min(tl.where(valid, y, float("inf")), axis=1), 0.0)
    mx = tl.where(any_fin, tl.max(tl.where(valid, y, float("-inf")), axis=1), 0.0)
    scale = tl.maximum(tl.div_rn(mx - mn, tl.zeros_like(mx) + LEVELS), SCALE_FLOOR)
    zp = _code(tl.div_rn(-mn, scale))
    inv = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    q = _code(y * inv[:, None] + zp.to(tl.float32)[:, None])
    q = tl.where(y != y, zp[:, None], q)
    pairs = tl.reshape(q, (R, D_PAD // 2, 2))
    lo, hi = tl.split(pairs)
    packed = (lo | (hi << 4)).to(tl.uint8)
    p = tl.arange(0, D_PAD // 2)
    row = page_r * c_sp + off_r * c_so + h64 * c_sh
    tl.store(dst_ptr + row[:, None] + p[None, :], packed, mask=write_r[:, None] & (p < D // 2)[None, :])
    bits = (scale.to(tl.int32, bitcast=True) & -16) | zp
    tl.store(sc_ptr + page_r * sc_sp + off_r * sc_so + h64 * sc_sh, bits.to(tl.float32, bitcast=True),
             mask=write_r)


@triton.jit
def store_kv_int4_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ksc_ptr, vsc_ptr, ksg_ptr, vsg_ptr, addr, num_heads,
    k_sn, k_sh, v_sn, v_sh, kc_sp, kc_so, kc_sh, vc_sp, vc_so, vc_sh,
    ksc_sp, ksc_so, ksc_sh, vsc_sp, vsc_so, vsc_sh,
    DK: tl.constexpr, DV: tl.constexpr, LOG_BK: tl.constexpr, LOG_BV: tl.constexpr, H_PAD: tl.constexpr,
    DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, IN: tl.constexpr,
    CHECK: tl.constexpr, OP: tl.constexpr, BLOCK_T: tl.constexpr,
):
    tok, page, offset, write = claim_tile(addr, BLOCK_T, CHECK, OP)
    _int4_side(k_ptr, kc_ptr, ksc_ptr, ksg_ptr, tok, write, page, offset, num_heads, k_sn, k_sh,
               kc_sp, kc_so, kc_sh, ksc_sp, ksc_so, ksc_sh, DK, LOG_BK, H_PAD, DK_PAD, BLOCK_T, IN)
    _int4_side(v_ptr, vc_ptr, vsc_ptr, vsg_ptr, tok, write, page, offset, num_heads, v_sn, v_sh,
               vc_sp, vc_so, vc_sh, vsc_sp, vsc_so, vsc_sh, DV, LOG_BV, H_PAD, DV_PAD, BLOCK_T, IN)


_IN = {"float32": 0, "float16": 1, "bfloat16": 2}


def launch(a) -> None:
    """Launch store_kv_int4_kernel for a validated `kvwrite.ops.kv.KVStore` (QUANT_INT4)."""
    from kvwrite import facts
    from kvwrite.kernels._launch import launch as run, loc_args

    n, h, dk = a.k.shape
    dv = a.v.shape[2]
    h_pad, dk_pad, dv_pad = (triton.next_power_of_2(x) for x in (h, dk, dv))
    # about 1K elements a program on a GPU: the butterfly keeps a tile's values live (4K-element
    # tiles need 80-92 registers, 1K stay under 64 with no spill)
    block_t = block_tokens(n, h_pad * max(dk_pad, dv_pad), gpu_elems=1024)
    ksc, vsc = a.k_scale_cache, a.v_scale_cache
    run(store_kv_int4_kernel, (triton.cdiv(n, block_t),), a,
        k_ptr=a.k, v_ptr=a.v, kc_ptr=a.k_cache, vc_ptr=a.v_cache, ksc_ptr=ksc, vsc_ptr=vsc,
        ksg_ptr=facts.int4_rht_signs(dk, a.k.device), vsg_ptr=facts.int4_rht_signs(dv, a.k.device),
        num_heads=h, k_sn=a.k.stride(0), k_sh=a.k.stride(1), v_sn=a.v.stride(0), v_sh=a.v.stride(1),
        kc_sp=a.k_cache.stride(0), kc_so=a.k_cache.stride(1), kc_sh=a.k_cache.stride(2),
        vc_sp=a.v_cache.stride(0), vc_so=a.v_cache.stride(1), vc_sh=a.v_cache.stride(2),
        ksc_sp=ksc.stride(0), ksc_so=ksc.stride(1), ksc_sh=ksc.stride(2),
        vsc_sp=vsc.stride(0), vsc_so=vsc.stride(1), vsc_sh=vsc.stride(2),
        DK=dk, DV=dv, LOG_BK=facts.int4_rht_block(dk).bit_length() - 1,
        LOG_BV=facts.int4_rht_block(dv).bit_length() - 1, H_PAD=h_pad,
        DK_PAD=dk_pad, DV_PAD=dv_pad, IN=_IN[str(a.k.dtype).removeprefix("torch.")],
        BLOCK_T=block_t, enable_fp_fusion=False, **loc_args(a))


def variants():
    """(name, kernel, pointer dtypes, constexprs) of every variant, for compile_check."""
    import torch

    for check in (0, 1, 2):
        for dtype, code in ((torch.float16, 1), (torch.bfloat16, 2)):
            pointers = dict(k_ptr=dtype, v_ptr=dtype, kc_ptr=torch.uint8, vc_ptr=torch.uint8,
                            loc_ptr=torch.int64, ksc_ptr=torch.float32, vsc_ptr=torch.float32,
                            ksg_ptr=torch.float32, vsg_ptr=torch.float32, err_ptr=torch.int64,
                            loc_map_ptr=torch.int32)
            constexprs = dict(DK=128, DV=128, LOG_BK=7, LOG_BV=7, H_PAD=8, DK_PAD=128, DV_PAD=128, IN=code,
                              HAS_MAP=False, HAS_DCP=False, CHECK=check, OP=0, BLOCK_T=1)
            yield f"{str(dtype)[6:]}->int4 c{check}", store_kv_int4_kernel, pointers, constexprs
            if dtype == torch.bfloat16:   # D = 256: a [8, 256] tile (BLOCK_T 1 at 1K elements)
                wide = dict(constexprs, DK=256, DV=256, LOG_BK=8, LOG_BV=8, DK_PAD=256, DV_PAD=256)
                yield f"bfloat16->int4 D256 c{check}", store_kv_int4_kernel, pointers, wide
