"""vLLM's cache-write ops (`vllm._custom_ops`, csrc/cache_kernels.cu) on kvwrite's kernels.

Each function takes vLLM's arguments in vLLM's order, plus keyword-only `check` ("off" |
"assert" | "guard"; None = the process default), `errors` (an ErrorBuffer for guard mode) and
`backend`. The page size is the cache's `block_size` dim; `slot_mapping[i]` is token i's slot
`block * block_size + offset`.

What matches vLLM (bytes in the cache):
- `kv_cache_dtype` strings: "auto" (cache in the input dtype; scales are ignored), "fp8" /
  "fp8_e4m3" (e4m3fn), "fp8_e5m2"; fp8 caches may be typed uint8, as vLLM allocates them;
  stored = fp8(x / scale), saturated, with fp32 `k_scale` / `v_scale` (`[]`, `[1]`, or `[H]`).
- key/value already in the cache's fp8 format are stored as they are (no scale).
- the number of tokens is `slot_mapping.shape[0]` (key/value may carry padding rows past it).
- any negative slot is skipped in off mode.

Where kvwrite differs (and why):
- check="assert"/"guard" report a slot < -1 (and any slot >= num_blocks * block_size) as an
  out-of-range write: vLLM pads with -1 only, so another negative slot is a bug upstream (an
  encoding with the wrong block size, vLLM #47056); off mode skips it, like vLLM.
- an e5m2 cache ("fp8_e5m2") gets e5m2 codes on every backend (vLLM's Triton path writes e4m3
  codes into it); caches are addressed through their strides everywhere (vLLM's Triton path
  assumes contiguous heads).
- `reshape_and_cache` (legacy head-major layout) honours the caches' strides; vLLM assumes them
  contiguous (identical bytes for contiguous caches).
- `indexer_k_quant_and_cache` takes any head_dim that is a multiple of `quant_block_size`
  (vLLM's kernel: one warp of 4-element vectors per block, i.e. quant_block_size = 128).
- ROCm's "fp8" (e4m3fnuz) is not supported.
- INT4_PER_TOKEN_HEAD (`triton_reshape_and_cache_flash_per_token_head_quant`): vLLM rotates K/V
  with the fp32 butterfly on CPU but with Hadacore / a bf16 Triton matmul on a GPU; kvwrite
  always uses the butterfly (its GPU bytes equal its CPU bytes, and vLLM's CPU bytes).

Where vLLM changed behaviour between releases, the adapter follows `vllm_version` (keyword, or
the module's `VLLM_VERSION`: the `KVWRITE_VLLM_VERSION` environment variable, else the newest
release checked, `NEWEST_VLLM`): `fp8_ds_mla` tile scales are max(amax/448, FLT_MIN) before
`DS_MLA_POW2_SINCE` and 2^ceil(log2(max(amax/448, 1e-4))) from it on.
"""
from __future__ import annotations

import os
import re

import torch

from kvwrite import validate
from kvwrite.compat._common import as_fp8, byte_pairs, scale_tensor
from kvwrite.errors import ErrorBuffer
from kvwrite.geometry import PageGeometry
from kvwrite.ops.indexer_k import row_bytes, store_indexer_k
from kvwrite.ops import kv as kv_op
from kvwrite.ops.kv import store_kv
from kvwrite.ops.kv_head_major import store_kv_head_major
from kvwrite.ops.mla import ds_mla_row_bytes, store_mla

__all__ = ["concat_and_cache_mla", "concat_and_cache_mla_grouped", "cpu_attn_reshape_and_cache", "ds_mla_scale", "indexer_k_quant_and_cache",
           "reshape_and_cache", "reshape_and_cache_flash", "reshape_and_cache_flash_per_token_quant",
           "reshape_and_cache_int4",
           "register_caches", "swap_blocks", "cp_gather_cache",
           "triton_reshape_and_cache_flash_per_token_head_quant"]

NEWEST_VLLM = "0.34.0"          # the newest vLLM release whose cache writers this adapter follows
DS_MLA_POW2_SINCE = (0, 31)     # first vLLM release with power-of-two fp8_ds_mla tile scales (0.30: exact)
VLLM_VERSION = os.environ.get("KVWRITE_VLLM_VERSION") or NEWEST_VLLM


def version_tuple(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a vLLM version string ("0.32.0", "0.11.1rc2+cpu", "v0.9")."""
    if not isinstance(version, str) or not re.match(r"v?\d+(\.\d+)*", version):
        raise ValueError(f"vllm_version must be a version string like '0.32.0', got {version!r}")
    return tuple(int(x) for x in re.match(r"v?(\d+(?:\.\d+)*)", version).group(1).split("."))


def ds_mla_scale(vllm_version: str | None = None) -> str:
    """store_mla's `ds_mla_scale` of vLLM `vllm_version` (None: VLLM_VERSION)."""
    version = version_tuple(vllm_version or VLLM_VERSION)
    return "pow2" if version >= DS_MLA_POW2_SINCE else "exact"


KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
MLA_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")


def _tokens(name: str, x: object, slot_mapping: object) -> torch.Tensor:
    """`x[:len(slot_mapping)]`: vLLM stores slot_mapping.shape[0] tokens."""
    x = validate.tensor(name, x)
    if isinstance(slot_mapping, torch.Tensor) and slot_mapping.dim() == 1 and x.dim() >= 1:
        n = slot_mapping.shape[0]
        if n > x.shape[0]:
            raise ValueError(f"slot_mapping has {n} entries but {name} only {x.shape[0]} tokens")
        return x if n == x.shape[0] else x[:n]
    return x


def _kv_caches(key, value, key_cache, value_cache, kv_cache_dtype, k_scale, v_scale):
    """(key, value, key_cache, value_cache, k_scale, v_scale) as kvwrite.store_kv takes them."""
    fmt = KV_CACHE_DTYPES[validate.choice("kv_cache_dtype", kv_cache_dtype, tuple(KV_CACHE_DTYPES))]
    if fmt is None:
        return key, value, key_cache, value_cache, None, None
    key_cache = as_fp8("key_cache", key_cache, fmt)
    value_cache = as_fp8("value_cache", value_cache, fmt)
    if key.dtype in validate.FP8_MAX:  # already quantised: stored as it is
        key, key_cache = byte_pairs("key", key, key_cache)
        value, value_cache = byte_pairs("value", value, value_cache)
        return key, value, key_cache, value_cache, None, None
    return key, value, key_cache, value_cache, k_scale, v_scale


# store_kv as vLLM calls it: errors name vLLM's arguments and the call
_KV_NAMES = {"k": "key", "v": "value", "k_cache": "key_cache", "v_cache": "value_cache", "loc": "slot_mapping"}
_FLASH = kv_op.SPEC.adapter("reshape_and_cache_flash", _KV_NAMES)
_CPU_ATTN = kv_op.SPEC.adapter("cpu_attn_reshape_and_cache", _KV_NAMES)


def reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            kv_cache_dtype: str, k_scale: torch.Tensor, v_scale: torch.Tensor, *,
                            check: str | None = None, errors: ErrorBuffer | None = None,
                            backend: str = "auto") -> None:
    """`torch.ops._C_cache_ops.reshape_and_cache_flash`: key/value `[N, H, D]` into caches of
    shape `[num_blocks, block_size, H, D]`, or any stride-permuted view of it (vLLM's HND
    allocation; K and V may be two views of one packed `[num_blocks, 2, ...]` buffer). One fused
    `kvwrite.store_kv` launch with the caches' own strides."""
    if (kv_cache_dtype == "auto" and type(key) is torch.Tensor and type(value) is torch.Tensor   # the common
            and type(slot_mapping) is torch.Tensor and key.dim() == 3 and value.dim() == 3  # case: nothing
            and key.shape[0] == value.shape[0] == slot_mapping.shape[0]):                    # to trim or view
        return _FLASH(key, value, key_cache, value_cache, slot_mapping, "NHD", None, None, check, errors, None, 0,
                      1, backend)
    key, value = _tokens("key", key, slot_mapping), _tokens("value", value, slot_mapping)
    key, value, key_cache, value_cache, ks, vs = _kv_caches(key, value, key_cache, value_cache,
                                                            kv_cache_dtype, k_scale, v_scale)
    _FLASH(key, value, key_cache, value_cache, slot_mapping, "NHD", ks, vs, check, errors, None, 0, 1, backend)


CPU_ATTN_ISAS = ("vec", "vec16", "neon")   # ISAs whose caches use the column-major key layout


def cpu_attn_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, slot_mapping: torch.Tensor, isa: str,
                               k_scale: float = 1.0, v_scale: float = 1.0,
                               kv_cache_dtype: str = "auto", *, check: str | None = None,
                               errors: ErrorBuffer | None = None, backend: str = "auto") -> None:
    """`torch.ops._C.cpu_attn_reshape_and_cache` (vLLM's CPU attention backend): key/value
    `[N, H, D]` into `key_cache, value_cache = kv.view(blocks, H, 2 * bs, D).chunk(2, dim=2)`,
    each `[num_blocks, H, block_size, D]`: the value tile of a (block, head) row-major, the key
    tile column-major (element (t, d) at d * block_size + t). One `kvwrite.store_kv` launch with
    layout "cpu_attn". `isa` names the CPU kernel vLLM picked: "vec", "vec16" and "neon" share
    this layout; "amx" / "amx_fp8" pack their tiles differently and are refused.

    fp8 ("fp8" / "fp8_e4m3" / "fp8_e5m2", uint8 caches): kvwrite stores saturate(x / scale)
    rounded to nearest even; vLLM's CPU kernel multiplies by 1/scale and truncates the mantissa
    (codes one step toward zero in about half the cases), stores -0 as +0 and NaN as the
    format's max. The bytes agree for "auto" caches."""
    if (kv_cache_dtype == "auto" and isa in CPU_ATTN_ISAS and type(key) is torch.Tensor      # the common
            and type(value) is torch.Tensor and type(slot_mapping) is torch.Tensor     # case: nothing
            and key.dim() == 3 and value.dim() == 3                                   # to trim or view
            and key.shape[0] == value.shape[0] == slot_mapping.shape[0]):
        return _CPU_ATTN(key, value, key_cache, value_cache, slot_mapping, "cpu_attn", None, None, check, errors,
                         None, 0, 1, backend)
    isa = validate.choice("isa", isa, CPU_ATTN_ISAS + ("amx", "amx_fp8", "vxe", "rvv", "vsx"))
    if isa not in CPU_ATTN_ISAS:
        raise NotImplementedError(f"isa={isa!r}: vLLM packs this ISA's cache tiles in its own "
                                  f"layout; kvwrite writes the {CPU_ATTN_ISAS} layout")
    key, value = _tokens("key", key, slot_mapping), _tokens("value", value, slot_mapping)
    fmt = KV_CACHE_DTYPES[validate.choice("kv_cache_dtype", kv_cache_dtype, tuple(KV_CACHE_DTYPES))]
    ks = vs = None
    if fmt is not None:
        key_cache = as_fp8("key_cache", key_cache, fmt)
        value_cache = as_fp8("value_cache", value_cache, fmt)
        ks = scale_tensor("k_scale", k_scale, key.device)
        vs = scale_tensor("v_scale", v_scale, key.device)
    _CPU_ATTN(key, value, key_cache, value_cache, slot_mapping, "cpu_attn", ks, vs, check, errors, None, 0, 1,
              backend)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str,
                      k_scale: torch.Tensor, v_scale: torch.Tensor, *, check: str | None = None,
                      errors: ErrorBuffer | None = None, backend: str = "auto") -> None:
    """`torch.ops._C_cache_ops.reshape_and_cache`: vLLM's legacy head-major layout, key_cache
    `[num_blocks, H, D // x, block_size, x]` (x = 16 // cache element size), value_cache
    `[num_blocks, H, D, block_size]`; `kv_cache_dtype` and scales as `reshape_and_cache_flash`.
    One `store_kv` launch with a split head-dim stride (`kvwrite.ops.kv_head_major`). bf16 /
    fp16 / fp32 inputs only, as vLLM's kernel (an fp8 value row is not contiguous in this
    layout)."""
    key, value = _tokens("key", key, slot_mapping), _tokens("value", value, slot_mapping)
    fmt = KV_CACHE_DTYPES[validate.choice("kv_cache_dtype", kv_cache_dtype, tuple(KV_CACHE_DTYPES))]
    if fmt is None:
        k_scale = v_scale = None
    else:
        key_cache = as_fp8("key_cache", key_cache, fmt)
        value_cache = as_fp8("value_cache", value_cache, fmt)
    store_kv_head_major(key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale,
                        v_scale=v_scale, check=check, errors=errors, backend=backend)


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor, *,
                         check: str | None = None, errors: ErrorBuffer | None = None,
                         backend: str = "auto", vllm_version: str | None = None) -> None:
    """`torch.ops._C_cache_ops.concat_and_cache_mla`: row = concat(kv_c `[N, L]`, k_pe `[N, R]`)
    into kv_cache `[num_blocks, block_size, L + R]` ("auto"; "fp8"/"fp8_e4m3"/"fp8_e5m2": uint8
    or fp8 cache, fp8(x / scale) with the fp32 per-tensor `scale`), or DeepSeek's 656-byte rows
    ("fp8_ds_mla": uint8 `[num_blocks, block_size, L + L/128*4 + 2R]`, `scale` unused as in
    vLLM). One `kvwrite.store_mla` launch.

    fp8_ds_mla as vLLM writes it: per-128-tile scales by `vllm_version` (`ds_mla_scale`); a bf16
    or fp16 k_pe stored as its own 16-bit pattern (vLLM copies k_pe's bits; fp32 input, which
    vLLM refuses, is rounded to bf16); NoPE rows (k_pe `[N, 0]` into rows that reserve rope
    bytes, vLLM 0.32's 656-byte rows with pe_dim 0): the rope bytes are zeroed."""
    kv_cache_dtype = validate.choice("kv_cache_dtype", kv_cache_dtype, MLA_CACHE_DTYPES)
    kv_c, k_pe = _tokens("kv_c", kv_c, slot_mapping), _tokens("k_pe", k_pe, slot_mapping)
    if kv_cache_dtype == "auto":
        store_mla(kv_c, k_pe, kv_cache, slot_mapping, check=check, errors=errors, backend=backend)
    elif kv_cache_dtype == "fp8_ds_mla":
        k_pe = _nope_rope(kv_c, k_pe, kv_cache)
        rope = "input" if kv_c.dtype in (torch.bfloat16, torch.float16) else "bf16"
        store_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype="fp8_ds_mla",
                  ds_mla_scale=ds_mla_scale(vllm_version), ds_mla_rope=rope, check=check,
                  errors=errors, backend=backend)
    else:
        fmt = KV_CACHE_DTYPES[kv_cache_dtype]
        store_mla(kv_c, k_pe, as_fp8("kv_cache", kv_cache, fmt), slot_mapping,
                  kv_cache_dtype="fp8_e5m2" if fmt == torch.float8_e5m2 else "fp8_e4m3", scale=scale,
                  check=check, errors=errors, backend=backend)


# Caches known by their data_ptr (the plugin registers every layer's KV cache at startup): the
# grouped MLA writer receives raw cache addresses, and only a known cache can be bounds-checked.
_CACHES: dict[tuple[str, int], torch.Tensor] = {}
_PTRS: dict[tuple[int, int, int], list[int]] = {}


def register_caches(caches) -> None:
    """Make `caches` (tensors; a dict's values) known by their data_ptr, so that
    `concat_and_cache_mla_grouped` can bound the writes its `kv_cache_ptrs` address."""
    for t in (caches.values() if isinstance(caches, dict) else caches):
        if isinstance(t, torch.Tensor):
            _CACHES[(t.device.type, t.data_ptr())] = t


def _cache_ptrs(ptrs: torch.Tensor) -> list[int]:
    """`kv_cache_ptrs` on the host: read every call from a CPU tensor; from a device tensor once
    per tensor version (vLLM builds it once; an inference tensor has no version: once per
    address), so a store does not wait for the device."""
    if ptrs.device.type == "cpu":
        return [int(p) for p in ptrs.tolist()]
    key = (ptrs.data_ptr(), ptrs.shape[0], None if ptrs.is_inference() else ptrs._version)
    if key not in _PTRS:
        _PTRS[key] = [int(p) for p in ptrs.tolist()]
    return _PTRS[key]


def _raw_cache(ptr: int, dtype: torch.dtype, device: torch.device, shape: tuple, strides: tuple) -> torch.Tensor:
    """A tensor over `ptr`'s memory with `shape` / `strides` (elements): an unregistered cache,
    addressed as vLLM's kernel addresses it (check="off" only)."""
    elem = torch.empty((), dtype=dtype).element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    if device.type == "cuda":
        class _Memory:
            __cuda_array_interface__ = {"shape": (extent * elem,), "typestr": "|u1", "data": (ptr, False),
                                        "version": 3, "strides": None}
        flat = torch.as_tensor(_Memory(), device=device)
    else:
        import ctypes

        flat = torch.frombuffer((ctypes.c_uint8 * (extent * elem)).from_address(ptr), dtype=torch.uint8)
    return flat.view(dtype).as_strided(shape, strides)


def concat_and_cache_mla_grouped(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache_ptrs: torch.Tensor,
                                 slot_mapping: torch.Tensor, block_size: int, block_stride: int,
                                 entry_stride: int, kv_scales: torch.Tensor | None = None,
                                 kv_cache_dtype: str = "auto", *, caches=None, check: str | None = None,
                                 errors: ErrorBuffer | None = None, backend: str = "auto") -> None:
    """`torch.ops._C_cache_ops.concat_and_cache_mla_grouped`: `concat_and_cache_mla` for every
    layer l at once: row concat(kv_c[l, i], k_pe[l, i]) at slot_mapping[l, i] of the cache at
    address kv_cache_ptrs[l] (blocks of `block_size` rows, `block_stride` / `entry_stride`
    elements apart); bf16 inputs, "auto" (bf16 cache) or "fp8" / "fp8_e4m3" / "fp8_e5m2" (uint8
    cache, fp32 `kv_scales` `[layers]`), as vLLM's kernel. One `store_mla` per layer.

    The caches are found by address: in `caches` (tensors), else among those registered with
    `register_caches` (the vLLM plugin registers every layer's cache at startup), so each layer's
    writes are checked against its cache's blocks. An address kvwrite does not know has no
    bound: with check="off" it is written as vLLM writes it (a view sized to the largest slot,
    one host read of slot_mapping); "assert" / "guard" refuse it."""
    kv_cache_dtype = validate.choice("kv_cache_dtype", kv_cache_dtype, ("auto", "bfloat16", "fp8", "fp8_e4m3",
                                                                        "fp8_e5m2"))
    kv_c = validate.tensor("kv_c", kv_c, ndim=3, dtypes=(torch.bfloat16,))
    k_pe = validate.tensor("k_pe", k_pe, ndim=3, dtypes=(torch.bfloat16,), device=kv_c.device)
    layers, tokens = kv_c.shape[:2]
    validate.shape("k_pe", k_pe, (layers, tokens, None), "num_layers, num_tokens, pe_dim")
    ptrs = validate.tensor("kv_cache_ptrs", kv_cache_ptrs, ndim=1, dtypes=(torch.int64,))
    validate.shape("kv_cache_ptrs", ptrs, (layers,), "num_layers")
    sm = validate.tensor("slot_mapping", slot_mapping, ndim=2, dtypes=(torch.int64,), device=kv_c.device)
    validate.shape("slot_mapping", sm, (layers, tokens), "num_layers, num_tokens")
    fp8 = kv_cache_dtype.startswith("fp8")
    if fp8:
        if kv_scales is None:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs kv_scales (fp32 [num_layers])")
        kv_scales = validate.tensor("kv_scales", kv_scales, ndim=1, dtypes=(torch.float32,), device=kv_c.device)
        validate.shape("kv_scales", kv_scales, (layers,), "num_layers")
        if not kv_scales.is_contiguous():
            raise ValueError("kv_scales must be contiguous")
    elif kv_scales is not None:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} (bf16 cache) takes no kv_scales")
    if layers == 0 or tokens == 0:
        return
    from kvwrite.geometry import require_positive_int
    bs = require_positive_int("block_size", block_size)
    width = kv_c.shape[2] + k_pe.shape[2]
    dtype = torch.uint8 if fp8 else torch.bfloat16
    known = {} if caches is None else {t.data_ptr(): t for t in caches}
    mode = validate.check_mode(check)
    for layer, ptr in enumerate(_cache_ptrs(ptrs)):
        cache = known.get(ptr, _CACHES.get((kv_c.device.type, ptr)))
        if cache is not None:
            if cache.dtype not in (dtype, *((torch.float8_e4m3fn, torch.float8_e5m2) if fp8 else ())):
                raise TypeError(f"kv_cache_ptrs[{layer}] is a {cache.dtype} cache; kv_cache_dtype="
                                f"{kv_cache_dtype!r} writes {dtype}")
            # the whole blocks the cache holds, addressed with the call's strides
            last = (bs - 1) * entry_stride + width
            pages = (cache.numel() - last) // block_stride + 1 if cache.numel() >= last else 0
            view = cache.view(-1).as_strided((pages, bs, width), (block_stride, entry_stride, 1))
        elif mode == "off":
            top = int(sm[layer].max())
            view = _raw_cache(ptr, dtype, kv_c.device, (max(top // bs + 1, 1), bs, width),
                              (block_stride, entry_stride, 1))
        else:
            raise ValueError(f"kv_cache_ptrs[{layer}] = {ptr:#x} is not a cache kvwrite knows, so its "
                             f"writes cannot be bounds-checked (check={mode!r}): pass caches=[...] or "
                             f"register the caches with kvwrite.compat.vllm.register_caches")
        concat_and_cache_mla(kv_c[layer], k_pe[layer], view, sm[layer],
                             "auto" if not fp8 else kv_cache_dtype,
                             kv_scales[layer] if fp8 else None, check=mode, errors=errors, backend=backend)


def _nope_rope(kv_c: object, k_pe: object, kv_cache: object) -> object:
    """k_pe, or for a NoPE call (k_pe `[N, 0]`, cache rows wider than the latent part) zero rope
    values filling the reserved rope bytes: vLLM zeroes them."""
    if not (isinstance(k_pe, torch.Tensor) and k_pe.dim() == 2 and k_pe.shape[1] == 0
            and isinstance(kv_c, torch.Tensor) and kv_c.dim() == 2
            and isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 3):
        return k_pe
    spare = kv_cache.shape[2] - ds_mla_row_bytes(kv_c.shape[1], 0)
    if spare <= 0 or spare % 2:
        return k_pe
    return torch.zeros(k_pe.shape[0], spare // 2, dtype=k_pe.dtype, device=k_pe.device)


def indexer_k_quant_and_cache(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              quant_block_size: int, scale_fmt: str | None, *,
                              check: str | None = None, errors: ErrorBuffer | None = None,
                              backend: str = "auto") -> None:
    """`torch.ops._C_cache_ops.indexer_k_quant_and_cache`: DSA indexer keys `[N, head_dim]`
    quantised per `quant_block_size` block to e4m3 (scale max(amax, 1e-4) / 448; "ue8m0": rounded
    up to a power of two) into vLLM's uint8 cache `[num_blocks, block_size, head_dim +
    head_dim * 4 // quant_block_size]`.

    vLLM addresses block b at byte `b * block_size * cache_stride` (cache_stride = the last dim):
    a block holds its `block_size * head_dim` fp8 values, then its `block_size * head_dim /
    quant_block_size` fp32 scales, whatever the 3-D shape suggests. That is exactly kvwrite's
    indexer page `[num_blocks, block_size * cache_stride]`, so the 3-D cache is passed to
    `kvwrite.store_indexer_k` as that 2-D view (same storage: rows of a block must be contiguous,
    stride(1) == cache_stride; the block stride is honoured)."""
    k = validate.tensor("k", k, ndim=2)
    cache = validate.tensor("kv_cache", kv_cache, ndim=3, dtypes=(torch.uint8,), device=k.device)
    if scale_fmt not in (None, "", "ue8m0"):
        raise ValueError(f"scale_fmt must be None, '' or 'ue8m0', got {scale_fmt!r}")
    if isinstance(quant_block_size, int) and quant_block_size > 0 and k.shape[1] % quant_block_size == 0:
        want = row_bytes(k.shape[1], quant_block_size)
        if cache.shape[2] != want:
            raise ValueError(f"kv_cache must have shape [num_blocks, block_size, {want}] (head_dim "
                             f"{k.shape[1]} + head_dim * 4 // quant_block_size), got {list(cache.shape)}")
    blocks, block_size, stride = cache.shape
    if cache.stride(2) != 1 or (block_size > 1 and cache.stride(1) != stride):
        raise ValueError(f"kv_cache's rows within a block must be contiguous (vLLM addresses a block "
                         f"as block_size * {stride} bytes), got strides {cache.stride()}")
    flat = cache.as_strided((blocks, block_size * stride), (cache.stride(0), 1))
    store_indexer_k(k, flat, slot_mapping, quant_block_size=quant_block_size,
                    scale_fmt=scale_fmt or None, check=check, errors=errors, backend=backend)


# vLLM's KVQuantMode values (vllm.v1.kv_cache_interface, an IntEnum) of the per-token-head modes.
INT8_PER_TOKEN_HEAD, FP8_PER_TOKEN_HEAD, INT4_PER_TOKEN_HEAD = 2, 3, 4
_PTH_MODES = {"int8_per_token_head": INT8_PER_TOKEN_HEAD, "fp8_per_token_head": FP8_PER_TOKEN_HEAD,
              "int4_per_token_head": INT4_PER_TOKEN_HEAD}


def _pth_mode(kv_quant_mode: object, key_cache: torch.Tensor) -> int:
    """vLLM's KVQuantMode (the enum, its int value, its name or the kv_cache_dtype string) as an
    int; None infers it from the cache dtype as vLLM's older signature did (fp8 -> FP8, else INT8)."""
    if kv_quant_mode is None:
        return FP8_PER_TOKEN_HEAD if key_cache.dtype in validate.FP8_MAX else INT8_PER_TOKEN_HEAD
    if isinstance(kv_quant_mode, str):
        mode = _PTH_MODES.get(kv_quant_mode.lower())
    elif isinstance(kv_quant_mode, int) and not isinstance(kv_quant_mode, bool):
        mode = int(kv_quant_mode)
    else:
        mode = None
    if mode not in (INT8_PER_TOKEN_HEAD, FP8_PER_TOKEN_HEAD, INT4_PER_TOKEN_HEAD):
        raise ValueError(f"kv_quant_mode must be vLLM's KVQuantMode INT8_PER_TOKEN_HEAD (2), "
                         f"FP8_PER_TOKEN_HEAD (3) or INT4_PER_TOKEN_HEAD (4), got {kv_quant_mode!r}")
    return mode


def triton_reshape_and_cache_flash_per_token_head_quant(
        key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor, slot_mapping: torch.Tensor,
        kv_quant_mode: object = None, *, check: str | None = None, errors: ErrorBuffer | None = None,
        backend: str = "auto") -> None:
    """vLLM's per-token-head dynamic-quant cache write (`vllm.v1.attention.ops.
    triton_reshape_and_cache_flash`, its Triton attention backend's int8 / fp8_per_token_head
    caches), byte for byte: key/value `[N, H, D]` into caches `[num_blocks, block_size, H, D]`
    (int8 for INT8_PER_TOKEN_HEAD; fp8 e4m3fn, or uint8 viewed as it, for FP8_PER_TOKEN_HEAD) and
    fp32 scale caches `[num_blocks, block_size, H]`; negative slots are skipped.

    Per (token, head), vLLM's formula (`quant_rule="vllm"` of kvwrite.store_kv):
    scale = max(absmax / QMAX, 1e-6) (QMAX 127 / 448), stored = x * (1 / scale) with the
    reciprocal rounded to fp32 first; int8: the fp32 sum of that product and +-0.5 (half away
    from zero), clamped to [-128, 127] and truncated; fp8: clamped to +-448 and rounded to nearest
    even. kvwrite computes every step correctly rounded and never fused; vLLM's Triton `/` (in
    absmax / QMAX and 1 / scale) compiles to an approximate division on NVIDIA GPUs, so its GPU
    bytes can differ from these (and from its own CPU/interpreter run) by one code where that
    division is off by an ulp. Differences kept on purpose (kvwrite's special-value policy):
    absmax over the finite values (an inf or NaN element does not blank its head), NaN -> int8 0.

    INT4_PER_TOKEN_HEAD (vLLM's `reshape_and_cache_int4`): uint8 caches `[num_blocks, block_size,
    H, D / 2]`, store_kv's int4 format (`kvwrite.reference.kv_int4`: a randomized Hadamard
    rotation, asymmetric 4-bit codes, the zero point in the scale's low 4 mantissa bits). The
    bytes equal vLLM's CPU run (its fp32 butterfly rotation) for finite inputs; vLLM's GPU run
    rotates with Hadacore or a bf16 Triton matmul (other roundings: codes one apart in places).
    Differences kept on purpose: the range is taken over the finite rotated values (NaN -> the
    zero point, +-inf saturate), subnormal inputs read as zero, and a zero point past int32 range
    (an all-negative row with a floored scale) clamps to 15 where vLLM's float -> int32 overflows.

    vLLM's Triton attention backend passes int4 caches whose rows carry the fp32 scale inline
    after the data (last dim D / 2 + 4 bytes, `_ensure_scale_caches`): such a cache is narrowed
    to its data bytes (the scale caches are vLLM's strided views of the rest, taken as they are)."""
    mode = _pth_mode(kv_quant_mode, key_cache)
    key, value = _tokens("key", key, slot_mapping), _tokens("value", value, slot_mapping)
    if mode == INT4_PER_TOKEN_HEAD:
        for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
            if isinstance(cache, torch.Tensor) and cache.dtype != torch.uint8:
                raise TypeError(f"kv_quant_mode=INT4_PER_TOKEN_HEAD needs uint8 caches, got {name} {cache.dtype}")
        key_cache = _data_part(key_cache, key, 2)
        value_cache = _data_part(value_cache, value, 2)
        store_kv(key, value, key_cache, value_cache, slot_mapping, layout="NHD",
                 k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache, check=check, errors=errors,
                 backend=backend, quant_rule="vllm")
        return
    if mode == FP8_PER_TOKEN_HEAD:
        key_cache = as_fp8("key_cache", key_cache, torch.float8_e4m3fn)
        value_cache = as_fp8("value_cache", value_cache, torch.float8_e4m3fn)
    elif isinstance(key_cache, torch.Tensor) and key_cache.dtype != torch.int8:
        raise TypeError(f"kv_quant_mode=INT8_PER_TOKEN_HEAD needs int8 caches, got key_cache "
                        f"{key_cache.dtype}")
    store_kv(key, value, key_cache, value_cache, slot_mapping, layout="NHD",
             k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache, check=check, errors=errors,
             backend=backend, quant_rule="vllm")


def reshape_and_cache_int4(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                           k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor,
                           check: str | None = None, errors: ErrorBuffer | None = None,
                           backend: str = "auto") -> None:
    """`vllm.v1.attention.ops.int4_per_token_head.reshape_and_cache_int4`, the INT4_PER_TOKEN_HEAD
    writer (vLLM's per-token-head store calls it): the same store as
    `triton_reshape_and_cache_flash_per_token_head_quant` with kv_quant_mode=INT4_PER_TOKEN_HEAD."""
    triton_reshape_and_cache_flash_per_token_head_quant(
        key, value, key_cache, value_cache, k_scale_cache, v_scale_cache, slot_mapping, INT4_PER_TOKEN_HEAD,
        check=check, errors=errors, backend=backend)


def _data_part(cache: object, x: object, per_byte: int) -> object:
    """A per-token-head cache `[blocks, block_size, H, width + 4 / element size]` (vLLM's Triton
    attention layout: each head's fp32 scale inline after its data, width = D / per_byte) as its
    `[..., :width]` data view; any other cache unchanged (store_kv checks it). Used for int4."""
    if (isinstance(cache, torch.Tensor) and isinstance(x, torch.Tensor) and cache.dim() == 4
            and x.dim() == 3 and cache.element_size() <= 4):
        width = x.shape[2] // per_byte
        if cache.shape[3] == width + 4 // cache.element_size():
            return cache[..., :width]
    return cache


def reshape_and_cache_flash_per_token_quant(key: torch.Tensor, value: torch.Tensor,
                                            key_cache: torch.Tensor, value_cache: torch.Tensor,
                                            k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor,
                                            slot_mapping: torch.Tensor, *, check: str | None = None,
                                            errors: ErrorBuffer | None = None,
                                            backend: str = "auto") -> None:
    """kvwrite's own per-token / per-token-head dynamic-quant flash cache write in vLLM's
    argument order: key/value `[N, H, D]` into int8 / fp8 caches `[num_blocks, block_size, H, D]`
    with fp32 scale caches `[num_blocks, block_size]` (per token) or `[num_blocks, block_size, H]`
    (per token-head). kvwrite's formula (`kvwrite.reference.kv_quant`): scale = max(absmax / QMAX,
    1e-6), stored = x / scale (correctly rounded division), int8 rounded to nearest even and
    saturated. vLLM's own store (`triton_reshape_and_cache_flash_per_token_head_quant`, above)
    multiplies by the fp32 reciprocal and rounds int8 half away from zero: its codes differ by
    one at exact ties (x / scale = k + 0.5) and where x * (1 / scale) and x / scale round
    differently."""
    key, value = _tokens("key", key, slot_mapping), _tokens("value", value, slot_mapping)
    store_kv(key, value, key_cache, value_cache, slot_mapping, layout="NHD",
             k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache, check=check, errors=errors,
             backend=backend)


# --- page moves (kvwrite.ops.pages) ----------------------------------------------------------------

def _byte_blocks(name: str, t: object, block_size_in_bytes: int) -> torch.Tensor:
    """A contiguous tensor as a pool of `block_size_in_bytes`-byte blocks `[blocks, 1, bytes]`
    (vLLM addresses block b at data_ptr + b * block_size_in_bytes)."""
    t = validate.tensor(name, t)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (swap_blocks addresses its bytes from data_ptr), "
                         f"got strides {t.stride()}")
    nbytes = t.numel() * t.element_size()
    if nbytes < block_size_in_bytes:
        raise ValueError(f"{name} holds {nbytes} bytes, less than one block of {block_size_in_bytes}")
    flat = t.view(-1).view(torch.uint8)
    blocks = nbytes // block_size_in_bytes
    return flat[:blocks * block_size_in_bytes].view(blocks, 1, block_size_in_bytes)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_size_in_bytes: int, block_mapping: torch.Tensor,
                *, check: str | None = None, errors: ErrorBuffer | None = None, backend: str = "auto") -> None:
    """`torch.ops._C_cache_ops.swap_blocks` (vLLM PR 30692 and later): for each row (s, d) of the int64
    `block_mapping` `[n, 2]`, copy `block_size_in_bytes` bytes from `src` at byte offset
    `s * block_size_in_bytes` to `dst` at `d * block_size_in_bytes` (the kernel block may be smaller
    than the logical block: the offloading connector's factor). GPU <-> host (pinned) or on one
    device. Differs from vLLM: block ids are checked against each tensor's whole blocks in
    check="assert"/"guard" (vLLM copies past the tensor); a -1 skips the pair."""
    from kvwrite.geometry import require_positive_int
    from kvwrite.ops.pages import copy_pages

    bsb = require_positive_int("block_size_in_bytes", block_size_in_bytes)
    m = validate.tensor("block_mapping", block_mapping, ndim=2, dtypes=validate.LOC_DTYPES)
    if m.shape[1] != 2:
        raise ValueError(f"block_mapping must be [num_pairs, 2] (src block, dst block), got {list(m.shape)}")
    copy_pages(_byte_blocks("src", src, bsb), _byte_blocks("dst", dst, bsb), m[:, 0].contiguous(),
               m[:, 1].contiguous(), check=check, errors=errors, backend=backend)


def cp_gather_cache(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                    cu_seq_lens: torch.Tensor, batch_size: int, seq_starts: torch.Tensor | None = None, *,
                    check: str | None = None, errors: ErrorBuffer | None = None,
                    backend: str = "auto") -> None:
    """`torch.ops._C_cache_ops.cp_gather_cache`: the rows of each request, contiguous in `dst`
    `[tokens, ...]`: `dst[cu_seq_lens[b] + t] = src_cache[block_table[b, p // bs], p % bs]` with
    `p = t + seq_starts[b]` (0 without seq_starts), bs = `src_cache.shape[1]`, in the cache's dtype;
    rows past `cu_seq_lens[batch_size]` are left as they are. A slot_mapping then a gather, both
    checked: a block past the table row or a page past the pool is reported (check="assert" /
    "guard"; that row reads as zeros) where vLLM reads out of bounds."""
    from kvwrite.geometry import require_positive_int
    from kvwrite.ops.pages import canonical_pool, gather, slot_mapping

    cache = canonical_pool("src_cache", src_cache)
    dst = validate.tensor("dst", dst, dtypes=(src_cache.dtype,), device=src_cache.device)
    validate.shape("dst", dst, (None, *src_cache.shape[2:]), "tokens, the cache's row shape")
    bs = require_positive_int("batch_size", batch_size)
    cu = validate.tensor("cu_seq_lens", cu_seq_lens, ndim=1, dtypes=validate.LOC_DTYPES, device=dst.device)
    if cu.shape[0] < bs + 1:
        raise ValueError(f"cu_seq_lens must have batch_size + 1 = {bs + 1} entries, got {cu.shape[0]}")
    cu = cu[:bs + 1].to(torch.int64)
    tok = torch.arange(dst.shape[0], device=dst.device)
    b = torch.searchsorted(cu[1:].contiguous(), tok, right=True)
    valid = (tok >= cu[0]) & (tok < cu[bs])
    bc = b.clamp(max=bs - 1)
    pos = tok - cu[bc]
    if seq_starts is not None:
        starts = validate.tensor("seq_starts", seq_starts, ndim=1, dtypes=validate.LOC_DTYPES, device=dst.device)
        pos = pos + starts.to(torch.int64)[bc]
    b = torch.where(valid, bc, -1)
    geometry = PageGeometry.from_pool(cache.shape[0], cache.shape[1])
    slots = slot_mapping(block_table, b, pos, geometry, check=check, errors=errors, backend=backend)
    rows = gather(src_cache, slots, check=check, errors=errors, backend=backend)
    shape = (-1,) + (1,) * (dst.dim() - 1)
    dst.copy_(torch.where(valid.view(shape), rows, dst))
