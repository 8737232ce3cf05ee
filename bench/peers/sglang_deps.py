"""Install what SGLang's memory-pool and configurator modules import (sglang itself is installed
--no-deps): import them, install the missing module's package, repeat. `sgl_kernel` gets a stub
(its CPU ops are imported by the pool module but never called by the stores compared here).
Run with the sglang env's python; SGLANG_USE_CPU_ENGINE=1 is set here."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

MODULES = ["sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.kv_cache_configurator",
           "sglang.kernels.ops.kvcache.mla_buffer", "sglang.srt.model_executor.runner"]
PACKAGE = {"tvm_ffi": "apache-tvm-ffi", "zmq": "pyzmq", "yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn", "cv2": "opencv-python-headless",
           "google.protobuf": "protobuf", "sentencepiece": "sentencepiece", "IPython": "ipython",
           "msgspec": "msgspec", "pybase64": "pybase64", "setproctitle": "setproctitle"}
STUB = '''"""Stub of sgl_kernel for kvwrite's peer runs: the store paths compared never call it."""
def __getattr__(name):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is a stub in kvwrite's peer environment")
    return missing
'''


def main() -> int:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", TRITON_INTERPRET="1")
    site = Path(subprocess.check_output([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    for _ in range(40):
        proc = subprocess.run([sys.executable, "-c", "import " + ", ".join(MODULES)], env=env, cwd="/",
                              capture_output=True, text=True)
        if proc.returncode == 0:
            print("sglang modules import")
            return 0
        m = re.search(r"No module named '([\w.]+)'", proc.stderr)
        if not m:
            print(proc.stderr[-3000:])
            return 1
        mod = m.group(1)
        top = mod.split(".")[0]
        if top == "sgl_kernel":
            (site / "sgl_kernel").mkdir(exist_ok=True)
            (site / "sgl_kernel" / "__init__.py").write_text(STUB)
            print("stub sgl_kernel")
            continue
        pkg = PACKAGE.get(mod, PACKAGE.get(top, top.replace("_", "-")))
        print("install", pkg, "for", mod, flush=True)
        if subprocess.run([sys.executable, "-m", "pip", "install", "-q", pkg], capture_output=True).returncode:
            print(f"cannot install {pkg}")
            return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
