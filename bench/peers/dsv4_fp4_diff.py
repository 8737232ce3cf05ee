"""DeepSeek V4 FP4 records against the engines' own code, on CPU (a `make peers` step, run in the
SGLang peer env with kvwrite on PYTHONPATH). One differential, one section per engine reference;
each counts the tokens whose record bytes are equal to the engine's, on finite inputs (the
measured claim) and separately on inputs with NaN / inf / fp32 subnormals (reported, not
asserted: kvwrite's special-value policy differs on purpose, see python/kvwrite/reference/dsv4_fp4.py),
for every kvwrite backend importable here (torch reference, Triton under the interpreter).

Sections:
  - nvfp4_v41 (288 B) vs SGLang 0.5.23's V4.1 FP4 oracle
    (`sglang.test.kernels.deepseek_v4.dsv41_kv_quant_reference.quantize_k_cache_v41_fp4`, pages
    256-byte aligned); SGLang's `dequantize_k_cache_v41_fp4` reads kvwrite's pages.
  - nvfp4_v41 (288 B) vs FlashInfer's torch reference `quantize_kv_dsv4_1_fp4` (FlashInfer
    tests/attention/sparse_mla_test_utils.py, "FlashMLA tests/quant.py trajectory"); its
    `dequantize_kv_dsv4_1_fp4` reads kvwrite's pages.
  - nvfp4 (384 B) vs FlashInfer PR #4955 (same file): its quantizer reference `_reference_rows`
    calls `flashinfer.nvfp4_kv_quantize`, a CUDA kernel (SM100+, `cvt.rn.satfinite.e2m1x2.f32`),
    and `nvfp4_quantize_pack_sparse_mla_cache` is an SM120 kernel: FlashInfer has no pure-torch
    NVFP4 quantizer, so the bytes cannot be compared on CPU (nor on the H200 lent to some tasks:
    SM90, no FlashInfer). What runs is its pure-torch decoder `_dequantize_nvfp4_cache`
    (`_split_cache` + `_dequantize_linear_nvfp4`) on kvwrite's pages: tokens whose 512 decoded
    values equal kvwrite's `dequant_dsv4_kv_fp4` (the layout and the value of every byte);
    tests/test_dsv4_fp4.py decodes the record by byte offsets besides.
  - mxfp4 (368 B) vs SGLang PR #37136 / PR #37138's codec for `--kv-cache-dtype fp4_e2m1`
    (`mxfp4_k_cache.py`: not in sglang 0.5.23; its public `quantize_dsv4_mxfp4_k_cache_into` runs
    the PyTorch reference `_quantize_mxfp4_reference` on CPU tensors, and its Triton kernel
    `_quantize_mxfp4_k_cache_into_kernel` runs under the interpreter, launched with the
    arguments its wrapper's CUDA branch passes: its quantised bytes on every input, its whole
    records on bf16 inputs, as the interpreter's own fp32/fp16 -> bf16 cast truncates the rope);
    its `dequantize_dsv4_mxfp4_k_cache_paged` reads kvwrite's pages (it reads the ue8m0 NaN byte
    0xFF as 2**128, kvwrite as NaN: special inputs only).
The engines' files are run from where they lie, never copied into this repo: FlashInfer's test
utils (`--flashinfer-utils`, env KVWRITE_FLASHINFER_TEST_UTILS) and SGLang's codec
(`--sglang-mxfp4`, env KVWRITE_SGLANG_MXFP4), by default under $KVWRITE_PEER_SRC (else $PEERS/src);
a section whose file is absent is skipped with a message. FlashInfer's file imports `flashinfer`
at the top: where FlashInfer is not installed an empty stand-in module satisfies the import (the
CUDA functions are never called; nothing of theirs is patched).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import types

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import kvwrite  # noqa: E402
from kvwrite.facts import FP4_RECORDS  # noqa: E402
from kvwrite.reference.dsv4_fp4 import regions  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
# kvwrite.kernels is installed from the repo's kernels/ (setup.py); with kvwrite on PYTHONPATH only,
# point the subpackage there so the Triton kernel runs too (interpreter).
kvwrite.__path__.append(ROOT)
from sglang.test.kernels.deepseek_v4 import dsv41_kv_quant_reference as sg  # noqa: E402

CASES = [(3, 64, torch.bfloat16), (4, 16, torch.float32), (2, 2, torch.float16), (5, 64, torch.bfloat16)]
FILL = 0xA5


def peer_src() -> str:
    src = os.environ.get("KVWRITE_PEER_SRC")
    if src:
        return src
    peers = os.environ.get("PEERS", ".peers")
    return os.path.join(peers if os.path.isabs(peers) else os.path.join(ROOT, peers), "src")


def load_module(name: str, path: str, stubs: tuple[str, ...] = ()) -> types.ModuleType:
    """The engine's file at `path` as module `name`; an absent package in `stubs` is replaced by an
    empty module for the import only."""
    for s in stubs:
        if s not in sys.modules and importlib.util.find_spec(s) is None:
            sys.modules[s] = types.ModuleType(s)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def inputs(seed: int, pages: int, pps: int, dtype: torch.dtype, special: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = pages * pps
    mag = torch.exp2(torch.randint(-24, 12, (n, 32, 1), generator=g).float())   # per 16-block scale
    k = (torch.randn(n, 32, 16, generator=g) * mag).reshape(n, 512)
    if special:
        pick = torch.randint(0, n * 512, (max(1, n // 2),), generator=g)
        vals = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -1e-42])
        k.view(-1)[pick] = vals[torch.randint(0, len(vals), pick.shape, generator=g)]
    return k.to(dtype)


def kv_pages(k: torch.Tensor, fmt: str, pps: int, backend: str) -> torch.Tensor:
    """kvwrite's pages `[pages, pps * token_bytes]` (filled with FILL first) of tokens `k` at locs
    0..n-1."""
    n = k.shape[0]
    cache = torch.full((n // pps, pps * FP4_RECORDS[fmt].token_bytes), FILL, dtype=torch.uint8)
    kvwrite.store_dsv4_kv_fp4(k, cache, torch.arange(n), fmt=fmt, backend=backend)
    return cache


def tokens_equal(a: torch.Tensor, b: torch.Tensor, fmt: str, pps: int, parts: int = 3) -> torch.Tensor:
    """bool `[n]`: token t's record bytes (packed values, scale slots with their pad, rope; the
    first `parts` of these) equal in the pages `a` and `b` of record `fmt`."""
    rec = FP4_RECORDS[fmt]
    same = None
    for x, y in list(zip(regions(a, pps, rec), regions(b, pps, rec)))[:parts]:
        eq = (x == y).all(-1)
        same = eq if same is None else same & eq
    return same.reshape(-1)


def reads_equal(theirs: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """bool `[n]`: the engine's decoder and kvwrite's give the same 512 values (NaN == NaN)."""
    return torch.isclose(theirs.float().reshape(-1, 512), mine.float().reshape(-1, 512),
                         rtol=0, atol=0, equal_nan=True).all(-1)


def count(mask: torch.Tensor) -> list[int]:
    return [int(mask.sum()), int(mask.numel())]


# --- sections: each returns {kvwrite backend: {"bytes_equal": [eq, n], ...}} for one input case ---

def v41_sglang(k, pages, pps, backends):
    ref = sg.quantize_k_cache_v41_fp4(k.view(pages, pps, 512))   # [pages, page_bytes] (256-aligned)
    raw = pps * sg.FP4_TOKEN_BYTES
    loc = torch.arange(pages * pps)
    out = {}
    for backend in backends:
        pages_kv = torch.full_like(ref, FILL)
        kvwrite.store_dsv4_kv_fp4(k, pages_kv[:, :raw], loc, fmt="nvfp4_v41", backend=backend)
        same = tokens_equal(pages_kv[:, :raw], ref[:, :raw], "nvfp4_v41", pps)
        back = sg.dequantize_k_cache_v41_fp4(pages_kv, pps)
        mine = kvwrite.dequant_dsv4_kv_fp4(pages_kv[:, :raw], loc, fmt="nvfp4_v41")
        out[backend] = dict(bytes_equal=count(same), engine_reads_kvwrite=count(reads_equal(back, mine.bfloat16())),
                            pad_untouched=bool((pages_kv[:, raw:] == FILL).all()))
    return out


def v41_flashinfer(fi, k, pages, pps, backends):
    ref = fi.quantize_kv_dsv4_1_fp4(k.view(pages, pps, 1, 512)).reshape(pages, -1)
    loc = torch.arange(pages * pps)
    out = {}
    for backend in backends:
        mine = kv_pages(k, "nvfp4_v41", pps, backend)
        back = fi.dequantize_kv_dsv4_1_fp4(mine.view(pages, pps, 1, 288))
        dq = kvwrite.dequant_dsv4_kv_fp4(mine, loc, fmt="nvfp4_v41")
        out[backend] = dict(bytes_equal=count(tokens_equal(mine, ref, "nvfp4_v41", pps)),
                            engine_reads_kvwrite=count(reads_equal(back, dq.bfloat16())))
    return out


def nvfp4_flashinfer(fi, k, pages, pps, backends):
    loc = torch.arange(pages * pps)
    out = {}
    for backend in backends:
        mine = kv_pages(k, "nvfp4", pps, backend)
        back = fi._dequantize_nvfp4_cache(mine.view(pages, pps, 1, 384))
        out[backend] = dict(engine_reads_kvwrite=count(reads_equal(
            back, kvwrite.dequant_dsv4_kv_fp4(mine, loc, fmt="nvfp4"))))
    return out


def sglang_mxfp4_triton(mx, k, cache, loc, pps):
    """SGLang's Triton quantize kernel (interpreter), launched as its wrapper's CUDA branch does."""
    k_nope, k_rope = mx._split_k(k)
    rows = mx._as_rows(cache, pps)
    loc = mx._validate_loc(loc, rows)
    packed_rows = rows[:, :mx.MXFP4_PACKED_NOPE_BYTES]
    scale_rows = rows[:, mx.MXFP4_PACKED_NOPE_BYTES:mx.MXFP4_PACKED_NOPE_BYTES + mx.MXFP4_SCALE_BYTES]
    rope_rows = rows[:, -mx.MXFP4_ROPE_BYTES:].view(torch.bfloat16)
    groups_per_program, num_warps = mx._quantize_launch_config(loc.numel())
    num_parts = -(-mx.MXFP4_NUM_GROUPS // groups_per_program)
    mx._quantize_mxfp4_k_cache_into_kernel[(loc.numel(), num_parts)](
        k_nope, k_rope, packed_rows, scale_rows, rope_rows, loc, rows.shape[0],
        k_nope.stride(0), k_rope.stride(0), packed_rows.stride(0), scale_rows.stride(0),
        rope_rows.stride(0), NUM_GROUPS=mx.MXFP4_NUM_GROUPS, GROUP_SIZE=mx.MXFP4_GROUP_SIZE,
        GROUPS_PER_PROGRAM=groups_per_program, ROPE_DIM=mx.MXFP4_ROPE_DIM, num_warps=num_warps)


def mxfp4_sglang(mx, k, pages, pps, backends, engine_paths):
    n = pages * pps
    loc = torch.arange(n)
    refs = {}
    for path in engine_paths:
        ref = torch.full((pages, pps * mx.MXFP4_BYTES_PER_TOKEN), FILL, dtype=torch.uint8)
        if path == "torch":
            mx.quantize_dsv4_mxfp4_k_cache_into(k, ref, loc, pps)   # CPU tensors: its PyTorch reference
        else:
            sglang_mxfp4_triton(mx, k, ref, loc, pps)
        refs[path] = ref
    out = {}
    for backend in backends:
        mine = kv_pages(k, "mxfp4", pps, backend)
        back = mx.dequantize_dsv4_mxfp4_k_cache_paged(mine, loc, pps)
        dq = kvwrite.dequant_dsv4_kv_fp4(mine, loc, fmt="mxfp4")
        r = {f"bytes_equal_{p}": count(tokens_equal(mine, ref, "mxfp4", pps)) for p, ref in refs.items()}
        if "triton" in refs:   # the interpreter truncates fp32/fp16 -> bf16: whole records on bf16 inputs only
            r["quant_bytes_equal_triton"] = count(tokens_equal(mine, refs["triton"], "mxfp4", pps, parts=2))
            if k.dtype != torch.bfloat16:
                r["bytes_equal_triton"] = [0, 0]
        out[backend] = dict(r, engine_reads_kvwrite=count(reads_equal(back, dq.bfloat16())))
    return out


def scale_edge_inputs(ulps: int = 16) -> torch.Tensor:
    """fp32 tokens `[n, 512]` whose first NoPE block's amax sweeps +-`ulps` fp32 ulps around
    6 * sqrt(2) * 2**e (where round(log2(amax / 6)) steps; e = -30, -27, .., 27); the other values
    below 0.9 amax; rope bf16-exact."""
    g = torch.Generator().manual_seed(7)
    amax = torch.cat([(torch.tensor(6 * 2 ** 0.5 * 2.0 ** e).view(torch.int32)
                       + torch.arange(-ulps, ulps + 1, dtype=torch.int32)).view(torch.float32)
                      for e in range(-30, 30, 3)])
    k = torch.rand(amax.numel(), 512, generator=g) * 0.9 * amax[:, None]
    k[:, 0] = amax
    k[:, 448:] = torch.randn(amax.numel(), 64, generator=g).bfloat16().float()
    return k


def run_section(name, fn, backends, quick):
    runs = []
    for special in (False, True):
        for seed, (pages, pps, dtype) in enumerate(CASES[:2] if quick else CASES):
            k = inputs(seed, pages, pps, dtype, special)
            r = fn(k, pages, pps)
            runs.append(dict(seed=seed, pages=pages, page_size=pps, dtype=str(dtype)[6:], special=special, **r))
            for b in backends:
                figs = ", ".join(f"{key} {v[0]}/{v[1]}" for key, v in r[b].items() if isinstance(v, list))
                print(f"{name} {'special' if special else 'finite '} {str(dtype)[6:]:8s} pps={pps:3d} {b:6s}: {figs}")
    total = {}
    for special in (False, True):
        part = {}
        for b in backends:
            keys = [key for key, v in runs[0][b].items() if isinstance(v, list)]
            part[b] = {key: [sum(r[b][key][i] for r in runs if r["special"] == special) for i in (0, 1)] for key in keys}
        total["special" if special else "finite"] = part
    print(f"{name}, finite inputs:", json.dumps(total["finite"]))
    return runs, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--flashinfer-utils", default=os.environ.get("KVWRITE_FLASHINFER_TEST_UTILS") or os.path.join(
        peer_src(), "flashinfer_tests", "tests", "attention", "sparse_mla_test_utils.py"))
    ap.add_argument("--sglang-mxfp4", default=os.environ.get("KVWRITE_SGLANG_MXFP4") or os.path.join(
        peer_src(), "sglang_mxfp4", "sglang_mxfp4_k_cache.py"))
    ap.add_argument("--quick", action="store_true", help="the first two input cases only")
    args = ap.parse_args()
    backends = [b for b, why in kvwrite.backends("cpu").items() if why is None]   # torch, triton where importable
    sections = []

    def add(name, fmt, engine, fn, note, compared="bytes"):
        runs, total = run_section(name, fn, backends, args.quick)
        sections.append(dict(name=name, fmt=fmt, engine=engine, compared=compared, note=note, runs=runs, **total))

    add("v41_fp4_sglang", "nvfp4_v41", "sglang 0.5.23 dsv41_kv_quant_reference.quantize_k_cache_v41_fp4",
        lambda k, p, s: v41_sglang(k, p, s, backends), "SGLang's V4.1 FP4 oracle; its decoder reads kvwrite's pages")

    if os.path.isfile(args.flashinfer_utils):
        fi = load_module("flashinfer_sparse_mla_test_utils", args.flashinfer_utils, stubs=("flashinfer",))
        add("v41_fp4_flashinfer", "nvfp4_v41", "flashinfer tests/attention/sparse_mla_test_utils.py quantize_kv_dsv4_1_fp4",
            lambda k, p, s: v41_flashinfer(fi, k, p, s, backends),
            "FlashInfer's torch V4.1 FP4 pack (FlashMLA trajectory); its decoder reads kvwrite's pages")
        add("nvfp4_flashinfer", "nvfp4", "flashinfer tests/attention/sparse_mla_test_utils.py _dequantize_nvfp4_cache",
            lambda k, p, s: nvfp4_flashinfer(fi, k, p, s, backends),
            "bytes not comparable on CPU: FlashInfer's NVFP4 quantizer reference (_reference_rows) calls "
            "flashinfer.nvfp4_kv_quantize, a CUDA kernel (SM100+), and nvfp4_quantize_pack_sparse_mla_cache is "
            "SM120-only; its pure-torch decoder reads kvwrite's pages instead", compared="decoder")
    else:
        print(f"skipped FlashInfer sections: {args.flashinfer_utils} not found (flashinfer-ai/flashinfer "
              "tests/attention/sparse_mla_test_utils.py; --flashinfer-utils or KVWRITE_FLASHINFER_TEST_UTILS)")
        sections.append(dict(name="flashinfer", skipped=f"{args.flashinfer_utils} not found"))

    if os.path.isfile(args.sglang_mxfp4):
        mx = load_module("sglang_mxfp4_k_cache", args.sglang_mxfp4)
        paths = ["torch"] + (["triton"] if "triton" in backends else [])
        add("mxfp4_sglang", "mxfp4", "SGLang PR #37136 / PR #37138 mxfp4_k_cache.py (torch reference, Triton kernel)",
            lambda k, p, s: mxfp4_sglang(mx, k, p, s, backends, paths),
            "bytes_equal_torch: whole records against SGLang's PyTorch reference; against its Triton kernel "
            "(interpreter): quant_bytes_equal_triton, the 224 packed + 16 scale-slot bytes, every input, and "
            "bytes_equal_triton, whole records, bf16 inputs only (the interpreter's own fp32/fp16 -> bf16 cast "
            "truncates: its rope bytes there are the input's truncated bits)")
        k = scale_edge_inputs()
        r = mxfp4_sglang(mx, k, k.shape[0], 1, backends, paths)
        print("mxfp4_sglang scale edges (fp32, amax within 16 ulps of 6*sqrt(2)*2**e):",
              json.dumps({b: {key: v for key, v in r[b].items() if v[1]} for b in backends}))
        sections.append(dict(name="mxfp4_sglang_scale_edges", fmt="mxfp4", engine=sections[-1]["engine"],
                             compared="bytes", note=(
                                 "fp32 inputs whose block amax lies within 16 ulps of 6*sqrt(2)*2**e: kvwrite "
                                 "rounds log2(amax / 6) exactly (from amax's bits), SGLang in fp32 "
                                 "(torch.log2(amax) - 2.584962500721156, then round) in its PyTorch reference, which "
                                 "moves the step by a few ulps: the scale byte (and so the codes) differ by one there, "
                                 "while its Triton kernel (interpreter) steps where kvwrite does; intended, "
                                 "reported, not asserted (bf16 / fp16 inputs cannot come that close)"),
                             special={}, finite={b: {key: v for key, v in r[b].items() if v[1]} for b in backends}))
    else:
        print(f"skipped SGLang MXFP4 section: {args.sglang_mxfp4} not found (sgl-project/sglang PR #37136 "
              "python/sglang/srt/layers/attention/dsv4/mxfp4_k_cache.py; --sglang-mxfp4 or KVWRITE_SGLANG_MXFP4)")
        sections.append(dict(name="mxfp4_sglang", skipped=f"{args.sglang_mxfp4} not found"))

    if args.json:
        v41 = sections[0]
        with open(args.json, "w") as f:
            json.dump(dict(step="dsv4_fp4_diff", engine=v41["engine"], runs=v41["runs"],
                           finite_bytes_equal={b: v["bytes_equal"] for b, v in v41["finite"].items()},
                           sections=sections), f, indent=1)


if __name__ == "__main__":
    main()
