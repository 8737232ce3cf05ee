"""SGLang 0.5.23's MLA pool stores (its Triton kernels, run by the interpreter on CPU) against
kvwrite.compat.sglang.set_mla_kv_buffer, byte for byte, including loc 0 (SGLang's reserved slot)
in every batch: skipped with rope, written by SGLang's no-rope kernel (rope_dim 0), which takes no
skip index (its torch path keeps that on purpose); the adapter follows both. Run with the sglang env's python (SGLANG_USE_CPU_ENGINE=1,
TRITON_INTERPRET=1 are set here before the imports). Writes a JSON summary with --json."""
from __future__ import annotations

import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402


def cases():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for lora, rope in ((512, 64), (128, 16), (96, 0)):
            for page_size in (1, 16):
                for seed in range(2):
                    yield dict(dtype=dtype, lora=lora, rope=rope, page_size=page_size, seed=seed)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    from sglang.kernels.ops.kvcache.mla_buffer import set_mla_kv_buffer_triton
    from kvwrite.compat import sglang as kv

    results = []
    for c in cases():
        gen = torch.Generator().manual_seed(c["seed"])
        size = 4 * c["page_size"] * 4
        rows = size + c["page_size"]
        n = 9
        loc = torch.randperm(rows - 1, generator=gen)[:n] + 1
        loc[2] = 0                                     # the reserved slot: SGLang skips it
        nope = (torch.randn(n, 1, c["lora"], generator=gen) * 3).to(c["dtype"])
        rope = (torch.randn(n, 1, c["rope"], generator=gen) * 3).to(c["dtype"])
        base = torch.randint(0, 256, (rows, 1, (c["lora"] + c["rope"]) * nope.element_size()), dtype=torch.uint8,
                             generator=gen)
        theirs, ours = base.clone().view(c["dtype"]), base.clone().view(c["dtype"])
        set_mla_kv_buffer_triton(theirs, loc, nope, rope)
        kv.set_mla_kv_buffer(ours, loc, nope, rope, c["page_size"], backend=os.environ.get("KVWRITE_BACKEND", "auto"))
        diff = (theirs.view(torch.uint8) != ours.view(torch.uint8))
        rows_differing = sorted(set(diff.reshape(rows, -1).any(dim=1).nonzero().flatten().tolist()))
        results.append(dict(op="set_mla_kv_buffer", dtype=str(c["dtype"])[6:], lora=c["lora"], rope=c["rope"],
                            page_size=c["page_size"], seed=c["seed"], tokens=n,
                            equal=not bool(diff.any()), bytes_differing=int(diff.sum()),
                            rows_differing=rows_differing, sglang_wrote_loc0=bool(
                                (theirs[0].view(torch.uint8) != base[0]).any()),
                            loc0_untouched=bool((ours[0].view(torch.uint8) == base[0]).all())))
    ok = sum(r["equal"] for r in results)
    summary = dict(sglang="0.5.23", store_records=sum(r["tokens"] for r in results), cases=len(results),
                   equal=ok, differing=len(results) - ok, results=results)
    print(f"SGLang MLA store differential: {ok}/{len(results)} cases byte-equal "
          f"({summary['store_records']} token rows)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
