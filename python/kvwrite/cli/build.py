"""`kvwrite build`: prebuild the C++/CUDA extension (the "cpu" and "cuda" backends) into the
per-user cache, showing ninja's progress, so that the first store of a serving process does not
pay the build (about a minute for the CPU kernels, several for the CUDA ones)."""
from __future__ import annotations

import argparse
import os
import sys

NAME = "build"
HELP = "prebuild the C++/CUDA extension into ~/.cache/kvwrite with progress (a no-op when built)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cuda", choices=("auto", "yes", "no"), default="auto",
                   help="build the CUDA kernels: auto = where a GPU is visible (KVWRITE_EXT_CUDA)")
    p.add_argument("--arch", default=None,
                   help='CUDA archs, e.g. "8.0;9.0" (TORCH_CUDA_ARCH_LIST; default: the visible GPUs, '
                        'else 8.0;9.0)')
    p.add_argument("--quiet", action="store_true", help="no ninja progress, only the start/end lines")


def run(args: argparse.Namespace) -> int:
    if args.cuda != "auto":
        os.environ["KVWRITE_EXT_CUDA"] = "1" if args.cuda == "yes" else "0"
    if args.arch:
        os.environ["TORCH_CUDA_ARCH_LIST"] = args.arch
    from kvwrite import _ext

    if _ext.csrc_dir() is None:
        print("kvwrite build: no csrc/ sources here (an install without them uses its prebuilt "
              "kvwrite._C, if any)", file=sys.stderr)
        return 1
    cfg = _ext.build_config()
    try:
        out, seconds = _ext.build(verbose=not args.quiet)
    except Exception as exc:  # a compiler error: ninja's log was shown above
        msg = str(exc).strip().splitlines()
        print(f"kvwrite build: failed ({exc.__class__.__name__}: {msg[-1] if msg else ''})", file=sys.stderr)
        return 1
    import torch

    kernels = "CPU + CUDA" if cfg["with_cuda"] else "CPU"
    threads = torch.ops.kvwrite_ext.cpu_threads(1 << 12)
    stream = torch.ops.kvwrite_ext.cpu_stream_bytes()
    print(f"kvwrite build: {kernels} kernels ready in {out} ({seconds:.1f} s); a large CPU call runs on "
          f"{threads} of torch's {torch.get_num_threads()} intra-op thread(s); K/V stores stream their rows "
          + (f"from {stream / 2**20:.3g} MiB of tensors a call" if stream >= 0 else "never")
          + " (KVWRITE_CPU_STREAM_BYTES)")
    return 0
