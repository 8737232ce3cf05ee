"""FlashInfer's page-table append calls (`flashinfer.page`) on kvwrite's kernels.

Each function takes FlashInfer's arguments in FlashInfer's order with its defaults, plus
keyword-only `check` ("off" | "assert" | "guard"; None = the process default), `errors` (an
ErrorBuffer for guard mode) and `backend`. Addressing is `kvwrite.PageTable`, resolved in every
backend's kernel prologue: token i goes to row `positions[i] % page_size` of page
`kv_indices[kv_indptr[b] + positions[i] // page_size]`, b = `batch_indices[i]`.

Where kvwrite differs from FlashInfer (and why):
- assert/guard catch a batch index outside [0, batch_size), a page-table slot outside the
  request's pages or outside kv_indices, and a page outside the pool (FlashInfer checks none);
  off mode skips tokens whose batch index or slot would read kv_indptr / kv_indices out of
  bounds (FlashInfer reads them) -- a valid call writes the same bytes.
- index tensors may be int32 or int64 (FlashInfer casts them to int32 with `.int()`, a copy).
- the cache must have the inputs' dtype, or be the same fp8 dtype as fp8 inputs (a byte copy):
  FlashInfer reinterprets the inputs' memory as the cache dtype without a check, so a bf16 key
  into an fp8 cache is refused here (quantise with `kvwrite.store_kv(..., k_scale=...)`).
- `append_paged_mla_kv_cache` takes any ckv/kpe width (FlashInfer's kernel: 512/64 only).
- `get_batch_indices_positions` writes batch -1 / position -1 to entries past
  `append_indptr[-1]` (FlashInfer leaves them uninitialised): assert/guard report such an entry as
  a bad batch index, off mode skips it.
- `kv_last_page_len` is checked (shape, dtype, device) but, as in FlashInfer's append kernels,
  not used for addressing.
"""
from __future__ import annotations

from typing import Tuple, Union

import torch

from kvwrite import validate
from kvwrite.errors import ErrorBuffer
from kvwrite.ops import kv as kv_op
from kvwrite.ops.kv import store_kv
from kvwrite.pagetable import PageTable

LAYOUTS = ("NHD", "HND")

__all__ = ["append_paged_kv_cache", "append_paged_mla_kv_cache", "get_batch_indices_positions",
           "get_seq_lens"]


def _unpack_paged_kv_cache(paged_kv_cache, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) 4-D views of a (k, v) tuple or of one 5-D [P, 2, ...] tensor."""
    if isinstance(paged_kv_cache, torch.Tensor):
        c = validate.tensor("paged_kv_cache", paged_kv_cache, ndim=5)
        if c.shape[1] != 2:
            dims = "[P, 2, page_size, H, D]" if kv_layout == "NHD" else "[P, 2, H, page_size, D]"
            raise ValueError(f"paged_kv_cache as one tensor must be {dims} ({kv_layout}); dim 1 must be 2 "
                             f"(K, V), got shape {list(c.shape)}")
        return c[:, 0], c[:, 1]
    if isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2:
        return paged_kv_cache[0], paged_kv_cache[1]
    raise TypeError("paged_kv_cache must be a (k_cache, v_cache) tuple or one 5-D tensor, got "
                    f"{type(paged_kv_cache).__name__}")


_PLAIN = (torch.float32, torch.float16, torch.bfloat16)   # dtypes stored without byte views


def _check_last_page_len(kv_last_page_len: object, kv_indptr: object, device: torch.device) -> None:
    t = kv_last_page_len   # the common case by one predicate; the checks below name what is wrong
    if (type(t) is torch.Tensor and t.dim() == 1 and t.dtype in validate.LOC_DTYPES and t.device == device
            and type(kv_indptr) is torch.Tensor and kv_indptr.dim() == 1 and kv_indptr.shape[0] == t.shape[0] + 1):
        return
    t = validate.tensor("kv_last_page_len", kv_last_page_len, ndim=1, dtypes=validate.LOC_DTYPES,
                        device=device)
    if isinstance(kv_indptr, torch.Tensor) and kv_indptr.dim() == 1 and kv_indptr.shape[0] != t.shape[0] + 1:
        raise ValueError(f"kv_indptr must have len(kv_last_page_len) + 1 = {t.shape[0] + 1} entries "
                         f"(batch_size + 1), got {kv_indptr.shape[0]}")


def _bit_views(x: torch.Tensor, cache: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 inputs into a cache of the same fp8 dtype: a byte copy, done as a copy of 16-bit pairs
    (kvwrite's copy kernels take 16/32-bit elements)."""
    if x.dtype not in validate.FP8_MAX:
        if cache.dtype in validate.FP8_MAX and x.dtype != cache.dtype:
            raise TypeError(f"{name} is {x.dtype} but its cache is {cache.dtype}: FlashInfer appends values "
                            f"already in the cache dtype; pass {name}.to({cache.dtype}) or quantise "
                            f"with kvwrite.store_kv(..., k_scale=..., v_scale=...)")
        return x, cache
    if cache.dtype != x.dtype:
        raise TypeError(f"{name} is {x.dtype} but its cache is {cache.dtype}: the dtypes must match")
    if x.shape[-1] % 2 or (x.shape[-1] > 1 and (x.stride(-1) != 1 or cache.stride(-1) != 1)):
        raise ValueError(f"fp8 {name} needs an even, contiguous last dim (copied as byte pairs), got "
                         f"{list(x.shape)}")
    return x.view(torch.float16), cache.view(torch.float16)


# store_kv as FlashInfer calls it: errors name FlashInfer's arguments and the call
_APPEND = kv_op.SPEC.adapter("append_paged_kv_cache", {"k": "append_key", "v": "append_value",
                                                       "k_cache": "paged_kv_cache[0]", "v_cache": "paged_kv_cache[1]"})


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor,
                          batch_indices: torch.Tensor, positions: torch.Tensor,
                          paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                          kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                          kv_last_page_len: torch.Tensor, kv_layout: str = "NHD", *,
                          check: str | None = None, errors: ErrorBuffer | None = None,
                          backend: str = "auto") -> None:
    """`flashinfer.page.append_paged_kv_cache`: append K/V rows `[nnz, H, D]` to a paged cache.

    `paged_kv_cache`: a (k_cache, v_cache) tuple of `[P, page_size, H, D]` (NHD) /
    `[P, H, page_size, D]` (HND) tensors, or one `[P, 2, page_size, H, D]` /
    `[P, 2, H, page_size, D]` tensor (`[:, 0]` K, `[:, 1]` V). Token i is written at row
    `positions[i] % page_size` of page `kv_indices[kv_indptr[b] + positions[i] // page_size]`,
    b = `batch_indices[i]`. One fused kvwrite.store_kv launch.
    """
    if type(paged_kv_cache) is tuple and type(kv_layout) is str and type(kv_last_page_len) is torch.Tensor:
        # the usual call (a (k, v) tuple, caches in the inputs' 16/32-bit dtype, a good
        # kv_last_page_len) in one predicate: the store checks the rest
        t = kv_last_page_len
        try:
            k_cache, v_cache = paged_kv_cache
            usual = (kv_layout in LAYOUTS and append_key.dtype in _PLAIN and k_cache.dtype is append_key.dtype
                     and v_cache.dtype is append_value.dtype and t.ndim == 1 and t.dtype in validate.LOC_DTYPES
                     and kv_indptr.shape[0] == t.shape[0] + 1 and t.device == append_key.device)
        except (AttributeError, IndexError, TypeError, ValueError):
            usual = False
        if usual:
            return _APPEND(append_key, append_value, k_cache, v_cache, positions, kv_layout, None, None, check,
                           errors, None, 0, 1, backend, None, None, None, batch_indices, kv_indices, kv_indptr)
    kv_layout = validate.choice("kv_layout", kv_layout, LAYOUTS)
    k_cache, v_cache = _unpack_paged_kv_cache(paged_kv_cache, kv_layout)
    k = validate.tensor("append_key", append_key)
    _check_last_page_len(kv_last_page_len, kv_indptr, k.device)
    k, k_cache = _bit_views(k, k_cache, "append_key")
    v, v_cache = _bit_views(validate.tensor("append_value", append_value), v_cache, "append_value")
    _APPEND(k, v, k_cache, v_cache, positions, kv_layout, None, None, check, errors, None, 0, 1, backend,
            None, None, None, batch_indices, kv_indices, kv_indptr)  # the page table as the schema's tail: no PageTable object


def append_paged_mla_kv_cache(append_ckv: torch.Tensor, append_kpe: torch.Tensor,
                              batch_indices: torch.Tensor, positions: torch.Tensor,
                              ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
                              kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                              kv_last_page_len: torch.Tensor, *, check: str | None = None,
                              errors: ErrorBuffer | None = None, backend: str = "auto") -> None:
    """`flashinfer.page.append_paged_mla_kv_cache`: append compressed KV `[nnz, ckv_dim]` and rope
    keys `[nnz, kpe_dim]` to `ckv_cache` `[P, page_size, ckv_dim]` and `kpe_cache`
    `[P, page_size, kpe_dim]` (two tensors, or two views of one `[P, page_size, ckv + kpe]`
    buffer), any widths. Addressing as `append_paged_kv_cache`; one fused launch (the two caches
    as the K and V sides of a one-head store_kv)."""
    ckv = validate.tensor("append_ckv", append_ckv, ndim=2)
    kpe = validate.tensor("append_kpe", append_kpe, ndim=2, device=ckv.device)
    ckv_cache = validate.tensor("ckv_cache", ckv_cache, ndim=3, device=ckv.device)
    kpe_cache = validate.tensor("kpe_cache", kpe_cache, ndim=3, device=ckv.device)
    if kpe_cache.shape[:2] != ckv_cache.shape[:2]:
        raise ValueError(f"ckv_cache and kpe_cache must have the same [pages, page_size], got "
                         f"{list(ckv_cache.shape)} and {list(kpe_cache.shape)}")
    _check_last_page_len(kv_last_page_len, kv_indptr, ckv.device)
    ckv, ckv_cache = _bit_views(ckv, ckv_cache, "append_ckv")
    kpe, kpe_cache = _bit_views(kpe, kpe_cache, "append_kpe")
    store_kv(ckv[:, None, :], kpe[:, None, :], ckv_cache[:, :, None, :], kpe_cache[:, :, None, :],
             PageTable(batch_indices, positions, kv_indices, kv_indptr), check=check,
             errors=errors, backend=backend)


def get_batch_indices_positions(append_indptr: torch.Tensor, seq_lens: torch.Tensor,
                                nnz: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """`flashinfer.page.get_batch_indices_positions`: int32 (batch_indices, positions) `[nnz]` of
    a ragged append. Entry j of request b (append_indptr[b] <= j < append_indptr[b + 1]) gets
    batch b and position `seq_lens[b] - (append_indptr[b + 1] - j)`: the appended tokens are the
    last ones of a request whose length (after the append) is seq_lens[b]. Entries past
    append_indptr[-1] get -1 / -1. No host sync."""
    indptr = validate.tensor("append_indptr", append_indptr, ndim=1, dtypes=validate.LOC_DTYPES)
    lens = validate.tensor("seq_lens", seq_lens, ndim=1, dtypes=validate.LOC_DTYPES, device=indptr.device)
    if isinstance(nnz, bool) or not isinstance(nnz, int) or nnz < 0:
        raise ValueError(f"nnz must be an int >= 0, got {nnz!r}")
    batch = indptr.shape[0] - 1
    if batch < 0 or lens.shape[0] != batch:
        raise ValueError(f"seq_lens must have len(append_indptr) - 1 = {batch} entries, got {lens.shape[0]}")
    j = torch.arange(nnz, device=indptr.device, dtype=torch.int64)
    if batch == 0:
        full = torch.full((nnz,), -1, dtype=torch.int32, device=indptr.device)
        return full, full.clone()
    ends = indptr[1:].to(torch.int64)
    b = torch.searchsorted(ends, j, right=True)
    valid = b < batch
    bc = b.clamp(max=batch - 1)
    pos = lens.to(torch.int64)[bc] - (ends[bc] - j)
    minus = torch.full_like(j, -1)
    return (torch.where(valid, b, minus).to(torch.int32),
            torch.where(valid, pos, minus).to(torch.int32))


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor,
                 page_size: int) -> torch.Tensor:
    """`flashinfer.page.get_seq_lens`: each request's length, `max(pages - 1, 0) * page_size +
    kv_last_page_len` (the engine's page size: FlashInfer's convention)."""
    indptr = validate.tensor("kv_indptr", kv_indptr, ndim=1, dtypes=validate.LOC_DTYPES)
    last = validate.tensor("kv_last_page_len", kv_last_page_len, ndim=1, dtypes=validate.LOC_DTYPES,
                           device=indptr.device)
    return torch.clamp(indptr[1:] - indptr[:-1] - 1, min=0) * page_size + last
