"""Assert-mode builds (`debug=True`) turn on Triton's int32 overflow checks on a GPU. The
interpreter skips them unless its builder runs with debug options: these tests run the kernels'
debug build on the CPU that way, so a bit trick that overflows on valid input fails here."""
from __future__ import annotations

import os

import pytest
import torch

import kvwrite
from conftest import DEVICE
from helpers import CanaryBuffer, assert_same_bytes
from kvwrite.kernels.store_mla import _bf16_bits
from kvwrite.reference.quant import bf16_bits
import triton  # noqa: E402  (after conftest set TRITON_INTERPRET)
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the debug build under the Triton interpreter")

# fp32 bit patterns: positive NaNs past 0x7FFF8000 (the old rounding overflowed there), the
# negative ones, quiet/signalling NaN, +-inf, max, rounding ties and carries, subnormals.
PATTERNS = [0x7FFFFFFF, 0x7FFF8000, 0x7FFFC000, 0x7FFF7FFF, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,
            0xFFFF8000, 0xFF800001, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F808000,
            0x3F818000, 0x3F80FFFF, 0xBF808000, 0x00000001, 0x80008000, 0x00000000, 0x80000000,
            0x7F7F8000, 0x4049_0FDB]


@triton.jit
def bits(x_ptr, out_ptr, n, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(out_ptr + i, _bf16_bits(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


@pytest.fixture
def debug_interpreter():
    """The interpreter builder with debug options: int32 overflow checks become asserts."""
    import triton.runtime.interpreter as interp

    saved = interp.interpreter_builder.options
    interp.interpreter_builder.options = interp.InterpreterOptions(debug=True)
    try:
        yield
    finally:
        interp.interpreter_builder.options = saved


def _patterns(n_random: int = 4096) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    rnd = torch.randint(-2 ** 31, 2 ** 31, (n_random,), generator=gen, dtype=torch.int64)
    fixed = torch.tensor(PATTERNS, dtype=torch.int64)
    bits = torch.cat([fixed, rnd])
    return torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(torch.float32)


def test_debug_interpreter_catches_an_int32_overflow(debug_interpreter):
    import triton
    import triton.language as tl

    @triton.jit
    def add(x_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(x_ptr + i, tl.load(x_ptr + i) + 0x7FFF)

    with pytest.raises(Exception, match="overflow"):
        add[(1,)](torch.full((2,), 2 ** 31 - 10, dtype=torch.int32), 2)


def test_bf16_bits_rounds_like_torch_without_overflow(debug_interpreter):
    import triton

    x = _patterns()
    out = torch.zeros(x.shape[0], dtype=torch.int32)
    bits[(triton.cdiv(x.shape[0], 1024),)](x, out, x.shape[0], 1024)
    want = x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF  # RNE
    want = torch.where(torch.isnan(x), 0x7FC0, want)  # every NaN -> the one quiet NaN
    assert torch.equal(out, want)
    assert torch.equal(out, bf16_bits(x).view(torch.int16).to(torch.int32) & 0xFFFF)  # the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ds_mla_assert_build_takes_every_nan_payload(debug_interpreter, dtype):
    from kvwrite.ops.mla import ds_mla_row_bytes

    n, L, R = 4, 128, 8
    gen = torch.Generator().manual_seed(1)
    kv_c = torch.randn(n, L, generator=gen).to(dtype)
    k_pe = _patterns(0).repeat(2)[: n * R].reshape(n, R)
    if dtype == torch.float32:
        kv_c[0, :4] = k_pe[0, :4]   # NaN payloads in the quantised part too
    k_pe = k_pe.to(dtype)
    row = ds_mla_row_bytes(L, R)
    pool = CanaryBuffer({"c": ((2, 4, row), torch.uint8)})
    ref, original = pool.clone(), pool.raw.clone()
    loc = torch.tensor([5, 0, 7, 2], device=DEVICE)
    for p, backend in ((pool, "triton"), (ref, "torch")):
        kvwrite.store_mla(kv_c.to(DEVICE), k_pe.to(DEVICE), p["c"], loc, kv_cache_dtype="fp8_ds_mla",
                          check="assert", backend=backend)
    assert_same_bytes(pool, ref, original)


def test_dsv4_assert_build_takes_every_nan_payload(debug_interpreter):
    from kvwrite.ops.dsv4 import kv_page_bytes

    pps = 4
    kv = torch.randn(3, 512, generator=torch.Generator().manual_seed(2)) * 3
    kv[:, 448:] = _patterns(0).repeat(9)[: 3 * 64].reshape(3, 64)
    pool = CanaryBuffer({"cache": ((3, kv_page_bytes(pps)), torch.uint8)}, 11)
    ref, original = pool.clone(), pool.raw.clone()
    loc = torch.tensor([9, -1, 2], device=DEVICE)
    for p, backend in ((pool, "triton"), (ref, "torch")):
        kvwrite.store_dsv4_kv(kv.to(DEVICE), p["cache"], loc, page_size=pps, check="assert",
                              backend=backend)
    assert_same_bytes(pool, ref, original)
