"""Fused paged K+V store (MHA/GQA), optionally fp8-quantised, with SWA/DCP loc resolution.

One launch writes K and V. Program (t, c) owns BLOCK_T tokens and column tile c of the
flattened [H * D] row; NHD and HND are the same kernel with different cache strides. vLLM's
legacy head-major layout is a split head-dim stride: feature d sits at (d // X) * x_stride +
d % X (X = the KX / VX constexpr, 0 = an unsplit row; `kvwrite.ops.kv_head_major`).
"""
import triton
import triton.language as tl

from kvwrite.kernels._common import claim_tile, fp8_quant


@triton.jit
def _store_rows(src_ptr, dst_ptr, scale_ptr, tok, write, row_base, cols, ncols,
                s_n, s_h, d_h, scale_h, d_x, D: tl.constexpr, QUANT: tl.constexpr,
                FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, X: tl.constexpr):
    """Copy (or saturate-quantise) columns `cols` of the tokens in `write` to their rows."""
    cmask = cols < ncols
    h = (cols // D).to(tl.int64)
    d = cols % D
    mask = write[:, None] & cmask[None, :]
    x = tl.load(src_ptr + tok.to(tl.int64)[:, None] * s_n + (h * s_h + d)[None, :], mask=mask)
    if QUANT:
        scale = tl.load(scale_ptr + h * scale_h, mask=cmask, other=1.0)
        x = fp8_quant(x, scale[None, :], FMAX, MANT, EMIN)  # exact division, as torch
    if X == 0:
        feat = d.to(tl.int64)
    else:  # split head dim (vLLM's legacy key [.., D/X, block, X], value [.., D, block])
        feat = (d // X).to(tl.int64) * d_x + d % X
    tl.store(dst_ptr + row_base[:, None] + (h * d_h + feat)[None, :],
             x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, addr, num_heads,
    k_sn, k_sh, v_sn, v_sh,
    kc_sp, kc_so, kc_sh, vc_sp, vc_so, vc_sh, ks_sh, vs_sh,
    DK: tl.constexpr, DV: tl.constexpr, QUANT: tl.constexpr, FMAX: tl.constexpr,
    MANT: tl.constexpr, EMIN: tl.constexpr,
    CHECK: tl.constexpr, OP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    kc_sx=0, vc_sx=0, KX: tl.constexpr = 0, VX: tl.constexpr = 0,
):
    tok, page, offset, write = claim_tile(addr, BLOCK_T, CHECK, OP)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    _store_rows(k_ptr, kc_ptr, ks_ptr, tok, write, page * kc_sp + offset * kc_so, cols,
                num_heads * DK, k_sn, k_sh, kc_sh, ks_sh, kc_sx, DK, QUANT, FMAX, MANT, EMIN, KX)
    _store_rows(v_ptr, vc_ptr, vs_ptr, tok, write, page * vc_sp + offset * vc_so, cols,
                num_heads * DV, v_sn, v_sh, vc_sh, vs_sh, vc_sx, DV, QUANT, FMAX, MANT, EMIN, VX)


def launch(a) -> None:
    """Launch store_kv_kernel for a validated `kvwrite.ops.kv.KVStore`."""
    import torch

    from kvwrite.validate import FP8_MAX
    from kvwrite.kernels._launch import fp8_constexprs, launch as run, loc_args, tiles

    n, h, dk = a.k.shape
    dv = a.v.shape[2]
    block_t, block_c = tiles(n, h * max(dk, dv))
    grid = (triton.cdiv(n, block_t), triton.cdiv(h * max(dk, dv), block_c))
    quant = a.k_cache.dtype in FP8_MAX
    ks = a.k_scale if quant else a.k
    vs = a.v_scale if quant else a.v
    # fp8 caches are written as bytes (fp8_bits): also valid on sm_80, which has no e4m3 type
    kc, vc = (a.k_cache.view(torch.uint8), a.v_cache.view(torch.uint8)) if quant else (a.k_cache, a.v_cache)
    run(store_kv_kernel, grid, a,
        k_ptr=a.k, v_ptr=a.v, kc_ptr=kc, vc_ptr=vc, ks_ptr=ks, vs_ptr=vs,
        num_heads=h, k_sn=a.k.stride(0), k_sh=a.k.stride(1), v_sn=a.v.stride(0),
        v_sh=a.v.stride(1), kc_sp=kc.stride(0), kc_so=kc.stride(1), kc_sh=kc.stride(2),
        vc_sp=vc.stride(0), vc_so=vc.stride(1), vc_sh=vc.stride(2),
        ks_sh=1 if quant and ks.numel() > 1 else 0, vs_sh=1 if quant and vs.numel() > 1 else 0,
        **_split_args(kc, vc),
        DK=dk, DV=dv, QUANT=quant, **fp8_constexprs(a.k_cache.dtype),
        BLOCK_T=block_t, BLOCK_C=block_c, **loc_args(a))


def _split_args(kc, vc) -> dict:
    """The split head-dim strides of canonical 5-D [pages, rows, H, D / X, X] caches (vLLM's
    legacy head-major layout; the key of its CPU attention layout); nothing for a 4-D
    [pages, rows, H, D] cache."""
    args = {}
    if kc.dim() == 5:
        args.update(kc_sx=kc.stride(3), KX=kc.shape[4])
    if vc.dim() == 5:
        args.update(vc_sx=vc.stride(3), VX=vc.shape[4])
    return args


def variants():
    """(name, kernel, pointer dtypes, constexprs) of every variant, for compile_check."""
    import torch

    from kvwrite.kernels._launch import fp8_constexprs
    from kvwrite.validate import FP8_MAX

    for check in (0, 1, 2):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for cache in (dtype, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz):
                for has_map, has_dcp in ((False, False),) + (((True, True),) if cache == dtype else ()):
                    quant = cache in FP8_MAX
                    store = torch.uint8 if quant else cache
                    pointers = dict(k_ptr=dtype, v_ptr=dtype, kc_ptr=store, vc_ptr=store,
                                    loc_ptr=torch.int64, ks_ptr=torch.float32 if quant else dtype,
                                    vs_ptr=torch.float32 if quant else dtype,
                                    err_ptr=torch.int64, loc_map_ptr=torch.int32)
                    constexprs = dict(DK=128, DV=128, QUANT=quant, **fp8_constexprs(cache),
                                      HAS_MAP=has_map, HAS_DCP=has_dcp, CHECK=check, OP=0,
                                      BLOCK_T=4, BLOCK_C=1024)
                    name = f"{str(dtype)[6:]}->{str(cache)[6:]}{'+map+dcp' if has_map else ''}"
                    yield name, store_kv_kernel, pointers, constexprs
        # page-table addressing (kvwrite.PageTable): int32 tables, as FlashInfer's
        for dtype, cache in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float8_e4m3fn)):
            quant = cache in FP8_MAX
            store = torch.uint8 if quant else cache
            pointers = dict(k_ptr=dtype, v_ptr=dtype, kc_ptr=store, vc_ptr=store, loc_ptr=torch.int32,
                            ks_ptr=torch.float32 if quant else dtype, vs_ptr=torch.float32 if quant else dtype,
                            err_ptr=torch.int64)
            constexprs = dict(DK=128, DV=128, QUANT=quant, **fp8_constexprs(cache), HAS_MAP=False,
                              HAS_DCP=False, CHECK=check, OP=0, BLOCK_T=4, BLOCK_C=1024, HAS_TABLE=True)
            yield f"{str(dtype)[6:]}->{str(cache)[6:]}+table", store_kv_kernel, pointers, constexprs
        # vLLM's legacy head-major layout: key split by x = 16 bytes / element, value by 1
        for dtype, cache in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float8_e4m3fn)):
            quant = cache in FP8_MAX
            store = torch.uint8 if quant else cache
            pointers = dict(k_ptr=dtype, v_ptr=dtype, kc_ptr=store, vc_ptr=store, loc_ptr=torch.int64,
                            ks_ptr=torch.float32 if quant else dtype, vs_ptr=torch.float32 if quant else dtype,
                            err_ptr=torch.int64, loc_map_ptr=torch.int32)
            constexprs = dict(DK=128, DV=128, QUANT=quant, **fp8_constexprs(cache), HAS_MAP=False,
                              HAS_DCP=False, CHECK=check, OP=0, BLOCK_T=4, BLOCK_C=1024,
                              KX=16 // torch.empty((), dtype=cache).element_size(), VX=1)
            yield f"{str(dtype)[6:]}->{str(cache)[6:]}+head_major", store_kv_kernel, pointers, constexprs
