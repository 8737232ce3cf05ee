"""DeepSeek V4 stores: FlashMLA MODEL1 KV pages, MXFP4 indexer rows, compress-state rows.

Formats in `kvwrite.reference.dsv4`. store_dsv4_kv: program (t, w) owns BLOCK_T tokens and work item w
of their rows: w < 7 is NoPE tile w (64 e4m3 bytes + its ue8m0 byte), w == 7 the 64 bf16 RoPE
values. MXFP4 indexer: program (t, b) owns 32-value block b. store_rows: program (t, c) copies
column tile c of the rows. Every quantised byte is built by bit arithmetic (fp8_bits, e2m1_code),
divisions by `tl.div_rn`: bit-identical to the reference on every backend.
"""
import triton
import triton.language as tl

from kvwrite.kernels._common import claim_tile, daz, finite_abs, fp8_quant, store_le_bytes
from kvwrite.kernels._nvfp4 import e2m1_code
from kvwrite.kernels.store_mla import _bf16_bits
from kvwrite import facts as _d

_NOPE = tl.constexpr(_d.NOPE)
_TILE = tl.constexpr(_d.TILE)
_TILES = tl.constexpr(_d.TILES)
_DATA_ROW = tl.constexpr(_d.DATA_ROW)
_SCALE_ROW = tl.constexpr(_d.SCALE_ROW)
_FLOOR = tl.constexpr(_d.AMAX_FLOOR)
_MX = tl.constexpr(_d.MXFP4_BLOCK)


@triton.jit
def _ue8m0_bits(amax, FMAX: tl.constexpr):
    """fp32 bits of max(amax, 1e-4) / FMAX rounded up to a power of two."""
    s = tl.div_rn(tl.maximum(amax, _FLOOR), FMAX)
    # s > 0; capped at +inf's bits so the int32 add cannot overflow (debug builds check it)
    return (tl.minimum(s.to(tl.int32, bitcast=True), 0x7F800000) + 0x7FFFFF) & 0x7F800000


@triton.jit
def store_dsv4_kv_kernel(
    kv_ptr, cache_ptr, addr, kv_sn, cache_sp,
    CHECK: tl.constexpr, OP: tl.constexpr, BLOCK_T: tl.constexpr,
):
    tok, page, offset, write = claim_tile(addr, BLOCK_T, CHECK, OP)
    w = tl.program_id(1)
    page_base = page * cache_sp
    row_base = page_base + offset * _DATA_ROW
    q = tl.arange(0, _TILE)
    cols = w * _TILE + q
    mask = write[:, None]
    x = tl.load(kv_ptr + tok.to(tl.int64)[:, None] * kv_sn + cols[None, :], mask=mask, other=0.0)
    if w < _TILES:
        xf = x.to(tl.float32)
        bits = _ue8m0_bits(tl.max(finite_abs(xf), axis=1), 448.0)   # special values: README
        code = fp8_quant(xf, bits.to(tl.float32, bitcast=True)[:, None], 448.0, 3, -6)
        tl.store(cache_ptr + row_base[:, None] + cols[None, :], code.to(tl.uint8), mask=mask)
        scale_addr = page_base + addr.page_size * _DATA_ROW + offset * _SCALE_ROW + w
        tl.store(cache_ptr + scale_addr, ((bits >> 23) & 0xFF).to(tl.uint8), mask=write)
    else:
        rope_at = row_base[:, None] + _NOPE + 2 * q[None, :]
        store_le_bytes(cache_ptr, rope_at, _bf16_bits(x), mask, 2)


@triton.jit
def store_dsv4_mxfp4_kernel(
    k_ptr, cache_ptr, addr, k_sn, cache_sp,
    D: tl.constexpr, CHECK: tl.constexpr, OP: tl.constexpr, BLOCK_T: tl.constexpr,
):
    tok, page, offset, write = claim_tile(addr, BLOCK_T, CHECK, OP)
    b = tl.program_id(1)
    page_base = page * cache_sp
    j = tl.arange(0, _MX // 2)
    mask = write[:, None]
    src = k_ptr + tok.to(tl.int64)[:, None] * k_sn + (b * _MX + 2 * j)[None, :]
    xe = daz(tl.load(src, mask=mask, other=0.0))
    xo = daz(tl.load(src + 1, mask=mask, other=0.0))
    amax = tl.maximum(tl.max(finite_abs(xe), axis=1), tl.max(finite_abs(xo), axis=1))
    bits = _ue8m0_bits(amax, 6.0)
    s = bits.to(tl.float32, bitcast=True)[:, None]
    lo = tl.where(xe != xe, 0, e2m1_code(tl.div_rn(xe, s)))   # NaN: code 0, the block's scale NaN
    hi = tl.where(xo != xo, 0, e2m1_code(tl.div_rn(xo, s)))
    packed = lo | (hi << 4)
    nan = tl.max(((xe != xe) | (xo != xo)).to(tl.int32), axis=1) != 0
    bits = tl.where(nan, 0x7F800000, bits)
    dst = page_base + offset * (D // 2) + b * (_MX // 2)
    tl.store(cache_ptr + dst[:, None] + j[None, :], packed.to(tl.uint8), mask=mask)
    scale_addr = page_base + addr.page_size * (D // 2) + offset * (D // _MX) + b
    tl.store(cache_ptr + scale_addr, ((bits >> 23) & 0xFF).to(tl.uint8), mask=write)


@triton.jit
def store_rows_kernel(
    src_ptr, pool_ptr, addr, src_sn, pool_sr, W,
    CHECK: tl.constexpr, OP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    tok, page, offset, write = claim_tile(addr, BLOCK_T, CHECK, OP)
    row = page * addr.page_size + offset
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = write[:, None] & (cols < W)[None, :]
    x = tl.load(src_ptr + tok.to(tl.int64)[:, None] * src_sn + cols[None, :], mask=mask)
    tl.store(pool_ptr + (row * pool_sr)[:, None] + cols[None, :], x, mask=mask)


def launch_kv(a) -> None:
    """Launch store_dsv4_kv_kernel for a validated `kvwrite.ops.dsv4.StoreDSV4KV`."""
    from kvwrite.kernels._launch import launch as run, loc_args, tiles

    n = a.kv.shape[0]
    block_t, _ = tiles(n, _d.TILE)
    run(store_dsv4_kv_kernel, (triton.cdiv(n, block_t), _d.TILES + 1), a,
        kv_ptr=a.kv, cache_ptr=a.cache, kv_sn=a.kv.stride(0), cache_sp=a.cache.stride(0),
        BLOCK_T=block_t, **loc_args(a))


def launch_indexer_mxfp4(a) -> None:
    """Launch store_dsv4_mxfp4_kernel for a validated mxfp4 `StoreDSV4IndexerK`."""
    from kvwrite.kernels._launch import launch as run, loc_args, tiles

    n, d = a.k.shape
    block_t, _ = tiles(n, _d.MXFP4_BLOCK)
    run(store_dsv4_mxfp4_kernel, (triton.cdiv(n, block_t), d // _d.MXFP4_BLOCK), a,
        k_ptr=a.k, cache_ptr=a.cache, k_sn=a.k.stride(0), cache_sp=a.cache.stride(0),
        D=d, BLOCK_T=block_t, **loc_args(a))


def launch_rows(a) -> None:
    """Launch store_rows_kernel for a validated `kvwrite.ops.dsv4.StoreRows`."""
    from kvwrite.kernels._launch import launch as run, loc_args, tiles

    n, w = a.src.shape
    block_t, block_c = tiles(n, w)
    run(store_rows_kernel, (triton.cdiv(n, block_t), triton.cdiv(max(w, 1), block_c)), a,
        src_ptr=a.src, pool_ptr=a.pool, src_sn=a.src.stride(0), pool_sr=a.pool.stride(0), W=w,
        BLOCK_T=block_t, BLOCK_C=block_c, **loc_args(a))


def variants():
    """(name, kernel, pointer dtypes, constexprs) of every variant, for compile_check."""
    import torch

    from kvwrite.errors import op_code

    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    for check in (0, 1, 2):
        for dtype, map_, dcp in ((bf16, False, False), (f32, True, True), (f16, False, True)):
            tag = f"{str(dtype)[6:]}{'+map' if map_ else ''}{'+dcp_page' if dcp else ''}"
            common = dict(HAS_MAP=map_, HAS_DCP=2 if dcp else 0, CHECK=check)
            ptr = dict(cache_ptr=torch.uint8, loc_ptr=torch.int64, err_ptr=torch.int64,
                       loc_map_ptr=torch.int32)
            yield (f"kv:{tag}", store_dsv4_kv_kernel, dict(kv_ptr=dtype, **ptr),
                   dict(common, OP=op_code("store_dsv4_kv"), BLOCK_T=32))
            yield (f"mxfp4:{tag}", store_dsv4_mxfp4_kernel, dict(k_ptr=dtype, **ptr),
                   dict(common, D=128, OP=op_code("store_dsv4_indexer_k"), BLOCK_T=64))
            yield (f"rows:{tag}", store_rows_kernel,
                   dict(src_ptr=dtype, pool_ptr=dtype, loc_ptr=torch.int64, err_ptr=torch.int64,
                        loc_map_ptr=torch.int32),
                   dict(common, OP=op_code("store_rows"), BLOCK_T=4, BLOCK_C=1024))
