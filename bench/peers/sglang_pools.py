"""SGLang 0.5.23's own memory-pool classes on CPU with kvwrite's SGLang hook
(`kvwrite.integrations.sglang`), real models' shapes, and planted faults.

Pools: MHATokenToKVPool with Llama-3.1-8B's KV shape (8 KV heads x 128, bf16 and fp8 e4m3),
MLATokenToKVPool with DeepSeek-V3's (kv_lora_rank 512 + rope 64, bf16), the same MLA pool with no
rope (rope_dim 0), and a hybrid SWAKVPool (layers 0 and 2 sliding-window, 1 full; the faults go
into SWA layer 2's pre-translated SWA loc); 3 layers each, 16-token pages. For each, SGLang's own
`set_kv_buffer` / `set_mla_kv_buffer` (its conversions, then the hooked physical write) is called
on a pool with the hook and on a twin without it: the buffers must be byte-equal. Then, in guard
mode, one store per fault gets one bad loc (token 0): one past the last row, a page 1000 past
the end, -7, and a loc duplicated from token 1: caught or not, the error text (it names the
layer), and whether any byte other than the good rows changed; and what the same store does in
SGLang without the hook. Usage (sglang env): python bench/peers/sglang_pools.py [--json F]
"""
from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402

SIZE, PAGE, LAYERS, N = 64, 16, 3, 6
SWA_SIZE = 32          # the SWA sub-pool's tokens (its locs come pre-translated in KVWriteLoc.swa_loc)
FAULTS = ("past_end", "block_ge", "negative", "duplicate")


def pools():
    import sglang.srt.mem_cache.memory_pool as mp
    common = dict(size=SIZE, page_size=PAGE, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    yield "MHA Llama-3.1-8B bf16", lambda: mp.MHATokenToKVPool(dtype=torch.bfloat16, head_num=8, head_dim=128, **common)
    yield "MHA Llama-3.1-8B fp8_e4m3", lambda: mp.MHATokenToKVPool(dtype=torch.float8_e4m3fn, head_num=8,
                                                                   head_dim=128, **common)
    yield "MLA DeepSeek-V3 bf16", lambda: mp.MLATokenToKVPool(dtype=torch.bfloat16, kv_lora_rank=512,
                                                              qk_rope_head_dim=64, **common)
    yield "MLA no rope bf16", lambda: mp.MLATokenToKVPool(dtype=torch.bfloat16, kv_lora_rank=512,
                                                          qk_rope_head_dim=0, **common)
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    # hybrid SWA (layers 0 and 2 sliding, 1 full): SGLang translates to SWA locs and writes the SWA
    # layers through its SWA sub-pool, an MHATokenToKVPool; the faults land in SWA layer 2
    yield "SWA Llama-3.1-8B shapes bf16", lambda: SWAKVPool(
        size=SIZE, size_swa=SWA_SIZE, page_size=PAGE, dtype=torch.bfloat16, head_num=8, head_dim=128,
        swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1], device="cpu", enable_memory_saver=False)


def buffers(pool) -> list[torch.Tensor]:
    if hasattr(pool, "swa_kv_pool"):
        return buffers(pool.full_kv_pool) + buffers(pool.swa_kv_pool)
    return [b for attr in ("k_buffer", "v_buffer", "kv_buffer") for b in (getattr(pool, attr, None) or [])]


def is_swa(pool) -> bool:
    return hasattr(pool, "swa_kv_pool")


def fault_layer(pool) -> int:
    return 2 if is_swa(pool) else 1


def rows(pool) -> int:
    """Rows of the buffer the fault layer writes."""
    return (SWA_SIZE if is_swa(pool) else SIZE) + PAGE


def write_loc(pool, loc: torch.Tensor):
    """SGLang's write target: SWA pools take the (pre-translated) SWA loc beside the full one."""
    if not is_swa(pool):
        return loc
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    return KVWriteLoc(loc=loc, swa_loc=loc)


def store(pool, layer: int, loc: torch.Tensor, gen: torch.Generator) -> None:
    """One SGLang store of N tokens through the pool's own method."""
    lay = types.SimpleNamespace(layer_id=layer)
    if hasattr(pool, "kv_lora_rank"):
        nope = torch.randn(N, 1, pool.kv_lora_rank, generator=gen).bfloat16()
        rope = torch.randn(N, 1, pool.qk_rope_head_dim, generator=gen).bfloat16() if pool.qk_rope_head_dim else None
        pool.set_mla_kv_buffer(lay, loc, nope, rope)
    else:
        k = torch.randn(N, pool.head_num, pool.head_dim, generator=gen).bfloat16()
        v = torch.randn(N, pool.head_num, pool.head_dim, generator=gen).bfloat16()
        pool.set_kv_buffer(lay, write_loc(pool, loc), k, v)


def fill(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in buffers(pool):
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8, generator=g))


def locs(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(SWA_SIZE, generator=g)[:N] + PAGE   # valid rows past the padding page (of every pool)


def bad_loc(fault: str, loc: torch.Tensor, n_rows: int) -> int:
    return {"past_end": n_rows, "block_ge": n_rows + 1000 * PAGE, "negative": -7, "duplicate": int(loc[1])}[fault]


def changed(pool, reference) -> int:
    return sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) for a, b in zip(buffers(pool), reference))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    from kvwrite import validate
    from kvwrite.integrations import sglang as hook
    from sglang.srt.runtime_context import get_parallel
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0)      # one rank: no DCP (SGLang's default)

    out = {"sglang": "0.5.23", "pools": {}, "faults": {}}
    for name, make in pools():
        theirs = make()
        hook.install()
        ours = make()
        fill(theirs, 1), fill(ours, 1)
        hook.uninstall()
        for layer in range(LAYERS):
            store(theirs, layer, locs(layer), torch.Generator().manual_seed(layer))
        hook.install()
        for layer in range(LAYERS):
            store(ours, layer, locs(layer), torch.Generator().manual_seed(layer))
        equal = changed(ours, buffers(theirs)) == 0
        out["pools"][name] = {"byte_equal_to_sglang": equal, "routed_calls": dict(hook.STATE.calls),
                              "buffers": [list(b.shape) for b in buffers(ours)][:1]}
        print(f"{name}: hooked stores byte-equal to SGLang's: {equal}")
        for fault in FAULTS:
            rec = {}
            for with_kvwrite in (True, False):
                (hook.install if with_kvwrite else hook.uninstall)()
                validate.DEFAULT_CHECK = "guard" if with_kvwrite else "off"
                pool = make()
                fill(pool, 2)
                loc = locs(7)
                bad = loc.clone()
                bad[0] = bad_loc(fault, loc, rows(pool))
                twin = [b.clone() for b in buffers(pool)]
                # the expected bytes: the same store with the bad token skipped; for a duplicate,
                # kvwrite's guard keeps the first writer (token 1 skipped), SGLang alone writes
                # both tokens to one row and the later one wins on CPU
                ref = make()
                for b, t in zip(buffers(ref), twin):
                    b.copy_(t)
                hook.uninstall()
                layer = fault_layer(pool)
                if fault == "duplicate" and not with_kvwrite:
                    store(ref, layer, bad, torch.Generator().manual_seed(9))
                else:
                    store_skip(ref, layer, bad, torch.Generator().manual_seed(9), 1 if fault == "duplicate" else 0)
                (hook.install if with_kvwrite else hook.uninstall)()
                err = None
                try:
                    store(pool, layer, bad, torch.Generator().manual_seed(9))
                except Exception as exc:  # noqa: BLE001 - recorded
                    err = f"{type(exc).__name__}: {exc}"[:600]
                outside = changed(pool, buffers(ref))
                rec["kvwrite" if with_kvwrite else "sglang_alone"] = dict(
                    bad_loc=int(bad[0]), error=err, caught=err is not None and ("OutOfBoundsWrite" in err or "DuplicateWrite" in err),
                    bytes_differing_from_good_rows_only=outside)
            out["faults"][f"{name}: {fault}"] = rec
            print(f"  {fault}: {json.dumps(rec)[:400]}")
        hook.uninstall()
    validate.DEFAULT_CHECK = "off"
    out["report"] = hook.report()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def store_skip(pool, layer: int, loc: torch.Tensor, gen: torch.Generator, skip: int) -> None:
    """The store of `store()` with token `skip` not written (same random values drawn)."""
    lay = types.SimpleNamespace(layer_id=layer)
    keep = torch.arange(N) != skip
    if hasattr(pool, "kv_lora_rank"):
        nope = torch.randn(N, 1, pool.kv_lora_rank, generator=gen).bfloat16()
        rope = torch.randn(N, 1, pool.qk_rope_head_dim, generator=gen).bfloat16() if pool.qk_rope_head_dim else None
        pool.set_mla_kv_buffer(lay, loc[keep], nope[keep], rope[keep] if rope is not None else None)
    else:
        k = torch.randn(N, pool.head_num, pool.head_dim, generator=gen).bfloat16()
        v = torch.randn(N, pool.head_num, pool.head_dim, generator=gen).bfloat16()
        pool.set_kv_buffer(lay, write_loc(pool, loc[keep]), k[keep], v[keep])


if __name__ == "__main__":
    sys.exit(main())
