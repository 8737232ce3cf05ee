"""DeepSeek V4 FP4 records against the engines' own code, on CPU (a `make peers` step, run in the
SGLang peer env with kvwrite on PYTHONPATH): SGLang 0.5.23's V4.1 FP4 oracle
(`sglang.test.kernels.deepseek_v4.dsv41_kv_quant_reference.quantize_k_cache_v41_fp4`, the
288-byte V41_FP4 page, 256-byte aligned) against `store_dsv4_kv_fp4(fmt="nvfp4_v41")` on the
torch reference and the Triton kernel (interpreter); SGLang's `dequantize_k_cache_v41_fp4` reads
kvwrite's pages. Counts tokens whose bytes are equal, on finite inputs (the measured claim) and
separately on inputs with NaN / inf / fp32 subnormals (kvwrite's special-value policy differs
on purpose: a NaN or inf makes SGLang's whole tile NaN, kvwrite saturates inf and keeps the
other values' scale). The 384-byte nvfp4 and 368-byte mxfp4 records have no CPU-runnable engine
code in these envs: tests/test_dsv4_fp4.py decodes them by the engines' byte layouts instead.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import kvwrite  # noqa: E402

# kvwrite.kernels is installed from the repo's kernels/ (setup.py); with kvwrite on PYTHONPATH only,
# point the subpackage there so the Triton kernel runs too (interpreter).
kvwrite.__path__.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from sglang.test.kernels.deepseek_v4 import dsv41_kv_quant_reference as sg  # noqa: E402


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


def one(seed: int, pages: int, pps: int, dtype: torch.dtype, special: bool, backends: list[str]) -> dict:
    k = inputs(seed, pages, pps, dtype, special)
    ref = sg.quantize_k_cache_v41_fp4(k.view(pages, pps, 512))   # [pages, page_bytes] (256-aligned)
    raw = pps * sg.FP4_TOKEN_BYTES
    out = {}
    loc = torch.arange(pages * pps)
    for backend in backends:
        pages_kv = torch.full_like(ref, 0xA5)
        kvwrite.store_dsv4_kv_fp4(k, pages_kv[:, :raw], loc, fmt="nvfp4_v41", backend=backend)
        data = pages_kv[:, :pps * 256].reshape(pages, pps, 256)
        scale = pages_kv[:, pps * 256:raw].reshape(pages, pps, 32)
        rdata = ref[:, :pps * 256].reshape(pages, pps, 256)
        rscale = ref[:, pps * 256:raw].reshape(pages, pps, 32)
        same = ((data == rdata).all(-1) & (scale == rscale).all(-1)).reshape(-1)
        back = sg.dequantize_k_cache_v41_fp4(pages_kv, pps).float().reshape(-1, 512)
        mine = kvwrite.dequant_dsv4_kv_fp4(pages_kv[:, :raw], loc, fmt="nvfp4_v41")
        read_same = (torch.isclose(back, mine.bfloat16().float(), equal_nan=True)).all(-1)
        out[backend] = dict(tokens=int(same.numel()), bytes_equal=int(same.sum()),
                            sglang_reads_kvwrite=int(read_same.sum()),
                            pad_untouched=bool((pages_kv[:, raw:] == 0xA5).all()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json")
    args = ap.parse_args()
    backends = [b for b, why in kvwrite.backends("cpu").items() if why is None]   # torch, triton where importable
    runs = []
    for special in (False, True):
        for seed, (pages, pps, dtype) in enumerate([(3, 64, torch.bfloat16), (4, 16, torch.float32),
                                                     (2, 2, torch.float16), (5, 64, torch.bfloat16)]):
            r = one(seed, pages, pps, dtype, special, backends)
            runs.append(dict(seed=seed, pages=pages, page_size=pps, dtype=str(dtype)[6:], special=special, **r))
            for b in backends:
                print(f"v41_fp4 {'special' if special else 'finite '} {str(dtype)[6:]:8s} pps={pps:3d} {b:6s}: "
                      f"{r[b]['bytes_equal']}/{r[b]['tokens']} tokens bytes-equal to SGLang, "
                      f"{r[b]['sglang_reads_kvwrite']} read back equal by SGLang's decoder")
    total = {b: (sum(r[b]["bytes_equal"] for r in runs if not r["special"]),
                 sum(r[b]["tokens"] for r in runs if not r["special"])) for b in backends}
    print("finite inputs, bytes equal:", {b: f"{e}/{t}" for b, (e, t) in total.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(step="dsv4_fp4_diff", engine="sglang 0.5.23 dsv41_kv_quant_reference", runs=runs,
                           finite_bytes_equal={b: list(v) for b, v in total.items()}), f, indent=1)


if __name__ == "__main__":
    main()
