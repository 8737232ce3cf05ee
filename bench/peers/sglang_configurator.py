"""kvwrite's configurator (engine="sglang") against SGLang 0.5.23's own sizing and pool builders,
run on CPU: SGLang's ModelConfig reads each config.json, its KVCacheConfigurator (the real class,
fed the fields its model runner passes) sizes the pools from a byte budget with its
MemoryPoolConfigurator, and its pool builders allocate the pools on the meta device. Compared per
plan: tokens, page sizes, KV heads per rank, cell bytes, every buffer's shape and dtype.

Run with the sglang env's python (`make peers` does, via bench/peers/run.sh); kvwrite is imported
from this worktree's python/. Writes --json (every row) and --markdown (default: the --json path
with .md; the table, each remaining difference with the engine rule that explains it).
Harness, not layout: SGLang's pools ask torch for the meta device's module (a stub answers) and a
speculative worker's MHA pool warms up its KV-copy kernel at construction (skipped on meta).
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("KVWRITE_EXT", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import json  # noqa: E402
import logging  # noqa: E402
import tempfile  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

from config_cases import BUDGET, CONFIGS, DRAFTS, cases, main, normalise_sglang, row  # noqa: E402

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

class _MetaDevice(types.ModuleType):
    """torch.get_device_module("meta") for SGLang's pool constructors (they ask it for streams,
    used only when a store runs; on meta tensors nothing runs)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: None


torch.meta = _MetaDevice("torch.meta")
sys.modules["torch.meta"] = torch.meta


def _no_copy_warmup() -> None:
    """A speculative worker's MHA pool warms up its KV-copy kernel at construction (a launch
    that reads strides back with .item()): not possible on meta tensors, and no part of the layout."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    MHATokenToKVPool._init_kv_copy_and_warmup = lambda self: None

DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}


def _overrides(hf_config) -> dict:
    """The KV-layout fields (disable_hybrid_swa_memory) that SGLang's registered model overrides
    (arg_groups/model_overrides) set for this config's architecture."""
    import sglang.srt.arg_groups.model_overrides  # noqa: F401  (registers them)
    from sglang.srt.arg_groups.model_override_base import _MODEL_OVERRIDE_FNS
    from sglang.srt.runtime_context import get_context

    out = {}
    for fn in _MODEL_OVERRIDE_FNS.get(hf_config.architectures[0], []):
        out.update(fn(get_context().server_args, hf_config) or {})
    return {k: v for k, v in out.items() if k == "disable_hybrid_swa_memory"}


def _layer_info(mc, n_layers: int):
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo

    swa = full = None
    if mc.is_hybrid_swa:
        swa = [i for i in mc.swa_attention_layer_ids if i < n_layers]
        full = [i for i in mc.full_attention_layer_ids if i < n_layers]
    return ModelLayerInfo(start_layer=0, end_layer=n_layers, num_effective_layers=n_layers,
                          swa_attention_layer_ids=swa, full_attention_layer_ids=full)


def _buffers(pool) -> dict:
    """name -> (shape, dtype) of every tensor an SGLang pool holds (one layer's)."""
    out = {}

    def add(name, t):
        if isinstance(t, torch.Tensor):
            out[name] = (list(t.shape), str(t.dtype).replace("torch.", ""))
        elif isinstance(t, (list, tuple)) and t and isinstance(t[0], torch.Tensor):
            out[name] = (list(t[0].shape), str(t[0].dtype).replace("torch.", ""))
            out[name + "#layers"] = len(t)

    for attr in ("k_buffer", "v_buffer", "kv_buffer", "index_k_with_scale_buffer"):
        if hasattr(pool, attr):
            add(attr, getattr(pool, attr))
    for sub in ("full_kv_pool", "swa_kv_pool"):
        if hasattr(pool, sub):
            prefix = f"{sub}." if hasattr(pool, "swa_kv_pool") else ""   # a hybrid-linear pool's KV: unprefixed
            for k, v in _buffers(getattr(pool, sub)).items():
                out[prefix + k] = v
    if hasattr(pool, "full_to_swa_index_mapping"):
        add("full_to_swa_index_mapping", pool.full_to_swa_index_mapping)
    return out


def sglang_row(case: dict) -> dict:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import SpecAuxHiddenStateConfig
    from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    cfg = CONFIGS[case["model"]]
    arch = cfg["architectures"][0]
    d = tempfile.mkdtemp(prefix="kvwrite-sg-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    draft = case["draft"]
    fields = dict(tp_size=case["tp"], dcp_size=case["dcp"], page_size=case["page"])
    if draft:
        fields["speculative_algorithm"] = "EAGLE"
    over = get_context().override_server_args(**fields)
    over.install()
    try:
        flags = _overrides(ModelConfig(d, trust_remote_code=False, is_draft_model=draft).hf_config)
        mc = ModelConfig(d, trust_remote_code=False, is_draft_model=draft, **flags)
        kv_dtype = DTYPES[case["kv"]] or mc.dtype
        use_mla = mc.attention_arch.name == "MLA"
        n_layers = mc.num_nextn_predict_layers if (draft and getattr(mc, "num_nextn_predict_layers", 0)) else (
            1 if draft else mc.num_hidden_layers)
        kvc = KVCacheConfigurator(
            device="meta", gpu_id=0, attn_dp_size=1, pp_size=1, pp_group=None, model=None, model_config=mc,
            server_args=get_context().server_args, kv_cache_dtype=kv_dtype, kv_cache_dtype_str=case["kv"],
            model_dtype=mc.dtype, page_size=case["page"],
            sliding_window_size=(mc.attention_chunk_size or getattr(mc.hf_text_config, "sliding_window", None)
                                 if mc.is_hybrid_swa else None),
            spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE" if draft else None), is_draft_worker=draft,
            post_capture_kv_active=False, spec_aux_config=SpecAuxHiddenStateConfig(), is_hybrid_swa=mc.is_hybrid_swa,
            is_hybrid_swa_compress=getattr(mc, "is_hybrid_swa_compress", False), use_mla_backend=use_mla, layer_info=_layer_info(mc, n_layers),
            forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None, memory_pool_config=None)
        if draft:   # the draft worker takes the target's resolved pool config
            config = MemoryPoolConfig(max_total_num_tokens=case["target_tokens"],
                                      full_max_total_num_tokens=case.get("target_full_tokens"),
                                      swa_max_total_num_tokens=case.get("target_swa_tokens"))
        else:
            budget = BUDGET
            if kvc.mambaish_config is not None:
                budget = int(kvc._handle_max_mamba_cache(BUDGET / (1 << 30)) * (1 << 30))
            config = kvc.config_from_budget(budget)
        sizes = kvc._derive_pool_sizes(config=config)
        from sglang.srt.configs.model_config import is_deepseek_dsa
        if kvc.mambaish_config is not None:   # its own req-to-token pool (with the Mamba state pool)
            reqs = kvc._build_req_to_token_pool(max_num_reqs=kvc.resolve_max_num_reqs(config.max_total_num_tokens))
        else:   # the DSA pool reads only the request-slot count off it
            reqs = types.SimpleNamespace(req_to_token=torch.empty((2049, 1), device="meta"))
        pool = kvc._build_token_to_kv_pool(sizes=sizes, is_dsa_model=is_deepseek_dsa(mc.hf_config),
                                           is_dsv4_model=False, req_to_token_pool=reqs)
        from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
        cell = getattr(create_memory_pool_configurator(kvc), "_cell_size", None)
        return dict(ok=True, max_total_num_tokens=sizes.max_total_num_tokens,
                    target_tokens=config.max_total_num_tokens,
                    full_tokens=config.full_max_total_num_tokens, swa_tokens=config.swa_max_total_num_tokens, loc_space_scale=kvc.loc_space_scale,
                    pool_page_size=kvc.pool_page_size, hybrid_swa=mc.is_hybrid_swa,
                    kv_heads=None if use_mla else mc.get_num_kv_heads(get_parallel().attn_tp_size,
                                                                       get_parallel().attn_dcp_size),
                    cell=cell, buffers=normalise_sglang(_buffers(pool)), pool_class=type(pool).__name__)
    except Exception as err:   # SGLang refuses: its own message
        if os.environ.get("KVWRITE_DEBUG"):
            import traceback; traceback.print_exc()
        return dict(ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
    finally:
        over.restore()


def _pool_bytes(buffers: dict) -> int:
    """Bytes of the KV pools SGLang built (every buffer x its layers)."""
    total = 0
    for name, v in buffers.items():
        if name.endswith("#layers") or "index_mapping" in name:
            continue
        (rows, elems), dtype = v
        total += rows * elems * torch.empty((), dtype=getattr(torch, dtype)).element_size() * buffers.get(
            name + "#layers", 1)
    return total


def compare(case: dict, sg: dict, kv: dict) -> tuple[str, list[str]]:
    if not sg["ok"] and not kv["ok"]:
        return "both refuse", []
    if not sg["ok"]:
        return "sglang refuses", []
    if not kv["ok"]:   # where SGLang's code builds something kvwrite refuses: what it built
        built = _pool_bytes(sg["buffers"])
        return "kvwrite refuses", [f"SGLang's own run sizes {sg['max_total_num_tokens']} tokens at {sg['cell']} B a "
                                   f"token but its builder allocates {sg['kv_heads']} KV heads a rank: "
                                   f"{built / 2**30:.1f} GiB of pools for the {BUDGET / 2**30:.0f} GiB budget"]
    diffs = []
    for key in ("max_total_num_tokens", "loc_space_scale", "pool_page_size", "kv_heads"):
        if sg[key] != kv[key]:
            diffs.append(f"{key}: sglang {sg[key]} kvwrite {kv[key]}")
    if sg["cell"] is not None and not case["draft"] and abs(sg["cell"] - kv["cell"]) > 1e-6:
        diffs.append(f"cell: sglang {sg['cell']} kvwrite {kv['cell']}")
    if sg["hybrid_swa"] != kv["hybrid_swa"]:
        diffs.append(f"hybrid_swa: sglang {sg['hybrid_swa']} kvwrite {kv['hybrid_swa']}")
    for name, want in kv["buffers"].items():
        got = sg["buffers"].get(name)
        if got is not None and json.loads(json.dumps(got)) != json.loads(json.dumps(want)):
            diffs.append(f"{name}: sglang {got} kvwrite {want}")
    # SGLang keeps the full->SWA loc map in its SWA allocator, not in the pool
    missing = sorted(set(kv["buffers"]) - set(sg["buffers"]) - {"full_to_swa_index_mapping"})
    if missing:
        diffs.append(f"buffers sglang lacks: {missing}")
    return ("equal" if not diffs else "differs"), diffs


def run(models) -> list:
    _no_copy_warmup()
    rows = []
    for case in cases(models):
        rows.append(row(case, "sglang", sglang_row, compare))
        sg, kv = rows[-1]["engine"], rows[-1]["kvwrite"]
        if sg["ok"] and kv["ok"] and case["model"] in DRAFTS:   # its draft worker, on the target's pool config
            rows.append(row(dict(case, draft=True, target_tokens=sg["target_tokens"], target_full_tokens=sg[
                "full_tokens"], target_swa_tokens=sg["swa_tokens"]), "sglang", sglang_row, compare))
    return rows


if __name__ == "__main__":
    sys.exit(main("SGLang", "0.5.23", "sglang", run))
