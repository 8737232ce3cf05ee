"""Host side shared by the Triton launchers: tile sizes, loc/check arguments, assert handling."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvwrite.backend import triton_interpreting
from kvwrite.errors import OutOfBoundsWrite, op_code
from kvwrite.kernels._common import DCP_PAGE, Addr


class KernelAssertion(OutOfBoundsWrite):
    """The Triton kernel's `assert` fired (CPU interpreter); details from the reference check."""


def tiles(n_tokens: int, n_cols: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_C): on a GPU about 4K elements a program, columns split for small batches;
    under the interpreter (≈0.45 ms a program) as few programs as memory allows."""
    cols = triton.next_power_of_2(max(n_cols, 1))
    if triton_interpreting():
        block_t = min(triton.next_power_of_2(max(n_tokens, 1)), max(1, 65536 // cols), 256)
        return block_t, cols
    block_c = min(cols, 1024)
    block_t = min(triton.next_power_of_2(max(n_tokens, 1)), max(1, 4096 // block_c))
    return block_t, block_c


def addr(a) -> Addr:
    """The addressing descriptor of a validated call `a` (its `locs`, `geometry`, `check`)."""
    locs, geo = a.locs, a.geometry
    t = getattr(locs, "table", None)
    m = locs.loc_map
    dcp = (DCP_PAGE if locs.dcp_page else 1) if locs.dcp_size > 1 else 0
    return Addr(locs.loc, m, a.check.errors, locs.n, geo.capacity, geo.pool_page_size,
                m.shape[0] if m is not None else 0, locs.dcp_rank, locs.dcp_size, tl.constexpr(dcp),
                *((t.batch_indices, t.kv_indices, t.kv_indptr, t.num_batches, t.kv_indices.shape[0])
                  if t is not None else (None, None, None, 0, 0)))


def loc_args(a) -> dict:
    """A store kernel's addressing keyword arguments: the descriptor `addr` and the check
    constexprs (CHECK, OP)."""
    return dict(addr=addr(a), CHECK=a.check.code, OP=op_code(a.check.op))


def num_warps(constexprs: dict) -> int:
    """Warps of a program, from its constexprs (the launch and kernels/compile_check.py use the
    same count). Copy variants (store_kv QUANT off, store_mla MODE 0): one warp per 256 elements
    of the BLOCK_T x BLOCK_C tile, so a thread moves >= 16 bytes (128-bit loads and stores),
    at most 8 warps (4 for the MLA row copy: 8 spill on sm_80 with fp32 + loc_map + DCP).
    Quantising variants: 16 warps for a 4K-element tile (8 elements a thread: the exact fp8 /
    e2m1 rounding keeps more values live, 16 warps keep it under 64 registers with no spill),
    scaled down with the store_kv tile; vLLM's head-major layout twice that. Limits checked by
    tests/test_compile.py."""
    elems = constexprs.get("BLOCK_T", 1) * constexprs.get("BLOCK_C", 0)
    mla_copy = constexprs.get("MODE", -1) == 0
    if is_copy(constexprs):
        w = max(1, min(4 if mla_copy else 8, elems // 256))
    elif constexprs.get("QUANT") is True and elems:
        w = max(1, min(16, elems // 256))
    else:
        w = 16
    if constexprs.get("VX", 0) and constexprs.get("CHECK") != 1:
        # vLLM's head-major layout: its V stores are strided (one address per element), twice
        # the warps keep those addresses under 64 registers (assert variants double below)
        w = min(32, w * 2)
    if constexprs.get("CHECK") == 1:
        # assert variants are debug builds (the device assert keeps its arguments live): twice
        # the warps (4x for the MLA row copy), so they too stay <= 64 registers with no spill
        w = min(32, w * (4 if mla_copy else 2))
    return w


def is_copy(constexprs: dict) -> bool:
    """A plain copy variant (store_kv without QUANT, store_mla MODE 0)."""
    return constexprs.get("QUANT") is False or constexprs.get("MODE", -1) == 0


def launch(kernel, grid, a, reference=None, options=None, device=None, check_first=False,
           **kwargs) -> None:
    """Launch with the assert variant built in debug mode (a device assert on a GPU), on
    `device` (default: the locs'; Triton launches on the current one) with `options`
    (default: `num_warps` of the constexprs; kernels/compile_check.py compiles the same).
    Under the interpreter a fired assert becomes a KernelAssertion carrying the first bad token,
    from `reference` (raises the call's OutOfBoundsWrite; default: the loc check of `a`);
    `check_first`: run `reference` before the kernel (no program writes on a bad call)."""
    if not triton_interpreting():
        kwargs.update(options if options is not None else {"num_warps": num_warps(kwargs)})
        device = device if device is not None else a.locs.loc.device
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                _launch(kernel, grid, a, kwargs, reference, check_first)
            return
    _launch(kernel, grid, a, kwargs, reference, check_first)


def _launch(kernel, grid, a, kwargs: dict, reference, check_first: bool) -> None:
    """`launch` on the current device."""
    if a.check.mode != "assert":
        kernel[grid](**kwargs)
        return
    if not triton_interpreting():
        kernel[grid](**kwargs, debug=True)
        return
    reference = reference or (lambda: _check_locs(a))
    if check_first:
        _as_kernel_assertion(reference, None)
    try:
        kernel[grid](**kwargs)
    except Exception as exc:
        if "kvwrite: store loc outside the pool" not in str(exc):
            raise
        _as_kernel_assertion(reference, exc)
        raise


def _check_locs(a) -> None:
    """The reference loc check of a validated store `a` (raises its OutOfBoundsWrite)."""
    from kvwrite.reference import _locs

    r = _locs.resolve(a.locs, a.geometry.capacity, a.check, a.geometry.pool_page_size)
    _locs.check(r, a.geometry, a.check)


def _as_kernel_assertion(reference, cause) -> None:
    """Run `reference`; its OutOfBoundsWrite is raised again as a KernelAssertion."""
    try:
        reference()
    except OutOfBoundsWrite as err:
        raise KernelAssertion(err.op, err.token_index, err.loc, err.page, err.num_pages,
                              err.pool_page_size, err.count, err.kind, err.target, err.limit,
                              batch=err.batch, position=err.position, table_slot=err.table_slot,
                              table_page=err.table_page) from cause


# (finite max, mantissa bits, smallest normal exponent) of each fp8 storage format.
# e4m3fnuz (bias 8, max 240) is told apart by its max inside `fp8_bits`.
_FP8_FORMAT = {torch.float8_e4m3fn: (448.0, 3, -6), torch.float8_e5m2: (57344.0, 2, -14),
               torch.float8_e4m3fnuz: (240.0, 3, -7)}


def fp8_constexprs(dtype: torch.dtype) -> dict:
    """FMAX/MANT/EMIN constexprs for `round_to_fp8` (zeros for a non-fp8 cache)."""
    fmax, mant, emin = _FP8_FORMAT.get(dtype, (0.0, 0, 0))
    return dict(FMAX=fmax, MANT=mant, EMIN=emin)
