"""Page-move targets as ratios measured in one run, each pair timed interleaved (batches of A
then B, repeated; medians), so a ratio shares the machine's state:

- copy_pages between two host pools (pages of 64 KiB) vs a contiguous copy of the same bytes;
- gather of K and V rows vs the store of the same rows (the mha-bf16 layer): bandwidth ratio;
- guard vs off for copy_pages, gather and slot_mapping.

`python -m kvwrite.bench.pages [--device cpu] [--n 4096 16384] [--backend cpu] [--threads 1]`
prints one line per measurement (JSON with --json). Shapes are the bench cases' (kvwrite.bench.cases
pages-64k, gather-mha-bf16, mha-bf16, slot-mapping).
"""
from __future__ import annotations

import argparse
import json

import torch

from kvwrite.bench import cases, timing
from kvwrite.bench.host import interleaved_us
from kvwrite.errors import ErrorBuffer


def measure(device: torch.device, ns, backend: str, min_time: float) -> list[dict]:
    rows = []
    for n in ns:
        gen = torch.Generator().manual_seed(n)
        cp = cases._copy_pages(n, device, gen)
        gx = cases._gather(n, device, gen)
        st = cases._mha(n, device, gen, torch.bfloat16)
        sm = cases._slot_mapping(n, device, gen)
        err = ErrorBuffer(device)

        def run(setup, check):
            return lambda: setup.call(backend, check, err if check == "guard" else None)

        copy = timing.copy_fn(cp.bytes_moved, device)
        a, b = interleaved_us(run(cp, "off"), copy, min_time)
        rows.append(dict(n=n, what="copy_pages off vs memcpy of the same bytes", us=a, base_us=b,
                         ratio=b / a, target=">= 0.80", bytes=cp.bytes_moved))
        a, b = interleaved_us(run(gx, "off"), run(st, "off"), min_time)
        rows.append(dict(n=n, what="gather K+V bandwidth vs store_kv of the same rows", us=a, base_us=b,
                         ratio=(gx.bytes_moved / a) / (st.bytes_moved / b), target=">= 0.50",
                         bytes=gx.bytes_moved))
        for name, setup in (("copy_pages", cp), ("gather", gx), ("slot_mapping", sm)):
            a, b = interleaved_us(run(setup, "guard"), run(setup, "off"), min_time)
            rows.append(dict(n=n, what=f"{name} guard over off", us=a, base_us=b, ratio=a / b - 1.0,
                             target="<= 0.05", bytes=setup.bytes_moved))
        assert err.error() is None, err.error()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--backend", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--min-time", type=float, default=0.5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for r in measure(torch.device(args.device), args.n, args.backend, args.min_time):
        if args.json:
            print(json.dumps(r))
        else:
            print(f"N={r['n']:6}  {r['what']:52} {r['us']:10.1f} us vs {r['base_us']:10.1f} us  "
                  f"ratio {r['ratio']:+.3f} (target {r['target']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
