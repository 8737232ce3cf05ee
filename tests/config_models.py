"""Tiny ModelSpecs of every built-in variant, for plan and build tests."""
from kvwrite import ModelSpec

TINY = {
    "mha": ModelSpec("mha", 2, num_kv_heads=2, head_dim=32),
    "mla": ModelSpec("mla", 2, kv_lora_rank=128, qk_rope_head_dim=16),
    "dsa": ModelSpec("dsa", 2, kv_lora_rank=128, qk_rope_head_dim=16, index_head_dim=128),
    "swa_hybrid": ModelSpec("swa_hybrid", 4, num_kv_heads=2, head_dim=32, sliding_window=16,
                            swa_layer_ids=[0, 2], full_attention_layer_ids=[1, 3]),
    "hybrid_linear": ModelSpec("hybrid_linear", 4, num_kv_heads=2, head_dim=32, full_attention_layer_ids=[3]),
    "minimax_sparse": ModelSpec("minimax_sparse", 2, num_kv_heads=2, head_dim=32, index_head_dim=32),
}
MLA_VARIANTS = ("mla", "dsa")
KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "nvfp4", "fp8_ds_mla")


def supported(variant: str, kv: str) -> bool:
    return kv != "fp8_ds_mla" or variant in MLA_VARIANTS
