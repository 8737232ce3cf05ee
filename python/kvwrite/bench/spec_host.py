"""Host cost per call at N = 1 against the op-spec host-cost targets (CPU, one thread; ratios from
interleaved runs): every public op (stores, fused RoPE stores, page moves) vs store_kv, each adapter vs the op it wraps, assert vs off, a
PageTable loc vs a plain loc; and the head-major layout against NHD at N=256. `python -m kvwrite.bench.spec_host [min_time]` prints a table."""
from __future__ import annotations

import sys

import torch

import kvwrite
from kvwrite.bench.host import interleaved_us
from kvwrite.compat import flashinfer, vllm
from kvwrite.ops.dsv4 import kv_page_bytes


def cases() -> list[tuple[str, object, str, object, float]]:
    """(call, fn, baseline, fn, target ratio)."""
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    rnd = lambda *s: torch.randn(*s, generator=g).to(bf)  # noqa: E731
    loc = torch.tensor([5])
    k, v = rnd(1, 8, 128), rnd(1, 8, 128)
    kc, vc = torch.zeros(16, 16, 8, 128, dtype=bf), torch.zeros(16, 16, 8, 128, dtype=bf)
    base = lambda: kvwrite.store_kv(k, v, kc, vc, loc)  # noqa: E731
    errors = kvwrite.ErrorBuffer()
    guard = lambda: kvwrite.store_kv(k, v, kc, vc, loc, check="guard", errors=errors)  # noqa: E731
    kv_c, k_pe, mla = rnd(1, 512), rnd(1, 64), torch.zeros(16, 16, 576, dtype=bf)
    ik, icache = rnd(1, 128), torch.zeros(16, 16 * 132, dtype=torch.uint8)
    nv = [torch.zeros(16, 16, 8, w, dtype=dt) for w, dt in ((64, torch.uint8),) * 2 + ((8, torch.float8_e4m3fn),) * 2]
    dkv, dcache = rnd(1, 512), torch.zeros(16, kv_page_bytes(16), dtype=torch.uint8)
    src, pool = rnd(1, 64), torch.zeros(64, 64, dtype=bf)
    fp4 = torch.zeros(16, 16 * 384, dtype=torch.uint8)   # DeepSeek V4 nvfp4 records
    pt = kvwrite.PageTable(torch.tensor([0]), torch.tensor([5]), torch.tensor([3, 1]), torch.tensor([0, 2]))
    last, moved = torch.tensor([5]), torch.tensor([6])
    i8 = [torch.zeros(16, 16, 8, 128, dtype=torch.int8) for _ in range(2)]
    one = torch.tensor(0.05)
    tok, head = [torch.zeros(16, 16) for _ in range(2)], [torch.zeros(16, 16, 8) for _ in range(2)]
    hm = (torch.zeros(16, 8, 16, 16, 8, dtype=bf), torch.zeros(16, 8, 128, 16, dtype=bf))   # vLLM head-major, x = 8
    pos, q, q_pe = torch.tensor([3]), rnd(1, 8, 128), rnd(1, 8, 64)
    cos_sin, cos_sin_pe = rnd(16, 128), rnd(16, 64)
    kc2, table, geo = torch.zeros_like(kc), torch.tensor([[3, 1]]), kvwrite.PageGeometry(16, 16)
    return [
        ("store_kv int8 static", lambda: kvwrite.store_kv(k, v, *i8, loc, k_scale=one, v_scale=one), "store_kv",
         base, 2.0),
        ("store_kv int8 per token", lambda: kvwrite.store_kv(k, v, *i8, loc, k_scale_cache=tok[0],
                                                              v_scale_cache=tok[1]), "store_kv", base, 2.0),
        ("store_kv int8 per token-head", lambda: kvwrite.store_kv(k, v, *i8, loc, k_scale_cache=head[0],
                                                                   v_scale_cache=head[1]), "store_kv", base, 2.0),
        ("store_mla", lambda: kvwrite.store_mla(kv_c, k_pe, mla, loc), "store_kv", base, 2.0),
        ("store_indexer_k", lambda: kvwrite.store_indexer_k(ik, icache, loc), "store_kv", base, 2.0),
        ("store_kv_nvfp4", lambda: kvwrite.store_kv_nvfp4(k, v, *nv, loc), "store_kv", base, 2.0),
        ("store_dsv4_kv", lambda: kvwrite.store_dsv4_kv(dkv, dcache, loc), "store_kv", base, 2.0),
        ("store_dsv4_indexer_k", lambda: kvwrite.store_dsv4_indexer_k(ik, icache, loc), "store_kv", base, 2.0),
        ("store_rows", lambda: kvwrite.store_rows(src, pool, loc), "store_kv", base, 2.0),
        ("store_dsv4_kv_fp4", lambda: kvwrite.store_dsv4_kv_fp4(dkv, fp4, loc), "store_kv", base, 2.0),
        ("rope_store_dsv4_kv_fp4", lambda: kvwrite.rope_store_dsv4_kv_fp4(pos, dkv, cos_sin_pe, fp4, loc),
         "store_kv", base, 2.0),
        ("store_kv PageTable", lambda: kvwrite.store_kv(k, v, kc, vc, pt), "store_kv", base, 2.0),
        ("store_kv_head_major", lambda: kvwrite.store_kv_head_major(k, v, *hm, loc), "store_kv", base, 2.0),
        ("rope_store_kv", lambda: kvwrite.rope_store_kv(pos, q, k, v, cos_sin, kc, vc, loc), "store_kv", base, 2.0),
        ("rope_store_mla", lambda: kvwrite.rope_store_mla(pos, q_pe, kv_c, k_pe, cos_sin_pe, mla, loc), "store_kv",
         base, 2.0),
        ("rope_store_kv check=guard", lambda: kvwrite.rope_store_kv(pos, q, k, v, cos_sin, kc, vc, loc, check="guard",
                                                                    errors=errors), "store_kv check=guard", guard, 2.0),
        ("rope_store_mla check=guard", lambda: kvwrite.rope_store_mla(pos, q_pe, kv_c, k_pe, cos_sin_pe, mla, loc,
                                                                      check="guard", errors=errors),
         "store_kv check=guard", guard, 2.0),
        ("copy_pages", lambda: kvwrite.copy_pages(kc, kc2, loc, loc), "store_kv", base, 2.0),
        ("gather", lambda: kvwrite.gather(kc, loc), "store_kv", base, 2.0),
        ("slot_mapping", lambda: kvwrite.slot_mapping(table, pt.batch_indices, pt.positions, geo), "store_kv",
         base, 2.0),
        ("move_rows", lambda: kvwrite.move_rows(kc, loc, moved), "store_kv", base, 2.0),
        ("store_kv check=assert", lambda: kvwrite.store_kv(k, v, kc, vc, loc, check="assert"), "store_kv", base, 1.3),
        ("vllm.reshape_and_cache_flash",
         lambda: vllm.reshape_and_cache_flash(k, v, kc, vc, loc, "auto", None, None), "store_kv", base, 1.2),
        ("flashinfer.append_paged_kv_cache",
         lambda: flashinfer.append_paged_kv_cache(k, v, pt.batch_indices, pt.positions, (kc, vc), pt.kv_indices,
                                                  pt.kv_indptr, last),
         "store_kv PageTable", lambda: kvwrite.store_kv(k, v, kc, vc, pt), 1.2),
        *head_major_cases(g),
    ]


def head_major_cases(g: torch.Generator) -> list:
    """vLLM's head-major caches (key [P, H, D/x, S, x], value [P, H, D, S]) against the NHD store
    at N=256 on the cpu backend: 256 tokens at random rows, then at consecutive rows (a prefill)."""
    bf, n, (pages, rows, h, d, x) = torch.bfloat16, 256, (64, 16, 8, 128, 8)
    k, v = torch.randn(n, h, d, generator=g).to(bf), torch.randn(n, h, d, generator=g).to(bf)
    kc, vc = torch.zeros(pages, rows, h, d, dtype=bf), torch.zeros(pages, rows, h, d, dtype=bf)
    hk, hv = torch.zeros(pages, h, d // x, rows, x, dtype=bf), torch.zeros(pages, h, d, rows, dtype=bf)
    out = []
    for what, loc in (("random rows", torch.randperm(pages * rows, generator=g)[:n]), ("consecutive rows",
                                                                                       torch.arange(n))):
        out.append((f"store_kv_head_major N=256 {what}, cpu",
                    lambda loc=loc: kvwrite.store_kv_head_major(k, v, hk, hv, loc, backend="cpu"),
                    "store_kv N=256", lambda loc=loc: kvwrite.store_kv(k, v, kc, vc, loc, backend="cpu"), 4.0))
    return out


def main(min_time: float = 0.2) -> None:
    torch.set_num_threads(1)
    print("| call | µs | vs | µs | ratio | target |\n|---|---:|---|---:|---:|---:|")
    for what, fn, vs, base, target in cases():
        fn(), base()
        a, b = interleaved_us(fn, base, min_time)
        print(f"| {what} | {a:.2f} | {vs} | {b:.2f} | {a / b:.2f}x | <= {target}x {'met' if a / b <= target else 'NOT met'} |")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 0.2)
