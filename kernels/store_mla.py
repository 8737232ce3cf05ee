"""MLA row store: concat(kv_c, k_pe) copied, per-tensor fp8, or DeepSeek's fp8_ds_mla row.

MODE (see `kvwrite.facts.MLA_FORMATS`) picks the row writer at compile time. Copy/fp8 rows: program
(t, c) owns BLOCK_T tokens and column tile c of the L + R row. fp8_ds_mla: program (t, c) owns
128-element latent tile c (its e4m3 bytes and fp32 scale); tile 0 also writes the bf16 rope.
Every cache byte of fp8 formats is written as a byte (sm_80 has no e4m3 type).
"""
import triton
import triton.language as tl

from kvwrite.kernels._common import claim_tile, finite_abs, fp8_quant, store_le_bytes
from kvwrite import facts as _mla

_COPY = tl.constexpr(_mla.MODE_COPY)
_FP8 = tl.constexpr(_mla.MODE_FP8)
_DS_MLA = tl.constexpr(_mla.MODE_DS_MLA)
_TILE = tl.constexpr(_mla.DS_MLA_TILE)
_SCALE_FLOOR = tl.constexpr(_mla.DS_MLA_SCALE_FLOOR)
_POW2_FLOOR = tl.constexpr(_mla.DS_MLA_POW2_FLOOR)
_POW2 = tl.constexpr(_mla.DS_MLA_POW2)
_RAW_ROPE = tl.constexpr(_mla.DS_MLA_RAW_ROPE)


@triton.jit
def _concat_row(c_ptr, pe_ptr, dst_ptr, scale_ptr, tok, write, row_base, cols, c_sn, pe_sn,
                L: tl.constexpr, R: tl.constexpr, QUANT: tl.constexpr, FMAX: tl.constexpr,
                MANT: tl.constexpr, EMIN: tl.constexpr):
    """Columns `cols` of concat(kv_c, k_pe), copied or saturate-quantised."""
    t64 = tok.to(tl.int64)[:, None]
    in_c = (cols < L)[None, :]
    in_pe = ((cols >= L) & (cols < L + R))[None, :]
    w = write[:, None]
    a = tl.load(c_ptr + t64 * c_sn + cols[None, :], mask=w & in_c)
    b = tl.load(pe_ptr + t64 * pe_sn + (cols - L)[None, :], mask=w & in_pe)
    x = tl.where(in_c, a, b)
    if QUANT:
        x = fp8_quant(x, tl.load(scale_ptr), FMAX, MANT, EMIN)
    tl.store(dst_ptr + row_base[:, None] + cols[None, :], x.to(dst_ptr.dtype.element_ty),
             mask=w & (in_c | in_pe))


@triton.jit
def _bf16_bits(x):
    """bf16 bits (int32) of x: bf16 input is copied; other floats round to nearest even like
    `tensor.to(torch.bfloat16)` (NaN -> 0x7FC0)."""
    if x.dtype == tl.bfloat16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        # rounded on the magnitude with NaN cleared (< 2**31 - 0x8000), the sign put back: no
        # int32 add can overflow (a debug build checks every one; the full bit pattern + 0x7FFF
        # overflows for the positive NaNs >= 0x7FFF8000)
        f = x.to(tl.float32)
        is_nan = f != f
        u = f.to(tl.int32, bitcast=True)
        a = tl.where(is_nan, 0, u & 0x7FFFFFFF)
        rounded = ((a + 0x7FFF + ((a >> 16) & 1)) >> 16) | ((u >> 16) & 0x8000)
        bits = tl.where(is_nan, 0x7FC0, rounded)
    return bits


@triton.jit
def _ds_mla_tile(c_ptr, pe_ptr, dst_ptr, tok, write, row_base, tile, c_sn, pe_sn,
                 L: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, FLAGS: tl.constexpr):
    """Latent tile `tile` of fp8_ds_mla rows (e4m3 bytes + fp32 scale); tile 0 adds the rope.
    FLAGS: DS_MLA_POW2 (scale rounded up to a power of two), DS_MLA_RAW_ROPE (rope bits kept)."""
    t64 = tok.to(tl.int64)
    w = write[:, None]
    cols = tile * _TILE + tl.arange(0, _TILE)
    x = tl.load(c_ptr + t64[:, None] * c_sn + cols[None, :], mask=w, other=0.0).to(tl.float32)
    if _POW2 & FLAGS:  # carry any mantissa bit into the exponent
        scale = tl.maximum(tl.div_rn(tl.max(finite_abs(x), axis=1), 448.0), _POW2_FLOOR)
        sbits = tl.minimum(scale.to(tl.int32, bitcast=True), 0x7F800000)  # scale > 0: no overflow
        scale = ((sbits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    else:
        scale = tl.maximum(tl.div_rn(tl.max(finite_abs(x), axis=1), 448.0), _SCALE_FLOOR)
    q = fp8_quant(x, scale[:, None], 448.0, 3, -6)
    tl.store(dst_ptr + row_base[:, None] + cols[None, :], q.to(tl.uint8), mask=w)
    store_le_bytes(dst_ptr, row_base + L + tile * 4, scale.to(tl.int32, bitcast=True), write, 4)
    if tile == 0:
        rc = tl.arange(0, BLOCK_R)
        rmask = w & (rc < R)[None, :]
        pe = tl.load(pe_ptr + t64[:, None] * pe_sn + rc[None, :], mask=rmask)
        addr = row_base[:, None] + (L + (L // _TILE) * 4) + 2 * rc[None, :]
        if _RAW_ROPE & FLAGS:
            bits = pe.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        else:
            bits = _bf16_bits(pe)
        store_le_bytes(dst_ptr, addr, bits, rmask, 2)


@triton.jit
def store_mla_kernel(
    c_ptr, pe_ptr, cache_ptr, scale_ptr, addr,
    c_sn, pe_sn, cache_sp, cache_so,
    L: tl.constexpr, R: tl.constexpr, MODE: tl.constexpr, FMAX: tl.constexpr,
    MANT: tl.constexpr, EMIN: tl.constexpr,
    CHECK: tl.constexpr, OP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    tok, page, offset, write = claim_tile(addr, BLOCK_T, CHECK, OP)
    pid_c = tl.program_id(1)
    row_base = page * cache_sp + offset * cache_so
    if (MODE & 15) == _DS_MLA:
        _ds_mla_tile(c_ptr, pe_ptr, cache_ptr, tok, write, row_base, pid_c, c_sn, pe_sn, L, R,
                     BLOCK_C, MODE & 48)
    else:
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        _concat_row(c_ptr, pe_ptr, cache_ptr, scale_ptr, tok, write, row_base, cols, c_sn, pe_sn,
                    L, R, MODE == _FP8, FMAX, MANT, EMIN)


def _grid_and_blocks(n: int, lora: int, rope: int, mode: int) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK_T, BLOCK_C); for fp8_ds_mla BLOCK_C is the rope block (tiles are 128 wide)."""
    from kvwrite.kernels._launch import tiles

    if mode == _mla.MODE_DS_MLA:
        block_t, _ = tiles(n, _mla.DS_MLA_TILE)
        return (triton.cdiv(n, block_t), lora // _mla.DS_MLA_TILE), block_t, triton.next_power_of_2(rope)
    block_t, block_c = tiles(n, lora + rope)
    return (triton.cdiv(n, block_t), triton.cdiv(lora + rope, block_c)), block_t, block_c


def _store_view(cache):
    """fp8 caches are written as bytes (fp8_bits); others as themselves."""
    import torch

    from kvwrite.validate import FP8_MAX

    return cache.view(torch.uint8) if cache.dtype in FP8_MAX else cache


def launch(a) -> None:
    """Launch store_mla_kernel for a validated `kvwrite.ops.mla.StoreMLA`."""
    from kvwrite.kernels._launch import fp8_constexprs, launch as run, loc_args

    n, lora = a.kv_c.shape
    rope = a.k_pe.shape[1]
    mode = a.format.kernel_mode
    grid, block_t, block_c = _grid_and_blocks(n, lora, rope, a.format.mode)
    cache = _store_view(a.kv_cache)
    run(store_mla_kernel, grid, a,
        c_ptr=a.kv_c, pe_ptr=a.k_pe, cache_ptr=cache,
        scale_ptr=a.scale if a.scale is not None else a.kv_c,
        c_sn=a.kv_c.stride(0), pe_sn=a.k_pe.stride(0),
        cache_sp=cache.stride(0), cache_so=cache.stride(1),
        L=lora, R=rope, MODE=mode, **fp8_constexprs(a.kv_cache.dtype),
        BLOCK_T=block_t, BLOCK_C=block_c, **loc_args(a))


def variants():
    """(name, kernel, pointer dtypes, constexprs) of every variant, for compile_check."""
    import torch

    from kvwrite.errors import op_code
    from kvwrite.kernels._launch import fp8_constexprs
    from kvwrite.validate import FP8_MAX

    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    cases = (  # (input, kv_cache_dtype, with loc_map + DCP)
        (bf16, "auto", False), (f32, "auto", True), (f16, "fp8_e4m3", False),
        (bf16, "fp8_e5m2", False), (bf16, "fp8_ds_mla", False), (f32, "fp8_ds_mla", True),
        (bf16, "fp8_e4m3fnuz", False), (f16, "fp8_ds_mla+pow2+input", False),
        (bf16, "fp8_ds_mla+pow2", True),
    )
    for check in (0, 1, 2):
        for dtype, name, map_dcp in cases:
            fmt = _mla.MLA_FORMATS[name]
            cache = fmt.cache_dtype(dtype)
            ds = fmt.mode == _mla.MODE_DS_MLA
            pointers = dict(c_ptr=dtype, pe_ptr=dtype, cache_ptr=torch.uint8 if cache in FP8_MAX else cache,
                            loc_ptr=torch.int64, scale_ptr=f32 if fmt.takes_scale else dtype,
                            err_ptr=torch.int64, loc_map_ptr=torch.int32)
            constexprs = dict(L=512, R=64, MODE=fmt.kernel_mode, **fp8_constexprs(cache),
                              HAS_MAP=map_dcp, HAS_DCP=map_dcp, CHECK=check, OP=op_code("store_mla"),
                              BLOCK_T=32 if ds else 4, BLOCK_C=64 if ds else 1024)
            yield (f"{str(dtype)[6:]}->{name}{'+map+dcp' if map_dcp else ''}", store_mla_kernel,
                   pointers, constexprs)
        # page-table addressing (kvwrite.PageTable), int32 tables
        pointers = dict(c_ptr=bf16, pe_ptr=bf16, cache_ptr=bf16, loc_ptr=torch.int32, scale_ptr=bf16,
                        err_ptr=torch.int64)
        constexprs = dict(L=512, R=64, MODE=_mla.MODE_COPY, **fp8_constexprs(bf16), HAS_MAP=False,
                          HAS_DCP=False, CHECK=check, OP=op_code("store_mla"), BLOCK_T=4, BLOCK_C=1024,
                          HAS_TABLE=True)
        yield "bfloat16->auto+table", store_mla_kernel, pointers, constexprs
