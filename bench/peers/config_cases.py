"""The configs and matrix both engine comparisons run (bench/peers/sglang_configurator.py,
vllm_configurator.py), kvwrite's side of each row, and the markdown table."""
from __future__ import annotations

import argparse
import copy
import json

from kvwrite.config.presets import PRESETS

BUDGET = 20 * 2**30            # KV bytes per rank
PARALLEL = ((1, 1), (8, 1), (8, 2), (8, 4), (8, 8))   # (tp, dcp)
PAGES = (1, 64)

def _gemma4(**text) -> dict:
    """A Gemma 4 config.json: transformers 5.25's Gemma4TextConfig fields (head_dim 256, global_head_dim
    512) with the given ones."""
    return dict(architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4", torch_dtype="bfloat16",
                text_config=dict(model_type="gemma4_text", head_dim=256, global_head_dim=512, **text))


# Public config.json values (the attention fields) of each model.
CONFIGS = {
    "llama-3-8b": PRESETS["llama-3.1-8b"][1],
    "qwen3-8b": PRESETS["qwen3-8b"][1],
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          head_dim=128, num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=48,
                          torch_dtype="bfloat16"),
    "deepseek-v3": PRESETS["deepseek-v3"][1],
    "deepseek-v3.2": PRESETS["deepseek-v3.2"][1],
    "gpt-oss-120b": PRESETS["gpt-oss-120b"][1],
    "gemma-3-27b": PRESETS["gemma-3-27b"][1],
    "gemma-3-4b": dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", torch_dtype="bfloat16",
                       text_config=dict(model_type="gemma3_text", hidden_size=2560, head_dim=256,
                                        num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=34,
                                        sliding_window=1024, sliding_window_pattern=6)),
    "command-r7b (cohere2)": dict(architectures=["Cohere2ForCausalLM"], model_type="cohere2", hidden_size=4096,
                                  num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
                                  sliding_window=4096, sliding_window_pattern=4, torch_dtype="bfloat16"),
    "qwen3-next-80b-a3b": PRESETS["qwen3-next-80b-a3b"][1],
    # transformers 5.25's Gemma4TextConfig / Gemma3nTextConfig defaults (documented there as similar to
    # google/gemma-4-e2b-it and google/gemma-3n-E4B), with the fields the configs spell out
    "gemma-4 (e2b-like)": _gemma4(hidden_size=2304, num_hidden_layers=30, num_attention_heads=8,
                                  num_key_value_heads=4, sliding_window=512, num_kv_shared_layers=0,
                                  attention_k_eq_v=False),
    "gemma-4 (k_eq_v, shared)": _gemma4(hidden_size=2304, num_hidden_layers=30, num_attention_heads=8,
                                        num_key_value_heads=4, num_global_key_value_heads=2, sliding_window=512,
                                        num_kv_shared_layers=12, attention_k_eq_v=True),
    # the 31B's shape (K = V global layers with 4 of 16 KV heads): a sliding page larger than a full one
    "gemma-4 (31b-like)": _gemma4(hidden_size=5376, num_hidden_layers=60, num_attention_heads=32,
                                  num_key_value_heads=16, num_global_key_value_heads=4, sliding_window=1024,
                                  num_kv_shared_layers=0, attention_k_eq_v=True),
    "gemma-3n (E4B-like)": dict(architectures=["Gemma3nForConditionalGeneration"], model_type="gemma3n",
                                torch_dtype="bfloat16", text_config=dict(
                                    model_type="gemma3n_text", hidden_size=2048, num_hidden_layers=35,
                                    num_attention_heads=8, num_key_value_heads=2, head_dim=256, sliding_window=512,
                                    num_kv_shared_layers=15)),
}
# Models whose draft worker is compared: their MTP layers (DeepSeek) or a one-layer EAGLE draft
# of the same attention (dense GQA). Hybrid models' drafts are separate checkpoints.
DRAFTS = ("llama-3-8b", "qwen3-8b", "qwen3-30b-a3b", "deepseek-v3", "deepseek-v3.2")


INDEX_ROW = 128 + 4     # DSA index-K bytes a token (e4m3 codes + fp32 scale)


def _index_rows(shape) -> list:
    """A DSA index-K buffer as [token rows, 132]: SGLang allocates it in pool pages and addresses
    it in 64-token index pages (DSATokenToKVPool.index_page_size), so only its bytes compare."""
    n = 1
    for d in shape:
        n *= d
    return [n // INDEX_ROW, INDEX_ROW]


def _rows_shape(shape, layout: str) -> list:
    """A buffer as [rows, elements a row] (paged layouts flattened), index-K as [rows, 132]."""
    if layout == "page_major":
        return _index_rows(shape)
    rows = shape[0] * shape[1] if layout == "rows" else shape[0]
    rest = 1
    for d in shape[2:]:
        rest *= d
    return [rows, rest]


# kvwrite sub-pool / buffer -> the attribute SGLang's pool holds it in
_NAMES = {("kv", "k"): "k_buffer", ("kv", "v"): "v_buffer", ("kv", "kv"): "kv_buffer",
          ("index_k", "index_k"): "index_k_with_scale_buffer",
          ("full", "k"): "full_kv_pool.k_buffer", ("full", "v"): "full_kv_pool.v_buffer",
          ("swa", "k"): "swa_kv_pool.k_buffer", ("swa", "v"): "swa_kv_pool.v_buffer",
          ("swa", "loc_map"): "full_to_swa_index_mapping"}


def layer_key(block: int, heads: int, head_size: int, copy: int) -> str:
    """A GQA layer in vLLM's terms: "block x heads x head size @ buffer copy"."""
    return f"{block}x{heads}x{head_size}@{copy}"


def state_key(content: int, page: int, copy: int) -> str:
    """A recurrent-state layer kept in KV blocks: "state bytes / padded page bytes @ buffer copy"."""
    return f"state {content}/{page}@{copy}"


def kvwrite_row(case: dict, engine: str) -> dict:
    """kvwrite's plan of `case` for `engine`, in the comparison's terms (or its refusal)."""
    from kvwrite import KVCacheConfigurator, ModelSpec, ParallelSpec
    from kvwrite.config import ConfigError

    try:
        spec = ModelSpec.from_hf_config(copy.deepcopy(CONFIGS[case["model"]]), reader="own")
        par = ParallelSpec(case["tp"], case["dcp"], is_draft_worker=case["draft"], engine=engine)
        size = (dict(max_total_num_tokens=case["target_tokens"]) if case["draft"] else dict(memory_bytes=BUDGET))
        c = KVCacheConfigurator(spec, par, page_size=case["page"], kv_cache_dtype=case["kv"], engine=engine, **size)
        plan = c.plan()
    except ConfigError as err:
        return dict(ok=False, error=f"{type(err).__name__}: {err}")
    bufs = {}
    for p in plan.pools:
        for b, spec_b in zip(p.buffers, p.spec.buffers):
            name = _NAMES.get((p.name, b.name)) or _NAMES.get((b.name, b.name)) or f"{p.name}.{b.name}"
            if spec_b.layout == "map":
                bufs[name] = ([b.shape[0], 1], b.dtype)
                continue
            bufs[name] = (_rows_shape(b.shape, spec_b.layout), b.dtype)
            bufs[name + "#layers"] = len(p.layer_ids)
    # vLLM's terms of each layer with a K/V cache of its own: (block size, KV heads, head size, the
    # buffer copy it uses: its position in its KV cache group)
    layers = {}
    for p in plan.pools:
        k = next((b for b in p.spec.buffers if b.name == "k" and b.layout in ("rows", "hnd")), None)
        if k is None or len(k.row_shape) != 2:
            continue
        for i, lid in enumerate(p.layer_ids):
            if plan.model.kv_source(lid) is None:
                layers[str(lid)] = layer_key(p.geometry.page_size, k.row_shape[0], k.row_shape[1], p.spec.slot(i))
    for p in plan.pools:   # recurrent states in KV blocks (vLLM's GDN layout): state bytes / page bytes
        if p.spec.alias and all(b.layout == "block" for b in p.spec.buffers):
            owner = plan.pool(p.spec.alias)
            page = sum(b.bytes for b in owner.buffers) // owner.geometry.num_pages
            content = sum(b.row_bytes for b in p.spec.buffers)
            for i, lid in enumerate(p.layer_ids):
                layers[str(lid)] = state_key(content, page, p.spec.slot(i))
    m = plan.model
    # KV heads of the full-attention layers (what SGLang's ModelConfig.get_num_kv_heads reports)
    heads = None if not m.num_kv_heads else plan.parallel.kv_heads_per_rank(m.num_global_kv_heads or m.num_kv_heads)
    return dict(ok=True, max_total_num_tokens=plan.max_total_num_tokens, loc_space_scale=plan.loc_space_scale,
                pool_page_size=plan.pool_page_size, kv_heads=heads, cell=plan.cell_size_bytes,
                hybrid_swa=plan.variant == "swa_hybrid", buffers=bufs, variant=plan.variant,
                kv_cache_dtype=plan.kv_cache_dtype, notes=list(plan.engine_notes), tensor_bytes=plan.kv_bytes,
                layers=layers)


def normalise_sglang(buffers: dict) -> dict:
    """SGLang's buffers (per-token rows `[size + page, ...]`, index pages) in the same terms."""
    out = {}
    for name, v in buffers.items():
        if name.endswith("#layers"):
            out[name] = v
            continue
        shape, dtype = v
        if "index_k" in name:
            out[name] = (_index_rows(shape), dtype)
        else:
            rest = 1
            for d in shape[1:]:
                rest *= d
            out[name] = ([shape[0], rest], dtype)
    return out


def markdown(engine: str, rows: list, budget: int, rules: dict | None = None) -> str:
    """The results table: one line per plan, status and the differences with the engine rule."""
    rules = rules or {}
    counts: dict = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    reasons: dict = {}
    for r in rows:
        if r["status"] == "equal":
            continue
        e, k = r["engine"], r["kvwrite"]
        msg = (e.get("error") if not e["ok"] else "") or k.get("error", "")
        msg = msg.split(": ", 1)[-1] if msg.split(": ", 1)[0].isidentifier() else msg   # drop the class name
        why = "; ".join(filter(None, (msg[:400], "; ".join(r["diffs"]))))
        key = (r["status"], why)
        reasons.setdefault(key, []).append(r["case"]["model"])
    out = [f"# kvwrite's configurator against {engine}'s own sizing\n",
           f"Budget {budget // 2**30} GiB of KV per rank. " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
           + f" of {len(rows)} plans.\n",
           "## Every plan that is not equal, and the rule that explains it\n",
           "| status | plans | models | the rule (the refusing side's message) |", "|---|---|---|---|"]
    for (status, why), models in sorted(reasons.items()):
        out.append(f"| {status} | {len(models)} | {', '.join(sorted(set(models)))} | {why.replace('|', '/')} |")
    out += ["", "## Every plan\n",
           "| model | kv | tp/dcp | page | worker | status | tokens (engine / kvwrite) | what differs, and the engine's rule |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, e, k = r["case"], r["engine"], r["kvwrite"]
        tok = f"{e.get('max_total_num_tokens', '-')} / {k.get('max_total_num_tokens', '-')}"
        why = "; ".join(r["diffs"])
        if not e["ok"]:
            why = (why + " " if why else "") + f"{engine}: {e['error']}"
        if not k["ok"]:
            why = (why + " " if why else "") + f"kvwrite: {k['error']}"
        if r.get("rule"):
            why += f" -- rule: {r['rule']}"
        out.append(f"| {c['model']} | {c['kv']} | {c['tp']}/{c['dcp']} | {c['page']} | "
                   f"{'draft' if c['draft'] else 'target'} | {r['status']} | {tok} | {why.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def cases(models=None):
    """The matrix: every model x kv dtype (auto, and fp8_e4m3 for DSA) x (tp, dcp) x page size."""
    for model in models or list(CONFIGS):
        for kv_dtype in (("auto", "fp8_e4m3") if model.startswith("deepseek-v3.2") else ("auto",)):
            for tp, dcp in PARALLEL:
                for page in PAGES:
                    yield dict(model=model, kv=kv_dtype, tp=tp, dcp=dcp, page=page, draft=False)


def row(case: dict, engine: str, engine_row, compare) -> dict:
    """One compared plan: the engine's own result, kvwrite's, and what differs."""
    e, k = engine_row(case), kvwrite_row(case, engine)
    status, diffs = compare(case, e, k)
    return dict(case=case, status=status, diffs=diffs, engine=e, kvwrite=k)


def main(label: str, version: str, engine: str, run) -> int:
    """Parse --json / --markdown / --models, `run(models)` -> rows, print and write the results."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--markdown", help="default: the --json path with .md")
    ap.add_argument("--models", nargs="*", default=None)
    args = ap.parse_args()
    rows = run(args.models)
    counts: dict = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"{label} configurator comparison:", ", ".join(f"{v} {k}" for k, v in sorted(counts.items())),
          f"of {len(rows)} plans")
    for r in rows:
        if r["status"] != "equal":
            c, e, k = r["case"], r["engine"], r["kvwrite"]
            err = (e.get("error", "") if not e["ok"] else "") or k.get("error", "")
            print(f"  {c['model']} kv={c['kv']} tp={c['tp']} dcp={c['dcp']} page={c['page']} "
                  f"{'draft' if c['draft'] else 'target'}: {r['status']} {r['diffs'] or ''} {err[:200]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({engine: version, "budget_bytes": BUDGET, "counts": counts, "rows": rows}, f, indent=1)
    md = args.markdown or (args.json[:-5] + ".md" if args.json and args.json.endswith(".json") else None)
    if md:
        with open(md, "w") as f:
            f.write(markdown(f"{label} {version}", rows, BUDGET))
    return 0
