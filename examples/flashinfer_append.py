"""FlashInfer's append_paged_kv_cache through kvwrite: the same call, the same bytes, plus a
bounds check. Runs on CPU (the cpu/torch backends) or CUDA.

    python examples/flashinfer_append.py
"""
import torch

import kvwrite
from kvwrite.compat import flashinfer

device = "cuda" if torch.cuda.is_available() else "cpu"
page_size, num_pages, heads, head_dim = 16, 64, 4, 64
# One [P, 2, page_size, H, D] tensor (NHD), as FlashInfer allocates it.
paged_kv_cache = torch.zeros(num_pages, 2, page_size, heads, head_dim, dtype=torch.bfloat16, device=device)

# Three requests appending 45, 8 and 25 tokens (prefill) onto pages 0..6.
append_len = torch.tensor([45, 8, 25], dtype=torch.int32, device=device)
append_indptr = torch.cat([torch.zeros(1, dtype=torch.int32, device=device), append_len.cumsum(0).int()])
pages_per_req = torch.tensor([3, 1, 2], dtype=torch.int32, device=device)
kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int32, device=device), pages_per_req.cumsum(0).int()])
kv_indices = torch.arange(6, dtype=torch.int32, device=device)
kv_last_page_len = torch.tensor([13, 8, 9], dtype=torch.int32, device=device)
nnz = int(append_indptr[-1])
k = torch.randn(nnz, heads, head_dim, dtype=torch.bfloat16, device=device)
v = torch.randn(nnz, heads, head_dim, dtype=torch.bfloat16, device=device)

seq_lens = flashinfer.get_seq_lens(kv_indptr, kv_last_page_len, page_size)
batch_indices, positions = flashinfer.get_batch_indices_positions(append_indptr, seq_lens, nnz)
flashinfer.append_paged_kv_cache(k, v, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                                 kv_last_page_len, check="guard")
kvwrite.default_errors(device).raise_if_any()

# Read token 50 (request 1, position 5) back with a plain gather: page kv_indices[3 + 5 // 16] = 3, row 5.
assert torch.equal(paged_kv_cache[3, 0, 5], k[50]) and torch.equal(paged_kv_cache[3, 1, 5], v[50])
print("bytes match: token 50 (request 1, position 5) is at page 3, row 5")

# A page table naming a page the pool does not have: guard mode skips it and says exactly where.
bad_indices = kv_indices.clone()
bad_indices[4] = num_pages + 3
errors = kvwrite.ErrorBuffer(device)
flashinfer.append_paged_kv_cache(k, v, batch_indices, positions, paged_kv_cache, bad_indices, kv_indptr,
                                 kv_last_page_len, check="guard", errors=errors)
try:
    errors.raise_if_any()
except kvwrite.OutOfBoundsWrite as err:
    print(f"{type(err).__name__}: {err}")
