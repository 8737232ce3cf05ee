"""DeepSeek V4 FP4 KV records (`store_dsv4_kv_fp4`; formats in `kvwrite.reference.dsv4_fp4`).

A program owns BLOCK_T tokens and every block of their rows: the quantised values as [T, NBP,
BLOCK/2] tensors of even and odd elements (NBP: the record's block count rounded up to a power
of two, masked), then the bf16 RoPE values. e4m3 blocks: amax / 6 (floored for nvfp4_v41) by
`tl.div_rn`, `fp8_bits`, codes by `_nvfp4`'s helpers; ue8m0 blocks: the scale byte from amax's
bits (the reference's rule), codes of x / 2**n. Bit-identical to the reference on every backend.
"""
import triton
import triton.language as tl

from kvwrite.kernels._common import claim, claim_rows, daz, end_call, finite_abs, fp8_bits, store_le_bytes
from kvwrite.kernels._nvfp4 import _element_codes, e2m1_code, e4m3_value
from kvwrite.kernels.rope_store import _bits, _in_code, _positions, _rope_vals, _rotate_q
from kvwrite.kernels.store_mla import _bf16_bits

_MX_MANT_HALF = tl.constexpr(0x7C3B7)   # kvwrite.reference.dsv4_fp4.MX_MANT_HALF


@triton.jit
def _store_blocks(kv_ptr, cache_ptr, tok, write, row_base, scale_base, kv_sn,
                  QUANT: tl.constexpr, BLOCK: tl.constexpr, NBP: tl.constexpr, UE8M0: tl.constexpr,
                  FLOOR: tl.constexpr):
    """Quantise and store every block of the tokens' rows (scales at `scale_base`)."""
    b = tl.arange(0, NBP)
    j = tl.arange(0, BLOCK // 2)
    bmask = write[:, None] & (b < QUANT // BLOCK)[None, :]
    mask = bmask[:, :, None]
    src = kv_ptr + tok.to(tl.int64)[:, None, None] * kv_sn + (b[:, None] * BLOCK + 2 * j[None, :])[None, :, :]
    xe = daz(tl.load(src, mask=mask, other=0.0))
    xo = daz(tl.load(src + 1, mask=mask, other=0.0))
    amax = tl.maximum(tl.max(finite_abs(xe), axis=2), tl.max(finite_abs(xo), axis=2))
    nan = (tl.max((xe != xe).to(tl.int32), axis=2) + tl.max((xo != xo).to(tl.int32), axis=2)) > 0
    if UE8M0:
        bits = amax.to(tl.int32, bitcast=True)
        byte = ((bits >> 23) & 0xFF) - 3 + ((bits & 0x7FFFFF) >= _MX_MANT_HALF).to(tl.int32)
        byte = tl.minimum(tl.maximum(byte, 0), 255)
        d = tl.where(byte == 0, 0x00400000, byte << 23).to(tl.float32, bitcast=True)[:, :, None]
        lo = tl.where(xe != xe, 0, e2m1_code(tl.div_rn(xe, tl.broadcast_to(d, xe.shape))))
        hi = tl.where(xo != xo, 0, e2m1_code(tl.div_rn(xo, tl.broadcast_to(d, xo.shape))))
        scale = tl.where(nan, 0xFF, byte)
    else:
        s = tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
        if FLOOR > 0:
            s = tl.maximum(s, FLOOR)
        code = fp8_bits(s, 448.0, 3, -6)
        d = tl.broadcast_to(e4m3_value(code)[:, :, None], xe.shape)
        zero = d == 0   # an all-zero block: each element its sign alone
        d = tl.where(zero, 1.0, d)
        lo = _element_codes(xe, d, zero)
        hi = _element_codes(xo, d, zero)
        scale = tl.where(nan, 0x7F, code)
    dst = row_base[:, None, None] + (b[:, None] * (BLOCK // 2) + j[None, :])[None, :, :]
    tl.store(cache_ptr + dst, (lo | (hi << 4)).to(tl.uint8), mask=mask)
    tl.store(cache_ptr + scale_base[:, None] + b[None, :], scale.to(tl.uint8), mask=bmask)


@triton.jit
def _bases(page, offset, cache_sp, pool_page_size, QUANT: tl.constexpr, DATA_ROW: tl.constexpr,
           SCALE_ROW: tl.constexpr, INLINE: tl.constexpr):
    """(row base, scale base) byte offsets of the tokens' records."""
    page_base = page * cache_sp
    row_base = page_base + offset * DATA_ROW
    if INLINE:
        return row_base, row_base + QUANT // 2
    return row_base, page_base + pool_page_size * DATA_ROW + offset * SCALE_ROW


@triton.jit
def store_dsv4_fp4_kernel(
    kv_ptr, cache_ptr, addr, kv_sn, cache_sp,
    QUANT: tl.constexpr, BLOCK: tl.constexpr, NBP: tl.constexpr, UE8M0: tl.constexpr,
    FLOOR: tl.constexpr, ROPE: tl.constexpr, DATA_ROW: tl.constexpr, SCALE_ROW: tl.constexpr,
    INLINE: tl.constexpr, ROPE_AT: tl.constexpr,
    CHECK: tl.constexpr, OP: tl.constexpr, BLOCK_T: tl.constexpr,
    pos_ptr=None, kv16_ptr=None, cs_ptr=None, q_ptr=None, max_pos=0, cs_sn=0, q_sn=0, q_sh=0,
    n_q_heads=0, IN: tl.constexpr = 0, CS_IN: tl.constexpr = 0, FUSED_ROPE: tl.constexpr = False,
):
    """The store; FUSED_ROPE (rope_store_dsv4_kv_fp4): the RoPE part rotated first (`_rope_vals`:
    GPT-J pairs, rounded to the input dtype) and q's heads rotated in place (`_rotate_q`); bad
    positions are bad tokens."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    if FUSED_ROPE:
        pos, pos_ok = _positions(pos_ptr, tok, tok < addr.n_tokens, max_pos)
        page, offset, write = claim(addr, tok, CHECK, OP, True, pos_ok, pos, max_pos)
    else:
        page, offset, write = claim_rows(addr, tok, CHECK, OP, True)
    row_base, scale_base = _bases(page, offset, cache_sp, addr.page_size, QUANT, DATA_ROW, SCALE_ROW, INLINE)
    _store_blocks(kv_ptr, cache_ptr, tok, write, row_base, scale_base, kv_sn, QUANT, BLOCK, NBP, UE8M0, FLOOR)
    if ROPE > 0:
        r = tl.arange(0, ROPE)[None, :]
        rmask = write[:, None]
        if FUSED_ROPE:
            val, _ = _rope_vals(kv16_ptr, (tok.to(tl.int64) * kv_sn + QUANT)[:, None], r, rmask, cs_ptr,
                                (pos * cs_sn)[:, None], 1.0, kv16_ptr, ROPE, False, False, IN, CS_IN)
        else:
            val = tl.load(kv_ptr + tok.to(tl.int64)[:, None] * kv_sn + QUANT + r, mask=rmask, other=0.0)
        store_le_bytes(cache_ptr, row_base[:, None] + ROPE_AT + 2 * r, _bf16_bits(val), rmask, 2)
    if FUSED_ROPE:
        for h in range(n_q_heads):
            _rotate_q(q_ptr, h, tok, pos_ok, pos, cs_ptr, cs_sn, q_ptr, 0.0, q_sn, q_sh, ROPE, ROPE, False,
                      False, IN, CS_IN, ROPE, 0)
        end_call(addr.errors, CHECK)  # guard: every program counts itself in the record's call


def record_constexprs(rec) -> dict:
    """The kernel's format constexprs of a `kvwrite.facts.FP4Record`."""
    return dict(QUANT=rec.quant, BLOCK=rec.block, NBP=triton.next_power_of_2(rec.blocks),
                UE8M0=rec.scale == "ue8m0", FLOOR=rec.floor, ROPE=rec.rope, DATA_ROW=rec.data_row,
                SCALE_ROW=rec.scale_row, INLINE=rec.inline, ROPE_AT=rec.rope_at)


def launch(a) -> None:
    """Launch store_dsv4_fp4_kernel for a validated `kvwrite.ops.dsv4_fp4.StoreDSV4KVFP4`."""
    from kvwrite.kernels._launch import launch as run, loc_args, tiles

    n = a.kv.shape[0]
    block_t, _ = tiles(n, 512)
    run(store_dsv4_fp4_kernel, (triton.cdiv(n, block_t),), a, kv_ptr=a.kv, cache_ptr=a.cache,
        kv_sn=a.kv.stride(0), cache_sp=a.cache.stride(0), BLOCK_T=block_t,
        **record_constexprs(a.record), **loc_args(a))


def launch_rope(a) -> None:
    """Launch store_dsv4_fp4_kernel (FUSED_ROPE) for a validated `kvwrite.ops.dsv4_fp4.RopeStoreDSV4KVFP4`."""
    from kvwrite.kernels._launch import launch as run, loc_args, tiles
    from kvwrite.kernels.rope_store import check_with_positions

    s = a.store
    n = s.kv.shape[0]
    block_t, _ = tiles(n, 512)
    q = a.q if a.q is not None else s.kv.new_empty((n, 0, s.record.rope))
    # fp fusion off: the rotation rounds each product (kvwrite.reference.rope)
    run(store_dsv4_fp4_kernel, (triton.cdiv(n, block_t),), a, lambda: check_with_positions(a),
        pos_ptr=a.positions, kv_ptr=s.kv, kv16_ptr=_bits(s.kv), cs_ptr=_bits(a.cos_sin), q_ptr=_bits(q),
        cache_ptr=s.cache, max_pos=a.cos_sin.shape[0], kv_sn=s.kv.stride(0), cs_sn=a.cos_sin.stride(0),
        q_sn=q.stride(0), q_sh=q.stride(1), n_q_heads=q.shape[1], cache_sp=s.cache.stride(0),
        IN=_in_code(s.kv.dtype), CS_IN=_in_code(a.cos_sin.dtype), BLOCK_T=block_t,
        FUSED_ROPE=True, enable_fp_fusion=False, **record_constexprs(s.record), **loc_args(s))


def variants():
    """(name, kernel, pointer dtypes, constexprs) of every variant, for compile_check."""
    import torch

    from kvwrite.errors import op_code
    from kvwrite.facts import FP4_RECORDS

    for check in (0, 1, 2):
        for fmt, rec in FP4_RECORDS.items():
            for dtype, map_, dcp in ((torch.bfloat16, False, False), (torch.float32, True, True)):
                tag = f"{fmt}:{str(dtype)[6:]}{'+map' if map_ else ''}{'+dcp_page' if dcp else ''}"
                yield (tag, store_dsv4_fp4_kernel,
                       dict(kv_ptr=dtype, cache_ptr=torch.uint8, loc_ptr=torch.int64, err_ptr=torch.int64,
                            loc_map_ptr=torch.int32),
                       dict(record_constexprs(rec), HAS_MAP=map_, HAS_DCP=2 if dcp else 0, CHECK=check,
                            OP=op_code("store_dsv4_kv_fp4"), BLOCK_T=8))
                if not rec.rope:
                    continue
                bits = torch.int16 if dtype == torch.bfloat16 else dtype
                yield (f"rope:{tag}", store_dsv4_fp4_kernel,
                       dict(pos_ptr=torch.int64, kv_ptr=dtype, kv16_ptr=bits, cs_ptr=torch.float32, q_ptr=bits,
                            cache_ptr=torch.uint8, loc_ptr=torch.int64, err_ptr=torch.int64,
                            loc_map_ptr=torch.int32),
                       dict(record_constexprs(rec), IN=_in_code(dtype), CS_IN=0, HAS_MAP=map_,
                            HAS_DCP=2 if dcp else 0, CHECK=check, OP=op_code("rope_store_dsv4_kv_fp4"), BLOCK_T=8,
                            FUSED_ROPE=True))
