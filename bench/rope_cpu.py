"""The fused RoPE stores on the cpu backend, thread CPU time (steadier than wall time on a shared
machine), one torch thread: rope_store_kv on a Llama-3.1-8B layer (32 q + 8 KV heads x 128, neox),
the same with q / k RMS norms (Qwen3-like), and rope_store_mla on a DeepSeek layer (16 q heads,
R = 64, GPT-J). Positions 0..N-1 (a prefill), random unique rows of a pool 4x the tokens.

    python bench/rope_cpu.py [N]
"""
from __future__ import annotations

import sys

import torch

import kvwrite
from quant_cpu import median_us  # bench/quant_cpu.py: the thread-clock median of a call


def cos_sin(positions: int, rotary_dim: int) -> torch.Tensor:
    """A rotary table (cos half, sin half) of real angles: q, rotated in place by every call, keeps
    its norm (random cos / sin would take it to inf or the subnormals within a few calls)."""
    inv_freq = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    ang = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([ang.cos(), ang.sin()], 1)


def main() -> None:
    torch.set_num_threads(1)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    g = torch.Generator().manual_seed(0)
    pos, loc = torch.arange(n), torch.randperm(4 * n, generator=g)[:n]
    page, pages = 16, max(4 * n // 16, 1)
    bf16 = dict(dtype=torch.bfloat16)
    q, k, v = (torch.randn(n, h, 128, generator=g).to(**bf16) for h in (32, 8, 8))
    kc, vc = (torch.zeros(pages, page, 8, 128, **bf16) for _ in range(2))
    cs = cos_sin(8192, 128)
    qw, kw = (torch.rand(128, generator=g) + 0.5 for _ in range(2))
    print(f"rope_store_kv  N={n} Llama (32 q + 8 KV heads x 128, neox)   "
          f"{median_us(lambda: kvwrite.rope_store_kv(pos, q, k, v, cs, kc, vc, loc, backend='cpu')):9.1f} us")
    print(f"rope_store_kv  N={n} the same with q / k RMS norms          "
          f"{median_us(lambda: kvwrite.rope_store_kv(pos, q, k, v, cs, kc, vc, loc, q_norm_weight=qw, k_norm_weight=kw, backend='cpu')):9.1f} us")
    q_pe, kv_c, k_pe = (torch.randn(*s, generator=g).to(**bf16) for s in ((n, 16, 64), (n, 512), (n, 64)))
    cache = torch.zeros(pages, page, 576, **bf16)
    cs64 = cos_sin(8192, 64)
    print(f"rope_store_mla N={n} DeepSeek (16 q heads, R = 64, GPT-J)   "
          f"{median_us(lambda: kvwrite.rope_store_mla(pos, q_pe, kv_c, k_pe, cs64, cache, loc, backend='cpu')):9.1f} us")


if __name__ == "__main__":
    main()
