"""A prefill/decode handoff on NIXL: the prefill process plans a pool with 16-token pages, stores
a request's K/V with kvwrite and publishes the pool; the decode process, whose pool pages 64
tokens, pulls the request's pages (one NIXL READ, no staging copy) and reads back the same K/V.
Host memory over UCX here; on GPUs the same code registers device memory.

    python examples/pd_handoff.py          (needs NIXL: pip install 'kvwrite[nixl]')
"""
import multiprocessing as mp
import sys

import torch

MODEL = dict(variant="mha", num_layers=2, num_kv_heads=4, head_dim=64)
TOKENS, SEED = 40, 0


def build(page_size: int):
    """A kvwrite pool for MODEL with `page_size`-token pages, and its allocator."""
    from kvwrite import KVCacheConfigurator, ModelSpec, ParallelSpec

    plan = KVCacheConfigurator(ModelSpec(**MODEL), ParallelSpec(), page_size=page_size, kv_cache_dtype="auto",
                               max_total_num_tokens=1024).plan()
    return plan.build("cpu", check="assert"), plan.allocator()


def request_kv(pool, layer: int):
    """The request's K and V of one layer (the same on both sides: a fixed seed)."""
    return pool.sample_inputs(layer, TOKENS, generator=torch.Generator().manual_seed(SEED + layer))


def prefill(conn) -> None:
    from kvwrite.transfer import KVAgent

    pool, alloc = build(page_size=16)
    held = alloc.alloc(TOKENS)                         # 3 whole pages of 16 tokens
    locs = held[:TOKENS]
    for layer in range(MODEL["num_layers"]):
        pool.store(layer, locs, *request_kv(pool, layer))
    agent = KVAgent("prefill")
    agent.register_pool(pool)                          # every layer's K and V, registered once
    conn.send(agent.metadata())
    decode_agent = agent.add_peer(conn.recv())
    pages = torch.unique(locs // 16)
    conn.send(pages.tolist())                          # the request's pages, in 16-token units
    agent.wait_notif(decode_agent, b"read")            # decode has pulled them: free the pages
    alloc.free(held)
    print(f"prefill: stored {TOKENS} tokens in pages {pages.tolist()} (16 tokens a page), handed off, freed")


def decode(conn) -> None:
    from kvwrite.transfer import KVAgent

    pool, alloc = build(page_size=64)
    agent = KVAgent("decode")
    agent.register_pool(pool)
    prefill_agent = agent.add_peer(conn.recv())
    conn.send(agent.metadata())
    src_units = conn.recv()
    page = int(alloc.alloc_pages(1)[0])                # one 64-token page holds the request
    dst_units = [page * 4 + i for i in range(len(src_units))]   # its quarters, in 16-token units
    stats = agent.read_pages(prefill_agent, src_units, dst_units, pool="kv")
    agent.send_notif(prefill_agent, b"read")
    locs = page * 64 + torch.arange(TOKENS)
    for layer in range(MODEL["num_layers"]):
        k, v = request_kv(pool, layer)
        got = pool.gather(layer, locs)
        assert torch.equal(got["k"], k) and torch.equal(got["v"], v), f"layer {layer}: K/V differ"
    print(f"decode: read {stats.pairs} pages ({stats.bytes} bytes, {stats.descriptors} descriptors) into page "
          f"{page} (64 tokens a page); K/V of {MODEL['num_layers']} layers x {TOKENS} tokens equal prefill's")


if __name__ == "__main__":
    from kvwrite.transfer import available

    if not available():
        sys.exit("NIXL is not installed: pip install 'kvwrite[nixl]'")
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    procs = [ctx.Process(target=prefill, args=(a,)), ctx.Process(target=decode, args=(b,))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    sys.exit(max(p.exitcode or 0 for p in procs) or 0)
