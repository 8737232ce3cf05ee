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

from kvwrite.kernels._common import claim, end_call, fp8_quant, store_le_bytes
from kvwrite.kernels._nvfp4 import store_blocks
from kvwrite.kernels._quant import abs_for_scale, dynamic_scale, quant_code
from kvwrite.kernels.store_mla import _RAW_ROPE, _bf16_bits, _ds_mla_tile
from kvwrite import facts as _mla

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
        b = _bf16_bits(y)  # no int32 overflow for NaN payloads (a GPU's NaN is 0x7FFFFFFF)
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
def _k_head(k_ptr, kw_ptr, cs_ptr, h, t64, pos, w, eps, k_sn, k_sh, cs_sn, D: tl.constexpr,
            R: tl.constexpr, NEOX: tl.constexpr, K_NORM: tl.constexpr, IN: tl.constexpr,
            CS_IN: tl.constexpr, BLOCK_D: tl.constexpr, LOG2P: tl.constexpr):
    """Rotated k head h of the tokens in `w` [BT, 1]: (fp32 rounded values, input-dtype values)."""
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = w & (cols < D)
    base = (t64 * k_sn + h * k_sh)[:, None]
    inv = 1.0
    if K_NORM:
        inv = _rms_inv(_load_f32(k_ptr, base + cols, mask, IN), D, LOG2P, eps)[:, None]
    return _rope_vals(k_ptr, base, cols, mask, cs_ptr, (pos * cs_sn)[:, None], inv, kw_ptr, R, NEOX,
                      K_NORM, IN, CS_IN)


@triton.jit
def _quant_store(x, mask, dst, scale, FMT: tl.constexpr, RULE: tl.constexpr, FMAX: tl.constexpr,
                 MANT: tl.constexpr, EMIN: tl.constexpr):
    tl.store(dst, quant_code(x, scale, FMT, RULE, FMAX, MANT, EMIN).to(tl.uint8), mask=mask)


@triton.jit
def rope_store_kv_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    ksc_ptr, vsc_ptr, addr, max_pos, eps,
    q_sn, q_sh, k_sn, k_sh, v_sn, v_sh, cs_sn,
    kc_sp, kc_so, kc_sh, vc_sp, vc_so, vc_sh, ks_sh, vs_sh,
    ksc_sp, ksc_so, ksc_sh, vsc_sp, vsc_so, vsc_sh,
    HQ: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, R: tl.constexpr,
    NEOX: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr, IN: tl.constexpr,
    CS_IN: tl.constexpr, QUANT: tl.constexpr, FMT: tl.constexpr, QMAX: tl.constexpr,
    RULE: tl.constexpr, FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
    CHECK: tl.constexpr, OP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, LOG2P: tl.constexpr,
):
    """QUANT (kvwrite.facts): 0 copy, 1 static scale (fp8 / int8), 2 dynamic per token
    (program HQ owns every kv head: two passes, amax then codes), 3 dynamic per token-head."""
    pid_t = tl.program_id(0)
    j = tl.program_id(1)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < addr.n_tokens
    pos, pos_ok = _positions(pos_ptr, tok, tmask, max_pos)
    if j < HQ:
        if CHECK == 1:  # assert: every program checks before it writes (q is written too)
            claim(addr, tok, CHECK, OP, False, pos_ok, pos, max_pos)
        _rotate_q(q_ptr, j, tok, pos_ok, pos, cs_ptr, cs_sn, qw_ptr, eps, q_sn, q_sh, D, R, NEOX,
                  Q_NORM, IN, CS_IN, BLOCK_D, LOG2P)
    else:
        page, offset, write = claim(addr, tok, CHECK, OP, j == HQ, pos_ok, pos, max_pos)
        t64 = tok.to(tl.int64)
        w = write[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
        mask = w & (cols < D)
        vcols = tl.arange(0, BLOCK_DV)[None, :]
        vmask = w & (vcols < DV)
        kbase = (page * kc_sp + offset * kc_so)[:, None] + cols
        vbase = (page * vc_sp + offset * vc_so)[:, None] + vcols
        if QUANT == 2:
            # one scale per token over every head: amax of the rotated k (and of v), then codes
            ka = tl.zeros([BLOCK_T], tl.float32)
            va = tl.zeros([BLOCK_T], tl.float32)
            for h in range(H):
                kr, _ = _k_head(k_ptr, kw_ptr, cs_ptr, h, t64, pos, w, eps, k_sn, k_sh, cs_sn, D, R,
                                NEOX, K_NORM, IN, CS_IN, BLOCK_D, LOG2P)
                ka = tl.maximum(ka, tl.max(tl.where(mask, abs_for_scale(kr), 0.0), axis=1))
                vx = _load_f32(v_ptr, (t64 * v_sn + h * v_sh)[:, None] + vcols, vmask, IN)
                va = tl.maximum(va, tl.max(tl.where(vmask, abs_for_scale(vx), 0.0), axis=1))
            ks = dynamic_scale(ka, QMAX)
            vs = dynamic_scale(va, QMAX)
            tl.store(ksc_ptr + page * ksc_sp + offset * ksc_so, ks, mask=write)
            tl.store(vsc_ptr + page * vsc_sp + offset * vsc_so, vs, mask=write)
            for h in range(H):
                kr, _ = _k_head(k_ptr, kw_ptr, cs_ptr, h, t64, pos, w, eps, k_sn, k_sh, cs_sn, D, R,
                                NEOX, K_NORM, IN, CS_IN, BLOCK_D, LOG2P)
                _quant_store(kr, mask, kc_ptr + kbase + h * kc_sh, ks[:, None], FMT, RULE, FMAX,
                             MANT, EMIN)
                vx = _load_f32(v_ptr, (t64 * v_sn + h * v_sh)[:, None] + vcols, vmask, IN)
                _quant_store(vx, vmask, vc_ptr + vbase + h * vc_sh, vs[:, None], FMT, RULE, FMAX,
                             MANT, EMIN)
        else:
            h = j - HQ
            kr, kbits = _k_head(k_ptr, kw_ptr, cs_ptr, h, t64, pos, w, eps, k_sn, k_sh, cs_sn, D,
                                R, NEOX, K_NORM, IN, CS_IN, BLOCK_D, LOG2P)
            kdst = kc_ptr + kbase + h * kc_sh
            vdst = vc_ptr + vbase + h * vc_sh
            vsrc = (t64 * v_sn + h * v_sh)[:, None] + vcols
            if QUANT == 0:
                tl.store(kdst, kbits, mask=mask)
                tl.store(vdst, tl.load(v_ptr + vsrc, mask=vmask), mask=vmask)
            else:
                vx = _load_f32(v_ptr, vsrc, vmask, IN)
                if QUANT == 1:
                    ks = tl.load(ks_ptr + h * ks_sh)
                    vs = tl.load(vs_ptr + h * vs_sh)
                else:  # one scale per token-head
                    ks = dynamic_scale(tl.max(tl.where(mask, abs_for_scale(kr), 0.0), axis=1), QMAX)
                    vs = dynamic_scale(tl.max(tl.where(vmask, abs_for_scale(vx), 0.0), axis=1), QMAX)
                    tl.store(ksc_ptr + page * ksc_sp + offset * ksc_so + h * ksc_sh, ks, mask=write)
                    tl.store(vsc_ptr + page * vsc_sp + offset * vsc_so + h * vsc_sh, vs, mask=write)
                    ks = ks[:, None]
                    vs = vs[:, None]
                _quant_store(kr, mask, kdst, ks, FMT, RULE, FMAX, MANT, EMIN)
                _quant_store(vx, vmask, vdst, vs, FMT, RULE, FMAX, MANT, EMIN)
    end_call(addr.errors, CHECK)  # guard: every program counts itself in the record's call


@triton.jit
def rope_store_mla_kernel(
    pos_ptr, q_ptr, c_ptr, c16_ptr, pe_ptr, cs_ptr, cache_ptr, scale_ptr, sc_ptr, g_ptr,
    addr, max_pos,
    q_sn, q_sh, c_sn, pe_sn, cs_sn, cache_sp, cache_so, sc_sp, sc_so, n_row_programs,
    HQ: tl.constexpr, L: tl.constexpr, R: tl.constexpr, NEOX: tl.constexpr, IN: tl.constexpr,
    CS_IN: tl.constexpr, MODE: tl.constexpr, FMAX: tl.constexpr, MANT: tl.constexpr,
    EMIN: tl.constexpr, HAS_GLOBAL: tl.constexpr, FLAGS: tl.constexpr,
    CHECK: tl.constexpr, OP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid_t = tl.program_id(0)
    c = tl.program_id(1)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < addr.n_tokens
    pos, pos_ok = _positions(pos_ptr, tok, tmask, max_pos)
    if c >= n_row_programs:
        if CHECK == 1:  # assert: every program checks before it writes (q is written too)
            claim(addr, tok, CHECK, OP, False, pos_ok, pos, max_pos)
        _rotate_q(q_ptr, c - n_row_programs, tok, pos_ok, pos, cs_ptr, cs_sn, q_ptr, 0.0, q_sn,
                  q_sh, R, R, NEOX, False, IN, CS_IN, BLOCK_R, 0)
    else:
        page, offset, write = claim(addr, tok, CHECK, OP, c == 0, pos_ok, pos, max_pos)
        t64 = tok.to(tl.int64)
        row_base = page * cache_sp + offset * cache_so
        cs_base = pos * cs_sn
        if MODE == _DS_MLA:
            # latent tile c as store_mla writes it (no rope there: R = 0), then the rotated rope
            _ds_mla_tile(c_ptr, pe_ptr, cache_ptr, tok, write, row_base, c, c_sn, pe_sn, L, 0, 1,
                         FLAGS)
            if c == 0:
                rc = tl.arange(0, BLOCK_R)[None, :]
                rmask = write[:, None] & (rc < R)
                val, own = _rope_vals(pe_ptr, (t64 * pe_sn)[:, None], rc, rmask, cs_ptr,
                                      cs_base[:, None], 1.0, pe_ptr, R, NEOX, False, IN, CS_IN)
                rope_at = row_base[:, None] + (L + (L // _TILE) * 4) + 2 * rc
                if _RAW_ROPE & FLAGS:  # the rounded input dtype's own 16 bits (bf16 / fp16)
                    rb = own.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                else:
                    rb = _bf16_bits(val)
                store_le_bytes(cache_ptr, rope_at, rb, rmask, 2)
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
    end_call(addr.errors, CHECK)  # guard: every program counts itself in the record's call


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


def _tile_cols(c: dict) -> int:
    """Columns of a program's widest tile (power of two), from its constexprs."""
    if "BLOCK_D" in c:
        return max(c["BLOCK_D"], c["BLOCK_DV"])
    width = {_mla.MODE_DS_MLA: _mla.DS_MLA_TILE, _mla.MODE_NVFP4: c["BLOCK_C"] * 16}.get(c["MODE"], c["BLOCK_C"])
    return max(width, c["BLOCK_R"])


def compile_options(constexprs: dict) -> dict:
    """Launch options of a variant (the launchers and kernels/compile_check.py use the same):
    one warp per 256 tile elements, at most 8 (assert variants: twice, debug builds); fp fusion
    off (bit-exact rounding); never a plain copy kernel (the rotation gathers pair partners)."""
    w = max(1, min(8, constexprs["BLOCK_T"] * _tile_cols(constexprs) // 256))
    if constexprs.get("CHECK") == 1:
        w = min(32, w * 2)
    return {"num_warps": w, "enable_fp_fusion": False, "copy": False}


def _run(kernel, grid, a, **kwargs) -> None:
    """`kernels._launch.launch` with this family's options (fp fusion off); under the interpreter
    a fired assert names the first bad token, positions included."""
    from kvwrite.kernels._launch import launch

    options = {k: v for k, v in compile_options(kwargs).items() if k != "copy"}
    launch(kernel, grid, a, lambda: check_with_positions(a), options=options, **kwargs)


def check_with_positions(a) -> None:
    """The reference check of a validated fused RoPE store `a`, its positions included."""
    from kvwrite.reference import _locs
    from kvwrite.reference.rope import resolve_with_positions

    _locs.check(resolve_with_positions(a)[0], a.geometry, a.check)


def launch_kv(a) -> None:
    """Launch rope_store_kv_kernel for a validated `kvwrite.ops.rope.RopeStoreKV` (every K/V
    store format: copy, static fp8 / int8, dynamic per-token / per-token-head int8 / fp8)."""
    import torch

    from kvwrite.kernels import _quant
    from kvwrite.kernels._launch import fp8_constexprs, loc_args

    s = a.store
    n, h, d = s.k.shape
    dv = s.v.shape[2]
    hq = a.q.shape[1]
    quant = s.quant
    block_d, block_dv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
    block_t = _block_t(n, max(block_d, block_dv))
    kc, vc = ((s.k_cache.view(torch.uint8), s.v_cache.view(torch.uint8)) if quant
              else (_bits(s.k_cache), _bits(s.v_cache)))
    static = quant == _mla.QUANT_STATIC
    ks = s.k_scale if static else a.cos_sin
    vs = s.v_scale if static else a.cos_sin
    ksc = s.k_scale_cache if s.k_scale_cache is not None else a.cos_sin.new_empty((1, 1, 1))
    vsc = s.v_scale_cache if s.v_scale_cache is not None else ksc
    w = a.q_norm_weight if a.q_norm_weight is not None else a.cos_sin
    kw = a.k_norm_weight if a.k_norm_weight is not None else a.cos_sin
    fmt = (_quant.constexprs(s.k_cache.dtype, s.rule) if quant
           else dict(FMT=0, QMAX=0.0, RULE=0, **fp8_constexprs(s.k_cache.dtype)))
    kwargs = dict(
        pos_ptr=a.positions, q_ptr=_bits(a.q), k_ptr=_bits(s.k), v_ptr=_bits(s.v),
        cs_ptr=_bits(a.cos_sin), qw_ptr=w, kw_ptr=kw, kc_ptr=kc, vc_ptr=vc, ks_ptr=ks, vs_ptr=vs,
        ksc_ptr=ksc, vsc_ptr=vsc, max_pos=a.cos_sin.shape[0], eps=a.eps,
        q_sn=a.q.stride(0), q_sh=a.q.stride(1), k_sn=s.k.stride(0), k_sh=s.k.stride(1),
        v_sn=s.v.stride(0), v_sh=s.v.stride(1), cs_sn=a.cos_sin.stride(0),
        kc_sp=kc.stride(0), kc_so=kc.stride(1), kc_sh=kc.stride(2),
        vc_sp=vc.stride(0), vc_so=vc.stride(1), vc_sh=vc.stride(2),
        ks_sh=(1 if s.k_scale.numel() > 1 else 0) if static else 0,
        vs_sh=(1 if s.v_scale.numel() > 1 else 0) if static else 0,
        ksc_sp=ksc.stride(0), ksc_so=ksc.stride(1), ksc_sh=ksc.stride(2),
        vsc_sp=vsc.stride(0), vsc_so=vsc.stride(1), vsc_sh=vsc.stride(2),
        HQ=hq, H=h, D=d, DV=dv, R=a.rotary_dim, NEOX=a.is_neox, Q_NORM=a.q_norm_weight is not None,
        K_NORM=a.k_norm_weight is not None, IN=_in_code(s.k.dtype), CS_IN=_in_code(a.cos_sin.dtype),
        QUANT=quant, **fmt,
        BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_DV=block_dv, LOG2P=_log2(block_d),
        **loc_args(a))
    kv_programs = 1 if quant == _mla.QUANT_TOKEN else h
    _run(rope_store_kv_kernel, (triton.cdiv(n, block_t), hq + kv_programs), a, **kwargs)


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
        block_c, row_programs, width = 1, lora // _mla.DS_MLA_TILE, _mla.DS_MLA_TILE
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
        HAS_GLOBAL=s.global_scale is not None, FLAGS=s.format.flags,
        BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_R=block_r, **loc_args(a))
    _run(rope_store_mla_kernel, (triton.cdiv(n, block_t), row_programs + hq), a, **kwargs)


def variants():
    """(name, kernel, pointer dtypes, constexprs) of every variant, for compile_check: Qwen3-like
    heads (32 q / 8 kv x 128, neox, q/k norm) copy and fp8, GPT-J partial rotary with SWA + DCP,
    a page table; DeepSeek MLA (512 + 64, 16 q heads) in every format."""
    import torch

    from kvwrite.errors import op_code
    from kvwrite.kernels import _quant
    from kvwrite.kernels._launch import fp8_constexprs

    f32, f16, bf16, u8, i32, i64 = (torch.float32, torch.float16, torch.bfloat16, torch.uint8,
                                    torch.int32, torch.int64)
    as_bits = lambda d: torch.int16 if d == bf16 else d  # noqa: E731
    i8 = torch.int8
    kv_cases = (  # (input, cache, quant mode, rule, neox, rotary, norm, map + dcp, table)
        (bf16, bf16, 0, 0, True, 128, True, False, False), (f16, torch.float8_e4m3fn, 1, 0, True, 128, True, False, False),
        (bf16, torch.float8_e5m2, 1, 0, False, 64, False, True, False), (f32, f32, 0, 0, False, 64, True, True, False),
        (bf16, bf16, 0, 0, True, 128, False, False, True), (bf16, i8, 1, 0, True, 128, True, False, False),
        (bf16, i8, 2, 0, True, 128, True, False, False), (f16, torch.float8_e4m3fn, 3, 1, True, 128, True, True, False),
        (bf16, i8, 3, 1, False, 64, True, False, False),
    )
    for check in (0, 1, 2):
        for dtype, cache, quant, rule, neox, rot, norm, extras, table in kv_cases:
            pointers = dict(pos_ptr=i64, q_ptr=as_bits(dtype), k_ptr=as_bits(dtype), v_ptr=as_bits(dtype),
                            cs_ptr=f32, qw_ptr=f32, kw_ptr=f32, kc_ptr=u8 if quant else as_bits(cache),
                            vc_ptr=u8 if quant else as_bits(cache), ks_ptr=f32, vs_ptr=f32,
                            ksc_ptr=f32, vsc_ptr=f32,
                            loc_ptr=i32 if table else i64, err_ptr=i64, loc_map_ptr=i32)
            fmt = (_quant.constexprs(cache, rule) if quant else
                   dict(FMT=0, QMAX=0.0, RULE=0, **fp8_constexprs(cache)))
            constexprs = dict(HQ=32, H=8, D=128, DV=128, R=rot, NEOX=neox, Q_NORM=norm, K_NORM=norm,
                              IN=_in_code(dtype), CS_IN=IN_F32, QUANT=quant, **fmt,
                              HAS_MAP=extras, HAS_DCP=extras, CHECK=check, OP=op_code("rope_store_kv"),
                              BLOCK_T=4, BLOCK_D=128, BLOCK_DV=128, LOG2P=7)
            if table:
                constexprs["HAS_TABLE"] = True
            name = (f"kv:{str(dtype)[6:]}->{str(cache)[6:]}/q{quant}r{rule}{'+neox' if neox else '+gptj'}{rot}"
                    f"{'+norm' if norm else ''}{'+map+dcp' if extras else ''}{'+table' if table else ''}")
            yield name, rope_store_kv_kernel, pointers, constexprs
        for dtype, fmt, extras in ((bf16, "auto", False), (f16, "fp8_e4m3", False), (bf16, "fp8_e5m2", True),
                                   (bf16, "fp8_ds_mla", False), (f32, "fp8_ds_mla", True),
                                   (f16, "fp8_ds_mla+pow2+input", False), (bf16, "nvfp4", False),
                                   (f32, "nvfp4", True)):
            f = _mla.MLA_FORMATS[fmt]
            cache = f.cache_dtype(dtype)
            mode = f.mode
            block_c = {_mla.MODE_DS_MLA: 1, _mla.MODE_NVFP4: 36}.get(mode, 1024)
            block_c = triton.next_power_of_2(block_c)
            pointers = dict(pos_ptr=i64, q_ptr=as_bits(dtype), c_ptr=dtype, c16_ptr=as_bits(dtype),
                            pe_ptr=as_bits(dtype), cs_ptr=f32,
                            cache_ptr=as_bits(cache) if mode == _mla.MODE_COPY else u8,
                            scale_ptr=f32, sc_ptr=u8, g_ptr=f32, loc_ptr=i64, err_ptr=i64,
                            loc_map_ptr=i32)
            constexprs = dict(HQ=16, L=512, R=64, NEOX=False, IN=_in_code(dtype), CS_IN=IN_F32, MODE=mode,
                              **fp8_constexprs(cache), HAS_GLOBAL=extras, FLAGS=f.flags, HAS_MAP=extras,
                              HAS_DCP=extras,
                              CHECK=check, OP=op_code("rope_store_mla"), BLOCK_T=4 if mode != _mla.MODE_DS_MLA else 8,
                              BLOCK_C=block_c, BLOCK_R=64)
            yield (f"mla:{str(dtype)[6:]}->{fmt}{'+map+dcp' if extras else ''}", rope_store_mla_kernel,
                   pointers, constexprs)
