"""The DeepSeek V4 planner (variant "dsv4"): SWA + compressed (c4, c128) KV caches in FlashMLA
MODEL1 pages, the c4 indexer cache and the compress-state pools (SGLang's DeepSeekV4TokenToKVPool).

Sub-pools, from `compress_ratios` (0: SWA only, 4: SWA + c4 + indexer + states, 128: SWA + c128
+ state): "swa" (every layer; the SWA loc space, full -> SWA loc map), "c4" / "c128" (pages of
page_size // 4 and page_size // 128 rows: a compressed page index is the full page index),
"c4_indexer" (fp8 rows of index_head_dim + 4 bytes, pages of page_size // 4), "c4_state",
"c4_indexer_state" (rows of 2*2*head_dim / 2*2*index_head_dim fp32, ring 8 per SWA page of
page_size tokens: SGLang 0.5.23's swa_page_size is the page size, 256) and "c128_state" (rows of
2*head_dim fp32, ring 128 per request slot: a fixed cost). A draft worker holds the SWA pool of
its MTP layer(s) only; under DCP every paged sub-pool pages in pool_page_size and a target
worker's pools are sharded by page.

Bytes per full token (SGLang's DSV4PoolConfigurator, fp32 state), with r = swa_full_tokens_ratio,
L layers, L4 / L128 layers of ratio 4 / 128, kv(p) = kv_page_bytes(p) / p (584 B padded to 576 B
pages: 585 B at p = 256 and 64, 864 B at p = 2), P = page_size:
    r*kv(P)*L + kv(P/4)*L4/4 + 132*L4/4 + kv(P/128)*L128/128 + r*(8/P)*(2*2*512*4 + 2*2*128*4)*L4
and the c128 state, ((max_running_requests + 1) * 128 + 128 + 1 rounded up to 128) rows of
2*512*4 bytes per c128 layer, taken first (`fixed_bytes`). max_running_requests unset: SGLang's
estimate, tokens / context_len * 512 clamped to [2048, 4096] and at most tokens / 2, with tokens =
memory / cell (`_resolve_max_running_requests_per_worker`).

FP4 records (`store_dsv4_kv_fp4`, `FP4_KV_CACHE_DTYPES`): the SWA, c4 and c128 pools hold
`record.token_bytes` a token in pages of page_size (P / 4, P / 128) tokens, no page padding, so kv(p)
above is 384 (nvfp4: kv_cache_dtype "nvfp4", vLLM's "nvfp4_fi_ds_mla"), 368 (mxfp4: SGLang's
"fp4_e2m1") or 288 (nvfp4_v41: "nvfp4_v41", kvwrite's name for DeepSeek-V4.1's record); the indexer
cache and the states are unchanged. engine="sglang" with "nvfp4" (its SGLANG_SM120_KV_CACHE_FORMAT
opt-in) regroups each pool's rows into the pages its kernels take (`SGLANG_NVFP4_PAGES`): one flat
slot space, so slot ids do not change.
"""
from __future__ import annotations

import math

from kvwrite.config.errors import SpecError, UnsupportedCombination
from kvwrite.config.model import ModelSpec
from kvwrite.config.plan import BufferSpec, LocSpace, PoolSpec
from kvwrite.config.registry import PlanContext, VariantPlanner, draft_layers, register_builtin
from kvwrite.facts import FP4_RECORDS, FP4Record
from kvwrite.geometry import PageGeometry
from kvwrite.ops import dsv4 as _d

STATE_DTYPE = "float32"      # SGLANG_DSV4_COMPRESS_STATE_DTYPE default
REQUESTS_MIN, REQUESTS_MAX, REQUESTS_PER_CONTEXT = 2048, 4096, 512   # SGLang's request estimate
# kv_cache_dtype -> the FP4 record (kvwrite.facts.FP4_RECORDS) of the SWA, c4 and c128 pools
FP4_KV_CACHE_DTYPES = {
    "nvfp4": "nvfp4",               # SGLang PR #38646's opt-in pool (SGLANG_SM120_KV_CACHE_FORMAT=nvfp4)
    "nvfp4_fi_ds_mla": "nvfp4",     # vLLM --kv-cache-dtype nvfp4_fi_ds_mla (FlashInfer PR #4955)
    "fp4_e2m1": "mxfp4",            # SGLang PR #37138 --kv-cache-dtype fp4_e2m1 (Hopper)
    "nvfp4_v41": "nvfp4_v41",       # DeepSeek-V4.1's record (vLLM PR #57344): kvwrite's name
}
# SGLang's NVFP4 pool: tokens per page of the pages its SM120 kernels take (64 primary, 64 / 2 for
# the c4 / c128 caches), the pools' rows regrouped into them with no per-page padding
SGLANG_NVFP4_PAGES = {"swa": 64, "c4": 64, "c128": 2}
POOL_RATIO = {"swa": 1, "c4": 4, "c4_indexer": 4, "c128": 128}   # full tokens per row of a paged pool


def fp4_record(kv_cache_dtype: str) -> FP4Record | None:
    """The FP4 record a V4 KV pool of `kv_cache_dtype` holds (None: the 584-byte fp8 record)."""
    fmt = FP4_KV_CACHE_DTYPES.get(kv_cache_dtype)
    return None if fmt is None else FP4_RECORDS[fmt]


def sglang_regroups(ctx) -> bool:
    """SGLang's NVFP4 pool regroups its pages (`SGLANG_NVFP4_PAGES`)."""
    return ctx.kv_cache_dtype == "nvfp4" and ctx.parallel.engine == "sglang"


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


class DSV4Planner(VariantPlanner):
    name = "dsv4"
    fields = frozenset({"head_dim", "qk_rope_head_dim", "index_head_dim", "sliding_window", "compress_ratios"})
    kv_cache_dtypes = ("fp8_e4m3", *FP4_KV_CACHE_DTYPES)
    native_kv_cache_dtype = "fp8_e4m3"   # SGLang resolves "auto" to fp8_e4m3 for V4
    request_slots = True                 # the c128 state ring per request slot
    fixed_what = "DeepSeek V4's c128 compress-state ring (128 rows of 4 KiB per c128 layer per request slot)"
    # SGLang's V4 overrides (arg_groups/model_overrides/deepseek_v4.py): page_size 256,
    # swa_full_tokens_ratio 0.1 (DSV4_DEFAULT_SWA_FULL_TOKENS_RATIO)
    defaults = dict(page_size=256, swa_full_tokens_ratio=0.1)

    def check_model(self, spec) -> None:
        if spec.head_dim != _d.KV_DIM or spec.qk_rope_head_dim != _d.ROPE:
            raise SpecError(f"dsv4 needs head_dim={_d.KV_DIM} and qk_rope_head_dim={_d.ROPE} (448 NoPE + 64 "
                            f"RoPE, the FlashMLA MODEL1 row), got {spec.head_dim} and {spec.qk_rope_head_dim}")
        if len(spec.compress_ratios) != spec.num_layers:
            raise SpecError(f"dsv4 needs one compress ratio per layer ({spec.num_layers}), got "
                            f"{len(spec.compress_ratios)}")
        bad = sorted(set(spec.compress_ratios) - {0, 4, 128})
        if bad:
            raise SpecError(f"dsv4 compress_ratios must be 0, 4 or 128, got {bad}")
        if 4 in spec.compress_ratios and (not spec.index_head_dim or spec.index_head_dim % _d.FP8_BLOCK):
            raise SpecError(f"dsv4 c4 layers need index_head_dim a multiple of {_d.FP8_BLOCK}, got {spec.index_head_dim}")
        if not spec.sliding_window:
            raise SpecError("dsv4 needs sliding_window > 0")

    def draft_model(self, spec):
        n = draft_layers(spec)
        return ModelSpec("dsv4", n, head_dim=spec.head_dim, qk_rope_head_dim=spec.qk_rope_head_dim,
                         sliding_window=spec.sliding_window, compress_ratios=(0,) * n, dtype=spec.dtype,
                         num_draft_layers=spec.num_draft_layers, name=f"{spec.name or spec.variant} draft")

    @staticmethod
    def _layers(m, ratio: int) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(m.compress_ratios) if r == ratio)

    @staticmethod
    def _check_page(P: int) -> None:
        if P % 128:
            raise UnsupportedCombination(f"dsv4 needs page_size a multiple of 128 (c128 pages of "
                                         f"page_size // 128 rows), got {P}")

    def check_dtype(self, ctx: PlanContext) -> None:
        super().check_dtype(ctx)
        self._check_page(ctx.page_size)
        step = math.lcm(*(k * POOL_RATIO[n] for n, k in SGLANG_NVFP4_PAGES.items()))   # 256
        if sglang_regroups(ctx) and ctx.page_size % step:
            raise UnsupportedCombination(f"SGLang's NVFP4 DeepSeek V4 pool regroups pages into its kernels' "
                                         f"{SGLANG_NVFP4_PAGES} tokens: page_size must be a multiple of {step}, "
                                         f"got {ctx.page_size}")

    def pools(self, ctx: PlanContext):
        m, P = ctx.model, ctx.page_size
        sharded = ctx.parallel.dcp_size > 1 and not ctx.parallel.is_draft_worker
        dcp = ("dcp_rank", "dcp_size") if sharded else ()
        rec = fp4_record(ctx.kv_cache_dtype)
        if rec is None:
            kv = BufferSpec("kv", (_d.TOKEN_BYTES,), "uint8", layout="dsv4_kv")
            op, note = "store_dsv4_kv", "fp8 NoPE + ue8m0, bf16 RoPE"
        else:   # pages of pool_page_size records, no padding
            kv = BufferSpec("kv", (rec.token_bytes,), "uint8", layout="page_major")
            op, note, dcp = "store_dsv4_kv_fp4", f"fmt={rec.name}, {rec.token_bytes} B a token", dcp + ("fmt",)
        kv_pool = lambda name, layers, *more, **kw: PoolSpec(  # noqa: E731  (an SWA / c4 / c128 KV pool)
            name, layers, (kv, *more), op, regrouped=sglang_regroups(ctx), **kw)
        swa_map = BufferSpec("loc_map", (), "int64", layout="map", per_layer=False)
        out = [kv_pool("swa", tuple(range(m.num_layers)), swa_map, space="swa", needs=("loc_map",) + dcp,
                       note=note)]
        dcp = tuple(n for n in dcp if n != "fmt")
        c4, c128 = self._layers(m, 4), self._layers(m, 128)
        state = lambda w: BufferSpec("state", (w,), STATE_DTYPE, layout="page_major")  # noqa: E731
        kv_needs = dcp + (("fmt",) if rec else ())
        if c4:
            out += [kv_pool("c4", c4, needs=kv_needs, note=note + ", c4 loc"),
                    PoolSpec("c4_indexer", c4, (BufferSpec("index_k", (_d.indexer_row_bytes(m.index_head_dim),),
                                                           "uint8", layout="page_major"),),
                             "store_dsv4_indexer_k", needs=dcp, note="fp8 + fp32 scale per 128, c4 loc"),
                    PoolSpec("c4_state", c4, (state(_d.state_row_width(4, _d.KV_DIM)),), "store_rows",
                             space="swa", note="state_loc ring 8"),
                    PoolSpec("c4_indexer_state", c4, (state(_d.state_row_width(4, m.index_head_dim)),),
                             "store_rows", space="swa", note="state_loc ring 8")]
        if c128:
            out += [kv_pool("c128", c128, needs=kv_needs, note=note + ", c128 loc"),
                    PoolSpec("c128_state", c128, (state(_d.state_row_width(128, _d.KV_DIM)),), "store_rows",
                             note=f"ring 128 x {(ctx.max_running_requests or 0) + 1} request slots")]
        return out

    def sub_pool(self, spec, ctx, pages: int, scale: int):
        P = ctx.page_size
        div = POOL_RATIO.get(spec.name, 0)
        out = None
        if div > 1:  # the compressed loc space: full loc // ratio, pages of page_size // ratio locs
            dcp = ctx.parallel.dcp_size
            space = LocSpace(f"c{div}", P // div * dcp, pages * P * dcp // div, dcp)
            out = dict(geometry=PageGeometry(P // div, pages, loc_space_scale=scale), space=space)
        if spec.regrouped:   # the same rows in the kernels' pages (DCP refused: engines._sglang)
            k = SGLANG_NVFP4_PAGES[spec.name]
            return dict(out or {}, geometry=PageGeometry(k, pages * (P // div) // k))
        if out:
            return out
        if spec.name in ("c4_state", "c4_indexer_state"):
            ring = _d.state_ring(4)
            rows = _ceil_to(pages * scale * ring + ring + 1, 4)   # one ring per SWA page of page_size
        elif spec.name == "c128_state":
            rows = self._c128_rows(ctx)
        else:
            return None
        # state rows are addressed by state_loc (rows of the pool, the last one the sentinel)
        return dict(geometry=PageGeometry(1, rows), space=LocSpace(spec.name, 1, rows),
                    addressing="local")

    @staticmethod
    def _c128_rows(ctx) -> int:
        ring = _d.state_ring(128)
        return _ceil_to(((ctx.max_running_requests or 0) + 1) * ring + ring + 1, 128)

    def fixed_bytes(self, ctx) -> int:
        L128 = len(self._layers(ctx.model, 128))
        if not L128:
            return 0
        return self._c128_rows(ctx) * _d.state_row_width(128, _d.KV_DIM) * 4 * L128

    def default_requests(self, ctx, swa_full_tokens_ratio, memory_bytes, tokens):
        """SGLang's `_resolve_max_running_requests_per_worker`: full tokens / context_len * 512,
        clamped to [2048, 4096], at most half the tokens (context_len unknown: 2048)."""
        if memory_bytes is not None:
            full = int(memory_bytes / self.cell_size(ctx, swa_full_tokens_ratio))
        else:
            full = tokens
        ctx_len = ctx.model.context_len
        est = int(full / ctx_len * REQUESTS_PER_CONTEXT) if ctx_len else REQUESTS_MIN
        return max(1, min(max(min(est, REQUESTS_MAX), REQUESTS_MIN), full // 2))

    def cell_size(self, ctx, swa_full_tokens_ratio: float):
        m, r, P = ctx.model, swa_full_tokens_ratio, ctx.page_size
        L, L4, L128 = m.num_layers, len(self._layers(m, 4)), len(self._layers(m, 128))
        rec = fp4_record(ctx.kv_cache_dtype)
        if rec is None:
            kv = lambda p: _d.kv_page_bytes(p) / p  # noqa: E731  (page-padded bytes a token)
        else:
            kv = lambda p: rec.token_bytes  # noqa: E731  (FP4 pages: no padding)
        ring4 = _d.state_ring(4)
        states = (_d.state_row_width(4, _d.KV_DIM) + _d.state_row_width(4, m.index_head_dim)) * 4
        index = _d.indexer_row_bytes(m.index_head_dim) if L4 else 0
        out = r * kv(P) * L + r * ring4 / P * states * L4
        if L4:
            out += kv(P // 4) * L4 / 4 + index * L4 / 4
        if L128:
            out += kv(P // 128) * L128 / 128
        return out

    def inputs(self, plan, layer_id):
        m = plan.model
        return [("kv", (_d.KV_DIM,), m.torch_dtype)]

    def store(self, pool, layer_id, loc, tensors, scales) -> None:
        """`(kv,)`: the token's SWA row (full loc, translated by the SWA loc map). Compressed
        rows, indexer keys and states are stored with their own ops on `pool.layer(sub, layer)`
        buffers (`kvwrite.compressed_loc`, `kvwrite.state_loc` give their locs)."""
        if len(tensors) != 1 or scales:
            raise TypeError("store() for variant 'dsv4' takes (layer_id, loc, kv) and no scales")
        b = pool.layer("swa", layer_id)
        rec = fp4_record(pool.plan.kv_cache_dtype)
        fmt = {} if rec is None else {"fmt": rec.name}
        pool.ops["swa"](tensors[0], b["kv"], loc, **pool.op_kwargs("swa"), **fmt)


register_builtin(DSV4Planner())
