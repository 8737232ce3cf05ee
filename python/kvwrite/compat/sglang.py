"""SGLang's KV pool stores (`sglang.srt.mem_cache.memory_pool`) on kvwrite's kernels.

SGLang's pools hold one flat buffer per layer, `[size + page_size, ...]` rows: `loc` is the row,
and page 0 (rows `[0, page_size)`) is the padding page that dummy writes land in, so a loc of 0
is a valid write for the MHA and indexer stores. The MLA store (`set_mla_kv_buffer`) skips loc 0
instead, as SGLang's MLA kernels do (`reserved_skip_index=0`: slot 0 is reserved padding). Each function takes the layer's buffer(s), then SGLang's arguments in SGLang's
order, plus keyword-only `dtype` (the torch fp8 dtype of a pool stored as uint8: SGLang's
`dtype` beside its uint8 `store_dtype`), `check` ("off" | "assert" | "guard"; None = the process
default), `errors` and `backend`. The buffer is viewed as `[(size + page_size) / page_size,
page_size, ...]` pages, so errors name SGLang's pages; the bounds are the buffer's rows.

Where kvwrite differs from SGLang (and why):
- fp8 pools: kvwrite stores saturate(x / scale) computed in fp32 with one rounding. SGLang
  divides in the input dtype (`cache_k.div_(k_scale)`, a bf16/fp16 rounding first) and casts
  with `.to(fp8)` (torch 2.14: saturates to 448 for e4m3fn, but overflows to inf for e5m2,
  where kvwrite stores 57344). The bytes are equal whenever x / scale is exact in the input
  dtype (no scale, a power-of-two scale, or fp32 inputs) and, for e5m2, within its range.
- SGLang divides the caller's `cache_k` / `cache_v` in place; kvwrite leaves the inputs as they
  are.
- the indexer (`set_index_k_buffer`) quantises with scale = max(amax, 1e-4) / 448, the division
  vLLM's CUDA kernel does; SGLang's Triton quantiser multiplies by 1/448 (1 ulp apart in about
  half the blocks; with "ue8m0" the power-of-two rounding almost always hides it).
- assert/guard catch a loc outside `[0, size + page_size)` (SGLang #33348, SGLang #33816: writes past
  the pool or before it), where SGLang's index_put asserts on the device or its Triton stores
  write out of bounds. Off mode skips negative locs. SGLang's Triton/CUDA stores turn loc -1
  into a write one row before the buffer; its torch paths (`buffer[loc] = x`, the CPU engine)
  write loc -1 into the buffer's last row, as Python indexing wraps it.
- DeepSeek V4.1 fp4 records with `freqs_cis` (`set_dsv4_v41_fp4_key_buffer`): the RoPE tail is
  rotated with each product and sum rounded to fp32, as SGLang's torch `rope_tail` does; its CUDA
  kernel may contract them into FMAs (a different bf16 only where that moves the fp32 result
  across a bf16 rounding boundary). NaN / inf: SGLang's kernel leaves them unhandled, kvwrite
  stores its special-value rule (`kvwrite.reference.dsv4_fp4`).
- DeepSeek V4.1 fp8 records (`set_dsv4_v41_fp8_key_buffer`): quantised in torch
  (`kvwrite.reference.dsv4.quantize_v41_fp8`), then a bounds-checked byte copy; NaN / inf:
  kvwrite's special-value rule (SGLang's oracle turns a non-finite amax into the ue8m0 NaN byte).
- The fp4 indexer (`set_fp4_index_k_buffer`) copies SGLang's own quantised bytes: kvwrite's
  `store_dsv4_indexer_k(fmt="mxfp4")` writes the same layout but a zero code keeps its sign
  (SGLang: 0x0), the scale floor is max(amax, 1e-4) / 6 (SGLang: max(amax / 6, 1e-4)) and ties go
  to even (SGLang's c4 pools: toward zero).
- NaN into an fp8 pool: kvwrite stores the format's positive NaN code (0x7F for e4m3fn and
  e5m2); SGLang's `.to(fp8)` keeps the NaN's sign bit, so a negative NaN (what 0/0 gives on
  x86, and any NaN coming from bf16) is stored as 0xFF.
"""
from __future__ import annotations

import math

import torch

from kvwrite import validate
from kvwrite.compat._common import FP8_DTYPES, as_fp8, byte_pairs, scale_tensor
from kvwrite.errors import ErrorBuffer
from kvwrite.geometry import require_positive_int
from kvwrite.ops.indexer_k import row_bytes, store_indexer_k
from kvwrite.ops.kv import store_kv
from kvwrite.ops.mla import store_mla

__all__ = ["move_kv_cache", "set_dsv4_key_buffer", "set_dsv4_norm_rope_key_buffer", "set_dsv4_v41_fp4_key_buffer",
           "set_dsv4_v41_fp8_key_buffer", "set_fp4_index_k_buffer", "set_index_k_buffer", "set_index_k_scale_buffer", "set_kv_buffer", "set_mla_kv_buffer",
           "store_page_parts"]

INDEX_HEAD_DIM = 128     # SGLang's NSA indexer: head_dim 128, one fp32 scale per 128 values
INDEX_BLOCK = 128


def _pool_dtype(name: str, buffer: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The pool's element dtype (a uint8 buffer needs `dtype=`, its fp8 type)."""
    if buffer.dtype == torch.uint8:
        if dtype not in FP8_DTYPES:
            raise TypeError(f"{name} is stored as uint8: pass dtype= the pool's fp8 dtype "
                            f"(torch.float8_e4m3fn or torch.float8_e5m2), got {dtype}")
        return dtype
    if dtype is not None and dtype != buffer.dtype:
        raise TypeError(f"dtype={dtype} does not match {name}'s dtype {buffer.dtype}")
    return buffer.dtype


def _pages(name: str, buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """`[rows, ...]` -> `[rows / page_size, page_size, ...]` (a view)."""
    rows = buffer.shape[0]
    if rows % page_size or rows < page_size:
        raise ValueError(f"{name} has {rows} rows, not a whole number of pages of page_size="
                         f"{page_size} (SGLang allocates size + page_size rows, size a multiple of "
                         f"page_size)")
    return buffer.unflatten(0, (rows // page_size, page_size))


def set_kv_buffer(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
                  cache_k: torch.Tensor, cache_v: torch.Tensor, page_size: int,
                  k_scale: float | torch.Tensor | None = None,
                  v_scale: float | torch.Tensor | None = None, *, dtype: torch.dtype | None = None,
                  check: str | None = None, errors: ErrorBuffer | None = None,
                  backend: str = "auto") -> None:
    """`MHATokenToKVPool.set_kv_buffer` for one layer: `cache_k` / `cache_v` `[N, H, D]` written
    at rows `loc` of `k_buffer` / `v_buffer` `[size + page_size, H, D]`.

    Inputs in the pool's dtype are stored as they are (fp8 inputs into an fp8 pool too). Other
    float inputs: an fp8 pool stores saturate(x / scale) (scale 1 when None; a float or an fp32
    `[]`/`[1]`/`[H]` tensor); a bf16/fp16/fp32 pool stores (x / scale).to(pool dtype) (the
    division in fp32). One fused `kvwrite.store_kv` launch (plus a cast for the rare float pool
    of another dtype).
    """
    page_size = require_positive_int("page_size", page_size)
    k_buffer = validate.tensor("k_buffer", k_buffer, ndim=3)
    v_buffer = validate.tensor("v_buffer", v_buffer, ndim=3)
    pool = _pool_dtype("k_buffer", k_buffer, dtype)
    _pool_dtype("v_buffer", v_buffer, dtype)
    kb = _pages("k_buffer", k_buffer.view(pool) if k_buffer.dtype == torch.uint8 else k_buffer, page_size)
    vb = _pages("v_buffer", v_buffer.view(pool) if v_buffer.dtype == torch.uint8 else v_buffer, page_size)
    k = validate.tensor("cache_k", cache_k, dtypes=(*validate.FLOAT_INPUTS, *FP8_DTYPES))
    v = validate.tensor("cache_v", cache_v, dtypes=(*validate.FLOAT_INPUTS, *FP8_DTYPES))
    ks, vs = scale_tensor("k_scale", k_scale, k.device), scale_tensor("v_scale", v_scale, k.device)
    if k.dtype == pool:  # SGLang: no conversion, no scale
        if pool in FP8_DTYPES:
            k, kb = byte_pairs("cache_k", k, kb)
            v, vb = byte_pairs("cache_v", v, vb)
        store_kv(k, v, kb, vb, loc, check=check, errors=errors, backend=backend)
        return
    if k.dtype in FP8_DTYPES:
        raise TypeError(f"cache_k is {k.dtype} but the pool is {pool}: fp8 inputs are stored only "
                        f"into a pool of the same fp8 dtype")
    if pool in FP8_DTYPES:
        one = torch.ones((), dtype=torch.float32, device=k.device)
        store_kv(k, v, kb, vb, loc, k_scale=one if ks is None else ks, v_scale=one if vs is None else vs,
                 check=check, errors=errors, backend=backend)
        return
    k = (k.float() / ks if ks is not None else k).to(pool)
    v = (v.float() / vs if vs is not None else v).to(pool)
    store_kv(k, v, kb, vb, loc, check=check, errors=errors, backend=backend)


def _rows2d(name: str, x: object) -> torch.Tensor:
    x = validate.tensor(name, x)
    if x.dim() == 3:
        if x.shape[1] != 1:
            raise ValueError(f"{name} must be [N, 1, dim] or [N, dim], got {list(x.shape)}")
        return x[:, 0]
    if x.dim() != 2:
        raise ValueError(f"{name} must be [N, 1, dim] or [N, dim], got {list(x.shape)}")
    return x


def _skip_reserved(loc: object) -> object:
    """`loc` with SGLang's reserved MLA slot 0 turned into kvwrite's padding loc -1."""
    if isinstance(loc, torch.Tensor) and not loc.is_floating_point() and loc.dtype != torch.bool:
        return loc.masked_fill(loc == 0, -1)
    return loc


def set_mla_kv_buffer(kv_buffer: torch.Tensor, loc: torch.Tensor, cache_k_nope: torch.Tensor,
                      cache_k_rope: torch.Tensor, page_size: int, *, dtype: torch.dtype | None = None,
                      check: str | None = None, errors: ErrorBuffer | None = None,
                      dcp_rank: int = 0, dcp_size: int = 1, backend: str = "auto") -> None:
    """`MLATokenToKVPool.set_mla_kv_buffer` for one layer: row = concat(nope `[N, 1, R]`, rope
    `[N, 1, rope]`; or 2-D) at rows `loc` of `kv_buffer` `[size + page_size, 1, R + rope]`; loc 0
    (SGLang's reserved padding slot) is skipped, like loc -1, except without rope (`cache_k_rope`
    None or 0 wide): SGLang's no-rope kernel (`set_mla_kv_buffer_kernel_norope`, and its torch
    path, kept bit-identical on purpose) takes no skip index and writes loc 0. An fp8 pool (fp8-typed, or uint8
    with `dtype=`) stores saturate(x) in that format (SGLang: `.to(fp8)` without a scale; e5m2
    overflows to inf there). `dcp_rank` / `dcp_size`: a DCP-sharded pool (SGLang's
    `set_mla_kv_buffer_dcp_sharded_triton`): `loc` is the widened (virtual) loc, this rank keeps
    `loc % dcp_size == dcp_rank` at row `loc // dcp_size`; the reserved loc 0 is the widened one.
    One `kvwrite.store_mla` launch."""
    page_size = require_positive_int("page_size", page_size)
    if cache_k_rope is None and isinstance(cache_k_nope, torch.Tensor):
        cache_k_rope = cache_k_nope.new_empty(cache_k_nope.shape[0], 0)
    if not (isinstance(cache_k_rope, torch.Tensor) and cache_k_rope.shape[-1] == 0):
        loc = _skip_reserved(loc)
    buf = validate.tensor("kv_buffer", kv_buffer, ndim=3)
    if buf.shape[1] != 1:
        raise ValueError(f"kv_buffer must be [size + page_size, 1, kv_lora_rank + rope_dim], got "
                         f"{list(buf.shape)}")
    pool = _pool_dtype("kv_buffer", buf, dtype)
    cache = _pages("kv_buffer", buf[:, 0].view(pool) if buf.dtype == torch.uint8 else buf[:, 0], page_size)
    nope, rope = _rows2d("cache_k_nope", cache_k_nope), _rows2d("cache_k_rope", cache_k_rope)
    if pool in FP8_DTYPES:
        if nope.dtype == pool:  # already fp8: a byte copy of the row
            n_pairs = byte_pairs("cache_k_nope", nope, cache)
            r_pairs = byte_pairs("cache_k_rope", rope, cache)
            store_mla(n_pairs[0], r_pairs[0], n_pairs[1], loc, check=check, errors=errors, dcp_rank=dcp_rank,
                      dcp_size=dcp_size, backend=backend)
            return
        one = torch.ones((), dtype=torch.float32, device=nope.device)
        store_mla(nope, rope, cache, loc, kv_cache_dtype="fp8_e4m3" if pool == torch.float8_e4m3fn else "fp8_e5m2",
                  scale=one, check=check, errors=errors, dcp_rank=dcp_rank, dcp_size=dcp_size, backend=backend)
        return
    if nope.dtype != pool:
        nope, rope = nope.to(pool), rope.to(pool)
    store_mla(nope, rope, cache, loc, check=check, errors=errors, dcp_rank=dcp_rank, dcp_size=dcp_size,
              backend=backend)


def set_index_k_buffer(index_buffer: torch.Tensor, loc: torch.Tensor, index_k: torch.Tensor,
                       page_size: int, scale_fmt: str | None = None, *, check: str | None = None,
                       errors: ErrorBuffer | None = None, backend: str = "auto") -> None:
    """The NSA (DSA) indexer store of `NSATokenToKVPool` for one layer: index keys `[N, 128]`
    quantised per 128 values to e4m3 (scale max(amax, 1e-4) / 448; "ue8m0": rounded up to a power
    of two) into the uint8 buffer `[num_pages, page_size * (128 + 4)]` (a page: `page_size * 128`
    fp8 bytes, then `page_size` fp32 scales; page 0 is the padding page). One
    `kvwrite.store_indexer_k` launch."""
    page_size = require_positive_int("page_size", page_size)
    buf = validate.tensor("index_buffer", index_buffer, ndim=2, dtypes=(torch.uint8,))
    k = validate.tensor("index_k", index_k, ndim=2)
    want = page_size * row_bytes(k.shape[1], INDEX_BLOCK) if k.shape[1] % INDEX_BLOCK == 0 else None
    if want is None or buf.shape[1] != want:
        raise ValueError(f"index_buffer must be [num_pages, page_size * (head_dim + head_dim / 128 * 4)]"
                         f" = [*, {want}] for page_size={page_size} and index_k {list(k.shape)}, got "
                         f"{list(buf.shape)}")
    store_indexer_k(k, buf, loc, quant_block_size=INDEX_BLOCK, scale_fmt=scale_fmt, check=check,
                    errors=errors, backend=backend)


_PART_MAPS: dict[tuple, torch.Tensor] = {}


def _part_map(device: torch.device, num_pages: int, page_size: int, page_bytes: int, offset: int,
              stride: int) -> torch.Tensor:
    """loc -> row of the `[bytes / stride, W]` view whose row holds loc's part (cached per shape):
    page * page_bytes / stride + offset / stride + loc % page_size."""
    key = (device, num_pages, page_size, page_bytes, offset, stride)
    m = _PART_MAPS.get(key)
    if m is None:
        loc = torch.arange(num_pages * page_size, device=device, dtype=torch.int64)
        m = _PART_MAPS[key] = (torch.div(loc, page_size, rounding_mode="floor") * (page_bytes // stride)
                               + offset // stride + loc % page_size)
    return m


def store_page_parts(buffer: torch.Tensor, loc: torch.Tensor, parts, page_size: int, *,
                     check: str | None = None, errors: ErrorBuffer | None = None,
                     backend: str = "auto") -> None:
    """Scatter already-quantised token bytes into a page-major uint8 buffer `[num_pages,
    page_bytes]`: `parts` is a sequence of (`src` uint8 `[N, W]`, `offset`, `stride`): token
    `loc`'s part lands at byte `offset + (loc % page_size) * stride` of page `loc // page_size`
    (e.g. SGLang's index-K page: 128 key bytes a token from byte 0, then its 4 scale bytes from
    byte page_size * 128). One `kvwrite.store_rows` per part on a `[bytes / stride, W]` row view
    of the buffer, `loc_map` taking loc to its row, so locs are checked against the buffer's
    `num_pages * page_size` locs and errors name SGLang's loc; -1 is padding (skipped). The first
    part is checked (and recorded, in guard mode); the others write the tokens it wrote (in range,
    the first writer of a duplicated loc) without recording them again."""
    from kvwrite.ops.dsv4 import store_rows

    page_size = require_positive_int("page_size", page_size)
    buf = validate.tensor("buffer", buffer, ndim=2, dtypes=(torch.uint8,))
    if not buf.is_contiguous():
        raise ValueError("buffer must be contiguous (SGLang's page buffers are)")
    num_pages, page_bytes = buf.shape
    flat = buf.view(-1)
    mode = validate.default_check() if check is None else check
    later = loc
    for i, (src, offset, stride) in enumerate(parts):
        if i == 1 and mode != "off":
            later, check, errors = _written_locs(loc, num_pages * page_size), "off", None
        src = validate.tensor(f"parts[{i}]", src, ndim=2, dtypes=(torch.uint8,))
        w = src.shape[1]
        if page_bytes % stride or offset % stride or w > stride or offset + page_size * stride > page_bytes:
            raise ValueError(f"parts[{i}]: {w} bytes every {stride} from byte {offset} do not fit "
                             f"{page_size} tokens in a {page_bytes}-byte page")
        rows = flat.as_strided((flat.numel() // stride, w), (stride, 1))
        store_rows(src, rows, later, loc_map=_part_map(buf.device, num_pages, page_size, page_bytes, offset, stride),
                   check=check, errors=errors, backend=backend)


def _written_locs(loc: torch.Tensor, n_locs: int) -> torch.Tensor:
    """`loc` with -1 wherever a checked store writes nothing: outside `[0, n_locs)`, or a later
    token of a duplicated loc (the first writer kept: `reference.claims.first_writers`, the rule
    of kvwrite's guard). On the device, no host sync."""
    from kvwrite.reference.claims import first_writers

    loc = loc.to(torch.int64)
    ok = (loc >= 0) & (loc < n_locs)
    dup, _ = first_writers(loc, ok)
    return torch.where(ok & ~dup, loc, torch.full_like(loc, -1))


def _bytes(name: str, t: torch.Tensor, n: int) -> torch.Tensor:
    """A tensor of N rows as its uint8 bytes `[N, row bytes]` (contiguous rows)."""
    t = validate.tensor(name, t)
    if t.dim() == 1:
        t = t.unsqueeze(1)
    width = (t.numel() // n if n else math.prod(t.shape[1:])) * t.element_size()     # 0 tokens too
    return t.contiguous().view(torch.uint8).reshape(n, width)


def set_index_k_scale_buffer(index_buffer: torch.Tensor, loc: torch.Tensor, index_k: torch.Tensor,
                             index_k_scale: torch.Tensor, page_size: int, *, check: str | None = None,
                             errors: ErrorBuffer | None = None, backend: str = "auto") -> None:
    """SGLang's `SetKAndS` of the DSA index-K cache (`DSATokenToKVPool.set_index_k_scale_buffer`,
    DeepSeek V4's indexer pool alike): index keys SGLang has already quantised (`index_k` e4m3
    `[N, 128]`, `index_k_scale` fp32 `[N]` or `[N, 1]`) copied byte for byte into the uint8 page
    buffer `[num_pages, page_size * (128 + 4)]` (a page: page_size * 128 key bytes, then page_size
    fp32 scales). `store_page_parts`: bounds-checked against num_pages * page_size locs."""
    n = validate.tensor("index_k", index_k, ndim=2).shape[0]
    if index_k.shape[1] != INDEX_HEAD_DIM or index_k.dtype not in FP8_DTYPES:
        raise ValueError(f"index_k must be fp8 [N, {INDEX_HEAD_DIM}], got {index_k.dtype} {list(index_k.shape)}")
    scale = validate.tensor("index_k_scale", index_k_scale, dtypes=(torch.float32,))
    if scale.numel() != n:
        raise ValueError(f"index_k_scale must hold one fp32 scale per token ({n}), got {list(scale.shape)}")
    key = _bytes("index_k", index_k, n)
    store_page_parts(index_buffer, loc, ((key, 0, INDEX_HEAD_DIM), (_bytes("index_k_scale", scale, n),
                                         page_size * INDEX_HEAD_DIM, 4)),
                     page_size, check=check, errors=errors, backend=backend)


def set_dsv4_key_buffer(kv_buffer: torch.Tensor, loc: torch.Tensor, k_nope_fp8: torch.Tensor,
                        k_rope_bf16: torch.Tensor, scale_k_nope_ue8m0: torch.Tensor, page_size: int, *,
                        check: str | None = None, errors: ErrorBuffer | None = None,
                        backend: str = "auto") -> None:
    """SGLang's DeepSeek V4 `SetKAndS` (`DeepSeekV4SingleKVPool.set_key_buffer`, the SWA, c4 and
    c128 pools): a quantised pack (`k_nope_fp8` e4m3 `[N, 448]`, `k_rope_bf16` `[N, 64]`,
    `scale_k_nope_ue8m0` uint8 `[N, 7]`) copied into the FlashMLA MODEL1 page
    (`kvwrite.reference.dsv4`: 576-byte data rows, then 8-byte scale rows whose pad byte is not
    written). `store_page_parts`: bounds-checked against num_pages * page_size locs."""
    from kvwrite.facts import DATA_ROW, NOPE, ROPE, SCALE_ROW, TILES

    n = validate.tensor("k_nope_fp8", k_nope_fp8, ndim=2).shape[0]
    nope, rope = _bytes("k_nope_fp8", k_nope_fp8, n), _bytes("k_rope_bf16", k_rope_bf16, n)
    scales = _bytes("scale_k_nope_ue8m0", scale_k_nope_ue8m0, n)
    if (nope.shape[1], rope.shape[1], scales.shape[1]) != (NOPE, 2 * ROPE, TILES):
        raise ValueError(f"the pack must be [N, {NOPE}] e4m3, [N, {ROPE}] bf16 and [N, {TILES}] uint8, got "
                         f"{list(k_nope_fp8.shape)}, {list(k_rope_bf16.shape)}, {list(scale_k_nope_ue8m0.shape)}")
    store_page_parts(kv_buffer, loc, ((torch.cat([nope, rope], 1), 0, DATA_ROW),
                                      (scales, page_size * DATA_ROW, SCALE_ROW)),
                     page_size, check=check, errors=errors, backend=backend)


FP4_INDEX_PAYLOAD = 64    # SGLang's fp4 index-K slot: 64 bytes of e2m1 (128 values), then 4 ue8m0 bytes


def set_fp4_index_k_buffer(index_buffer: torch.Tensor, loc: torch.Tensor, k_fp4: torch.Tensor,
                           k_sf: torch.Tensor, page_size: int, *, check: str | None = None,
                           errors: ErrorBuffer | None = None, backend: str = "auto") -> None:
    """DeepSeek V4's fp4 index-K cache (`DeepSeekV4IndexerPool.set_index_fp4`, SGLang's
    `store_fp4_index_k_cache`): keys SGLang's `quantize_fp4_indexer_tensor` has quantised
    (`k_fp4` int8/uint8 `[N, 64]` packed e2m1, `k_sf` int32 `[N]`: four ue8m0 bytes, group j in
    bits 8j..8j+7) copied byte for byte into the uint8 page buffer `[num_pages, page_size * 68]`
    (a page: page_size * 64 payload bytes, then page_size * 4 scale bytes, the int32's bytes in
    memory order, as SGLang's kernel stores them). `store_page_parts`: bounds-checked against
    num_pages * page_size locs."""
    n = validate.tensor("k_fp4", k_fp4, ndim=2).shape[0]
    if k_fp4.shape[1] != FP4_INDEX_PAYLOAD or k_fp4.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"k_fp4 must be int8/uint8 [N, {FP4_INDEX_PAYLOAD}], got {k_fp4.dtype} {list(k_fp4.shape)}")
    sf = validate.tensor("k_sf", k_sf, dtypes=(torch.int32,))
    if sf.numel() != n:
        raise ValueError(f"k_sf must hold one int32 of four ue8m0 bytes per token ({n}), got {list(sf.shape)}")
    store_page_parts(index_buffer, loc, ((_bytes("k_fp4", k_fp4, n), 0, FP4_INDEX_PAYLOAD),
                                         (_bytes("k_sf", sf, n), page_size * FP4_INDEX_PAYLOAD, 4)),
                     page_size, check=check, errors=errors, backend=backend)


def _rope_tail(cache_k: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """`cache_k` `[N, 512]` with its last 64 values rotated by the per-token `freqs_cis` (`[N, 32]`
    complex or `[N, 64]` fp32, real / imag interleaved): pairs (2i, 2i + 1) as complex numbers
    times freqs_cis[i], every product and sum rounded to fp32, then to cache_k's dtype (SGLang's
    V4.1 store rotates, rounds to the input dtype, then quantises; an fp32 cache_k stays fp32)."""
    from kvwrite.facts import NOPE, ROPE

    f = validate.tensor("freqs_cis", freqs_cis)
    if f.is_complex():
        f = torch.view_as_real(f).flatten(-2)
    if f.dim() != 2 or f.shape != (cache_k.shape[0], ROPE) or f.dtype != torch.float32:
        raise ValueError(f"freqs_cis must be [N, {ROPE // 2}] complex64 or [N, {ROPE}] fp32 for cache_k "
                         f"{list(cache_k.shape)}, got {f.dtype} {list(freqs_cis.shape)}")
    tail = cache_k[:, NOPE:].float()
    x, y, c, s = tail[:, 0::2], tail[:, 1::2], f[:, 0::2], f[:, 1::2]
    rotated = torch.stack((x * c - y * s, x * s + y * c), -1).flatten(-2)
    return torch.cat([cache_k[:, :NOPE], rotated.to(cache_k.dtype)], -1)


def _rms_norm(kv: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 `kv * rsqrt(mean(kv^2) + eps) * weight` over the last dim, as SGLang's fused K norm
    computes it (fp32 registers, not rounded to the input dtype)."""
    x = kv.float()
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) / x.shape[-1] + eps) * weight.float()


def set_dsv4_norm_rope_key_buffer(kv_buffer: torch.Tensor, loc: torch.Tensor, kv: torch.Tensor,
                                  kv_weight: torch.Tensor, eps: float, freqs_cis: torch.Tensor,
                                  positions: torch.Tensor, page_size: int, *, layout: str = "v4",
                                  check: str | None = None, errors: ErrorBuffer | None = None,
                                  backend: str = "auto") -> None:
    """`DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused_norm_rope` (SGLang's JIT
    `fused_k_norm_rope_flashmla`): RMSNorm of `kv` `[N, 512]` with `kv_weight` `[512]`, RoPE of its
    last 64 values by `freqs_cis[positions]` (the full `[max_pos, 32]` complex64 table), then the
    `layout` record at `loc`. "v4": the norm and the rotation stay fp32 and `store_dsv4_kv`
    quantises the NoPE values and rounds the RoPE values from fp32, as the fused kernel does from
    its registers; "v41_fp4" / "v41_fp4_new": the normed values rounded to kv's dtype, rotated,
    rounded again, then the V4.1 fp4 record (`set_dsv4_v41_fp4_key_buffer`), as SGLang's V4.1
    branch. The fp32 norm is torch's reduction order and rsqrt, not the kernel's: a value that
    lands on an fp8 / bf16 rounding boundary can differ. A position outside `freqs_cis` is torch's
    index error (SGLang's kernel reads past the table)."""
    from kvwrite.ops.dsv4 import store_dsv4_kv

    x = validate.tensor("kv", kv, ndim=2)
    w = validate.tensor("kv_weight", kv_weight, ndim=1, device=x.device)
    if w.shape[0] != x.shape[-1]:
        raise ValueError(f"kv_weight must be [{x.shape[-1]}] (one weight per kv value), got {list(w.shape)}")
    pos = validate.tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64), device=x.device)
    if pos.shape[0] != x.shape[0]:
        raise ValueError(f"positions must have one entry per kv row ({x.shape[0]}), got {list(pos.shape)}")
    rows = validate.tensor("freqs_cis", freqs_cis, ndim=2, device=x.device)[pos.long()]
    normed = _rms_norm(x, w, float(eps))
    if layout == "v4":
        store_dsv4_kv(_rope_tail(normed, rows), kv_buffer, loc, page_size=page_size, check=check, errors=errors,
                      backend=backend)
    elif layout in V41_LAYOUTS:
        write, interleaved = V41_LAYOUTS[layout]
        write(kv_buffer, loc, normed.to(x.dtype), page_size, rows, interleaved=interleaved, check=check,
              errors=errors, backend=backend)
    else:
        raise ValueError(f"layout must be 'v4' or one of {sorted(V41_LAYOUTS)}, got {layout!r}")


def set_dsv4_v41_fp4_key_buffer(kv_buffer: torch.Tensor, loc: torch.Tensor, cache_k: torch.Tensor,
                                page_size: int, freqs_cis: torch.Tensor | None = None, *,
                                interleaved: bool = False, check: str | None = None,
                                errors: ErrorBuffer | None = None, backend: str = "auto") -> None:
    """`DeepSeekV4SingleKVPool.set_key_buffer_fused` of a V4.1 fp4 pool (SGLang's JIT
    `fused_store_cache(type="flashmla", layout=V41_FP4 / V41_FP4_NEW)`): `cache_k` `[N, 512]`
    quantised into the 288-byte FlashMLA V41_FP4 record, `kvwrite.store_dsv4_kv_fp4(fmt=
    "nvfp4_v41")` (the same encoding: e4m3(clamp(amax / 6, 2^-9)) per 16 values, e2m1 of x over
    the rounded scale, ties to even, the sign kept on a zero code). Block-split (`V41_FP4`): a page
    is page_size data rows of 256 bytes, then page_size scale rows of 32, no padding (page_size *
    288 bytes). `interleaved` (`V41_FP4_NEW`): each token's 256 data bytes, then its 32 scales: the
    buffer is viewed as one-token pages (errors then name the loc as the page). `freqs_cis`: the
    RoPE tail is rotated first (`_rope_tail`), as SGLang's in-kernel RoPE does."""
    from kvwrite.facts import FP4_RECORDS
    from kvwrite.ops.dsv4_fp4 import store_dsv4_kv_fp4

    page_size = require_positive_int("page_size", page_size)
    buf = validate.tensor("kv_buffer", kv_buffer, ndim=2, dtypes=(torch.uint8,))
    token = FP4_RECORDS["nvfp4_v41"].token_bytes
    if buf.shape[1] != page_size * token or not buf.is_contiguous():
        raise ValueError(f"kv_buffer must be contiguous [num_pages, page_size * {token}] = [*, {page_size * token}] "
                         f"(unpadded V4.1 fp4 pages), got {list(buf.shape)}")
    k = validate.tensor("cache_k", cache_k, ndim=2)
    if freqs_cis is not None:
        k = _rope_tail(k, freqs_cis)
    if interleaved:
        buf, page_size = buf.view(-1, token), 1
    store_dsv4_kv_fp4(k, buf, loc, fmt="nvfp4_v41", page_size=page_size, check=check, errors=errors,
                      backend=backend)


def set_dsv4_v41_fp8_key_buffer(kv_buffer: torch.Tensor, loc: torch.Tensor, cache_k: torch.Tensor,
                                page_size: int, freqs_cis: torch.Tensor | None = None, *,
                                interleaved: bool = False, check: str | None = None,
                                errors: ErrorBuffer | None = None, backend: str = "auto") -> None:
    """`DeepSeekV4SingleKVPool.set_key_buffer_fused` of a V4.1 fp8 pool (SGLang's JIT
    `fused_store_cache(type="flashmla", layout=V41 / V41_NEW)`): `cache_k` `[N, 512]` quantised into
    the 528-byte record (`kvwrite.reference.dsv4.quantize_v41_fp8`: e4m3 over a ue8m0 scale per 32
    values, in torch: kvwrite has no kernel for this record yet), its bytes then written by
    `store_page_parts` (bounds-checked, -1 skipped). Block-split (`V41`): a page is page_size data
    rows of 512 bytes, then page_size scale rows of 16, padded to a multiple of 512; `interleaved`
    (`V41_NEW`): each token's 512 data bytes then its 16 scales (the buffer viewed as one-token
    pages: errors then name the loc as the page). `freqs_cis`: the RoPE tail rotated first
    (`_rope_tail`), as SGLang's in-kernel RoPE."""
    from kvwrite.facts import KV_DIM, V41_FP8_SCALES, V41_FP8_TOKEN, v41_fp8_page_bytes
    from kvwrite.reference.dsv4 import quantize_v41_fp8

    page_size = require_positive_int("page_size", page_size)
    buf = validate.tensor("kv_buffer", kv_buffer, ndim=2, dtypes=(torch.uint8,))
    want = v41_fp8_page_bytes(page_size, interleaved)
    if buf.shape[1] != want or not buf.is_contiguous():
        raise ValueError(f"kv_buffer must be contiguous [num_pages, {want}] (V4.1 fp8 pages of {page_size} tokens"
                         f"{', interleaved' if interleaved else ''}), got {list(buf.shape)}")
    k = validate.tensor("cache_k", cache_k, ndim=2, device=buf.device)
    if k.shape[1] != KV_DIM:
        raise ValueError(f"cache_k must be [N, {KV_DIM}], got {list(k.shape)}")
    if freqs_cis is not None:
        k = _rope_tail(k, freqs_cis)
    data, scales = quantize_v41_fp8(k)
    if interleaved:     # a token's record is one 528-byte row
        parts, buf, page_size = ((torch.cat([data, scales], 1), 0, V41_FP8_TOKEN),), buf.view(-1, V41_FP8_TOKEN), 1
    else:
        parts = ((data, 0, KV_DIM), (scales, page_size * KV_DIM, V41_FP8_SCALES))
    store_page_parts(buf, loc, parts, page_size, check=check, errors=errors, backend=backend)


def move_kv_cache(k_buffer, v_buffer, tgt_loc: torch.Tensor, src_loc: torch.Tensor, *,
                  check: str | None = None, errors: ErrorBuffer | None = None, backend: str = "auto") -> None:
    """`MHATokenToKVPool.move_kv_cache(tgt_loc, src_loc)`: in every layer's K and V buffer
    (`k_buffer` / `v_buffer`: one `[rows, ...]` tensor or a list of them, one per layer), row
    `tgt_loc[i]` takes the row that was at `src_loc[i]` (all sources read first, as
    `buf[tgt_loc] = buf[src_loc]`). kvwrite.move_rows per buffer: locs checked against the
    buffer's rows in check="assert"/"guard" (op "move_rows"), where SGLang's copy indexes
    unchecked; a -1 skips the pair."""
    from kvwrite.ops.pages import move_rows

    bufs = []
    for name, group in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        layers = list(group) if isinstance(group, (list, tuple)) else [group]
        for i, b in enumerate(layers):
            b = validate.tensor(f"{name}[{i}]", b)
            if b.dim() < 2:
                raise ValueError(f"{name}[{i}] must be [rows, ...], got shape {list(b.shape)}")
            bufs.append(b)
    for b in bufs:
        move_rows(b.unsqueeze(1), src_loc, tgt_loc, check=check, errors=errors, backend=backend)


# SGLang's V4.1 KVLayout values -> (their kvwrite writer, interleaved)
V41_LAYOUTS = {"v41_fp4": (set_dsv4_v41_fp4_key_buffer, False), "v41_fp4_new": (set_dsv4_v41_fp4_key_buffer, True),
               "v41": (set_dsv4_v41_fp8_key_buffer, False), "v41_new": (set_dsv4_v41_fp8_key_buffer, True)}
