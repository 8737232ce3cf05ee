"""MLA row store in NVFP4 (`store_mla(..., kv_cache_dtype="nvfp4")`): the row concat(kv_c, k_pe)
quantised in blocks of 16 (a block may straddle kv_c and k_pe), with SWA/DCP loc resolution.

Program (t, c) owns BLOCK_T tokens and BLOCK_B of the (L + R)/16 blocks of a row. The NVFP4
arithmetic is `kernels/_nvfp4.py`.
"""
import triton
import triton.language as tl

from kvwrite.kernels._common import claim_tile
from kvwrite.kernels._nvfp4 import store_blocks


@triton.jit
def _load_concat(c_ptr, pe_ptr, t64, cols, mask, c_sn, pe_sn, L: tl.constexpr, R: tl.constexpr):
    """fp32 elements `cols` of concat(kv_c, k_pe) for tokens t64 (where `mask`)."""
    in_c = cols < L
    a = tl.load(c_ptr + t64 * c_sn + cols, mask=mask & in_c, other=0.0)
    b = tl.load(pe_ptr + t64 * pe_sn + (cols - L), mask=mask & (in_c == 0) & (cols < L + R), other=0.0)
    return tl.where(in_c, a, b).to(tl.float32)


@triton.jit
def store_mla_nvfp4_kernel(
    c_ptr, pe_ptr, cache_ptr, sc_ptr, g_ptr, addr,
    c_sn, pe_sn, cache_sp, cache_so, sc_sp, sc_so,
    L: tl.constexpr, R: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    CHECK: tl.constexpr, OP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr,
):
    tok, page, offset, write = claim_tile(addr, BLOCK_T, CHECK, OP)
    blocks = (tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    i = tl.arange(0, 8).to(tl.int64)
    mask = write[:, None] & (blocks < (L + R) // 16)[None, :]
    cols = (blocks * 16)[None, :, None] + 2 * i[None, None, :]
    t64 = tok.to(tl.int64)[:, None, None]
    x_even = _load_concat(c_ptr, pe_ptr, t64, cols, mask[:, :, None], c_sn, pe_sn, L, R)
    x_odd = _load_concat(c_ptr, pe_ptr, t64, cols + 1, mask[:, :, None], c_sn, pe_sn, L, R)
    g = tl.load(g_ptr).to(tl.float32) if HAS_GLOBAL else 1.0
    byte_off = (page * cache_sp + offset * cache_so)[:, None, None] + (blocks * 8)[None, :, None] + i[None, None, :]
    scale_off = (page * sc_sp + offset * sc_so)[:, None] + blocks[None, :]
    store_blocks(x_even, x_odd, g, cache_ptr, byte_off, sc_ptr, scale_off, mask, HAS_GLOBAL)


def launch(a) -> None:
    """Launch store_mla_nvfp4_kernel for a validated `kvwrite.ops.mla.StoreMLA` (nvfp4)."""
    import torch

    from kvwrite.kernels._launch import launch as run, loc_args, tiles

    n, lora = a.kv_c.shape
    rope = a.k_pe.shape[1]
    n_blocks = (lora + rope) // 16
    block_t, block_c = tiles(n, lora + rope)
    block_b = max(block_c // 16, 1)
    sc = a.scale_cache.view(torch.uint8)  # e4m3 written as bytes (sm_80 has no e4m3 type)
    g = a.global_scale
    run(store_mla_nvfp4_kernel, (triton.cdiv(n, block_t), triton.cdiv(n_blocks, block_b)), a,
        c_ptr=a.kv_c, pe_ptr=a.k_pe, cache_ptr=a.kv_cache, sc_ptr=sc,
        g_ptr=g if g is not None else a.kv_c,
        c_sn=a.kv_c.stride(0), pe_sn=a.k_pe.stride(0),
        cache_sp=a.kv_cache.stride(0), cache_so=a.kv_cache.stride(1),
        sc_sp=sc.stride(0), sc_so=sc.stride(1),
        L=lora, R=rope, HAS_GLOBAL=g is not None, BLOCK_T=block_t, BLOCK_B=block_b, **loc_args(a))


def variants():
    """(name, kernel, pointer dtypes, constexprs) of every variant, for compile_check:
    DeepSeek's 512 + 64 row, bf16 plain and fp32 with a global scale + SWA + DCP, every check."""
    import torch

    from kvwrite.errors import op_code

    for check in (0, 1, 2):
        for dtype, extras in ((torch.bfloat16, False), (torch.float32, True)):
            pointers = dict(c_ptr=dtype, pe_ptr=dtype, cache_ptr=torch.uint8, sc_ptr=torch.uint8,
                            g_ptr=torch.float32, loc_ptr=torch.int64, err_ptr=torch.int64,
                            loc_map_ptr=torch.int32)
            constexprs = dict(L=512, R=64, HAS_GLOBAL=extras, HAS_MAP=extras, HAS_DCP=extras,
                              CHECK=check, OP=op_code("store_mla"), BLOCK_T=4, BLOCK_B=64)
            name = f"{str(dtype)[6:]}->nvfp4{'+global+map+dcp' if extras else ''}"
            yield name, store_mla_nvfp4_kernel, pointers, constexprs
