"""The cpu backend's vectorised conversions (csrc/kvwrite/simd_x86.h) against the torch
reference: every 16-bit input pattern (bf16 and fp16: NaNs, infs, subnormals, both zeros, every
exponent), head widths that leave a scalar tail, and scales that put the grid anywhere (tiny,
subnormal, huge). Canaries around the pool."""
from __future__ import annotations

import pytest
import torch

import kvwrite
from conftest import KERNEL_BACKENDS
from helpers import CanaryBuffer, assert_same_bytes

pytestmark = pytest.mark.skipif("cpu" not in KERNEL_BACKENDS, reason="the cpu backend is not built here")

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)


def every_pattern(dtype: torch.dtype, heads: int, dim: int) -> torch.Tensor:
    """All 65536 bit patterns of a 16-bit float type as [n, heads, dim] (the last token padded
    with the first patterns again)."""
    per_token = heads * dim
    n = -(-65536 // per_token)
    bits = torch.arange(n * per_token, dtype=torch.int32) % 65536
    return bits.to(torch.int16).view(dtype).reshape(n, heads, dim)


def run(call, specs: dict) -> None:
    pool = CanaryBuffer(specs)
    ref, original = pool.clone(), pool.raw.clone()
    call(pool, "cpu")
    call(ref, "torch")
    assert_same_bytes(pool, ref, original)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache", FP8)
@pytest.mark.parametrize("dim", [128, 40])   # 40: one 32-wide block and an 8-element tail
def test_store_kv_fp8_every_pattern(dtype, cache, dim):
    heads = 4
    k = every_pattern(dtype, heads, dim)
    v = k.flip(0)
    n = k.shape[0]
    loc = torch.randperm(n + 8, generator=torch.Generator().manual_seed(1))[:n]
    shape = (-(-(n + 8) // 16), 16, heads, dim)
    # per-head scales: ordinary, tiny, an fp32 subnormal, huge
    ks = torch.tensor([0.37, 1e-30, 3e-39, 1e30])
    vs = torch.tensor(1.0)

    def call(p, b):
        kvwrite.store_kv(k, v, p["k"], p["v"], loc, k_scale=ks, v_scale=vs, backend=b)

    run(call, {"k": (shape, cache), "v": (shape, cache)})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("rule", ["rne", "vllm"])
def test_store_kv_dynamic_every_pattern(dtype, cache, per_head, rule):
    heads, dim = 4, 72   # 72: two 32-wide blocks and an 8-element tail
    k = every_pattern(dtype, heads, dim)
    # the dynamic scale comes from the row's finite amax: spread the magnitudes per token
    v = (k.float() * torch.logspace(-3, 3, k.shape[0])[:, None, None]).to(dtype)
    n = k.shape[0]
    loc = torch.randperm(n + 8, generator=torch.Generator().manual_seed(2))[:n]
    pages = -(-(n + 8) // 16)
    shape = (pages, 16, heads, dim)
    sshape = (pages, 16, heads) if per_head else (pages, 16)

    def call(p, b):
        kvwrite.store_kv(k, v, p["k"], p["v"], loc, k_scale_cache=p["ks"], v_scale_cache=p["vs"],
                         quant_rule=rule, backend=b)

    run(call, {"k": (shape, cache), "v": (shape, cache), "ks": (sshape, torch.float32),
               "vs": (sshape, torch.float32)})
