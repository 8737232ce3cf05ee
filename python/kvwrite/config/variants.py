"""The built-in planners, one per attention variant (registered in `kvwrite.config.registry`).

A planner says which ModelSpec fields its variant reads, checks them, lays out the sub-pools
and buffers per kv_cache_dtype (the formats of design.md), and routes `KVPool.store` calls to
the store ops. Sizing, geometry and allocator checks are the configurator's, never a planner's.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from kvwrite.config.errors import SpecError, UnsupportedCombination
from kvwrite.config.model import ModelSpec
from kvwrite.config.plan import BufferSpec, PoolSpec, StatePoolSpec
from kvwrite.config.scales import DYNAMIC, FP8, STATIC_SCALED, fp8_scale_names, scale_applies  # noqa: F401
from kvwrite.config.registry import (PlanContext, VariantPlanner, draft_layers, planner_for,  # noqa: F401
                                     register_builtin, register_variant, unregister_variant, variants)
from kvwrite.ops.indexer_k import row_bytes as indexer_row_bytes
from kvwrite.ops.mla import DS_MLA_TILE, ds_mla_row_bytes
from kvwrite.ops.nvfp4 import BLOCK as NVFP4_BLOCK
from kvwrite.validate import FP8_MAX

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "nvfp4", "fp8_ds_mla", "int8",
                   *DYNAMIC, "fp4_e2m1", "nvfp4_fi_ds_mla", "nvfp4_v41")   # the last three: DeepSeek V4 (config/dsv4.py)
INDEXER_BLOCK = 128        # the DSA indexer's quant_block_size (DeepSeek-V3.2), passed to the op


def _require(spec, *names: str) -> None:
    missing = [n for n in names if not getattr(spec, n)]
    if missing:
        raise SpecError(f"variant {spec.variant!r} needs {', '.join(missing)} > 0")


def _scales(scales: dict, allowed: Sequence[str], variant: str, kv_cache_dtype: str = "auto") -> None:
    """No silent ignores: every scale keyword must be one this variant and format use."""
    ok = tuple(n for n in allowed if scale_applies(n, kv_cache_dtype))
    bad = sorted(set(scales) - set(ok))
    if bad:
        takes = f"scales {ok}" if ok else "no scales"
        raise TypeError(f"store() for variant {variant!r} with kv_cache_dtype={kv_cache_dtype!r} takes "
                        f"{takes}, got {bad}")


def _arity(tensors: tuple, names: Sequence[str], variant: str) -> None:
    if len(tensors) != len(names):
        raise TypeError(f"store() for variant {variant!r} takes (layer_id, loc, {', '.join(names)}), "
                        f"got {len(tensors)} tensor(s)")


# --- formats (design.md) -------------------------------------------------------------------------

def kv_buffers(kv: str, model_dtype: str, heads: int, dims: dict[str, int], variant: str
               ) -> tuple[tuple[BufferSpec, ...], str, str]:
    """MHA-style K/V buffers `[rows, heads, d]` per kv_cache_dtype -> (buffers, op, note)."""
    if kv == "auto":
        return tuple(BufferSpec(n, (heads, d), model_dtype) for n, d in dims.items()), "store_kv", ""
    if kv in STATIC_SCALED:
        return tuple(BufferSpec(n, (heads, d), STATIC_SCALED[kv]) for n, d in dims.items()), "store_kv", kv
    if kv in DYNAMIC:  # K/V codes + fp32 scale caches [pages, pps] or [pages, pps, H]
        dtype, per_head = DYNAMIC[kv]
        out = [BufferSpec(n, (heads, d), dtype) for n, d in dims.items()]
        out += [BufferSpec(f"{n}_scale_cache", (heads,) if per_head else (), "float32") for n in dims]
        return tuple(out), "store_kv", kv
    if kv == "nvfp4":
        bad = {n: d for n, d in dims.items() if d % NVFP4_BLOCK}
        if bad:
            raise UnsupportedCombination(f"variant {variant!r} with nvfp4 needs head dims that are "
                                         f"multiples of {NVFP4_BLOCK}, got {bad}")
        out = []
        for n, d in dims.items():
            out.append(BufferSpec(n, (heads, d // 2), "uint8"))
        for n, d in dims.items():
            out.append(BufferSpec(f"{n}_scale", (heads, d // NVFP4_BLOCK), "float8_e4m3fn"))
        return tuple(out), "store_kv_nvfp4", ""
    raise UnsupportedCombination(f"kv_cache_dtype={kv!r} applies only to MLA variants (mla, dsa), "
                                 f"not {variant!r}")


def mla_buffers(kv: str, model_dtype: str, lora: int, rope: int) -> tuple[tuple[BufferSpec, ...], str, str]:
    """MLA row `[rows, lora + rope]` per kv_cache_dtype -> (buffers, op, note)."""
    if kv == "auto":
        return (BufferSpec("kv", (lora + rope,), model_dtype),), "store_mla", ""
    if kv in FP8:
        return (BufferSpec("kv", (lora + rope,), FP8[kv]),), "store_mla", kv
    if kv == "fp8_ds_mla":
        if lora % DS_MLA_TILE:
            raise UnsupportedCombination(f"fp8_ds_mla needs kv_lora_rank a multiple of {DS_MLA_TILE}, got {lora}")
        return (BufferSpec("kv", (ds_mla_row_bytes(lora, rope),), "uint8"),), "store_mla", kv
    if kv == "nvfp4":
        if (lora + rope) % NVFP4_BLOCK:
            raise UnsupportedCombination(f"nvfp4 MLA needs kv_lora_rank + qk_rope_head_dim a multiple of "
                                         f"{NVFP4_BLOCK}, got {lora + rope}")
        return (BufferSpec("kv", ((lora + rope) // 2,), "uint8"),
                BufferSpec("kv_scale", ((lora + rope) // NVFP4_BLOCK,), "float8_e4m3fn")), "store_mla", kv
    raise UnsupportedCombination(f"kv_cache_dtype={kv!r} is not an MLA format")


def indexer_buffer(dim: int) -> BufferSpec:
    """DSA indexer K: uint8 page-major `[pages, pps * (dim + dim/128 * 4)]` (e4m3 + fp32 scales)."""
    return BufferSpec("index_k", (indexer_row_bytes(dim, INDEXER_BLOCK),), "uint8", layout="page_major")


def _needs(op: str, kv: str, sharded: bool, loc_map: bool = False) -> tuple[str, ...]:
    needs: list[str] = []
    if op == "store_mla" and kv != "auto":
        needs.append(f"kv_cache_dtype={kv}")
    if op == "store_mla" and kv == "nvfp4":
        needs += ["scale_cache"]
    if loc_map:
        needs.append("loc_map")
    if sharded:
        needs += ["dcp_rank", "dcp_size"]
    return tuple(needs)


def _with_layout(ctx: PlanContext, bufs: tuple[BufferSpec, ...], needs: tuple[str, ...]
                 ) -> tuple[tuple[BufferSpec, ...], tuple[str, ...]]:
    """`layout="HND"`: the paged K/V buffers head-major, and the op must take `layout=`."""
    if ctx.layout == "NHD":
        return bufs, needs
    return tuple(dataclasses.replace(b, layout="hnd") if b.layout == "rows" else b for b in bufs), needs + ("layout",)


def _only_nhd(ctx: PlanContext, variant: str) -> None:
    if ctx.layout != "NHD":
        raise UnsupportedCombination(f"layout={ctx.layout!r} applies to MHA-style K/V pools (mha, swa_hybrid, "
                                     f"hybrid_linear, minimax_sparse), not {variant!r}: its rows have no head axis")


def _shared_slots(ctx: PlanContext, layers: tuple[int, ...]) -> tuple[int, ...]:
    """Buffer copies of `layers` when the model has KV-shared layers: each reuses its source's copy
    (kvwrite's and vLLM's layouts); SGLang allocates the shared layers' buffers too (unused)."""
    m = ctx.model
    if not m.kv_sharing or ctx.parallel.engine == "sglang":
        return ()
    own = [lid for lid in layers if m.kv_source(lid) is None]
    slot = {lid: i for i, lid in enumerate(own)}
    return tuple(slot[lid] if lid in slot else slot[m.kv_source(lid)] for lid in layers)


def _sharded(ctx: PlanContext) -> bool:
    """Main pools of a target worker under DCP keep only this rank's tokens."""
    return ctx.parallel.dcp_size > 1 and not ctx.parallel.is_draft_worker


# --- store helpers (the pool passes itself) ------------------------------------------------------

def _store_kv_like(pool, sub: str, layer_id: int, loc, k, v, scales: dict, prefix: str = "") -> None:
    """store_kv / store_kv_nvfp4 of one sub-pool (k and v may be the same tensor and `v` buffers
    absent: the K-only index pool stores its K as both, into the same cache)."""
    b = pool.layer(sub, layer_id)
    plan = pool.plan.pool(sub)
    kw = pool.op_kwargs(sub)
    k_only = "v" not in b
    if plan.op == "store_kv_nvfp4":
        ks, vs = b["k_scale"], (b["k_scale"] if k_only else b["v_scale"])
        mine = ("global_scale",) * 2 if k_only else ("k_global_scale", "v_global_scale")
        for theirs, name in zip(("k_global_scale", "v_global_scale"), mine):
            if scales.get(prefix + name) is not None:
                kw[theirs] = scales[prefix + name]
        pool.ops[sub](k, v, b["k"], b["k"] if k_only else b["v"], ks, vs, loc, **kw)
        return
    if "k_scale_cache" in b:  # dynamic per-token / per-token-head scales (kvwrite.ops.kv)
        kw["k_scale_cache"] = b["k_scale_cache"]
        kw["v_scale_cache"] = b["k_scale_cache"] if k_only else b["v_scale_cache"]
    elif b["k"].dtype in FP8_MAX or b["k"].dtype == torch.int8:  # the pool's build-time scales, or this call's (KVPool.store)
        kw["k_scale"] = scales[prefix + ("scale" if k_only else "k_scale")]
        kw["v_scale"] = kw["k_scale"] if k_only else scales[prefix + "v_scale"]
    pool.ops[sub](k, v, b["k"], b["k"] if k_only else b["v"], loc, **kw)


def _store_mla(pool, sub: str, layer_id: int, loc, kv_c, k_pe, scales: dict) -> None:
    b = pool.layer(sub, layer_id)
    kw = pool.op_kwargs(sub)
    kv = pool.plan.kv_cache_dtype
    if kv != "auto":
        kw["kv_cache_dtype"] = kv
    if kv in FP8:
        kw["scale"] = scales["scale"]
    if kv == "nvfp4":
        kw["scale_cache"] = b["kv_scale"]
        if scales.get("global_scale") is not None:
            kw["global_scale"] = scales["global_scale"]
    pool.ops[sub](kv_c, k_pe, b["kv"], loc, **kw)


def _store_indexer(pool, sub: str, layer_id: int, loc, index_k, scales: dict) -> None:
    b = pool.layer(sub, layer_id)
    kw = pool.op_kwargs(sub)
    kw["quant_block_size"] = INDEXER_BLOCK
    if scales.get("index_scale_fmt") is not None:
        kw["scale_fmt"] = scales["index_scale_fmt"]
    pool.ops[sub](index_k, b["index_k"], loc, **kw)


# --- planners ------------------------------------------------------------------------------------

MHA_FIELDS = frozenset({"num_kv_heads", "head_dim", "v_head_dim", "kv_sharing"})
MHA_SCALES = ("k_scale", "v_scale", "k_global_scale", "v_global_scale")


class MHAPlanner(VariantPlanner):
    name = "mha"
    fields = MHA_FIELDS
    kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "nvfp4", "int8", *DYNAMIC)
    SCALES = MHA_SCALES

    def check_model(self, spec) -> None:
        _require(spec, "num_kv_heads", "head_dim")

    def _dims(self, spec) -> dict[str, int]:
        return {"k": spec.head_dim, "v": spec.v_head_dim or spec.head_dim}

    def _kv_pool(self, ctx: PlanContext, name: str, layers, space: str = "full",
                 loc_map: bool = False, heads: int | None = None, dims: dict | None = None) -> PoolSpec:
        heads = ctx.heads if heads is None else heads
        dims = self._dims(ctx.model) if dims is None else dims
        bufs, op, note = kv_buffers(ctx.kv_cache_dtype, ctx.dtype, heads, dims, self.name)
        bufs, needs = _with_layout(ctx, bufs, _needs(op, ctx.kv_cache_dtype, _sharded(ctx), loc_map))
        layers = tuple(layers)
        return PoolSpec(name, layers, bufs, op, space=space, needs=needs, note=note,
                        slots=_shared_slots(ctx, layers))

    def pools(self, ctx: PlanContext) -> Sequence[PoolSpec]:
        return [self._kv_pool(ctx, "kv", self.kv_layer_ids(ctx.model))]

    def _layer_shape(self, m, parallel, layer_id: int) -> tuple[int, dict[str, int]]:
        """(KV heads per rank, {"k": dim, "v": dim}) of layer `layer_id`."""
        return parallel.kv_heads_per_rank(m.num_kv_heads), self._dims(m)

    def inputs(self, plan, layer_id):
        m = plan.model
        heads, d = self._layer_shape(m, plan.parallel, layer_id)
        return [("k", (heads, d["k"]), m.torch_dtype), ("v", (heads, d["v"]), m.torch_dtype)]

    def route(self, pool, layer_id: int) -> str:
        return "kv"

    def store(self, pool, layer_id, loc, tensors, scales) -> None:
        _arity(tensors, ("k", "v"), self.name)
        _scales(scales, MHA_SCALES, self.name, pool.plan.kv_cache_dtype)
        _store_kv_like(pool, self.route(pool, layer_id), layer_id, loc, tensors[0], tensors[1], scales)


MHAPlanner.FAST_STORE = MHAPlanner.store   # KVPool's bound C++ fast path serves exactly this store


class SWAHybridPlanner(MHAPlanner):
    """Full-attention layers in a full pool; sliding-window layers in a smaller SWA pool whose
    stores translate the full loc through the `loc_map` (full -> SWA, -1 = not in the window)."""

    name = "swa_hybrid"
    fields = MHA_FIELDS | {"sliding_window", "swa_layer_ids", "full_attention_layer_ids", "global_head_dim",
                           "num_global_kv_heads"}

    def _layer_shape(self, m, parallel, layer_id):
        """Gemma 4: the full-attention layers have their own head dim and KV heads."""
        if layer_id in m.swa_layer_ids:
            return super()._layer_shape(m, parallel, layer_id)
        d = m.global_head_dim or m.head_dim
        return parallel.kv_heads_per_rank(m.num_global_kv_heads or m.num_kv_heads), {"k": d, "v": d}

    def check_model(self, spec) -> None:
        _require(spec, "num_kv_heads", "head_dim", "sliding_window")
        swa, full = set(spec.swa_layer_ids), set(spec.full_attention_layer_ids)
        if not swa or not full:
            raise SpecError("swa_hybrid needs both swa_layer_ids and full_attention_layer_ids (a model "
                            "with only one kind is 'mha')")
        if swa & full or len(swa | full) != spec.num_layers:
            raise SpecError(f"swa_layer_ids and full_attention_layer_ids must partition the "
                            f"{spec.num_layers} layers (overlap {sorted(swa & full)}, missing "
                            f"{sorted(set(range(spec.num_layers)) - swa - full)})")

    def draft_model(self, spec):
        return _mha_draft(spec)

    def pools(self, ctx):
        m = ctx.model
        heads, dims = self._layer_shape(m, ctx.parallel, m.full_attention_layer_ids[0])
        full = self._kv_pool(ctx, "full", m.full_attention_layer_ids, heads=heads, dims=dims)
        swa = self._kv_pool(ctx, "swa", m.swa_layer_ids, space="swa", loc_map=True)
        swa = dataclasses.replace(swa, buffers=swa.buffers + (
            BufferSpec("loc_map", (), "int64", layout="map", per_layer=False),))
        return [full, swa]

    def route(self, pool, layer_id):
        return "swa" if layer_id in pool.plan.model.swa_layer_ids else "full"


class GroupedSWAPlanner(SWAHybridPlanner):
    """vLLM's layout of a sliding-window hybrid (engine="vllm"): every layer in one block pool
    (one loc space, no loc map), layers grouped as vLLM's KV cache manager groups them
    (`kvwrite.config.engines.vllm_kv_cache_groups`); the i-th layer of every group shares buffer
    copy i, so a pool holds group-size copies, not one a layer. Each group's slot mapping addresses
    the shared blocks (a sliding-window group frees blocks outside its window).

    Full-attention layers with their own head size / KV heads (Gemma 4): sub-pools "full" and
    "swa", each with the block size vLLM gives its layers after page-size unification
    (`engines.vllm_block_multipliers`: the smaller page's block holds more tokens, so both pages
    are the same bytes); the sub-pool with fewer copies views the other's memory
    (`PoolSpec.alias`). Both serve `num_pages` blocks of one block pool; a sub-pool whose block is
    k pages addresses its own loc space ("<name>_x<k>": slot = block * k * page_size + offset)."""

    name = "swa_grouped"

    @staticmethod
    def _slots(m) -> dict[int, int]:
        """layer id -> its position in its vLLM KV cache group (the buffer copy it uses)."""
        from kvwrite.config.engines import vllm_kv_cache_groups

        # KV-shared layers have no cache of their own in vLLM (kv_sharing_target_layer_name): they
        # join no group and read their source layer's tensor
        kinds = [(i, "swa" if i in m.swa_layer_ids else "full") for i in range(m.num_layers)
                 if m.kv_source(i) is None]
        slot = {lid: j for g in vllm_kv_cache_groups(kinds) for j, lid in enumerate(g)}
        slot.update({a: slot[b] for a, b in m.kv_sharing})
        return slot

    def _multipliers(self, ctx) -> dict[str, int] | None:
        """None when every layer has one shape (one sub-pool), else vLLM's block-size multiplier
        of the "full" and "swa" layers."""
        from kvwrite.config.engines import vllm_block_multipliers

        m = ctx.model
        shapes = {kind: self._layer_shape(m, ctx.parallel, ids[0])
                  for kind, ids in (("full", m.full_attention_layer_ids), ("swa", m.swa_layer_ids))}
        if shapes["full"] == shapes["swa"]:
            return None
        pages = {kind: {b.name: b.row_bytes for b in kv_buffers(ctx.kv_cache_dtype, ctx.dtype, h, d, self.name)[0]}
                 for kind, (h, d) in shapes.items()}
        return vllm_block_multipliers(pages, m.architecture or m.name or "this model")

    def pools(self, ctx):
        m = ctx.model
        slot = self._slots(m)
        mult = self._multipliers(ctx)
        if mult is None:
            kv = self._kv_pool(ctx, "kv", range(m.num_layers))
            return [dataclasses.replace(kv, slots=tuple(slot[i] for i in kv.layer_ids),
                                        note=", ".join(filter(None, (kv.note, "vLLM KV cache groups"))))]
        out = []
        for name, ids in (("full", m.full_attention_layer_ids), ("swa", m.swa_layer_ids)):
            heads, dims = self._layer_shape(m, ctx.parallel, ids[0])
            p = self._kv_pool(ctx, name, ids, heads=heads, dims=dims)
            note = f"vLLM KV cache groups, blocks of {mult[name]} x page_size" if mult[name] > 1 else \
                "vLLM KV cache groups"
            out.append(dataclasses.replace(p, slots=tuple(slot[i] for i in ids),
                                           note=", ".join(filter(None, (p.note, note)))))
        owner = max(out, key=lambda p: p.num_buffers)   # ties: "full"
        return [p if p is owner else dataclasses.replace(p, alias=owner.name) for p in out]

    def sub_pool(self, spec, ctx, pages, scale):
        mult = self._multipliers(ctx) if spec.name in ("full", "swa") else None
        k = mult[spec.name] if mult else 1
        if k == 1:
            return None
        from kvwrite.config.plan import LocSpace
        from kvwrite.geometry import PageGeometry

        P, dcp = ctx.page_size * k, ctx.parallel.dcp_size
        return dict(geometry=PageGeometry(P, pages, loc_space_scale=scale),
                    space=LocSpace(f"{spec.name}_x{k}", P * dcp, pages * P * dcp, dcp))

    def cell_size(self, ctx, swa_full_tokens_ratio):
        """Bytes a page_size token of the block pool: the memory owner's copies x its rows a token
        (k for blocks of k pages); the aliasing sub-pool adds nothing."""
        mult = self._multipliers(ctx)
        if mult is None:
            return None
        return sum(p.num_buffers * mult[p.name] * sum(b.row_bytes for b in p.buffers)
                   for p in self.pools(ctx) if not p.alias)

    def route(self, pool, layer_id):
        if len(pool.plan.pools) == 1:
            return "kv"
        return super().route(pool, layer_id)


def _mha_draft(spec):
    return ModelSpec("mha", draft_layers(spec), num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                     v_head_dim=spec.v_head_dim, dtype=spec.dtype, num_draft_layers=spec.num_draft_layers,
                     name=f"{spec.name or spec.variant} draft")


class HybridLinearPlanner(MHAPlanner):
    """KV only for the full-attention layers (the linear/recurrent layers keep a state pool of
    their own, outside kvwrite); the layer map sends layer id -> index in the KV pool."""

    name = "hybrid_linear"
    fields = MHA_FIELDS | {"full_attention_layer_ids", "linear_layer_ids", "linear_state"}

    def check_model(self, spec) -> None:
        _require(spec, "num_kv_heads", "head_dim")
        if not spec.full_attention_layer_ids:
            raise SpecError("hybrid_linear needs full_attention_layer_ids (the layers with a KV cache)")
        if (spec.linear_state is None) != (not spec.linear_layer_ids):
            raise SpecError("hybrid_linear takes linear_layer_ids and linear_state together (the layers "
                            "with a recurrent state and its shape), or neither")

    def kv_layer_ids(self, spec):
        return spec.full_attention_layer_ids

    def state_pools(self, ctx):
        """Conv and SSM / recurrent state per linear layer, one row per request slot. On the
        Ascend layout the conv state is stored window-major (`[K-1, channels]`), as SGLang's NPU
        Mamba pool does."""
        st = ctx.model.linear_state
        if st is None:
            return ()
        shapes, dtypes = st.shapes(ctx.parallel.tp_size), st.dtypes()
        if ctx.target == "npu" and "conv" in shapes:
            shapes["conv"] = shapes["conv"][::-1]
        bufs = tuple(BufferSpec(n, shape, dtypes[n], layout="slots") for n, shape in shapes.items())
        return (StatePoolSpec("state", ctx.model.linear_layer_ids, bufs),)

    def draft_model(self, spec):
        return _mha_draft(spec)


class LinearGroupedPlanner(MHAPlanner):
    """vLLM's layout of a gated-delta-net hybrid (engine="vllm", Qwen3-Next): no request-slot state
    pool; each GDN layer's conv + recurrent state lives in KV blocks, one a block, at the block size
    vLLM raises until an attention page holds one (`engines.vllm_gdn_block`, the configurator's
    page_size). Attention and GDN layers form vLLM's KV cache groups (`engines.vllm_gdn_groups`);
    the i-th layer of every group shares block-major copy i: an attention layer's K | V page, or a
    GDN layer's state and padding (sub-pool "state", vLLM's state shapes, no store: read it with
    `KVPool.state(layer)`, `[blocks, ...]`)."""

    name = "linear_grouped"
    fields = HybridLinearPlanner.fields
    check_model = HybridLinearPlanner.check_model

    def kv_layer_ids(self, spec):
        return spec.full_attention_layer_ids

    def pools(self, ctx):
        from kvwrite.config.engines import vllm_gdn_groups, vllm_gdn_state

        m = ctx.model
        slot = {lid: j for g in vllm_gdn_groups(m) for j, lid in enumerate(g)}
        kv = self._kv_pool(ctx, "kv", m.full_attention_layer_ids)
        kv = dataclasses.replace(kv, slots=tuple(slot[i] for i in kv.layer_ids), block_major=True,
                                 note=", ".join(filter(None, (kv.note, "vLLM KV cache groups, K | V a block"))))
        bufs = tuple(BufferSpec(n, shape, dtype, layout="block")
                     for n, (shape, dtype) in vllm_gdn_state(m, ctx.parallel.tp_size).items())
        state = PoolSpec("state", m.linear_layer_ids, bufs, "", alias="kv", note="GDN states, one a block",
                         slots=tuple(slot[i] for i in m.linear_layer_ids))
        return [kv, state]

    def draft_model(self, spec):
        return _mha_draft(spec)


class MLAPlanner(VariantPlanner):
    name = "mla"
    fields = frozenset({"kv_lora_rank", "qk_rope_head_dim"})
    kv_cache_dtypes = ("auto", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_ds_mla", "nvfp4")
    SCALES = ("scale", "global_scale")

    def check_model(self, spec) -> None:
        _require(spec, "kv_lora_rank", "qk_rope_head_dim")

    def _mla_pool(self, ctx) -> PoolSpec:
        _only_nhd(ctx, self.name)
        m = ctx.model
        if ctx.target == "npu":
            # SGLang's NPU MLA pool: the latent (nope) and rope parts in two buffers
            # [pages, page, 1, kv_lora_rank] and [pages, page, 1, qk_rope_head_dim], one store_kv.
            bufs = (BufferSpec("k", (1, m.kv_lora_rank), ctx.dtype), BufferSpec("v", (1, m.qk_rope_head_dim), ctx.dtype))
            return PoolSpec("kv", self.kv_layer_ids(m), bufs, "store_kv", needs=_needs("store_kv", "auto", _sharded(ctx)),
                            note="ascend: nope | rope buffers")
        bufs, op, note = mla_buffers(ctx.kv_cache_dtype, ctx.dtype, m.kv_lora_rank, m.qk_rope_head_dim)
        return PoolSpec("kv", self.kv_layer_ids(m), bufs, op, needs=_needs(op, ctx.kv_cache_dtype, _sharded(ctx)),
                        note=note)

    def pools(self, ctx):
        return [self._mla_pool(ctx)]

    def inputs(self, plan, layer_id):
        m = plan.model
        return [("kv_c", (m.kv_lora_rank,), m.torch_dtype), ("k_pe", (m.qk_rope_head_dim,), m.torch_dtype)]

    def store(self, pool, layer_id, loc, tensors, scales) -> None:
        _arity(tensors, ("kv_c", "k_pe"), self.name)
        if pool.plan.target == "npu":
            _scales(scales, (), f"{self.name} (ascend layout)", "auto")
            _store_kv_like(pool, "kv", layer_id, loc, tensors[0].unsqueeze(-2), tensors[1].unsqueeze(-2), {})
            return
        _scales(scales, self.SCALES, self.name, pool.plan.kv_cache_dtype)
        _store_mla(pool, "kv", layer_id, loc, tensors[0], tensors[1], scales)


class DSAPlanner(MLAPlanner):
    """MLA pool + the DSA indexer K cache (fp8 + fp32 scales per 128, always). SGLang's and
    kvwrite's: every DCP rank holds it whole, indexed by the virtual loc, so its pages are
    page_size * dcp_size. vLLM's (engine="vllm"): sharded over the DCP ranks like the MLA pool."""

    name = "dsa"
    fields = MLAPlanner.fields | {"index_head_dim"}
    SCALES = MLAPlanner.SCALES + ("index_scale_fmt",)

    def check_model(self, spec) -> None:
        _require(spec, "kv_lora_rank", "qk_rope_head_dim", "index_head_dim")
        if spec.index_head_dim % INDEXER_BLOCK:
            raise SpecError(f"dsa index_head_dim must be a multiple of {INDEXER_BLOCK}, got {spec.index_head_dim}")

    def pools(self, ctx):
        if ctx.target == "npu":
            raise UnsupportedCombination("variant 'dsa' has no Ascend layout here: SGLang's NPU DSA pool keeps a "
                                         "bf16 index K per layer, which this kvwrite does not plan")
        layers = self.kv_layer_ids(ctx.model)
        if ctx.parallel.engine == "vllm":   # vLLM shards the indexer cache over the DCP ranks like the MLA cache
            return [self._mla_pool(ctx), PoolSpec("indexer", layers, (indexer_buffer(ctx.model.index_head_dim),),
                                                  "store_indexer_k", needs=_needs("store_indexer_k", "auto",
                                                                                  _sharded(ctx)))]
        return [self._mla_pool(ctx), PoolSpec("indexer", layers, (indexer_buffer(ctx.model.index_head_dim),),
                                              "store_indexer_k", virtual=True)]

    def inputs(self, plan, layer_id):
        m = plan.model
        return super().inputs(plan, layer_id) + [("index_k", (m.index_head_dim,), m.torch_dtype)]

    def store(self, pool, layer_id, loc, tensors, scales) -> None:
        _arity(tensors, ("kv_c", "k_pe", "index_k"), self.name)
        _scales(scales, self.SCALES, self.name, pool.plan.kv_cache_dtype)
        _store_mla(pool, "kv", layer_id, loc, tensors[0], tensors[1], scales)
        _store_indexer(pool, "indexer", layer_id, loc, tensors[2], scales)


class MLALinearPlanner(MLAPlanner):
    """MLA KV only for the full-attention layers of a linear-attention hybrid (Kimi Linear: MLA
    layers beside Kimi Delta Attention layers), the recurrent state per request slot beside."""

    name = "mla_linear"
    fields = MLAPlanner.fields | {"full_attention_layer_ids", "linear_layer_ids", "linear_state"}

    def check_model(self, spec) -> None:
        _require(spec, "kv_lora_rank", "qk_rope_head_dim")
        if not spec.full_attention_layer_ids:
            raise SpecError("mla_linear needs full_attention_layer_ids (the MLA layers)")
        if (spec.linear_state is None) != (not spec.linear_layer_ids):
            raise SpecError("mla_linear takes linear_layer_ids and linear_state together, or neither")

    def kv_layer_ids(self, spec):
        return spec.full_attention_layer_ids

    state_pools = HybridLinearPlanner.state_pools

    def draft_model(self, spec):
        return ModelSpec("mla", draft_layers(spec), kv_lora_rank=spec.kv_lora_rank,
                         qk_rope_head_dim=spec.qk_rope_head_dim, dtype=spec.dtype,
                         num_draft_layers=spec.num_draft_layers, name=f"{spec.name or spec.variant} draft")


class MiniMaxSparsePlanner(MHAPlanner):
    """Main MHA pool + a 1-head index-K pool (K only) in the same format; two stores a layer."""

    name = "minimax_sparse"
    fields = MHA_FIELDS | {"index_head_dim"}
    SCALES = MHA_SCALES + ("index_scale", "index_global_scale")

    def check_model(self, spec) -> None:
        _require(spec, "num_kv_heads", "head_dim", "index_head_dim")

    def pools(self, ctx):
        main = self._kv_pool(ctx, "kv", self.kv_layer_ids(ctx.model))
        bufs, op, note = kv_buffers(ctx.kv_cache_dtype, ctx.dtype, 1, {"k": ctx.model.index_head_dim}, self.name)
        bufs, needs = _with_layout(ctx, bufs, _needs(op, ctx.kv_cache_dtype, _sharded(ctx)))
        index = PoolSpec("index", main.layer_ids, bufs, op, needs=needs, note=(note + ", " if note else "") + "K only")
        return [main, index]

    def inputs(self, plan, layer_id):
        m = plan.model
        return super().inputs(plan, layer_id) + [("index_k", (m.index_head_dim,), m.torch_dtype)]

    def store(self, pool, layer_id, loc, tensors, scales) -> None:
        _arity(tensors, ("k", "v", "index_k"), self.name)
        _scales(scales, self.SCALES, self.name, pool.plan.kv_cache_dtype)
        _store_kv_like(pool, "kv", layer_id, loc, tensors[0], tensors[1], scales)
        ik = tensors[2]
        ik = ik.unsqueeze(1) if ik.dim() == 2 else ik
        _store_kv_like(pool, "index", layer_id, loc, ik, ik, scales, prefix="index_")


# --- the built-in variants ---------------------------------------------------------------------

BUILTIN = ("mha", "mla", "dsa", "swa_hybrid", "swa_grouped", "hybrid_linear", "linear_grouped", "minimax_sparse",
           "mla_linear")
register_builtin(MHAPlanner(), MLAPlanner(), DSAPlanner(), SWAHybridPlanner(), GroupedSWAPlanner(),
                 HybridLinearPlanner(), LinearGroupedPlanner(), MiniMaxSparsePlanner(), MLALinearPlanner())
