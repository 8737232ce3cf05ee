"""Whose layout a plan is: the model as SGLang's or vLLM's code lays out its KV cache.

A `ModelSpec` says what the model's attention is; the engine decides which pools serve it
("kvwrite": the spec's variant as read, kvwrite's own pools and allocator).
`engine_layout` turns the spec read from a config into the spec the engine actually builds
(hybrid SWA off where SGLang's model code stores every layer in one full pool, the DS-MLA fp8
row both engines use for DeepSeek DSA) and refuses where the engine has no layout, each refusal
naming the engine's rule. Facts from SGLang 0.5.23 and vLLM 0.32.0 (paths given per rule).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvwrite.config.errors import UnsupportedCombination
from kvwrite.config.model import ModelSpec
from kvwrite.config.parallel import ENGINES

# SGLang (configs/model_config.py `is_hybrid_swa_model`): the architectures whose sliding-window
# layers get an SWA pool. Every other model with sliding layers (Gemma 2 / 3 / 3n, Cohere2,
# EXAONE 4, text-only Llama 4, ...) is stored in one full pool at the full loc; for Gemma 2/3/3n,
# EXAONE 4 and OLMo 2 its model overrides also set disable_hybrid_swa_memory.
SGLANG_HYBRID_SWA_ARCHS = frozenset({
    "GptOssForCausalLM", "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM", "IQuestQ1ForCausalLM",
    "Llama4ForConditionalGeneration", "DeepseekV4ForCausalLM", "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration", "EmbeddingGemma2Model",
    "BeamForCausalLM", "Step3p5ForCausalLM", "Step3p7ForConditionalGeneration", "LagunaForCausalLM",
    "MellumForCausalLM", "MiMoV2FlashForCausalLM", "InklingForConditionalGeneration",
})
SGLANG_SWA_DISABLED_BY_OVERRIDE = frozenset({
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma3nForCausalLM",
    "Gemma3nForConditionalGeneration", "Exaone4ForCausalLM", "Olmo2ForCausalLM",
})
SGLANG_DSA_PAGE_SIZE = 64   # model_overrides/deepseek_v2.py: "Setting page size to 64 for DeepSeek DSA"
FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz")


def vllm_kv_cache_groups(kinds: list[tuple[int, str]]) -> list[tuple[int, ...]]:
    """vLLM's KV cache groups of a model whose layers (layer id, attention kind) have one page
    size (v1/core/kv_cache_utils.py `_get_kv_cache_groups_uniform_page_size`): layers bucketed by
    kind in first-seen order; group size = the smallest bucket, or the largest when that is under
    1.5 x the smallest; bucket b splits into cdiv(len, size) groups, group i = bucket[i::n]."""
    buckets: dict[str, list[int]] = {}
    for lid, kind in kinds:
        buckets.setdefault(kind, []).append(lid)
    sizes = [len(b) for b in buckets.values()]
    size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups = []
    for layers in buckets.values():
        n = -(-len(layers) // size)
        groups += [tuple(layers[i::n]) for i in range(n)]
    return groups


def vllm_block_multipliers(page_bytes: dict[str, dict[str, int]], what: str) -> dict[str, int]:
    """vLLM's `kv_cache_utils.unify_kv_cache_spec_page_size` for attention layers of different page
    sizes: a layer kind whose page (bytes a block at the configured block size) is smaller than
    the largest takes block_size x (largest // its page), so every page holds the same bytes.
    `page_bytes`: {kind: {buffer: bytes a token}}; returns {kind: block-size multiplier}. vLLM
    pads a page that does not divide the largest (`page_size_padded`, a strided view), which
    kvwrite does not plan; kvwrite also needs each buffer to scale alike (its copies alias
    buffer by buffer): both refused with UnsupportedCombination."""
    total = {kind: sum(b.values()) for kind, b in page_bytes.items()}
    top = max(total.values())
    out = {kind: top // t for kind, t in total.items()}
    if any(top % t for t in total.values()):
        raise UnsupportedCombination(
            f"engine='vllm' pads {what}'s smaller KV pages to the largest ({total} bytes a token: not a divisor, "
            f"kv_cache_utils.unify_kv_cache_spec_page_size sets page_size_padded), a strided layout kvwrite does "
            f"not plan: use engine='sglang'")
    per_buffer = {name: {kind: b[name] * out[kind] for kind, b in page_bytes.items()} for name in
                  next(iter(page_bytes.values()))}
    if any(len(set(v.values())) > 1 for v in per_buffer.values()):
        raise UnsupportedCombination(
            f"engine='vllm' unifies {what}'s page sizes by block size, but this kv_cache_dtype's buffers do not "
            f"scale alike ({per_buffer}), so kvwrite's sub-pools cannot share their memory buffer by buffer: "
            f"use kv_cache_dtype='auto' or an fp8 format, or engine='sglang'")
    return out


VLLM_KERNEL_BLOCK = 16   # FlashAttention's kernel block sizes: MultipleOf(16) (v1/attention/backends/flash_attn.py)


def vllm_gdn_state(spec: ModelSpec, tp: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """vLLM's GDN state of one layer on one of `tp` ranks, {name: (shape, dtype)}
    (MambaStateShapeCalculator.gated_delta_net_state_shape, conv state-length-major): conv
    `[K-1, conv_dim/tp]`, recurrent `[H/tp, head_v_dim, head_k_dim]`. dtypes: mamba_cache_dtype
    "auto" is the model's; the recurrent state's too (mamba_ssm_cache_dtype "auto"), except on
    Qwen3.5, whose config hook adopts the config's mamba_ssm_dtype (as read: float32 when absent)."""
    st = spec.linear_state
    conv, ssm = st.shapes(tp)["conv"], st.shapes(tp)["ssm"]
    ssm_dtype = st.ssm_dtype if (spec.architecture or "").startswith("Qwen3_5") else spec.dtype
    return {"conv": ((conv[1], conv[0]), spec.dtype), "ssm": ((ssm[0], ssm[2], ssm[1]), ssm_dtype)}


def vllm_gdn_block(spec: ModelSpec, parallel, kv: str, page_size: int) -> dict[str, int]:
    """vLLM 0.32's block size for a gated-delta-net hybrid (Qwen3-Next): the GDN states live in the
    KV block pool, one layer's state a block (`Platform._align_hybrid_block_size`): the attention
    block size grows in multiples of max(16, block_size) (FlashAttention's kernel blocks) until an
    attention page holds a state, and the state page is padded to it (`mamba_page_size_padded`).
    {"block", "attn" (attention bytes a token), "state" (a layer's state bytes,
    `vllm_gdn_state`)}; UnsupportedCombination for a
    kv_cache_dtype whose page vLLM sizes otherwise."""
    import torch

    from kvwrite.config.scales import STATIC_SCALED

    def size(dtype: str) -> int:
        return torch.empty((), dtype=getattr(torch, dtype)).element_size()

    kv_dtype = spec.dtype if kv == "auto" else STATIC_SCALED.get(kv)
    if kv_dtype is None:
        raise UnsupportedCombination(f"kvwrite plans vLLM's layout of a GDN hybrid for kv_cache_dtype 'auto' and "
                                     f"the per-tensor-scaled formats, not {kv!r}: use engine='sglang' or 'kvwrite'")
    heads = parallel.kv_heads_per_rank(spec.num_kv_heads)
    attn = heads * (spec.head_dim + (spec.v_head_dim or spec.head_dim)) * size(kv_dtype)
    state = sum(math.prod(shape) * size(dtype) for shape, dtype in vllm_gdn_state(spec, parallel.tp_size).values())
    align = max(VLLM_KERNEL_BLOCK, page_size)
    block = align * -(-state // (align * attn))
    block = max(page_size, VLLM_KERNEL_BLOCK * -(-block // VLLM_KERNEL_BLOCK))
    return dict(block=block, attn=attn, state=state)


def vllm_gdn_groups(spec: ModelSpec) -> list[tuple[int, ...]]:
    """vLLM's KV cache groups of a GDN hybrid: attention and GDN layers, equal pages."""
    kinds = sorted([(i, "attention") for i in spec.full_attention_layer_ids] +
                   [(i, "gdn") for i in spec.linear_layer_ids])
    return vllm_kv_cache_groups(kinds)


@dataclass(frozen=True)
class EngineLayout:
    """The model as `engine` lays it out, the kv cache dtype it stores, and each change from the
    spec as read (with the engine's rule that makes it)."""

    engine: str
    model: ModelSpec
    kv_cache_dtype: str
    notes: tuple[str, ...] = ()
    page_size: int | None = None   # the engine's block size where it overrides the one asked for


def _one_pool(spec: ModelSpec) -> ModelSpec:
    """An SWA-hybrid spec served with every layer in one full pool."""
    return ModelSpec("mha", spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                     v_head_dim=spec.v_head_dim, dtype=spec.dtype, num_draft_layers=spec.num_draft_layers,
                     kv_sharing=spec.kv_sharing, context_len=spec.context_len, name=spec.name,
                     architecture=spec.architecture)


def _check_dcp(engine: str, parallel) -> None:
    tp, dcp = parallel.tp_size, parallel.dcp_size
    if dcp > 1 and tp % dcp:
        rule = ("its attention TP size must be a multiple of dcp_size (arg_groups/parallel_hook.py)"
                if engine == "sglang" else "tp_size must be divisible by dcp_size (config/parallel.py)")
        raise UnsupportedCombination(f"engine={engine!r} has no layout for tp_size={tp} with dcp_size={dcp}: "
                                     f"{rule}; DCP ranks are TP ranks, give tp_size a multiple of {dcp}")


def _sglang(spec: ModelSpec, parallel, kv: str, page_size: int) -> EngineLayout:
    notes: list[str] = []
    arch = spec.architecture
    if spec.variant == "swa_hybrid" and arch and arch not in SGLANG_HYBRID_SWA_ARCHS:
        why = ("its model overrides set disable_hybrid_swa_memory (arg_groups/model_overrides)"
               if arch in SGLANG_SWA_DISABLED_BY_OVERRIDE else
               "configs/model_config.py is_hybrid_swa_model does not list it")
        notes.append(f"SGLang stores every layer of {arch} in one full pool at the full loc (hybrid SWA "
                     f"memory off: {why})")
        spec = _one_pool(spec)
    if spec.variant == "swa_hybrid" and parallel.dcp_size > 1:
        raise UnsupportedCombination(
            f"engine='sglang' has no layout for hybrid SWA ({arch or spec.name or 'swa_hybrid'}) with "
            f"dcp_size={parallel.dcp_size}: its SWA allocator is not widened for DCP "
            f"(KVCacheConfigurator.logical_token_capacity: 'SWA allocators never widen under DCP'); use "
            f"dcp_size=1")
    if spec.variant == "dsa":
        if page_size != SGLANG_DSA_PAGE_SIZE:
            raise UnsupportedCombination(
                f"engine='sglang' serves DeepSeek DSA at page_size={SGLANG_DSA_PAGE_SIZE} only (its model "
                f"override sets it: arg_groups/model_overrides/deepseek_v2.py), got page_size={page_size}")
        if kv == "fp8_e4m3":
            notes.append("SGLang stores fp8 DSA rows as the 656-byte DS-MLA row (512 e4m3 + 4 fp32 scales + "
                         "64 bf16 rope: calculate_mla_kv_cache_dim on its default CUDA DSA backends)")
            kv = "fp8_ds_mla"
    if spec.variant == "dsv4":
        kv = _sglang_dsv4(kv, parallel, notes)
    return EngineLayout("sglang", spec, kv, tuple(notes))


def _sglang_dsv4(kv: str, parallel, notes: list[str]) -> str:
    """SGLang's DeepSeek V4 KV records (memory_pool/deepseek_v4_memory_pool.py): fp8 (584 B),
    --kv-cache-dtype fp4_e2m1 (PR #37138), the NVFP4 opt-in (PR #38646; kvwrite's "nvfp4")."""
    if kv in ("nvfp4_fi_ds_mla", "nvfp4_v41"):
        raise UnsupportedCombination(
            f"engine='sglang' has no DeepSeek V4 kv_cache_dtype {kv!r} (vLLM's / DeepSeek-V4.1's record): its FP4 "
            f"pools are 'fp4_e2m1' (MXFP4, 368 B) and the NVFP4 opt-in SGLANG_SM120_KV_CACHE_FORMAT=nvfp4 "
            f"(kv_cache_dtype='nvfp4', 384 B); plan {kv!r} with engine='kvwrite'")
    if kv == "fp4_e2m1":
        notes.append("SGLang fp4_e2m1 (PR #37138): 368-byte MXFP4 records in the SWA, c4 and c128 pools, no fp8 "
                     "page-tail padding; the c4 indexer stays fp8")
    if kv == "nvfp4":
        if parallel.dcp_size > 1:
            raise UnsupportedCombination(
                f"kvwrite does not plan SGLang's NVFP4 DeepSeek V4 pool with dcp_size={parallel.dcp_size}: it "
                f"regroups pages into its kernels' smaller pages, and DCP shards whole allocator pages; use "
                f"dcp_size=1 or kv_cache_dtype='fp4_e2m1'")
        notes.append("SGLang's NVFP4 opt-in (SGLANG_SM120_KV_CACHE_FORMAT=nvfp4, PR #38646; its --kv-cache-dtype "
                     "stays fp8): 384-byte records, each pool's rows regrouped into 64-token (SWA, c4) and 2-token "
                     "(c128) pages with no per-page padding, slot ids unchanged")
    return kv


VLLM_PLANNED = ("mha", "mla", "dsa", "swa_hybrid")   # the variants whose vLLM layout kvwrite plans


def _vllm(spec: ModelSpec, parallel, kv: str, page_size: int) -> EngineLayout:
    notes: list[str] = []
    if parallel.is_draft_worker:
        raise UnsupportedCombination(
            "engine='vllm' has no draft worker with pools of its own: the draft's (EAGLE / MTP) attention "
            "layers get KV cache specs beside the target's and join its KV cache groups (kv_cache_utils."
            "_annotate_eagle_groups); plan the target with the draft layers counted, or use engine='sglang'")
    if spec.variant == "hybrid_linear" and spec.linear_state is not None and spec.linear_state.kind == "gdn":
        f = vllm_gdn_block(spec, parallel, kv, page_size)
        groups = vllm_gdn_groups(spec)
        page = f["block"] * f["attn"]
        notes.append(f"vLLM keeps each GDN layer's conv + recurrent state ({f['state']} B) in a KV "
                     f"block: it raises the block size from {page_size} to {f['block']} tokens so an attention page "
                     f"({f['block']} x {f['attn']} B = {page} B) holds one (Platform._align_hybrid_block_size, "
                     f"kernel blocks of {VLLM_KERNEL_BLOCK}), pads the state page to {page} B "
                     f"(mamba_page_size_padded) and groups the {len(spec.full_attention_layer_ids)} attention and "
                     f"{len(spec.linear_layer_ids)} GDN layers into {len(groups)} KV cache groups sharing "
                     f"{max(len(g) for g in groups)} tensors; no request-slot state pool")
        return EngineLayout("vllm", spec.replace(variant="linear_grouped"), kv, tuple(notes), page_size=f["block"])
    if spec.variant not in VLLM_PLANNED:
        raise UnsupportedCombination(
            f"kvwrite does not plan vLLM's layout of variant {spec.variant!r} (vLLM sizes recurrent-state and "
            f"compressed caches as KV cache specs of their own and unifies their page sizes with the attention "
            f"layers': kv_cache_utils.unify_kv_cache_spec_page_size); plan it with "
            + ("engine='kvwrite' (its record planned in kvwrite's layout)" if kv in ("nvfp4_fi_ds_mla", "nvfp4_v41")
               else "engine='sglang' or 'kvwrite'"))
    if spec.variant == "swa_hybrid" and (spec.global_head_dim or spec.num_global_kv_heads):
        notes.append(f"{spec.architecture or spec.name or 'this model'}'s full-attention layers have their own head "
                     f"size / KV heads: vLLM raises the block size of the layers with the smaller page until every "
                     f"page holds the same bytes (kv_cache_utils.unify_kv_cache_spec_page_size) and the groups share "
                     f"one tensor per position, each layer viewing it with its own shape; kvwrite plans sub-pools "
                     f"'full' and 'swa' with those block sizes, one viewing the other's memory")
    if spec.variant == "swa_hybrid":
        kinds = [(i, "swa" if i in spec.swa_layer_ids else "full") for i in range(spec.num_layers)
                 if spec.kv_source(i) is None]
        groups = vllm_kv_cache_groups(kinds)
        notes.append(f"vLLM's KV cache manager groups the {spec.num_layers} layers into {len(groups)} groups of "
                     f"{max(len(g) for g in groups)} sharing one block pool, one tensor per position in a group "
                     f"(kv_cache_utils._get_kv_cache_groups_uniform_page_size); sliding-window groups free blocks "
                     f"outside the window")
        spec = spec.replace(variant="swa_grouped")
    if spec.variant == "dsa" and parallel.dcp_size > 1:
        notes.append(f"vLLM shards the DSA indexer cache over the {parallel.dcp_size} DCP ranks like the MLA "
                     f"cache (its MLAAttentionSpec is dcp_sharded): store_indexer_k translates the virtual loc "
                     f"to this rank's row (SGLang's indexer cache holds the whole virtual loc space)")
    if spec.variant == "dsa" and kv in FP8_FORMATS:
        notes.append(f"vLLM serves any quantized DSA cache ({kv}) as fp8_ds_mla, 656-byte rows "
                     f"(model_executor/layers/attention/mla_attention.py, FLASHMLA_SPARSE)")
        kv = "fp8_ds_mla"
    return EngineLayout("vllm", spec, kv, tuple(notes))


def engine_layout(engine: str, spec: ModelSpec, parallel, kv_cache_dtype: str, page_size: int) -> EngineLayout:
    """`spec` as `engine` lays out its KV cache (see the module docstring); raises
    UnsupportedCombination, naming the engine's rule, where the engine has no layout."""
    if engine not in ENGINES:
        raise UnsupportedCombination(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "kvwrite":   # kvwrite's own layouts: the spec as read
        return EngineLayout(engine, spec, kv_cache_dtype)
    _check_dcp(engine, parallel)
    return (_sglang if engine == "sglang" else _vllm)(spec, parallel, kv_cache_dtype, page_size)
