"""The cpu backend under each forced SIMD level (KVWRITE_CPU_SIMD = 0 / avx2 / avx512, read once
per process, so each in its own subprocess): the exhaustive lane tests (test_cpu_simd.py) and the
cpu-vs-reference comparisons of the quantised formats (fp8 static / int8 / dynamic, fp8_ds_mla,
NVFP4, DeepSeek V4 nvfp4 / mxfp4 / v4.1 records, the fused RoPE stores), every byte against the
torch reference with canaries. The SIMD levels run with every call streaming its rows
(KVWRITE_CPU_STREAM_BYTES=0, csrc/kvwrite/stream.h: the test pools are far below the default
footprint, so the main suite runs the plain stores). A level this CPU lacks falls back to the best
it has (still a valid run of the store)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import KERNEL_BACKENDS

pytestmark = pytest.mark.skipif("cpu" not in KERNEL_BACKENDS, reason="the cpu backend is not built here")

HERE = Path(__file__).parent
FILES = ["test_cpu_simd.py", "test_dsv4_fp4.py", "test_mla.py", "test_dynamic_quant.py", "test_nvfp4.py",
         "test_store_kv.py", "test_rope.py"]
SELECT = "test_cpu_simd.py or (cpu and (matches_reference or special or reference or unfused))"


@pytest.mark.parametrize("level,stream", [("0", "-1"), ("avx2", "0"), ("avx512", "0")])
def test_quantised_stores_match_reference_at_level(level, stream):
    env = dict(os.environ, KVWRITE_CPU_SIMD=level, KVWRITE_CPU_STREAM_BYTES=stream, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          *FILES, "-k", SELECT], cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    assert " passed" in out.stdout and "failed" not in out.stdout, tail


def test_stream_footprint_follows_env():
    """KVWRITE_CPU_STREAM_BYTES (read once per process) is the footprint from which K/V stores
    stream (csrc/kvwrite/stream.h); unset, a quarter of the last-level cache on x86."""
    code = ("import torch\nfrom kvwrite import _ext\nassert _ext.unavailable_reason('cpu') is None\n"
            "print(torch.ops.kvwrite_ext.cpu_stream_bytes())")
    got = {}
    for value in ("12345", "-1", None):
        env = {k: v for k, v in os.environ.items() if k != "KVWRITE_CPU_STREAM_BYTES"}
        if value is not None:
            env["KVWRITE_CPU_STREAM_BYTES"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-2000:]
        got[value] = int(out.stdout.split()[-1])
    assert got["12345"] == 12345 and got["-1"] == -1
    import platform
    if platform.machine() in ("x86_64", "AMD64"):
        assert got[None] >= 1 << 18, got  # a quarter of an LLC of at least 1 MiB
