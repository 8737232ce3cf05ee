"""The cpu backend under each forced SIMD level (KVWRITE_CPU_SIMD = 0 / avx2 / avx512, read once
per process, so each in its own subprocess): the exhaustive lane tests (test_cpu_simd.py) and the
cpu-vs-reference comparisons of the quantised formats (fp8 / int8 dynamic, fp8_ds_mla, NVFP4,
DeepSeek V4 nvfp4 / mxfp4 / v4.1 records), every byte against the torch reference with canaries.
A level this CPU lacks falls back to the best it has (still a valid run of the store)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import KERNEL_BACKENDS

pytestmark = pytest.mark.skipif("cpu" not in KERNEL_BACKENDS, reason="the cpu backend is not built here")

HERE = Path(__file__).parent
FILES = ["test_cpu_simd.py", "test_dsv4_fp4.py", "test_mla.py", "test_dynamic_quant.py", "test_nvfp4.py"]
SELECT = "test_cpu_simd.py or (cpu and (matches_reference or special or reference))"


@pytest.mark.parametrize("level", ["0", "avx2", "avx512"])
def test_quantised_stores_match_reference_at_level(level):
    env = dict(os.environ, KVWRITE_CPU_SIMD=level, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          *FILES, "-k", SELECT], cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    assert " passed" in out.stdout and "failed" not in out.stdout, tail
