"""`store_mla`: the MLA latent+rope row store (bf16/fp16/fp32, per-tensor fp8, DeepSeek fp8_ds_mla,
NVFP4).

Each `kv_cache_dtype` is one `MLAFormat` in `FORMATS`: the cache dtype it needs, the width of its
cache row, whether it takes a per-tensor `scale`, the kernel mode, and any extra rule on the
dims. A new format is one more entry there (plus its row writer in each backend).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kvwrite import validate
from kvwrite.errors import ErrorBuffer
from kvwrite.geometry import PageGeometry
from kvwrite.ops import spec
from kvwrite.ops._common import Check, Locs

OP = "store_mla"
IMPLS = (
    ("torch", "kvwrite.reference.mla:store_mla"),
    ("triton", "kvwrite.kernels.store_mla:launch"),
    ("cpu", "kvwrite._ext:store_mla"),
    ("cuda", "kvwrite._ext:store_mla"),
)

# Kernel modes (the Triton kernel's MODE constexpr).
MODE_COPY = 0      # row = concat(kv_c, k_pe) in the input dtype
MODE_FP8 = 1       # the same row, saturate(x / scale) in an fp8 dtype
MODE_DS_MLA = 2    # DeepSeek's fp8 MLA row, see `ds_mla_row_bytes`
MODE_NVFP4 = 3     # NVFP4 row + e4m3 block-scale row (`kernels/store_mla_nvfp4.py`)

# NVFP4 rows have their own Triton kernel (the reference is store_mla's, writer in
# reference/mla.WRITERS); the C++/CUDA store_mla covers them as its mode MODE_NVFP4.
NVFP4_IMPLS = (
    ("torch", "kvwrite.reference.mla:store_mla"),
    ("triton", "kvwrite.kernels.store_mla_nvfp4:launch"),
    ("cpu", "kvwrite._ext:store_mla"),
    ("cuda", "kvwrite._ext:store_mla"),
)
NVFP4_BLOCK = 16   # row elements per e4m3 block scale

DS_MLA_TILE = 128                       # kv_c elements per fp32 scale
DS_MLA_SCALE_FLOOR = torch.finfo(torch.float32).tiny   # "exact": scale = max(amax / 448, FLT_MIN)
DS_MLA_POW2_FLOOR = 1e-4                # "pow2": scale = 2^ceil(log2(max(amax / 448, 1e-4)))

# fp8_ds_mla options, as flag bits beside the kernel mode (kernels and the C++ op read them from
# the format's `flags`): how the tile scale is formed and how the rope is stored.
DS_MLA_POW2 = 1 << 4       # tile scale rounded up to a power of two (floor 1e-4)
DS_MLA_RAW_ROPE = 1 << 5   # rope stored as the input's own 16-bit pattern (bf16 or fp16 bits)
DS_MLA_SCALES = {"exact": 0, "pow2": DS_MLA_POW2}
DS_MLA_ROPES = {"bf16": 0, "input": DS_MLA_RAW_ROPE}


def ds_mla_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one fp8_ds_mla row: L e4m3 latent bytes, L/128 fp32 tile scales, R bf16 rope."""
    return kv_lora_rank + (kv_lora_rank // DS_MLA_TILE) * 4 + 2 * rope_dim


def _nvfp4_dims(kv_lora_rank: int, rope_dim: int) -> str | None:
    if (kv_lora_rank + rope_dim) % NVFP4_BLOCK:
        return (f"kv_cache_dtype='nvfp4' needs kv_lora_rank + rope_dim to be a multiple of "
                f"{NVFP4_BLOCK}, got {kv_lora_rank} + {rope_dim}")
    return None


def _ds_mla_dims(kv_lora_rank: int, rope_dim: int) -> str | None:
    if kv_lora_rank % DS_MLA_TILE:
        return (f"kv_cache_dtype='fp8_ds_mla' needs kv_c's last dim (kv_lora_rank) to be a multiple "
                f"of {DS_MLA_TILE}, got {kv_lora_rank}")
    return None


@dataclass(frozen=True)
class MLAFormat:
    """One `kv_cache_dtype`: how its cache looks and which kernel mode writes it."""

    name: str
    mode: int
    cache_dtype: Callable[[torch.dtype], torch.dtype]   # input dtype -> cache dtype
    row_width: Callable[[int, int], int]                 # (L, R) -> cache row, in cache elements
    takes_scale: bool = False
    dims: Callable[[int, int], Optional[str]] = lambda L, R: None   # error text or None
    impls: tuple[tuple[str, str], ...] = IMPLS                       # backend -> implementation
    takes_scale_cache: bool = False                                  # nvfp4: scale_cache, global_scale
    flags: int = 0                                                   # fp8_ds_mla: DS_MLA_* bits

    @property
    def kernel_mode(self) -> int:
        """The mode the kernels take: MODE_* with the format's option bits."""
        return self.mode | self.flags


def ds_mla_format(scale: str = "exact", rope: str = "bf16") -> str:
    """The kv_cache_dtype name of fp8_ds_mla with tile scale `scale` ("exact": max(amax/448,
    FLT_MIN); "pow2": 2^ceil(log2(max(amax/448, 1e-4)))) and rope `rope` ("bf16": rounded to bf16;
    "input": the 16-bit input's own bits), e.g. "fp8_ds_mla+pow2+input"."""
    validate.choice("ds_mla_scale", scale, tuple(DS_MLA_SCALES))
    validate.choice("ds_mla_rope", rope, tuple(DS_MLA_ROPES))
    return "fp8_ds_mla" + ("+pow2" if scale == "pow2" else "") + ("+input" if rope == "input" else "")


_CONCAT = lambda L, R: L + R  # noqa: E731
FORMATS: dict[str, MLAFormat] = {f.name: f for f in (
    MLAFormat("auto", MODE_COPY, lambda dtype: dtype, _CONCAT),
    MLAFormat("fp8_e4m3", MODE_FP8, lambda dtype: torch.float8_e4m3fn, _CONCAT, takes_scale=True),
    MLAFormat("fp8_e5m2", MODE_FP8, lambda dtype: torch.float8_e5m2, _CONCAT, takes_scale=True),
    MLAFormat("fp8_e4m3fnuz", MODE_FP8, lambda dtype: torch.float8_e4m3fnuz, _CONCAT,
              takes_scale=True),
    *(MLAFormat(ds_mla_format(sc, rp), MODE_DS_MLA, lambda dtype: torch.uint8, ds_mla_row_bytes,
                dims=_ds_mla_dims, flags=DS_MLA_SCALES[sc] | DS_MLA_ROPES[rp])
      for sc in DS_MLA_SCALES for rp in DS_MLA_ROPES),
    MLAFormat("nvfp4", MODE_NVFP4, lambda dtype: torch.uint8, lambda L, R: (L + R) // 2,
              dims=_nvfp4_dims, impls=NVFP4_IMPLS, takes_scale_cache=True),
)}


@dataclass(frozen=True)
class StoreMLA:
    """A validated store_mla call. `kv_cache` is `[pages, pool_page_size, row]`."""

    kv_c: torch.Tensor
    k_pe: torch.Tensor
    kv_cache: torch.Tensor
    format: MLAFormat
    scale: torch.Tensor | None
    geometry: PageGeometry
    locs: Locs
    check: Check
    scale_cache: torch.Tensor | None = None     # nvfp4: e4m3 [pages, pool_page_size, (L + R)/16]
    global_scale: torch.Tensor | None = None    # nvfp4: optional fp32 [] / [1]


def _format(env: dict, v: dict) -> None:
    """kv_cache_dtype: its dims rule, cache dtype and row width (letter W)."""
    name = validate.choice("kv_cache_dtype", v["kv_cache_dtype"], tuple(FORMATS))
    fmt = FORMATS[name]
    problem = fmt.dims(env["L"], env["R"])
    if problem:
        raise ValueError(problem)
    if fmt.flags & DS_MLA_RAW_ROPE and env["kv_c"] not in (torch.bfloat16, torch.float16):
        raise ValueError(f"kv_cache_dtype={fmt.name!r} stores the rope's own 16-bit pattern: kv_c "
                         f"and k_pe must be bfloat16 or float16, got {env['kv_c']}")
    env.update(fmt=name, cache_dtype=fmt.cache_dtype(env["kv_c"]), W=fmt.row_width(env["L"], env["R"]))


def _scales(env: dict, v: dict) -> None:
    """The per-tensor scale (fp8 formats) and nvfp4's scale_cache / global_scale."""
    fmt = FORMATS[env["fmt"]]
    if fmt.takes_scale:
        if v["scale"] is None:
            raise ValueError(f"scale is required for kv_cache_dtype={fmt.name!r}")
    elif v["scale"] is not None:
        scaled = "/".join(repr(f.name) for f in FORMATS.values() if f.takes_scale)
        raise ValueError(f"scale applies only to kv_cache_dtype {scaled}, not {fmt.name!r}")
    if fmt.takes_scale_cache:
        if v["scale_cache"] is None:
            raise ValueError(f"scale_cache is required for kv_cache_dtype={fmt.name!r}")
        env["B"] = (env["L"] + env["R"]) // NVFP4_BLOCK
    elif v["scale_cache"] is not None or v["global_scale"] is not None:
        raise ValueError(f"scale_cache/global_scale apply only to kv_cache_dtype 'nvfp4', not {fmt.name!r}")


def _build(v: dict, env: dict, locs: Locs, chk: Check) -> StoreMLA:
    return StoreMLA(v["kv_c"], v["k_pe"], v["kv_cache"], FORMATS[env["fmt"]], v["scale"], env["geometry"],
                    locs, chk, v["scale_cache"], v["global_scale"])


SPEC = spec.Op(
    OP,
    args=(spec.T("kv_c", "N L", validate.FLOAT_INPUTS),
          spec.T("k_pe", "N R", ("=kv_c",), what="tokens as kv_c, rope_dim"),
          spec.cache("kv_cache", "P S W", ("=cache_dtype",),
                     what="num_pages, pool_page_size, row of {W} for kv_cache_dtype={fmt!r} with "
                          "kv_lora_rank={L}, rope_dim={R}"),
          spec.LOC, spec.option("kv_cache_dtype"), spec.opt("scale", "scale", role="scale"),
          spec.CHECK, spec.ERRORS, spec.LOC_MAP, *spec.DCP, spec.BACKEND,
          spec.opt("scale_cache", "P S B", (torch.float8_e4m3fn,), mutable=True, role="cache",
                   default=None,
                   what=f"num_pages, pool_page_size as kv_cache, (kv_lora_rank + rope_dim)/{NVFP4_BLOCK}"),
          spec.opt("global_scale", "scale", role="scale", default=None)),
    checks=("kv_c", "k_pe", _format, "kv_cache", spec.geometry("kv_cache"), _scales, "scale",
            "scale_cache", "global_scale"),
    build=_build, impls=lambda a: a.format.impls)
_OP = SPEC.overload
_CALL = _OP._op


def prepare_store_mla(kv_c, k_pe, kv_cache, loc, kv_cache_dtype, scale, check, errors,
                      loc_map, dcp_rank, dcp_size, scale_cache=None, global_scale=None) -> StoreMLA:
    """A validated store_mla call (the spec's checks)."""
    return SPEC.prepare((kv_c, k_pe, kv_cache, loc, kv_cache_dtype, scale, check, errors, loc_map,
                         dcp_rank, dcp_size, "auto", scale_cache, global_scale))


def store_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, loc: torch.Tensor,
              *, kv_cache_dtype: str = "auto", scale: torch.Tensor | None = None,
              check: str | None = None, errors: ErrorBuffer | None = None,
              loc_map: torch.Tensor | None = None, dcp_rank: int = 0, dcp_size: int = 1,
              backend: str = "auto", scale_cache: torch.Tensor | None = None,
              global_scale: torch.Tensor | None = None, ds_mla_scale: str | None = None,
              ds_mla_rope: str | None = None) -> None:
    """Write token i's MLA row (latent `kv_c[i]` `[L]`, rope `k_pe[i]` `[R]`) at `loc[i]`
    (-1 = padding, skipped). `kv_c`/`k_pe` may be strided along tokens.

    `kv_cache_dtype`:
      - "auto": `kv_cache` `[pages, pool_page_size, L + R]` in the input dtype, row = concat.
      - "fp8_e4m3" / "fp8_e5m2" / "fp8_e4m3fnuz": the same row in that fp8 dtype
        (float8_e4m3fn / float8_e5m2 / float8_e4m3fnuz), saturate(x / scale) with a per-tensor
        fp32 `scale` (`[]` or `[1]`).
      - "fp8_ds_mla": uint8 `[pages, pool_page_size, L + L/128*4 + 2R]` (656 for 512/64): L e4m3
        bytes quantised per 128-element tile with scale max(amax/448, FLT_MIN), stored as
        fp8(x / scale); then the L/128 fp32 scales; then R bf16 rope values (bf16 input: bit
        copies; fp16/fp32 input: rounded to bf16, nearest-even, like `tensor.to(torch.bfloat16)`).
        Needs L % 128 == 0. Read rows back with `kvwrite.dequant_ds_mla`.
        Options (fp8_ds_mla only): `ds_mla_scale="pow2"` rounds each tile scale up to a power of
        two, 2^ceil(log2(max(amax/448, 1e-4))) (what vLLM's writers store since its FlashMLA
        readers convert scales to bf16 / ue8m0); `ds_mla_rope="input"` stores a bf16 or fp16
        rope as its own 16-bit pattern (vLLM copies k_pe's bits; fp16 rope is then read as
        fp16: `dequant_ds_mla(..., rope_dtype=torch.float16)`). The same choices are the
        kv_cache_dtype names `ds_mla_format(scale, rope)` builds ("fp8_ds_mla+pow2+input").
      - "nvfp4": uint8 `[pages, pool_page_size, (L + R)/2]` (two e2m1 codes a byte, even element
        in the low nibble) and `scale_cache` float8_e4m3fn `[pages, pool_page_size, (L + R)/16]`,
        the row concat(kv_c, k_pe) quantised in blocks of 16 like `kvwrite.store_kv_nvfp4`
        (optional positive fp32 `global_scale` `[]`/`[1]`). Needs (L + R) % 16 == 0. Read rows
        back with `kvwrite.dequant_nvfp4(kv_cache[p, o], scale_cache[p, o], global_scale)`.
    `check`, `errors`, `loc_map`, `dcp_rank`, `dcp_size`: as in `store_kv`. A pool stored as
    `[rows, 1, row]` (SGLang's MLA buffer) is the same cache with pool_page_size 1.
    """
    if ds_mla_scale is not None or ds_mla_rope is not None:
        if kv_cache_dtype != "fp8_ds_mla":
            raise ValueError(f"ds_mla_scale/ds_mla_rope apply only to kv_cache_dtype='fp8_ds_mla', "
                             f"not {kv_cache_dtype!r}")
        kv_cache_dtype = ds_mla_format(ds_mla_scale or "exact", ds_mla_rope or "bf16")
    return SPEC.entry(kv_c, k_pe, kv_cache, loc, kv_cache_dtype, scale, check, errors, loc_map,
                      dcp_rank, dcp_size, backend, scale_cache, global_scale)
