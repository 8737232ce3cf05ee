"""vLLM's cache writes through kvwrite: the same calls, the same bytes, plus a bounds check.
Runs on CPU (the cpu/torch backends) or CUDA.

    python examples/vllm_store.py
"""
import torch

import kvwrite
from kvwrite.compat import vllm

device = "cuda" if torch.cuda.is_available() else "cpu"
num_blocks, block_size, heads, head_dim = 32, 16, 4, 64
# vLLM's flash layout, fp8: one uint8 [num_blocks, 2, block_size, H, D] buffer, K and V as views.
kv_cache = torch.zeros(num_blocks, 2, block_size, heads, head_dim, dtype=torch.uint8, device=device)
key_cache, value_cache = kv_cache[:, 0], kv_cache[:, 1]
k_scale = torch.tensor([0.5], device=device)
v_scale = torch.tensor([0.25], device=device)

n = 20
key = torch.randn(n, heads, head_dim, dtype=torch.bfloat16, device=device)
value = torch.randn(n, heads, head_dim, dtype=torch.bfloat16, device=device)
slot_mapping = torch.randperm(num_blocks * block_size, device=device)[:n]
slot_mapping[3] = -1  # padding: skipped
vllm.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, "fp8", k_scale, v_scale,
                             check="guard")
kvwrite.default_errors(device).raise_if_any()

# Read token 0 back with a plain gather: block slot // block_size, offset slot % block_size.
s = int(slot_mapping[0])
stored = key_cache[s // block_size, s % block_size].view(torch.float8_e4m3fn)
expect = (key[0].float() / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn)
assert torch.equal(stored.view(torch.uint8), expect.view(torch.uint8))
print(f"bytes match: token 0 (slot {s}) is at block {s // block_size}, offset {s % block_size}")

# A slot_mapping encoded with the wrong block size (vLLM #47056): guard skips it and says where.
bad = slot_mapping.clone()
bad[7] = num_blocks * block_size + 40
errors = kvwrite.ErrorBuffer(device)
vllm.reshape_and_cache_flash(key, value, key_cache, value_cache, bad, "fp8", k_scale, v_scale,
                             check="guard", errors=errors)
try:
    errors.raise_if_any()
except kvwrite.OutOfBoundsWrite as err:
    print(f"{type(err).__name__}: {err}")
