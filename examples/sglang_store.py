"""SGLang's pool stores through kvwrite: the same buffers, the same bytes, plus a bounds check.
Runs on CPU (the cpu/torch backends) or CUDA.

    python examples/sglang_store.py
"""
import torch

import kvwrite
from kvwrite.compat import sglang

device = "cuda" if torch.cuda.is_available() else "cpu"
page_size, size, heads, head_dim = 16, 256, 4, 64
# MHATokenToKVPool, fp8 e4m3 stored as uint8: one [size + page_size, H, D] buffer per layer and
# side; page 0 (rows 0..15) is the padding page.
k_buffer = torch.zeros(size + page_size, heads, head_dim, dtype=torch.uint8, device=device)
v_buffer = torch.zeros_like(k_buffer)

n = 10
cache_k = torch.randn(n, heads, head_dim, dtype=torch.bfloat16, device=device)
cache_v = torch.randn(n, heads, head_dim, dtype=torch.bfloat16, device=device)
loc = torch.arange(page_size, page_size + n, device=device)  # the allocator's first real page
sglang.set_kv_buffer(k_buffer, v_buffer, loc, cache_k, cache_v, page_size, dtype=torch.float8_e4m3fn,
                     check="guard")
kvwrite.default_errors(device).raise_if_any()
expect = cache_k[0].float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
assert torch.equal(k_buffer[page_size], expect)
print(f"bytes match: token 0 is row {page_size} (page 1, the first after the padding page)")

# The SGLang #33348 scenario: a draft pool sized per rank while its allocator pages page_size * dcp_size
# locs hands out a loc past the buffer. Guard mode skips it and names token, loc and page.
bad = loc.clone()
bad[4] = size + page_size + 9
errors = kvwrite.ErrorBuffer(device)
sglang.set_kv_buffer(k_buffer, v_buffer, bad, cache_k, cache_v, page_size, dtype=torch.float8_e4m3fn,
                     check="guard", errors=errors)
try:
    errors.raise_if_any()
except kvwrite.OutOfBoundsWrite as err:
    print(f"{type(err).__name__}: {err}")
