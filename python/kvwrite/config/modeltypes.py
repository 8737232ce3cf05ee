"""The reader's model types as docs/configurator.md's table: what `from_hf_config` reads from each
model type (`kvwrite.config.hf.ARCHITECTURES`) and what SGLang's and vLLM's layouts make of it
(`kvwrite.config.engines`). docs/generate.py writes it; tests/test_docs.py keeps it current."""
from __future__ import annotations

import kvwrite.config.hf as hf
from kvwrite.config.engines import SGLANG_DSA_PAGE_SIZE, SGLANG_HYBRID_SWA_ARCHS, VLLM_PLANNED

# reader -> (variants it can produce, what decides)
READS = {
    hf._dense: (("mha", "swa_hybrid"), "swa_hybrid when layer_types / sliding_window_pattern mix sliding and "
                                       "full layers"),
    hf._text_dense: (("mha", "swa_hybrid"), "the text_config's layers, as dense"),
    hf._alternating: (("swa_hybrid",), "even layers sliding"),
    hf._gemma3: (("swa_hybrid",), "every 6th layer global"),
    hf._gemma3n: (("swa_hybrid",), "every 5th layer global; the last num_kv_shared_layers reuse an earlier "
                                   "layer's KV"),
    hf._gemma4: (("swa_hybrid",), "full layers with global_head_dim (and num_global_key_value_heads with "
                                  "attention_k_eq_v: K reused as V); KV-shared last layers"),
    hf._llama4: (("swa_hybrid",), "chunked-local layers in the SWA pool, every 4th global"),
    hf._mla: (("mla",), "kv_lora_rank + qk_rope_head_dim"),
    hf._qwen3_next: (("hybrid_linear",), "KV for the full-attention layers, GDN state per request"),
    hf._deepseek_v4: (("dsv4",), "compress_ratios per layer"),
    hf._nemotron_h: (("hybrid_linear",), "hybrid_override_pattern, Mamba2 state"),
    hf._falcon_h1: (("hybrid_linear",), "attention and Mamba2 in every layer"),
    hf._jamba: (("hybrid_linear",), "attn_layer_period / offset, Mamba state"),
    hf._minimax: (("hybrid_linear",), "attn_type_list, lightning-attention state"),
    hf._granite_hybrid: (("hybrid_linear",), "layer_types, Mamba2 state"),
    hf._lfm2: (("hybrid_linear",), "short-conv state beside GQA layers"),
    hf._kimi_linear: (("mla_linear",), "MLA layers beside KDA state"),
}


def _reads(parser) -> tuple[tuple[str, ...], str]:
    if parser in READS:
        return READS[parser]
    return ("dsa",), "MLA + the DSA indexer K"   # the lambdas: _mla(c, "dsa")


def _sglang(variants: tuple[str, ...], archs: tuple[str, ...]) -> str:
    out = ["as read"] if "mha" in variants or not {"swa_hybrid", "dsa"} & set(variants) else []
    if "swa_hybrid" in variants:
        out.append(("sliding layers: " if out else "") + (
            "full + SWA pools (no DCP)" if set(archs) & SGLANG_HYBRID_SWA_ARCHS else
            "one full pool (hybrid SWA memory off)"))
    if "dsa" in variants:
        out.append(f"page_size {SGLANG_DSA_PAGE_SIZE}; fp8_e4m3 -> 656-byte fp8_ds_mla rows")
    return "; ".join(out)


def _vllm(variants: tuple[str, ...], parser) -> str:
    if parser is hf._qwen3_next:
        return ("null block inside the budget; GDN states in KV blocks (block size raised until a page holds "
                "one, state page padded)")
    if not set(variants) & set(VLLM_PLANNED):
        return "refused (kvwrite does not plan vLLM's state / compressed specs)"
    out = ["null block inside the budget"]
    if "swa_hybrid" in variants:
        out.append("sliding layers: KV cache groups over one block pool" + (
            " (full / sliding pages unified by block size: two sub-pools sharing memory)" if parser is hf._gemma4
            else ""))
    if "dsa" in variants:
        out.append("fp8 -> fp8_ds_mla; indexer cache DCP-sharded")
    return "; ".join(out)


def table() -> str:
    """One row per model type the reader knows: architectures, variant(s), and each engine's layout."""
    rows = ["| model_type | architectures | kvwrite reads | SGLang (engine='sglang') | vLLM (engine='vllm') |",
            "|---|---|---|---|---|"]
    for mt, (archs, parser) in sorted(hf.ARCHITECTURES.items()):
        variants, what = _reads(parser)
        rows.append(f"| {mt} | {', '.join(archs) or '(DeepseekV3ForCausalLM)'} | {' / '.join(variants)}: {what} | "
                    f"{_sglang(variants, archs)} | {_vllm(variants, parser)} |")
    return "\n".join(rows) + "\n"
