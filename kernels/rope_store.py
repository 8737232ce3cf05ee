"""Fused RoPE (+ q/k RMS norm) and paged store: `rope_store_kv` (store_kv's copy and static fp8
formats) and `rope_store_mla` (every store_mla format), with SWA/DCP/page-table loc resolution
and the position check folded in.

Arithmetic (`kvwrite.reference.rope`, bit for bit): fp32, launched with enable_fp_fusion=False
(no fused multiply-add), divisions and the square root correctly rounded (`tl.div_rn`,
`tl.sqrt_rn`), the sum of squares as the adjacent-pair tree, one rounding to the input dtype
(bf16 by bit arithmetic: the interpreter's fp32->bf16 cast truncates). A rotated element is
computed where it is needed, in natural column order: out[c] = y[c]*cos - y[partner]*sin (first
of its pair) or y[c]*cos + y[partner]*sin (second); past rotary_dim out[c] = y[c].
bf16 buffers that are rotated or copied are passed as int16 views (bits in, bits out).

rope_store_kv: program (t, j) owns BLOCK_T tokens and head j of [q heads, kv heads]: a q head
is rotated in place (valid positions); kv head h is rotated and stored with v head h (program
j == HQ owns the error record). rope_store_mla: program (t, c): c < C stores column tile c of
the row (copy / fp8), latent tile c (fp8_ds_mla; tile 0 adds the rope) or block group c (nvfp4);
c >= C rotates q_pe head c - C in place.
"""
import triton
import triton.language as tl

from kvwrite import errors as _e
from kvwrite.kernels._common import (CHECK_OFF, check_or_record, fp8_quant, record_table,
                                     resolve_locs, resolve_table, store_le_bytes)
from kvwrite.kernels._nvfp4 import store_blocks
from kvwrite.kernels.store_mla import _bf16_bits, _ds_mla_tile
from kvwrite.ops import mla as _mla

_KIND_POSITION = tl.constexpr(_e.KIND_POSITION)
_COPY = tl.constexpr(_mla.MODE_COPY)
_FP8 = tl.constexpr(_mla.MODE_FP8)
_DS_MLA = tl.constexpr(_mla.MODE_DS_MLA)
_TILE = tl.constexpr(_mla.DS_MLA_TILE)

# input dtype codes (the IN / CS_IN constexprs)
IN_F32, IN_F16, IN_BF16 = 0, 1, 2


@triton.jit
def _load_f32(ptr, offs, mask, IN: tl.constexpr):
    """fp32 of elements `offs` (bf16 read from an int16 view: exact)."""
    x = tl.load(ptr + offs, mask=mask, other=0)
    if IN == 2:
        return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _rounded(y, IN: tl.constexpr):
    """(fp32 value of y rounded to the input dtype, what an input-dtype buffer stores: the value,
    or bf16 bits as int16). Round to nearest even; bf16 NaN -> 0x7FC0 (as torch)."""
    if IN == 2:
        u = y.to(tl.int32, bitcast=True)
        b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
        b = tl.where(y != y, 0x7FC0, b)
        return (b << 16).to(tl.float32, bitcast=True), b.to(tl.int16)
    elif IN == 1:
        h = y.to(tl.float16)
        return h.to(tl.float32), h
    else:
        return y, y


@triton.jit
def _rms_inv(x, D: tl.constexpr, LOG2P: tl.constexpr, eps):
    """1 / sqrt(sum(x*x) / D + eps) per row of x [BT, 2**LOG2P] (zero past D): the sum as the
    adjacent-pair tree."""
    s = x * x
    for _ in tl.static_range(LOG2P):
        s = tl.reshape(s, [s.shape[0], s.shape[1] // 2, 2])
        a, b = tl.split(s)
        s = a + b
    ss = tl.sum(s, axis=1)  # one element
    ms = tl.div_rn(ss, tl.full(ss.shape, D, tl.float32)) + eps
    return tl.div_rn(tl.full(ss.shape, 1.0, tl.float32), tl.sqrt_rn(ms))


@triton.jit
def _rope_vals(src_ptr, base, cols, mask, cs_ptr, cs_base, inv, w_ptr, R: tl.constexpr,
               NEOX: tl.constexpr, NORM: tl.constexpr, IN: tl.constexpr, CS_IN: tl.constexpr):
    """Rotated (normed when NORM: `inv` per row, weights `w_ptr`) elements `cols` of the rows at
    `base`, rounded: `_rounded`'s pair. `base`, `cs_base`, `inv` broadcast against `cols`."""
    HALF: tl.constexpr = R // 2
    rot = cols < R
    if NEOX:
        first = cols < HALF
        partner = tl.where(first, cols + HALF, cols - HALF)
        ci = tl.where(first, cols, cols - HALF)
    else:
        first = (cols % 2) == 0
        partner = tl.where(first, cols + 1, cols - 1)
        ci = cols // 2
    pmask = mask & rot
    x = _load_f32(src_ptr, base + cols, mask, IN)
    xp = _load_f32(src_ptr, base + partner, pmask, IN)
    if NORM:
        x = (x * inv) * tl.load(w_ptr + cols, mask=mask, other=0.0)
        xp = (xp * inv) * tl.load(w_ptr + partner, mask=pmask, other=0.0)
    co = _load_f32(cs_ptr, cs_base + ci, pmask, CS_IN)
    si = _load_f32(cs_ptr, cs_base + HALF + ci, pmask, CS_IN)
    a = x * co
    b = xp * si
    return _rounded(tl.where(rot, tl.where(first, a - b, a + b), x), IN)


@triton.jit
def _positions(pos_ptr, tok, tmask, max_pos):
    pos = tl.load(pos_ptr + tok, mask=tmask, other=0).to(tl.int64)
    return pos, tmask & (pos >= 0) & (pos < max_pos)


@triton.jit
def _claim(loc_ptr, pos, pos_ok, tok, n_tokens, loc_map_ptr, map_len, dcp_rank, dcp_size,
           capacity, pool_page_size, max_pos, err_ptr, HAS_MAP: tl.constexpr,
           HAS_DCP: tl.constexpr, CHECK: tl.constexpr, OP: tl.constexpr, record, pt_batch_ptr,
           pt_indices_ptr, pt_indptr_ptr, pt_num_batches, pt_num_indices, HAS_TABLE: tl.constexpr):
    """`claim_rows` with the position check folded in (reference `resolve_with_positions`): a
    position outside [0, max_pos) is a KIND_POSITION error, never written (every mode)."""
    tmask = tok < n_tokens
    if HAS_TABLE:
        tpos, loc, page, offset, write, bad, target, limit, kind, batch, slot, tpage = resolve_table(
            loc_ptr, pt_batch_ptr, pt_indices_ptr, pt_indptr_ptr, tok, tmask, pt_num_batches,
            pt_num_indices, capacity, pool_page_size, CHECK)
    else:
        loc, row, write, bad, target, limit, kind = resolve_locs(
            loc_ptr, tok, tmask, loc_map_ptr, map_len, dcp_rank, dcp_size, capacity,
            HAS_MAP, HAS_DCP, CHECK, pool_page_size)
        page = row // pool_page_size
        offset = row % pool_page_size
    write = write & pos_ok
    if CHECK != CHECK_OFF:
        bad_pos = tmask & (pos_ok == 0)
        bad = bad | bad_pos
        kind = tl.where(bad_pos, _KIND_POSITION, kind)
        target = tl.where(bad_pos, pos, target)
        limit = tl.where(bad_pos, max_pos, limit)
    check_or_record(err_ptr, tok, loc, bad, target, limit, kind, pool_page_size, OP, CHECK, record)
    if HAS_TABLE:
        record_table(err_ptr, tok, bad, batch, tpos, slot, tpage, CHECK, record)
    return page, offset, write


@triton.jit
def _rotate_q(q_ptr, head, tok, ok, pos, cs_ptr, cs_sn, qw_ptr, eps, q_sn, q_sh,
              D: tl.constexpr, R: tl.constexpr, NEOX: tl.constexpr, NORM: tl.constexpr,
              IN: tl.constexpr, CS_IN: tl.constexpr, BLOCK_D: tl.constexpr, LOG2P: tl.constexpr):
    """Rotate q head `head` of the tokens in `ok` in place."""
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = ok[:, None] & (cols < D)
    base = (tok.to(tl.int64) * q_sn + head * q_sh)[:, None]
    inv = 1.0
    if NORM:
        inv = _rms_inv(_load_f32(q_ptr, base + cols, mask, IN), D, LOG2P, eps)[:, None]
    _, out = _rope_vals(q_ptr, base, cols, mask, cs_ptr, (pos * cs_sn)[:, None], inv, qw_ptr, R,
                        NEOX, NORM, IN, CS_IN)
    tl.debug_barrier()  # every element (and its partner) is read before any is written
    tl.store(q_ptr + base + cols, out, mask=mask)


@triton.jit
def _concat_rotated(c16_ptr, pe_ptr, t64, cols, mask, c_sn, pe_sn, cs_ptr, cs_base,
                    L: tl.constexpr, R: tl.constexpr, NEOX: tl.constexpr, IN: tl.constexpr,
                    CS_IN: tl.constexpr):
    """fp32 elements `cols` [T, B, 8] of concat(kv_c, rotated k_pe)."""
    in_c = cols < L
    in_pe = mask & (in_c == 0) & (cols < L + R)
    pv, _ = _rope_vals(pe_ptr, (t64 * pe_sn)[:, None, None], tl.where(in_pe, cols - L, 0), in_pe,
                       cs_ptr, cs_base[:, None, None], 1.0, pe_ptr, R, NEOX, False, IN, CS_IN)
    cv = _load_f32(c16_ptr, (t64 * c_sn)[:, None, None] + cols, mask & in_c, IN)
    return tl.where(in_c, cv, pv)


@triton.jit
def rope_store_kv_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    loc_ptr, err_ptr, loc_map_ptr,
    n_tokens, max_pos, eps, capacity, pool_page_size, map_len, dcp_rank, dcp_size,
    q_sn, q_sh, k_sn, k_sh, v_sn, v_sh, cs_sn,
    kc_sp, kc_so, kc_sh, vc_sp, vc_so, vc_sh, ks_sh, vs_sh,
    HQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, NEOX: tl.constexpr,
    Q_NORM: tl.constexpr, K_NORM: tl.constexpr, IN: tl.constexpr, CS_IN: tl.constexpr,
    QUANT: tl.constexpr, FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
    HAS_MAP: tl.constexpr, HAS_DCP: tl.constexpr, CHECK: tl.constexpr, OP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, LOG2P: tl.constexpr,
    pt_batch_ptr=None, pt_indices_ptr=None, pt_indptr_ptr=None, pt_num_batches=0,
    pt_num_indices=0, HAS_TABLE: tl.constexpr = False,
):
    pid_t = tl.program_id(0)
    j = tl.program_id(1)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < n_tokens
    pos, pos_ok = _positions(pos_ptr, tok, tmask, max_pos)
    if j < HQ:
        _rotate_q(q_ptr, j, tok, pos_ok, pos, cs_ptr, cs_sn, qw_ptr, eps, q_sn, q_sh, D, R, NEOX,
                  Q_NORM, IN, CS_IN, BLOCK_D, LOG2P)
    else:
        h = j - HQ
        page, offset, write = _claim(loc_ptr, pos, pos_ok, tok, n_tokens, loc_map_ptr, map_len,
                                     dcp_rank, dcp_size, capacity, pool_page_size, max_pos,
                                     err_ptr, HAS_MAP, HAS_DCP, CHECK, OP, h == 0, pt_batch_ptr,
                                     pt_indices_ptr, pt_indptr_ptr, pt_num_batches,
                                     pt_num_indices, HAS_TABLE)
        t64 = tok.to(tl.int64)
        w = write[:, None]
        # k head h: rotated, rounded, stored as store_kv stores it
        cols = tl.arange(0, BLOCK_D)[None, :]
        mask = w & (cols < D)
        base = (t64 * k_sn + h * k_sh)[:, None]
        inv = 1.0
        if K_NORM:
            inv = _rms_inv(_load_f32(k_ptr, base + cols, mask, IN), D, LOG2P, eps)[:, None]
        kr, kbits = _rope_vals(k_ptr, base, cols, mask, cs_ptr, (pos * cs_sn)[:, None], inv,
                               kw_ptr, R, NEOX, K_NORM, IN, CS_IN)
        kdst = kc_ptr + (page * kc_sp + offset * kc_so + h * kc_sh)[:, None] + cols
        vcols = tl.arange(0, BLOCK_DV)[None, :]
        vmask = w & (vcols < DV)
        vsrc = (t64 * v_sn + h * v_sh)[:, None] + vcols
        vdst = vc_ptr + (page * vc_sp + offset * vc_so + h * vc_sh)[:, None] + vcols
        if QUANT:
            kq = fp8_quant(kr, tl.load(ks_ptr + h * ks_sh), FMAX, MANT, EMIN)
            tl.store(kdst, kq.to(tl.uint8), mask=mask)
            vq = fp8_quant(_load_f32(v_ptr, vsrc, vmask, IN), tl.load(vs_ptr + h * vs_sh), FMAX,
                           MANT, EMIN)
            tl.store(vdst, vq.to(tl.uint8), mask=vmask)
        else:
            tl.store(kdst, kbits, mask=mask)
            tl.store(vdst, tl.load(v_ptr + vsrc, mask=vmask), mask=vmask)


@triton.jit
def rope_store_mla_kernel(
    pos_ptr, q_ptr, c_ptr, c16_ptr, pe_ptr, cs_ptr, cache_ptr, scale_ptr, sc_ptr, g_ptr,
    loc_ptr, err_ptr, loc_map_ptr,
    n_tokens, max_pos, capacity, pool_page_size, map_len, dcp_rank, dcp_size,
    q_sn, q_sh, c_sn, pe_sn, cs_sn, cache_sp, cache_so, sc_sp, sc_so, n_row_programs,
    HQ: tl.constexpr, L: tl.constexpr, R: tl.constexpr, NEOX: tl.constexpr, IN: tl.constexpr,
    CS_IN: tl.constexpr, MODE: tl.constexpr, FMAX: tl.constexpr, MANT: tl.constexpr,
    EMIN: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    HAS_MAP: tl.constexpr, HAS_DCP: tl.constexpr, CHECK: tl.constexpr, OP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    pt_batch_ptr=None, pt_indices_ptr=None, pt_indptr_ptr=None, pt_num_batches=0,
    pt_num_indices=0, HAS_TABLE: tl.constexpr = False,
):
    pid_t = tl.program_id(0)
    c = tl.program_id(1)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < n_tokens
    pos, pos_ok = _positions(pos_ptr, tok, tmask, max_pos)
    if c >= n_row_programs:
        _rotate_q(q_ptr, c - n_row_programs, tok, pos_ok, pos, cs_ptr, cs_sn, q_ptr, 0.0, q_sn,
                  q_sh, R, R, NEOX, False, IN, CS_IN, BLOCK_R, 0)
    else:
        page, offset, write = _claim(loc_ptr, pos, pos_ok, tok, n_tokens, loc_map_ptr, map_len,
                                     dcp_rank, dcp_size, capacity, pool_page_size, max_pos,
                                     err_ptr, HAS_MAP, HAS_DCP, CHECK, OP, c == 0, pt_batch_ptr,
                                     pt_indices_ptr, pt_indptr_ptr, pt_num_batches,
                                     pt_num_indices, HAS_TABLE)
        t64 = tok.to(tl.int64)
        row_base = page * cache_sp + offset * cache_so
        cs_base = pos * cs_sn
        if MODE == _DS_MLA:
            # latent tile c as store_mla writes it (no rope there: R = 0), then the rotated rope
            _ds_mla_tile(c_ptr, pe_ptr, cache_ptr, tok, write, row_base, c, c_sn, pe_sn, L, 0, 1)
            if c == 0:
                rc = tl.arange(0, BLOCK_R)[None, :]
                rmask = write[:, None] & (rc < R)
                val, _ = _rope_vals(pe_ptr, (t64 * pe_sn)[:, None], rc, rmask, cs_ptr,
                                    cs_base[:, None], 1.0, pe_ptr, R, NEOX, False, IN, CS_IN)
                addr = row_base[:, None] + (L + (L // _TILE) * 4) + 2 * rc
                store_le_bytes(cache_ptr, addr, _bf16_bits(val), rmask, 2)
        elif MODE == _COPY or MODE == _FP8:
            cols = (c * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
            w = write[:, None]
            in_c = cols < L
            in_pe = (cols >= L) & (cols < L + R)
            pcols = tl.where(in_pe, cols - L, 0)
            val, bits = _rope_vals(pe_ptr, (t64 * pe_sn)[:, None], pcols, w & in_pe, cs_ptr,
                                   cs_base[:, None], 1.0, pe_ptr, R, NEOX, False, IN, CS_IN)
            dst = cache_ptr + row_base[:, None] + cols
            if MODE == _FP8:
                x = tl.where(in_c, _load_f32(c16_ptr, (t64 * c_sn)[:, None] + cols, w & in_c, IN), val)
                x = fp8_quant(x, tl.load(scale_ptr), FMAX, MANT, EMIN)
                tl.store(dst, x.to(tl.uint8), mask=w & (in_c | in_pe))
            else:
                raw = tl.load(c16_ptr + (t64 * c_sn)[:, None] + cols, mask=w & in_c)
                tl.store(dst, tl.where(in_c, raw, bits), mask=w & (in_c | in_pe))
        else:  # nvfp4: blocks of 16 over concat(kv_c, rotated k_pe)
            blocks = (c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
            i = tl.arange(0, 8).to(tl.int64)
            mask = write[:, None] & (blocks < (L + R) // 16)[None, :]
            cols = (blocks * 16)[None, :, None] + 2 * i[None, None, :]
            m3 = mask[:, :, None]
            x_even = _concat_rotated(c16_ptr, pe_ptr, t64, cols, m3, c_sn, pe_sn, cs_ptr, cs_base,
                                     L, R, NEOX, IN, CS_IN)
            x_odd = _concat_rotated(c16_ptr, pe_ptr, t64, cols + 1, m3, c_sn, pe_sn, cs_ptr,
                                    cs_base, L, R, NEOX, IN, CS_IN)
            g = tl.load(g_ptr).to(tl.float32) if HAS_GLOBAL else 1.0
            byte_off = row_base[:, None, None] + (blocks * 8)[None, :, None] + i[None, None, :]
            scale_off = (page * sc_sp + offset * sc_so)[:, None] + blocks[None, :]
            store_blocks(x_even, x_odd, g, cache_ptr, byte_off, sc_ptr, scale_off, mask,
                         HAS_GLOBAL)


# ---- host side -------------------------------------------------------------------------------

def _in_code(dtype) -> int:
    import torch

    return {torch.float32: IN_F32, torch.float16: IN_F16, torch.bfloat16: IN_BF16}[dtype]


def _bits(t):
    """bf16 tensors as int16 views (the kernels move bf16 as bits); others unchanged."""
    import torch

    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _log2(x: int) -> int:
    return max(x, 1).bit_length() - 1


def _block_t(n: int, cols: int) -> int:
    from kvwrite.backend import triton_interpreting

    cols = triton.next_power_of_2(max(cols, 1))
    cap = 65536 if triton_interpreting() else 4096
    return min(triton.next_power_of_2(max(n, 1)), max(1, cap // cols), 256)


def _num_warps(block_t: int, cols: int, check: int) -> int:
    w = max(1, min(8, block_t * cols // 256))
    return min(32, w * 2) if check == 1 else w


def _run(kernel, grid, a, **kwargs) -> None:
    """Launch (fp fusion off; assert variants in debug mode on a GPU). Under the interpreter a
    fired assert becomes a KernelAssertion carrying the first bad token, positions included."""
    from kvwrite.backend import triton_interpreting
    from kvwrite.errors import OutOfBoundsWrite
    from kvwrite.kernels._launch import KernelAssertion

    kwargs["enable_fp_fusion"] = False
    if a.check.mode != "assert":
        kernel[grid](**kwargs)
        return
    if not triton_interpreting():
        kernel[grid](**kwargs, debug=True)
        return
    try:
        kernel[grid](**kwargs)
    except Exception as exc:
        if "kvwrite: store loc outside the pool" not in str(exc):
            raise
        from kvwrite.reference import _locs
        from kvwrite.reference.rope import resolve_with_positions

        r, _ = resolve_with_positions(a)
        try:
            _locs.check(r, a.geometry, a.check)
        except OutOfBoundsWrite as err:
            raise KernelAssertion(err.op, err.token_index, err.loc, err.page, err.num_pages,
                                  err.pool_page_size, err.count, err.kind, err.target,
                                  err.limit, batch=err.batch, position=err.position,
                                  table_slot=err.table_slot, table_page=err.table_page) from exc
        raise


def launch_kv(a) -> None:
    """Launch rope_store_kv_kernel for a validated `kvwrite.ops.rope.RopeStoreKV` (copy or static
    fp8 K/V store)."""
    import torch

    from kvwrite.kernels._launch import fp8_constexprs, loc_args
    from kvwrite.ops import kv_quant

    s = a.store
    n, h, d = s.k.shape
    dv = s.v.shape[2]
    hq = a.q.shape[1]
    quant = s.quant == kv_quant.QUANT_STATIC
    block_d, block_dv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
    block_t = _block_t(n, max(block_d, block_dv))
    kc, vc = ((s.k_cache.view(torch.uint8), s.v_cache.view(torch.uint8)) if quant
              else (_bits(s.k_cache), _bits(s.v_cache)))
    ks = s.k_scale if quant else a.cos_sin
    vs = s.v_scale if quant else a.cos_sin
    w = a.q_norm_weight if a.q_norm_weight is not None else a.cos_sin
    kw = a.k_norm_weight if a.k_norm_weight is not None else a.cos_sin
    kwargs = dict(
        pos_ptr=a.positions, q_ptr=_bits(a.q), k_ptr=_bits(s.k), v_ptr=_bits(s.v),
        cs_ptr=_bits(a.cos_sin), qw_ptr=w, kw_ptr=kw, kc_ptr=kc, vc_ptr=vc, ks_ptr=ks, vs_ptr=vs,
        max_pos=a.cos_sin.shape[0], eps=a.eps,
        q_sn=a.q.stride(0), q_sh=a.q.stride(1), k_sn=s.k.stride(0), k_sh=s.k.stride(1),
        v_sn=s.v.stride(0), v_sh=s.v.stride(1), cs_sn=a.cos_sin.stride(0),
        kc_sp=kc.stride(0), kc_so=kc.stride(1), kc_sh=kc.stride(2),
        vc_sp=vc.stride(0), vc_so=vc.stride(1), vc_sh=vc.stride(2),
        ks_sh=(1 if s.k_scale.numel() > 1 else 0) if quant else 0,
        vs_sh=(1 if s.v_scale.numel() > 1 else 0) if quant else 0,
        HQ=hq, D=d, DV=dv, R=a.rotary_dim, NEOX=a.is_neox, Q_NORM=a.q_norm_weight is not None,
        K_NORM=a.k_norm_weight is not None, IN=_in_code(s.k.dtype), CS_IN=_in_code(a.cos_sin.dtype),
        QUANT=quant, **fp8_constexprs(s.k_cache.dtype),
        BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_DV=block_dv, LOG2P=_log2(block_d),
        **loc_args(a))
    kwargs["num_warps"] = _num_warps(block_t, max(block_d, block_dv), kwargs["CHECK"])
    _run(rope_store_kv_kernel, (triton.cdiv(n, block_t), hq + h), a, **kwargs)


def launch_mla(a) -> None:
    """Launch rope_store_mla_kernel for a validated `kvwrite.ops.rope.RopeStoreMLA`."""
    import torch

    from kvwrite.kernels._launch import fp8_constexprs, loc_args
    from kvwrite.validate import FP8_MAX

    s = a.store
    n, lora = s.kv_c.shape
    rope = s.k_pe.shape[1]
    hq = a.q.shape[1]
    mode = s.format.mode
    block_r = triton.next_power_of_2(rope)
    if mode == _mla.MODE_DS_MLA:
        block_c, row_programs, width = _mla.DS_MLA_TILE, lora // _mla.DS_MLA_TILE, _mla.DS_MLA_TILE
    elif mode == _mla.MODE_NVFP4:
        block_c = max(1, min(triton.next_power_of_2((lora + rope) // 16), 64))
        row_programs, width = triton.cdiv((lora + rope) // 16, block_c), block_c * 16
    else:
        block_c = min(triton.next_power_of_2(lora + rope), 1024)
        row_programs, width = triton.cdiv(lora + rope, block_c), block_c
    block_t = _block_t(n, max(width, block_r))
    cache = s.kv_cache
    if cache.dtype in FP8_MAX:
        cache = cache.view(torch.uint8)
    elif mode == _mla.MODE_COPY:
        cache = _bits(cache)
    sc = s.scale_cache.view(torch.uint8) if s.scale_cache is not None else cache
    kwargs = dict(
        pos_ptr=a.positions, q_ptr=_bits(a.q), c_ptr=s.kv_c, c16_ptr=_bits(s.kv_c),
        pe_ptr=_bits(s.k_pe), cs_ptr=_bits(a.cos_sin), cache_ptr=cache,
        scale_ptr=s.scale if s.scale is not None else a.cos_sin, sc_ptr=sc,
        g_ptr=s.global_scale if s.global_scale is not None else a.cos_sin,
        max_pos=a.cos_sin.shape[0], q_sn=a.q.stride(0), q_sh=a.q.stride(1),
        c_sn=s.kv_c.stride(0), pe_sn=s.k_pe.stride(0), cs_sn=a.cos_sin.stride(0),
        cache_sp=cache.stride(0), cache_so=cache.stride(1), sc_sp=sc.stride(0), sc_so=sc.stride(1),
        n_row_programs=row_programs,
        HQ=hq, L=lora, R=rope, NEOX=a.is_neox, IN=_in_code(s.kv_c.dtype),
        CS_IN=_in_code(a.cos_sin.dtype), MODE=mode, **fp8_constexprs(s.kv_cache.dtype),
        HAS_GLOBAL=s.global_scale is not None,
        BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_R=block_r, **loc_args(a))
    kwargs["num_warps"] = _num_warps(block_t, max(width, block_r), kwargs["CHECK"])
    _run(rope_store_mla_kernel, (triton.cdiv(n, block_t), row_programs + hq), a, **kwargs)
