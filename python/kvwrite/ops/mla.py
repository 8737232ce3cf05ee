"""`store_mla`: the MLA latent+rope row store. Each `kv_cache_dtype` is one `MLAFormat` in
`FORMATS` (`kvwrite.facts.MLA_FORMATS`); a new format is one more entry there (plus its row writer
in each backend, and its backend table here if not IMPLS).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import validate
from kvwrite.errors import ErrorBuffer
from kvwrite.facts import (DS_MLA_POW2, DS_MLA_RAW_ROPE, MLA_FORMATS, MODE_NVFP4, NVFP4_BLOCK, MLAFormat,
                           ds_mla_format)
from kvwrite.facts import DS_MLA_TILE, MODE_DS_MLA, ds_mla_row_bytes  # noqa: F401  (re-exported)
from kvwrite.geometry import PageGeometry
from kvwrite.ops import spec
from kvwrite.ops._common import Check, Locs, impls

IMPLS = impls("mla:store_mla", "store_mla:launch", "store_mla")

# NVFP4 rows have their own Triton kernel (the reference is store_mla's, writer in
# reference/mla.WRITERS); the C++/CUDA store_mla covers them as its mode MODE_NVFP4.
NVFP4_IMPLS = impls("mla:store_mla", "store_mla_nvfp4:launch", "store_mla")
FORMATS = MLA_FORMATS   # kv_cache_dtype -> MLAFormat (kvwrite.facts)


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

    @property
    def kernel_mode(self) -> int:
        return self.format.kernel_mode


def _by_format(values: list) -> str:
    """An expression: the value (an expression) of the call's format, by its index f in FORMATS."""
    return " : ".join(f"f == {i} ? ({x})" for i, x in enumerate(values)) + " : -1"


# The C++ twin, built from the table: the format's index f, its kernel mode, dims rule (and the raw
# rope's 16-bit input), cache dtype and row width W.
_FORMAT_EXPR = "; ".join([
    f"f = {spec.switch('kv_cache_dtype', {n: i for i, n in enumerate(FORMATS)})}", "f >= 0",
    f"fmt = {_by_format([f.kernel_mode for f in FORMATS.values()])}",
    _by_format([f.rule or 1 for f in FORMATS.values()]),
    _by_format(["kv_c == bfloat16 || kv_c == float16" if f.flags & DS_MLA_RAW_ROPE else 1 for f in FORMATS.values()]),
    f"cache_dtype = {_by_format(['kv_c' if f.cache is None else str(f.cache)[6:] for f in FORMATS.values()])}",
    f"W = {_by_format([f.width for f in FORMATS.values()])}"])


@spec.rule(expr=_FORMAT_EXPR)
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


def _modes(flag: str) -> str:
    """An expression: whether the call's kernel mode (env fmt, option bits off) takes `flag`."""
    modes = sorted({f.mode for f in FORMATS.values() if getattr(f, flag)})
    assert all(getattr(f, flag) == (f.mode in modes) for f in FORMATS.values()), flag   # a mode's property
    return " || ".join(f"fmt % {DS_MLA_POW2} == {m}" for m in modes) or "0"


@spec.rule(expr=f"ts = {_modes('takes_scale')}; ts ? !none($scale) : none($scale); nv = {_modes('takes_scale_cache')}; "
                f"nv ? !none($scale_cache) : none($scale_cache) && none($global_scale); "
                f"B = nv ? (L + R) / {NVFP4_BLOCK} : 0")
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


@spec.when(f"fmt % {DS_MLA_POW2} == {MODE_NVFP4}")
def nvfp4_row(env: dict) -> bool:
    """The NVFP4 row has its own Python-path kernels (the C++ fast path runs store_mla for all)."""
    return FORMATS[env["fmt"]].mode == MODE_NVFP4


SPEC = spec.Op(
    "store_mla",
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
    build=_build, impls=(spec.Format(NVFP4_IMPLS, nvfp4_row), spec.Format(IMPLS)), raw_args={"kernel_mode": "e:fmt"})
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
