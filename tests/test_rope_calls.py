"""The cpu backend's per-thread cos/sin row is keyed by a call id unique across every rope op:
the first rope_store_kv and the first rope_store_mla of a process, at the same position with
different cos/sin caches, each rotate by their own cache (a counter per kernel instantiation
gave both id 1, and the second call reused the first one's row)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import KERNEL_BACKENDS

SCRIPT = textwrap.dedent("""
    import torch, kvwrite
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([3])
    out = {}
    for b in ("cpu", "torch"):
        cs_kv = torch.rand(8, 32, generator=torch.Generator().manual_seed(1))
        cs_mla = torch.rand(8, 32, generator=torch.Generator().manual_seed(2))
        q, k, v = (torch.randn(1, 1, 32, generator=torch.Generator().manual_seed(3)).bfloat16() for _ in range(3))
        kc, vc = torch.zeros(2, 1, 1, 32, dtype=torch.bfloat16), torch.zeros(2, 1, 1, 32, dtype=torch.bfloat16)
        kvwrite.rope_store_kv(pos, q, k, v, cs_kv, kc, vc, torch.tensor([1]), backend=b)
        q_pe = torch.randn(1, 1, 32, generator=torch.Generator().manual_seed(4)).bfloat16()
        kv_c, k_pe = (torch.randn(1, w, generator=torch.Generator().manual_seed(w)).bfloat16() for w in (64, 32))
        cache = torch.zeros(2, 1, 96, dtype=torch.bfloat16)
        kvwrite.rope_store_mla(pos, q_pe, kv_c, k_pe, cs_mla, cache, torch.tensor([1]), backend=b)
        out[b] = (q, kc, q_pe, cache)
    for a, r in zip(out["cpu"], out["torch"]):
        assert torch.equal(a.view(torch.int16), r.view(torch.int16)), (a, r)
    print("ok")
""")


@pytest.mark.skipif("cpu" not in KERNEL_BACKENDS, reason="the cpu backend is not built here")
def test_first_calls_of_two_rope_ops_use_their_own_cos_sin():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
