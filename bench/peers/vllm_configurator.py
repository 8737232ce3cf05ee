"""kvwrite's configurator (engine="vllm") against vLLM 0.32.0's own KV cache manager sizing, on
CPU: each layer's KVCacheSpec is built with vLLM's spec classes as its attention layers build them
(FullAttentionSpec / SlidingWindowSpec for GQA layers, MLAAttentionSpec for MLA latents and the
DeepSeek-V3.2 indexer cache, fp8_ds_mla's 656-byte rows), then vLLM's get_kv_cache_groups
(grouping of sliding-window layers, page-size unification) and get_kv_cache_config_from_groups
(blocks from the byte budget, tensors shared across groups) decide the layout. Compared per plan:
the groups, blocks, bytes a block, KV heads per rank, and each layer's buffer.

Run with the vllm032 env's python (PYTHONPATH=python first: that env has another worktree's
kvwrite installed). Writes --json and a markdown table (the --json path with .md).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
os.environ.setdefault("KVWRITE_EXT", "0")

import json  # noqa: E402
import logging  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

from config_cases import BUDGET, CONFIGS, cases, layer_key, main, row, state_key  # noqa: E402

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _vllm_config(tp: int, dcp: int):
    """The fields of VllmConfig that vLLM's grouping and sizing read."""
    ns = types.SimpleNamespace
    cache = ns(kv_cache_layout="LBNHC", num_gpu_blocks_override=None, prefix_cache_retention_interval=None,
               block_size=16)
    from vllm.config.cache import CacheConfig
    cache.get_resolved_kv_cache_layout = lambda: CacheConfig.get_resolved_kv_cache_layout(cache)
    return ns(scheduler_config=ns(disable_hybrid_kv_cache_manager=False), cache_config=cache,
              attention_config=ns(hisparse_config=None), speculative_config=None,
              parallel_config=ns(decode_context_parallel_size=dcp, tensor_parallel_size=tp,
                                 prefill_context_parallel_size=1),
              model_config=ns(hf_config=None))


def _specs(spec, case: dict) -> dict:
    """Each attention layer's KVCacheSpec, as vLLM's layers build it, for kvwrite's ModelSpec `spec`
    (the attention facts read from the same config.json)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    tp, page, kv = case["tp"], case["page"], case["kv"]
    dtype = DTYPE[spec.dtype]
    out = {}
    if spec.variant in ("mla", "dsa"):
        ds = "fp8_ds_mla" if (spec.variant == "dsa" and kv != "auto") else None
        for i in range(spec.num_layers):
            out[f"layers.{i}.attn"] = MLAAttentionSpec(
                block_size=page, num_kv_heads=1, max_tp_shards=1, head_size=spec.kv_lora_rank + spec.qk_rope_head_dim,
                dtype=torch.uint8 if ds else dtype, cache_dtype_str=ds or "auto",
                state_content_bytes=656 if ds else None, is_index_group_leader=spec.variant == "dsa")
            if spec.variant == "dsa":
                from vllm.v1.kv_cache_interface import SparseCacheRole
                out[f"layers.{i}.indexer.k_cache"] = MLAAttentionSpec(
                    block_size=page, num_kv_heads=1, max_tp_shards=1, head_size=spec.index_head_dim + 4 * (
                        spec.index_head_dim // 128), dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)
        return out
    heads = max(1, spec.num_kv_heads // tp)
    swa = set(spec.swa_layer_ids) if spec.variant == "swa_hybrid" else set()
    for i in spec.kv_layer_ids:
        if spec.kv_source(i) is not None:   # a KV-shared layer (kv_sharing_target_layer_name): no cache spec
            continue
        common = dict(block_size=page, num_kv_heads=heads, head_size=spec.head_dim, dtype=dtype,
                      max_tp_shards=spec.num_kv_heads)
        if i not in swa and (spec.global_head_dim or spec.num_global_kv_heads):   # Gemma 4's full layers
            hg = spec.num_global_kv_heads or spec.num_kv_heads
            common.update(num_kv_heads=max(1, hg // tp), head_size=spec.global_head_dim or spec.head_dim,
                          max_tp_shards=hg)
        out[f"layers.{i}.attn"] = (SlidingWindowSpec(**common, sliding_window=spec.sliding_window) if i in swa
                                   else FullAttentionSpec(**common))
    return out


def _hybrid_specs(spec, case: dict, cfg: dict, vcfg) -> dict:
    """A gated-delta-net hybrid's specs (Qwen3-Next) as vLLM builds them: its own
    Platform._align_hybrid_block_size (FlashAttention's kernel blocks; the model class's
    get_mamba_state_shape/dtype_from_config) raises vcfg's block size and sets
    mamba_page_size_padded, then FullAttentionSpec per attention layer and the GDN layers' MambaSpec
    (model_executor/layers/mamba/abstract.py get_kv_cache_spec) with prefix caching off."""
    from unittest import mock

    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    ns = types.SimpleNamespace
    text = ns(**cfg.get("text_config", cfg))
    heads = max(1, spec.num_kv_heads // case["tp"])
    vcfg.cache_config.__dict__.update(cache_dtype="auto", block_size=case["page"], mamba_page_size_padded=None,
                                      mamba_cache_mode="none", mamba_block_size=spec.context_len or 262144,
                                      mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto",
                                      kv_cache_dtype_skip_layers=None)
    vcfg.model_config = ns(dtype=DTYPE[spec.dtype], use_mla=False, architecture=cfg["architectures"][0],
                           hf_text_config=text, hf_config=text, get_num_kv_heads=lambda par: heads,
                           get_head_size=lambda: spec.head_dim)
    vcfg.num_speculative_tokens = 0
    with mock.patch.object(ModelRegistry, "resolve_model_cls", lambda *a, **k: (Qwen3NextForCausalLM, None)), \
            mock.patch.object(Platform, "_find_non_ssm_backends", classmethod(lambda cls, c: [FlashAttentionBackend])):
        Platform._align_hybrid_block_size(vcfg, FlashAttentionBackend)
    cache = vcfg.cache_config
    shapes = Qwen3NextForCausalLM.get_mamba_state_shape_from_config(vcfg)
    dtypes = Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(vcfg)
    out = {}
    for i in range(spec.num_layers):
        if i in spec.full_attention_layer_ids:
            out[f"layers.{i}.attn"] = FullAttentionSpec(block_size=cache.block_size, num_kv_heads=heads,
                                                        head_size=spec.head_dim, dtype=DTYPE[spec.dtype],
                                                        max_tp_shards=spec.num_kv_heads)
        else:
            out[f"layers.{i}.linear_attn"] = MambaSpec(
                shapes=tuple(shapes), dtypes=dtypes, block_size=cache.mamba_block_size,
                page_size_padded=cache.mamba_page_size_padded, mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                mamba_cache_mode=cache.mamba_cache_mode)
    return out


def _verify_parallel(cfg: dict, spec, tp: int, dcp: int) -> None:
    """vLLM's own ModelConfig.verify_with_parallel_config (its head-count and DCP rules) on the
    config's head counts; a ValueError is vLLM's refusal. Lines after its DCP checks read fields
    this harness does not fill (an AttributeError there: the checks passed)."""
    from vllm.config.model import ModelConfig

    text = cfg.get("text_config", cfg)
    heads = text.get("num_attention_heads", 128)
    ns = types.SimpleNamespace
    me = ns(model_arch_config=ns(total_num_attention_heads=heads), use_mla=spec.variant in ("mla", "dsa"),
            get_total_num_kv_heads=lambda: spec.num_kv_heads or 1, architectures=cfg["architectures"])
    par = ns(enable_hc_sp=False, tensor_parallel_size=tp, enable_expert_parallel=False, pipeline_parallel_size=1,
             decode_context_parallel_size=dcp)
    try:
        ModelConfig.verify_with_parallel_config(me, par)
    except AttributeError:
        pass


def vllm_row(case: dict) -> dict:
    from kvwrite import ModelSpec
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    try:
        spec = ModelSpec.from_hf_config(json.loads(json.dumps(CONFIGS[case["model"]])), reader="own")
        _verify_parallel(CONFIGS[case["model"]], spec, case["tp"], case["dcp"])
        cfg = _vllm_config(case["tp"], case["dcp"])
        cfg.cache_config.block_size = case["page"]   # --block-size
        specs = (_hybrid_specs(spec, case, CONFIGS[case["model"]], cfg) if spec.variant == "hybrid_linear"
                 else _specs(spec, case))
        groups = get_kv_cache_groups(cfg, specs)
        conf = get_kv_cache_config_from_groups(cfg, groups, BUDGET)
    except Exception as err:
        return dict(ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, MLAAttentionSpec

    # each GQA layer's (block size, KV heads, head size, position of its bytes in the group tensors)
    spec_of = {name: g.kv_cache_spec for g in groups for name in g.layer_names}
    layers = {}
    for t in conf.kv_cache_tensors:
        for j, name in enumerate(t.layers):
            s = spec_of[name]
            copy = j + t.offset // t.layer_stride
            if isinstance(s, AttentionSpec) and not isinstance(s, MLAAttentionSpec) and name.endswith(".attn"):
                layers[name.split(".")[1]] = layer_key(s.block_size, s.num_kv_heads, s.head_size, copy)
            elif isinstance(s, MambaSpec):
                layers[name.split(".")[1]] = state_key(s.real_page_size_bytes, s.page_size_bytes, copy)
    g0 = groups[0].kv_cache_spec
    return dict(ok=True, num_blocks=conf.num_blocks, groups=[len(g.layer_names) for g in groups],
                group_kinds=[type(g.kv_cache_spec).__name__ for g in groups],
                group_block_sizes=[g.kv_cache_spec.block_size for g in groups],
                tensors=len(conf.kv_cache_tensors),
                # every group's tensor aliases the same memory from byte 0: the pool is the largest
                tensor_bytes=max(t.size for t in conf.kv_cache_tensors),
                block_size=g0.block_size, kv_heads=getattr(g0, "num_kv_heads", None), layers=layers,
                cache_block_size=cfg.cache_config.block_size, page_bytes=g0.page_size_bytes,
                # usable tokens in blocks of the cache's block size (block 0 is the BlockPool's null block;
                # vLLM raises it for hybrid models); a group whose pages vLLM unified holds a multiple a block
                max_total_num_tokens=(conf.num_blocks - 1) * cfg.cache_config.block_size)


def compare(case, v, k) -> tuple[str, list]:
    if v.get("not_run"):
        return "not compared", []
    if not v["ok"] and not k["ok"]:
        return "both refuse", []
    if not v["ok"] or not k["ok"]:
        return ("vllm refuses" if not v["ok"] else "kvwrite refuses"), []
    diffs = []
    kv_blocks = k["max_total_num_tokens"] // k["pool_page_size"] + k.get("padding_pages", 1)   # the plan's block size
    if v["num_blocks"] != kv_blocks:
        diffs.append(f"blocks: vllm {v['num_blocks']} kvwrite {kv_blocks}")
    if v["layers"]:   # every GQA layer: block size, KV heads, head size, buffer copy; every GDN state layer
        mine = k.get("layers", {})
        bad = [f"layer {i}: vllm {v['layers'][i]} kvwrite {mine.get(i)}" for i in v["layers"] if mine.get(i) != v["layers"][i]]
        bad += [f"layer {i}: kvwrite only" for i in mine if i not in v["layers"]]
        if bad:
            diffs.append(f"layers (block x heads x head size @ copy): {'; '.join(bad[:3])}" + (" ..." if len(bad) > 3 else ""))
    elif v["kv_heads"] not in (None, 1) and k["kv_heads"] != v["kv_heads"]:
        diffs.append(f"kv_heads: vllm {v['kv_heads']} kvwrite {k['kv_heads']}")
    if k.get("tensor_bytes") is not None and v["tensor_bytes"] != k["tensor_bytes"]:
        diffs.append(f"bytes: vllm {v['tensor_bytes']} kvwrite {k['tensor_bytes']}")
    return ("equal" if not diffs else "differs"), diffs


def run(models) -> list:
    return [row(case, "vllm", vllm_row, compare) for case in cases(models)]


if __name__ == "__main__":
    try:
        import vllm  # noqa: F401
    except ImportError:   # e.g. run.sh's loop over *configurator*.py under the sglang env: write nothing
        print("vllm_configurator.py needs the vllm032 env's python (PYTHONPATH=python); not run")
        sys.exit(0)
    sys.exit(main("vLLM", "0.32.0", "vllm", run))
