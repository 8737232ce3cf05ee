"""DSA indexer-K store: per-block e4m3 quantisation into the page-major indexer cache.

Program (t, b) owns BLOCK_T tokens and quant block b: it writes the block's e4m3 bytes and its
fp32 scale (layout in `kvwrite.reference.indexer_k`). The indexer cache is addressed by the virtual loc
(optional SWA loc_map, no DCP sharding).
"""
import triton
import triton.language as tl

from kvwrite.kernels._common import claim_tile, finite_abs, fp8_quant, store_le_bytes
from kvwrite import facts as _ik

_AMAX_FLOOR = tl.constexpr(_ik.AMAX_FLOOR)


@triton.jit
def store_indexer_k_kernel(
    k_ptr, cache_ptr, addr,
    k_sn, cache_sp, page_data_bytes,
    D: tl.constexpr, QBS: tl.constexpr, BLOCK_Q: tl.constexpr, UE8M0: tl.constexpr,
    CHECK: tl.constexpr, OP: tl.constexpr, BLOCK_T: tl.constexpr,
):
    tok, page, offset, write = claim_tile(addr, BLOCK_T, CHECK, OP)
    blk = tl.program_id(1)
    page_base = page * cache_sp
    q = tl.arange(0, BLOCK_Q)
    cols = blk * QBS + q
    mask = write[:, None] & (q < QBS)[None, :]
    x = tl.load(k_ptr + tok.to(tl.int64)[:, None] * k_sn + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    scale = tl.div_rn(tl.maximum(tl.max(finite_abs(x), axis=1), _AMAX_FLOOR), 448.0)
    if UE8M0:  # round up to a power of two: carry any mantissa bit into the exponent
        bits = tl.minimum(scale.to(tl.int32, bitcast=True), 0x7F800000)  # scale > 0: no overflow
        scale = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    code = fp8_quant(x, scale[:, None], 448.0, 3, -6)
    tl.store(cache_ptr + (page_base + offset * D)[:, None] + cols[None, :], code.to(tl.uint8),
             mask=mask)
    scale_addr = page_base + page_data_bytes + (offset * (D // QBS) + blk) * 4
    store_le_bytes(cache_ptr, scale_addr, scale.to(tl.int32, bitcast=True), write, 4)


def launch(a) -> None:
    """Launch store_indexer_k_kernel for a validated `kvwrite.ops.indexer_k.StoreIndexerK`."""
    from kvwrite.kernels._launch import launch as run, loc_args, tiles

    n, d = a.k.shape
    qbs = a.quant_block_size
    block_t, block_q = tiles(n, qbs)
    run(store_indexer_k_kernel, (triton.cdiv(n, block_t), d // qbs), a,
        k_ptr=a.k, cache_ptr=a.cache, k_sn=a.k.stride(0), cache_sp=a.cache.stride(0),
        page_data_bytes=a.geometry.pool_page_size * d,
        D=d, QBS=qbs, BLOCK_Q=triton.next_power_of_2(qbs), UE8M0=a.ue8m0,
        BLOCK_T=block_t, **loc_args(a))


def variants():
    """(name, kernel, pointer dtypes, constexprs) of every variant, for compile_check."""
    import torch

    from kvwrite.errors import op_code

    cases = ((torch.bfloat16, False, False), (torch.float32, True, True), (torch.float16, True, False))
    for check in (0, 1, 2):
        for dtype, ue8m0, has_map in cases:
            pointers = dict(k_ptr=dtype, cache_ptr=torch.uint8, loc_ptr=torch.int64,
                            err_ptr=torch.int64, loc_map_ptr=torch.int32)
            constexprs = dict(D=128, QBS=128, BLOCK_Q=128, UE8M0=ue8m0, HAS_MAP=has_map,
                              HAS_DCP=False, CHECK=check, OP=op_code("store_indexer_k"), BLOCK_T=32)
            name = f"{str(dtype)[6:]}{'+ue8m0' if ue8m0 else ''}{'+map' if has_map else ''}"
            yield name, store_indexer_k_kernel, pointers, constexprs
