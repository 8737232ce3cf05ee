"""Fused paged K+V NVFP4 store (MHA/GQA) with SWA/DCP loc resolution.

One launch quantises and writes K and V: program (t, c) owns BLOCK_T tokens and BLOCK_B of the
flattened [H, D/16] 16-element blocks of a row (K and V alike); NHD and HND are the same kernel
with different cache strides. The NVFP4 arithmetic is `kernels/_nvfp4.py`.
"""
import triton
import triton.language as tl

from kvwrite.kernels._common import claim_tile
from kvwrite.kernels._nvfp4 import store_blocks


@triton.jit
def _store_heads(src_ptr, dst_ptr, sc_ptr, g, tok, write, dst_base, sc_base, blocks, n_blocks,
                 s_n, s_h, d_h, sc_h, D: tl.constexpr, HAS_GLOBAL: tl.constexpr):
    """Blocks `blocks` of the flattened [H, D/16] blocks of the rows of the tokens in `write`:
    source element (t, h, 16j + e) at t*s_n + h*s_h + 16j + e; byte i of block (h, j) at
    dst_base + h*d_h + 8j + i, its scale at sc_base + h*sc_h + j."""
    NB: tl.constexpr = D // 16
    h = (blocks // NB).to(tl.int64)
    j = (blocks % NB).to(tl.int64)
    i = tl.arange(0, 8).to(tl.int64)
    mask = write[:, None] & (blocks < n_blocks)[None, :]
    src = (src_ptr + tok.to(tl.int64)[:, None, None] * s_n + (h * s_h + j * 16)[None, :, None]
           + 2 * i[None, None, :])
    x_even = tl.load(src, mask=mask[:, :, None], other=0.0).to(tl.float32)
    x_odd = tl.load(src + 1, mask=mask[:, :, None], other=0.0).to(tl.float32)
    byte_off = dst_base[:, None, None] + (h * d_h + j * 8)[None, :, None] + i[None, None, :]
    store_blocks(x_even, x_odd, g, dst_ptr, byte_off, sc_ptr, sc_base[:, None] + (h * sc_h + j)[None, :],
                 mask, HAS_GLOBAL)


@triton.jit
def store_kv_nvfp4_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ksc_ptr, vsc_ptr, kg_ptr, vg_ptr, addr, num_heads,
    k_sn, k_sh, v_sn, v_sh,
    kc_sp, kc_so, kc_sh, vc_sp, vc_so, vc_sh,
    ksc_sp, ksc_so, ksc_sh, vsc_sp, vsc_so, vsc_sh,
    DK: tl.constexpr, DV: tl.constexpr, K_GLOBAL: tl.constexpr, V_GLOBAL: tl.constexpr,
    CHECK: tl.constexpr, OP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr,
):
    tok, page, offset, write = claim_tile(addr, BLOCK_T, CHECK, OP)
    blocks = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    kg = tl.load(kg_ptr).to(tl.float32) if K_GLOBAL else 1.0
    vg = tl.load(vg_ptr).to(tl.float32) if V_GLOBAL else 1.0
    _store_heads(k_ptr, kc_ptr, ksc_ptr, kg, tok, write, page * kc_sp + offset * kc_so,
                 page * ksc_sp + offset * ksc_so, blocks, num_heads * (DK // 16),
                 k_sn, k_sh, kc_sh, ksc_sh, DK, K_GLOBAL)
    _store_heads(v_ptr, vc_ptr, vsc_ptr, vg, tok, write, page * vc_sp + offset * vc_so,
                 page * vsc_sp + offset * vsc_so, blocks, num_heads * (DV // 16),
                 v_sn, v_sh, vc_sh, vsc_sh, DV, V_GLOBAL)


def launch(a) -> None:
    """Launch store_kv_nvfp4_kernel for a validated `kvwrite.ops.nvfp4.StoreKVNVFP4`."""
    import torch

    from kvwrite.kernels._launch import launch as run, loc_args, tiles

    n, h, dk = a.k.shape
    dv = a.v.shape[2]
    n_blocks = h * max(dk, dv) // 16
    block_t, block_c = tiles(n, n_blocks * 16)
    block_b = max(block_c // 16, 1)
    grid = (triton.cdiv(n, block_t), triton.cdiv(n_blocks, block_b))
    # e4m3 scales are written as bytes: also valid on sm_80, which has no e4m3 type
    ksc, vsc = a.k_scale_cache.view(torch.uint8), a.v_scale_cache.view(torch.uint8)
    kc, vc = a.k_cache, a.v_cache
    kg, vg = a.k_global_scale, a.v_global_scale
    run(store_kv_nvfp4_kernel, grid, a,
        k_ptr=a.k, v_ptr=a.v, kc_ptr=kc, vc_ptr=vc, ksc_ptr=ksc, vsc_ptr=vsc,
        kg_ptr=kg if kg is not None else a.k, vg_ptr=vg if vg is not None else a.v,
        num_heads=h, k_sn=a.k.stride(0), k_sh=a.k.stride(1), v_sn=a.v.stride(0),
        v_sh=a.v.stride(1), kc_sp=kc.stride(0), kc_so=kc.stride(1), kc_sh=kc.stride(2),
        vc_sp=vc.stride(0), vc_so=vc.stride(1), vc_sh=vc.stride(2),
        ksc_sp=ksc.stride(0), ksc_so=ksc.stride(1), ksc_sh=ksc.stride(2),
        vsc_sp=vsc.stride(0), vsc_so=vsc.stride(1), vsc_sh=vsc.stride(2),
        DK=dk, DV=dv, K_GLOBAL=kg is not None, V_GLOBAL=vg is not None,
        BLOCK_T=block_t, BLOCK_B=block_b, **loc_args(a))


def variants():
    """(name, kernel, pointer dtypes, constexprs) of every variant, for compile_check: bf16 and
    fp16 plain, fp32 with global scales + SWA + DCP, each check mode; head dims 128 (K), 64 (V)."""
    import torch

    from kvwrite.errors import op_code

    for check in (0, 1, 2):
        for dtype, extras in ((torch.bfloat16, False), (torch.float16, False), (torch.float32, True)):
            pointers = dict(k_ptr=dtype, v_ptr=dtype, kc_ptr=torch.uint8, vc_ptr=torch.uint8,
                            ksc_ptr=torch.uint8, vsc_ptr=torch.uint8, kg_ptr=torch.float32,
                            vg_ptr=torch.float32, loc_ptr=torch.int64, err_ptr=torch.int64,
                            loc_map_ptr=torch.int32)
            constexprs = dict(DK=128, DV=64, K_GLOBAL=extras, V_GLOBAL=extras, HAS_MAP=extras,
                              HAS_DCP=extras, CHECK=check, OP=op_code("store_kv_nvfp4"),
                              BLOCK_T=4, BLOCK_B=32)
            name = f"{str(dtype)[6:]}->nvfp4{'+global+map+dcp' if extras else ''}"
            yield name, store_kv_nvfp4_kernel, pointers, constexprs
