"""`kvwrite presets`: list the built-in model presets."""
from __future__ import annotations

import argparse

NAME = "presets"
HELP = "list the built-in model presets (from the models' public config.json)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the ModelSpecs as JSON")


def _describe(spec) -> str:
    v = spec.variant
    if v in ("mla", "dsa"):
        s = f"kv_lora_rank {spec.kv_lora_rank} + rope {spec.qk_rope_head_dim}"
        return s + (f", indexer K {spec.index_head_dim}" if v == "dsa" else "")
    if v == "dsv4":  # one shared latent KV head per token, in the SWA pool and the compressed ones
        r = spec.compress_ratios
        return (f"1 KV head x {spec.head_dim} ({spec.head_dim - spec.qk_rope_head_dim} NoPE + "
                f"{spec.qk_rope_head_dim} RoPE); SWA window {spec.sliding_window} on every layer; "
                f"c4 on {r.count(4)}, c128 on {r.count(128)} layers; indexer K {spec.index_head_dim}")
    s = f"{spec.num_kv_heads} KV heads x {spec.head_dim}"
    if v == "swa_hybrid":
        s += (f"; {len(spec.swa_layer_ids)} SWA layers (window {spec.sliding_window}) + "
              f"{len(spec.full_attention_layer_ids)} full")
    if v == "hybrid_linear":
        s += f"; KV on {len(spec.full_attention_layer_ids)} full-attention layers"
    return s


def run(args: argparse.Namespace) -> int:
    import json

    from kvwrite.config.presets import preset_source, presets

    specs = presets()
    if args.json:
        print(json.dumps({n: s.to_dict() for n, s in specs.items()}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title="kvwrite presets")
    for col in ("preset", "variant", "layers", "attention", "draft layers", "dtype", "source"):
        t.add_column(col)
    for name, s in specs.items():
        t.add_row(name, s.variant, str(s.num_layers), _describe(s), str(s.num_draft_layers), s.dtype,
                  preset_source(name))
    Console(width=160).print(t)
    return 0
