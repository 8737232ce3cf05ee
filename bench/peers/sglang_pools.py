"""SGLang 0.5.23's own memory-pool classes on CPU with kvwrite's SGLang hook
(`kvwrite.integrations.sglang`), real models' shapes, and planted faults.

Pools: MHATokenToKVPool with Llama-3.1-8B's KV shape (8 KV heads x 128, bf16 and fp8 e4m3),
MLATokenToKVPool with DeepSeek-V3's (kv_lora_rank 512 + rope 64, bf16), the same MLA pool with no
rope (rope_dim 0), and a hybrid SWAKVPool (layers 0 and 2 sliding-window, 1 full; the faults go
into SWA layer 2's pre-translated SWA loc); 3 layers each, 16-token pages. For each, SGLang's own
`set_kv_buffer` / `set_mla_kv_buffer` (its conversions, then the hooked physical write) is called
on a pool with the hook and on a twin without it: the buffers must be byte-equal. The quantised
stores SGLang writes with its own (Triton, run by the interpreter) kernels: the DSA index-K cache
of a DSATokenToKVPool with DeepSeek-V3.2's shapes (index_head_dim 128, 64-token pages,
`set_index_k_scale_buffer` of fp8 keys + fp32 scales), DeepSeek V4's KV pages
(DeepSeekV4SingleKVPool, 64-token pages, `set_key_buffer` of its fp8 NoPE / bf16 RoPE / ue8m0
pack), its c4 indexer pool (DeepSeekV4IndexerPool, `set_index_k_scale_buffer`), the same two
pools' fused stores of bf16 input (`set_key_buffer_fused`, `set_index_fused`: SGLang's JIT
store_cache, replaced on CPU by SGLang's Triton port of it; values that need no fp8 rounding),
the V4.1 fp4 KV pools (DeepSeekV4SingleKVPool of layout v41_fp4 and v41_fp4_new, `set_key_buffer_fused`,
with and without in-kernel RoPE: SGLang's writer is CUDA only, the CPU reference is SGLang's V4.1
oracle `quantize_k_cache_v41_fp4` (after its `rope_tail`) written at the kernel's addresses), the
fp4 indexer (DeepSeekV4IndexerPool, `set_index_fp4`, index_k_rne off and on: SGLang's Triton
quantiser and store), and V4's c4 compress state (CompressStatePool, ring 8, head_dim 512,
`set_state_by_state_loc`);
a DCP-sharded MLA pool (DCP 2, rank 1: widened locs). Their
buffers are views into a larger backing tensor (2 pages before, 1002 after), so what SGLang's
own Triton store does with a bad loc lands in memory this script owns and is counted. Then, in guard
mode, one store per fault gets one bad loc (token 0): one past the last row, a page 1000 past
the end, -7, and a loc duplicated from token 1: caught or not, the error text (it names the
layer), and whether any byte other than the good rows changed; and what the same store does in
SGLang without the hook. Last, SGLang's fp4 indexer bytes against kvwrite's own MXFP4 indexer
store on the same keys (why that route keeps SGLang's quantiser). Usage (sglang env):
python bench/peers/sglang_pools.py [--json F] [--only NAME-PART]
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
    # DCP: 2 ranks, this one rank 1; the pool is sharded (widened locs, SGLang's
    # set_mla_kv_buffer_dcp_sharded_triton keeps loc % 2 == 1 at row loc // 2)
    yield "MLA DeepSeek-V3 bf16, DCP-sharded (rank 1 of 2)", lambda: dcp(lambda: mp.MLATokenToKVPool(
        dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64, **common))
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    # hybrid SWA (layers 0 and 2 sliding, 1 full): SGLang translates to SWA locs and writes the SWA
    # layers through its SWA sub-pool, an MHATokenToKVPool; the faults land in SWA layer 2
    yield "SWA Llama-3.1-8B shapes bf16", lambda: SWAKVPool(
        size=SIZE, size_swa=SWA_SIZE, page_size=PAGE, dtype=torch.bfloat16, head_num=8, head_dim=128,
        swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1], device="cpu", enable_memory_saver=False)


V4_PAGE, INDEX_PAGE = 64, 64     # DeepSeek V4 / DSA: 64-token physical pages (SGLang asserts it)
BEFORE, AFTER = 2, 1002           # backing pages around a quantised pool's buffer


def quantised_pools():
    """(name, make, kind): the pools SGLang stores already-quantised bytes into."""
    import sglang.srt.mem_cache.deepseek_v4_memory_pool as v4
    import sglang.srt.mem_cache.memory_pool as mp
    from sglang.srt.mem_cache.deepseek_v4_compress_state import CompressStatePool
    common = dict(page_size=INDEX_PAGE, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    yield "DSA index-K DeepSeek-V3.2 (fp8 keys + fp32 scales)", lambda: mp.DSATokenToKVPool(
        size=2 * INDEX_PAGE, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64,
        index_head_dim=128, kv_cache_dim=656, **common), "index_k"
    yield "DeepSeek V4 KV pages (SingleKVPool, fp8 NoPE + bf16 RoPE + ue8m0)", lambda: v4.DeepSeekV4SingleKVPool(
        size=2 * V4_PAGE, dtype=torch.float8_e4m3fn, qk_nope_head_dim=448, qk_rope_head_dim=64, **common), "dsv4_kv"
    yield "DeepSeek V4 c4 indexer (IndexerPool fp8)", lambda: v4.DeepSeekV4IndexerPool(
        size=2 * V4_PAGE, dtype=torch.float8_e4m3fn, index_head_dim=128, use_fp4_indexer=False, **common), "index_k"
    # The fused stores (bf16 in, quantised in SGLang's CUDA JIT store_cache, which does not run on
    # CPU): SGLang's own Triton port of those kernels (its ROCm path, `triton_fused_store_cache`) is
    # the reference here, fed values that need no rounding (the interpreter's fp8 rounding is not
    # the hardware's; kvwrite's rounding is tested against torch's elsewhere).
    v4.fused_store_cache = fused_store_cache_cpu
    yield "DeepSeek V4 KV pages, fused store (bf16 in, SGLang's store_cache)", lambda: v4.DeepSeekV4SingleKVPool(
        size=2 * V4_PAGE, dtype=torch.float8_e4m3fn, qk_nope_head_dim=448, qk_rope_head_dim=64, **common), "dsv4_fused"
    yield "DeepSeek V4 c4 indexer, fused store (bf16 in, SGLang's store_cache)", lambda: v4.DeepSeekV4IndexerPool(
        size=2 * V4_PAGE, dtype=torch.float8_e4m3fn, index_head_dim=128, use_fp4_indexer=False, **common), "index_fused"
    # V4.1 pools (SingleKVPool of layout v41_fp4 / v41_fp4_new, v41 / v41_new): SGLang's writer is the
    # same CUDA JIT store_cache; on CPU, SGLang's V4.1 oracles (`quantize_k_cache_v41_fp4` /
    # `quantize_k_cache_v41`, what its store tests check the kernel against; `rope_tail` first with
    # freqs_cis) at the kernel's addresses
    v41 = dict(size=2 * V4_PAGE, dtype=torch.float8_e4m3fn, qk_nope_head_dim=448, qk_rope_head_dim=64, **common)
    for what, split, interleaved in (("fp4", "v41_fp4", "v41_fp4_new"), ("fp8", "v41", "v41_new")):
        for layout, kind, how in ((split, "v41", "fused store"), (interleaved, "v41", "interleaved, fused store"),
                                  (split, "v41_rope", "fused store with in-kernel RoPE, freqs_cis")):
            yield f"DeepSeek V4.1 KV {what} (SingleKVPool {layout}, {how}; SGLang's V4.1 oracle)", \
                lambda layout=layout: v4.DeepSeekV4SingleKVPool(kv_layout=layout, **v41), kind
    # the fp4 indexer (set_index_fp4: SGLang's Triton quantiser and store kernel, run by the interpreter)
    for rne, which in ((False, "c4: threshold rounding"), (True, "low-ratio: index_k_rne")):
        yield f"DeepSeek V4 fp4 indexer (IndexerPool set_index_fp4, {which})", \
            lambda rne=rne: fp4_indexer(v4.DeepSeekV4IndexerPool(size=2 * V4_PAGE, dtype=torch.float8_e4m3fn,
                                                               index_head_dim=128, use_fp4_indexer=True, **common), rne), \
            "index_fp4"
    yield "DeepSeek V4 c4 compress state (ring 8, head_dim 512, fp32)", lambda: CompressStatePool(
        size=2 * V4_PAGE, ring_size=8, overlap=True, head_dim=512, dtype=torch.float32, device="cpu",
        enable_memory_saver=False, ratio=4, swa_page_size=V4_PAGE), "state"


def fp4_indexer(pool, rne: bool):
    pool.index_k_rne = rne
    return pool


def fused_store_cache_cpu(input, cache, indices, *, page_size, type, layout=None, freqs_cis=None):
    """SGLang's `fused_store_cache` on CPU: its Triton port (`triton_fused_store_cache`, its ROCm
    path) for the V4 layout and the indexer; for the V4.1 fp4 layouts, SGLang's V4.1 oracle bytes
    written where the CUDA kernel writes them (unchecked: a bad loc lands where the kernel's
    address arithmetic puts it, here inside the backing tensor around the buffer)."""
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
    from sglang.kernels.ops.kvcache.triton_store_cache import triton_fused_store_cache
    layout = KVLayout.parse(layout or "v4")
    if layout is KVLayout.V4:
        assert freqs_cis is None
        return triton_fused_store_cache(input, cache, indices, page_size=page_size, type=type)
    from sglang.srt.layers.attention.dsv4.dsv41_sparse import rope_tail
    from sglang.test.kernels.deepseek_v4.dsv41_kv_quant_reference import (quantize_k_cache_v41,
                                                                          quantize_k_cache_v41_fp4)
    assert layout.encoding in (KVLayout.V41, KVLayout.V41_FP4), f"no CPU stand-in for SGLang's {layout} store"
    oracle = quantize_k_cache_v41_fp4 if layout.is_fp4 else quantize_k_cache_v41
    x = rope_tail(input, freqs_cis, 64) if freqs_cis is not None else input
    rec = oracle(x.view(-1, 1, 512), page_bytes=layout.bytes_per_token)     # one record a token
    db = layout.data_bytes
    data_stride, scale_base, scale_stride = layout.row_addressing(page_size)
    flat = cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)   # the whole backing
    loc = indices.to(torch.int64)
    page, slot = torch.div(loc, page_size, rounding_mode="floor"), loc % page_size
    base = cache.storage_offset() + page * cache.stride(0)
    for at, part in ((base + slot * data_stride, rec[:, :db]), (base + scale_base + slot * scale_stride, rec[:, db:])):
        addr = at[:, None] + torch.arange(part.shape[1])
        ok = (addr >= 0) & (addr < flat.numel())      # outside the process's backing: not emulated
        flat[addr[ok]] = part[ok]


def _index_bufs(pool) -> list:
    cache = getattr(pool, "index_key_cache", None)
    return cache.buffer if cache is not None else pool.index_k_with_scale_buffer


def widen(pool, kind: str) -> None:
    """Put each written buffer of a quantised pool inside a backing tensor with pages around it
    (a bad loc that SGLang's Triton store writes out of the buffer lands in the backing)."""
    if kind == "state":
        t = pool.kv_score_buffer.kv_score
        back = torch.zeros(t.shape[0] + BEFORE + AFTER, t.shape[1], dtype=t.dtype)
        back[BEFORE:BEFORE + t.shape[0]] = t
        pool.kv_score_buffer.kv_score = back[BEFORE:BEFORE + t.shape[0]]
        pool._kvw_backing = [back]
        return
    bufs = _index_bufs(pool) if kind in ("index_k", "index_fused", "index_fp4") else pool.kv_buffer
    pool._kvw_backing = []
    for i, t in enumerate(bufs):
        back = torch.zeros(t.shape[0] + BEFORE + AFTER, t.shape[1], dtype=t.dtype)
        bufs[i] = back[BEFORE:BEFORE + t.shape[0]]
        pool._kvw_backing.append(back)


DCP = (2, 1)      # dcp_size, this rank


def dcp(make):
    """Build a pool under DCP (the setting stays while its stores run; `no_dcp` ends it)."""
    from sglang.srt.runtime_context import get_parallel
    get_parallel().override_permanently(attn_dcp_size=DCP[0], attn_dcp_rank=DCP[1])
    pool = make()
    pool._kvw_dcp = True
    return pool


def no_dcp() -> None:
    from sglang.srt.runtime_context import get_parallel
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0)


def widened(pool, loc: torch.Tensor) -> torch.Tensor:
    """A DCP-sharded pool's (widened) locs for these rows of this rank: row * dcp_size + rank."""
    return loc * DCP[0] + DCP[1] if getattr(pool, "_kvw_dcp", False) else loc


def buffers(pool) -> list[torch.Tensor]:
    if hasattr(pool, "_kvw_backing"):
        return pool._kvw_backing
    if hasattr(pool, "swa_kv_pool"):
        return buffers(pool.full_kv_pool) + buffers(pool.swa_kv_pool)
    return [b for attr in ("k_buffer", "v_buffer", "kv_buffer") for b in (getattr(pool, attr, None) or [])]


def is_swa(pool) -> bool:
    return hasattr(pool, "swa_kv_pool")


def fault_layer(pool) -> int:
    return 2 if is_swa(pool) else 1


def rows(pool) -> int:
    """Locs (rows) of the buffer the fault layer writes."""
    if hasattr(pool, "kv_score_buffer"):
        return pool.kv_score_buffer.kv_score.shape[0]
    if hasattr(pool, "index_k_with_scale_buffer") and not hasattr(pool, "kv_lora_rank") or hasattr(pool, "index_key_cache"):
        return _index_bufs(pool)[0].shape[0] * INDEX_PAGE
    if hasattr(pool, "qk_nope_head_dim") and not hasattr(pool, "kv_lora_rank"):
        return pool.kv_buffer[0].shape[0] * V4_PAGE
    return (SWA_SIZE if is_swa(pool) else SIZE) + PAGE


def write_loc(pool, loc: torch.Tensor):
    """SGLang's write target: SWA pools take the (pre-translated) SWA loc beside the full one."""
    if not is_swa(pool):
        return loc
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    return KVWriteLoc(loc=loc, swa_loc=loc)


def store(pool, layer: int, loc: torch.Tensor, gen: torch.Generator, kind: str | None = None) -> None:
    """One SGLang store of N tokens through the pool's own method."""
    lay = types.SimpleNamespace(layer_id=layer)
    if kind is not None:
        quantised_store(pool, kind, layer, loc, gen, torch.ones(N, dtype=torch.bool))
    elif hasattr(pool, "kv_lora_rank"):
        nope = torch.randn(N, 1, pool.kv_lora_rank, generator=gen).bfloat16()
        rope = torch.randn(N, 1, pool.qk_rope_head_dim, generator=gen).bfloat16() if pool.qk_rope_head_dim else None
        pool.set_mla_kv_buffer(lay, loc, nope, rope)
    else:
        k = torch.randn(N, pool.head_num, pool.head_dim, generator=gen).bfloat16()
        v = torch.randn(N, pool.head_num, pool.head_dim, generator=gen).bfloat16()
        pool.set_kv_buffer(lay, write_loc(pool, loc), k, v)


def exact(n: int, d: int, tile: int, gen: torch.Generator) -> torch.Tensor:
    """[n, d] values whose fp8 quantisation needs no rounding: e4m3 codes times a power of two per
    tile, each tile's amax 448 times it (so its scale is that power of two, ue8m0 or not)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)]
    q = codes[torch.randint(0, len(codes), (n, d), generator=gen)].view(n, d // tile, tile)
    q[:, :, 0] = 448.0
    return (q * torch.exp2(torch.randint(-6, 4, (n, d // tile, 1), generator=gen).float())).view(n, d)


def quantised_store(pool, kind: str, layer: int, loc: torch.Tensor, gen: torch.Generator, keep: torch.Tensor) -> None:
    """SGLang's own store of already-quantised rows (random bytes of the right dtypes; finite fp8
    codes, as SGLang's quantiser makes them), the tokens in `keep` only."""
    def fp8(*shape):
        return (torch.randn(*shape, generator=gen) * 8).to(torch.float8_e4m3fn)
    if kind == "index_k":
        k, s = fp8(N, 128), torch.rand(N, generator=gen)
        pool.set_index_k_scale_buffer(layer, loc[keep].contiguous(), k[keep].contiguous(), s[keep].contiguous())
    elif kind == "dsv4_kv":
        from sglang.kernels.ops.kvcache.dsv4_main_kv_store import NopeFp8RopeBf16Pack
        nope, rope = fp8(N, 448), torch.randn(N, 64, generator=gen).bfloat16()
        sc = torch.randint(100, 140, (N, 7), generator=gen, dtype=torch.uint8)
        pool.set_key_buffer(layer, loc[keep].contiguous(), NopeFp8RopeBf16Pack(
            nope[keep].contiguous(), rope[keep].contiguous(), sc[keep].contiguous()))
    elif kind == "dsv4_fused":
        x = exact(N, 448, 64, gen)
        x = torch.cat([x, torch.randn(N, 64, generator=gen)], 1).bfloat16()    # NoPE, then RoPE (bf16 as is)
        pool.set_key_buffer_fused(layer, loc[keep].contiguous(), x[keep].contiguous())
    elif kind == "index_fused":
        pool.set_index_fused(layer, loc[keep].contiguous(), exact(N, 128, 128, gen).bfloat16()[keep].contiguous())
    elif kind == "index_fp4":       # SGLang quantises on both sides: random bf16 keys
        pool.set_index_fp4(layer, loc[keep].contiguous(), torch.randn(N, 128, generator=gen).bfloat16()[keep].contiguous())
    elif kind in ("v41", "v41_rope"):
        x = torch.randn(N, 512, generator=gen).bfloat16()
        freqs = None
        if kind == "v41_rope":      # per-token freqs_cis [N, 32] complex64: polar(1, position * inv_freq)
            pos = torch.randint(0, 65536, (N, 1), generator=gen).float()
            inv = 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)
            freqs = torch.polar(torch.ones(N, 32), pos * inv)[keep].contiguous()
        pool.set_key_buffer_fused(layer, loc[keep].contiguous(), x[keep].contiguous(), freqs)
    else:
        from sglang.srt.mem_cache.deepseek_v4_compress_state import KVAndScore
        v = torch.randn(N, pool.last_dim, generator=gen)
        pool.set_state_by_state_loc(loc[keep].clone(), KVAndScore(v[keep].contiguous()))


def fill(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in buffers(pool):
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8, generator=g))


def locs(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(SWA_SIZE, generator=g)[:N] + PAGE   # valid rows past the padding page (of every pool)


def bad_loc(fault: str, loc: torch.Tensor, n_rows: int, pool=None) -> int:
    if getattr(pool, "_kvw_dcp", False):      # this rank's widened locs one past / 1000 pages past its rows
        return {"past_end": int(widened(pool, torch.tensor(n_rows))), "block_ge": int(widened(pool, torch.tensor(n_rows + 1000 * PAGE))),
                "negative": -7, "duplicate": int(loc[1])}[fault]
    return {"past_end": n_rows, "block_ge": n_rows + 1000 * PAGE, "negative": -7, "duplicate": int(loc[1])}[fault]


def changed(pool, reference) -> int:
    return sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) for a, b in zip(buffers(pool), reference))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--only", help="run the pools whose name contains this")
    args = ap.parse_args()
    from kvwrite import validate
    from kvwrite.integrations import sglang as hook
    from sglang.srt.runtime_context import get_parallel
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0)      # one rank: no DCP (SGLang's default)

    out = {"sglang": "0.5.23", "pools": {}, "faults": {}}
    every = [(name, make, None) for name, make in pools()] + list(quantised_pools())
    if args.only:
        every = [e for e in every if args.only in e[0]]
    for name, plain, kind in every:
        run_pool(out, name, plain, kind, hook, validate)
    if not args.only or "fp4 indexer" in args.only:
        out["fp4_indexer_vs_kvwrite_mxfp4"] = fp4_indexer_formats()
    if not args.only or "norm" in args.only:
        out["v4_swa_norm_rope"] = swa_norm_rope(hook, validate)
    validate.DEFAULT_CHECK = "off"
    out["report"] = hook.report()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def fp4_indexer_formats() -> dict:
    """Why set_index_fp4 keeps SGLang's quantiser: SGLang's fp4 index-K store against kvwrite's own
    MXFP4 indexer store (`store_dsv4_indexer_k(fmt="mxfp4")`, the same page layout) on the same
    keys: random bf16 DeepSeek V4 keys [256, 128], and keys built to avoid the three differences
    (no negative value rounding to a zero code, every 32-value group's amax >= 6e-4, no e2m1 tie)."""
    import kvwrite
    from kvwrite.reference.dsv4 import read_dsv4_indexer_k
    from sglang.kernels.ops.kvcache.dsv4_fp4_index_k_cache import store_fp4_index_k_cache
    g = torch.Generator().manual_seed(5)
    n, pages = 256, 4
    mags = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0])       # e2m1 magnitudes other than 0 and 6 (no tie)
    q = mags[torch.randint(0, len(mags), (n, 4, 32), generator=g)] * torch.where(
        torch.rand(n, 4, 32, generator=g) < 0.5, -1.0, 1.0)
    q[:, :, 0] = 6.0                                            # amax 6 * 2^e: scale 2^e exactly
    clean = (q * torch.exp2(torch.randint(-8, 4, (n, 4, 1), generator=g).float())).view(n, 128)
    res = {}
    for what, keys in (("random bf16", torch.randn(n, 128, generator=g)), ("no zero code, amax >= 6e-4, no tie", clean)):
        keys = keys.bfloat16()
        loc = torch.randperm(pages * V4_PAGE, generator=g)[:n]
        mine = torch.zeros(pages, V4_PAGE * 68, dtype=torch.uint8)
        kvwrite.store_dsv4_indexer_k(keys, mine, loc, page_size=V4_PAGE, fmt="mxfp4", check="assert")
        for rne in (False, True):
            theirs = torch.zeros_like(mine)
            store_fp4_index_k_cache(keys, theirs, loc, page_size=V4_PAGE, rne=rne)
            payload = slice(0, V4_PAGE * 64)
            a, b = mine[:, payload].reshape(-1), theirs[:, payload].reshape(-1)
            nib = torch.stack([a & 15, a >> 4, b & 15, b >> 4], -1)
            differ = (nib[:, :2] != nib[:, 2:])
            signed_zero = differ & (nib[:, :2] == 8) & (nib[:, 2:] == 0)
            vm = read_dsv4_indexer_k(mine, loc, page_size=V4_PAGE, fmt="mxfp4")
            vt = read_dsv4_indexer_k(theirs, loc, page_size=V4_PAGE, fmt="mxfp4")
            res[f"{what}, rne={rne}"] = r = dict(
                tokens_byte_equal=int((mine.view(pages, V4_PAGE, -1) == theirs.view(pages, V4_PAGE, -1)).all(-1).sum()),
                tokens=n, payload_nibbles_differing=int(differ.sum()),
                of_which_kvwrite_minus_zero_sglang_zero=int(signed_zero.sum()),
                scale_bytes_differing=int((mine[:, V4_PAGE * 64:] != theirs[:, V4_PAGE * 64:]).sum()),
                decoded_values_differing=int((vm != vt).sum()))
            print(f"fp4 indexer, kvwrite mxfp4 vs SGLang, {what}, rne={rne}: {r}")
    return res


def v4_token_pool():
    """SGLang's DeepSeekV4TokenToKVPool (V4 layout, SWA pages of 64, layers of ratios 4 / 128 / 4) on
    CPU, with the runtime configuration it reads published as a launch would (flashmla backend,
    no speculative decoding, fp8 indexer)."""
    import sglang.srt.mem_cache.deepseek_v4_memory_pool as v4
    ns = types.SimpleNamespace
    v4.get_spec = lambda: ns(speculative_algorithm=None, speculative_num_draft_tokens=0)
    v4.get_exec = lambda: ns(kernel=ns(dsv4_attn_backend="flashmla", enable_deepseek_v4_fp4_indexer=False),
                             features=ns(enable_encoder_swa_bounded_replay=False))
    return v4.DeepSeekV4TokenToKVPool(
        max_num_reqs=4, swa_size=256, c4_size=256, c128_size=256, c4_state_pool_size=16, c128_state_pool_size=16,
        page_size=256, swa_page_size=V4_PAGE, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128,
        layer_num=LAYERS, device="cpu", enable_memory_saver=False, compression_ratios=[4, 128, 4], unified_fp8=False)


def swa_norm_rope(hook, validate) -> dict:
    """DeepSeek V4's SWA store (`set_swa_key_buffer_radix_fused_norm_rope`, what SGLang's V4 attention
    calls for every SWA write: RMSNorm + RoPE + FlashMLA store in one CUDA JIT kernel, which does not
    run on CPU) on the real pool class with the hook: the routed bytes against kvwrite's store of the
    norm + RoPE restated in torch (fp32, the kernel's order of operations), no other byte changed, and
    the four faults in guard mode. SGLang alone: not runnable here (CUDA only)."""
    import kvwrite
    hook.install()                 # before the pool is built: its SWA buffers are registered by layer
    pool = v4_token_pool()
    g = torch.Generator().manual_seed(11)
    kv = (torch.randn(N, 512, generator=g) * 2).bfloat16()
    weight = (torch.rand(512, generator=g) + 0.5).bfloat16()
    inv = 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    freqs = torch.polar(torch.ones(4096, 32), torch.arange(4096).float()[:, None] * inv)   # the full table
    positions = torch.randint(0, 4096, (N,), generator=g)
    x = torch.nn.functional.rms_norm(kv.float(), (512,), weight.float(), 1e-6)
    rope = torch.view_as_complex(x[:, 448:].reshape(-1, 32, 2).contiguous()) * freqs[positions]
    rows_fp32 = torch.cat([x[:, :448], torch.view_as_real(rope).flatten(-2)], -1)
    layer, res = 1, {}
    nrows = pool.get_swa_raw_buffer(layer).shape[0] * V4_PAGE

    def call(loc):
        pool.set_swa_key_buffer_radix_fused_norm_rope(layer_id=layer, swa_loc=loc, kv=kv, kv_weight=weight, eps=1e-6,
                                                      freqs_cis=freqs, positions=positions)

    hook.STATE.calls.clear()
    for fault in (None,) + FAULTS:
        validate.DEFAULT_CHECK = "off" if fault is None else "guard"
        buf = pool.get_swa_raw_buffer(layer)
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))
        loc = torch.randperm(nrows - V4_PAGE, generator=g)[:N] + V4_PAGE
        if fault is not None:
            loc[0] = bad_loc(fault, loc, nrows)
        want = buf.clone()
        keep = torch.arange(N) != (1 if fault == "duplicate" else 0) if fault else torch.ones(N, dtype=torch.bool)
        kvwrite.store_dsv4_kv(rows_fp32[keep], want, loc[keep], page_size=V4_PAGE, check="off", backend="torch")
        err = None
        try:
            call(loc.to(torch.int32))
        except Exception as exc:  # noqa: BLE001 - recorded
            err = f"{type(exc).__name__}: {exc}"[:400]
        res[fault or "good"] = r = dict(error=err, caught=err is not None and ("OutOfBounds" in err or "Duplicate" in err),
                                       bytes_differing_from_expected=int((buf != want).sum()))
        print(f"V4 SWA norm+RoPE store, {fault or 'good rows'}: {json.dumps(r)[:300]}")
    res["routed_calls"] = dict(hook.STATE.calls)
    res["fallbacks"] = dict(hook.STATE.fallbacks)
    hook.uninstall()
    validate.DEFAULT_CHECK = "off"
    return res


def run_pool(out: dict, name: str, plain, kind: str | None, hook, validate) -> None:
    """Byte-equality against SGLang alone, then the four faults with and without kvwrite."""
    def make():
        pool = plain()
        if kind is not None:
            widen(pool, kind)
            hook.register_pool(pool)       # the buffers moved into their backing: name them again
        return pool

    def good(seed: int) -> torch.Tensor:
        if kind is None:
            return widened(probe_plain, locs(seed))
        g = torch.Generator().manual_seed(seed)
        return torch.randperm(rows(probe) - 1 - PAGE, generator=g)[:N] + PAGE   # not the last (sentinel) row

    probe = make() if kind is not None else None
    probe_plain = make() if kind is None else None
    theirs = make()
    hook.install()
    ours = make()
    fill(theirs, 1), fill(ours, 1)
    hook.uninstall()
    hook.STATE.calls.clear()
    for layer in range(LAYERS if kind != "state" else 1):
        store(theirs, layer, good(layer), torch.Generator().manual_seed(layer), kind)
    hook.install()
    for layer in range(LAYERS if kind != "state" else 1):
        store(ours, layer, good(layer), torch.Generator().manual_seed(layer), kind)
    equal = changed(ours, buffers(theirs)) == 0
    out["pools"][name] = {"byte_equal_to_sglang": equal, "routed_calls": dict(hook.STATE.calls),
                          "buffers": [list(b.shape) for b in buffers(ours)][:1]}
    print(f"{name}: hooked stores byte-equal to SGLang's: {equal} {dict(hook.STATE.calls)}")
    layer = fault_layer(ours) if kind != "state" else 0
    for fault in FAULTS:
        rec = {}
        for with_kvwrite in (True, False):
            (hook.install if with_kvwrite else hook.uninstall)()
            validate.DEFAULT_CHECK = "guard" if with_kvwrite else "off"
            pool = make()
            fill(pool, 2)
            loc = good(7)
            bad = loc.clone()
            bad[0] = bad_loc(fault, loc, rows(pool), pool)
            twin = [b.clone() for b in buffers(pool)]
            # the expected bytes: the same store with the bad token skipped; for a duplicate,
            # kvwrite's guard keeps the first writer (token 1 skipped), SGLang alone writes
            # both tokens to one row and the later one wins on CPU
            ref = make()
            for b, t in zip(buffers(ref), twin):
                b.copy_(t)
            hook.uninstall()
            if fault == "duplicate" and not with_kvwrite:
                store(ref, layer, bad, torch.Generator().manual_seed(9), kind)
            else:
                store_skip(ref, layer, bad, torch.Generator().manual_seed(9), 1 if fault == "duplicate" else 0, kind)
            (hook.install if with_kvwrite else hook.uninstall)()
            err = None
            try:
                store(pool, layer, bad, torch.Generator().manual_seed(9), kind)
            except Exception as exc:  # noqa: BLE001 - recorded
                err = f"{type(exc).__name__}: {exc}"[:600]
            outside = changed(pool, buffers(ref))
            rec["kvwrite" if with_kvwrite else "sglang_alone"] = r = dict(
                bad_loc=int(bad[0]), error=err, caught=err is not None and ("OutOfBoundsWrite" in err or "DuplicateWrite" in err),
                bytes_differing_from_good_rows_only=outside)
            if kind is not None:     # of those, the bytes outside the pool's buffer (in the backing around it)
                r["bytes_changed_outside_the_buffer"] = sum(
                    int((a[m].view(torch.uint8) != b[m].view(torch.uint8)).sum())
                    for a, b in zip(buffers(pool), twin)
                    for m in (slice(0, BEFORE), slice(a.shape[0] - AFTER, None)))
        out["faults"][f"{name}: {fault}"] = rec
        print(f"  {fault}: {json.dumps(rec)[:400]}")
    hook.uninstall()
    no_dcp()


def store_skip(pool, layer: int, loc: torch.Tensor, gen: torch.Generator, skip: int, kind: str | None = None) -> None:
    """The store of `store()` with token `skip` not written (same random values drawn)."""
    lay = types.SimpleNamespace(layer_id=layer)
    keep = torch.arange(N) != skip
    if kind is not None:
        quantised_store(pool, kind, layer, loc, gen, keep)
    elif hasattr(pool, "kv_lora_rank"):
        nope = torch.randn(N, 1, pool.kv_lora_rank, generator=gen).bfloat16()
        rope = torch.randn(N, 1, pool.qk_rope_head_dim, generator=gen).bfloat16() if pool.qk_rope_head_dim else None
        pool.set_mla_kv_buffer(lay, loc[keep], nope[keep], rope[keep] if rope is not None else None)
    else:
        k = torch.randn(N, pool.head_num, pool.head_dim, generator=gen).bfloat16()
        v = torch.randn(N, pool.head_num, pool.head_dim, generator=gen).bfloat16()
        pool.set_kv_buffer(lay, write_loc(pool, loc[keep]), k[keep], v[keep])


if __name__ == "__main__":
    sys.exit(main())
