"""Installs kvwrite: the Python API from python/kvwrite, the Triton kernels from kernels/."""
import os

import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


# python/kvwrite is the `kvwrite` package; kernels/ is installed as `kvwrite.kernels`.
PACKAGES = ["kvwrite", "kvwrite.kernels"] + [f"kvwrite.{p}" for p in find_packages("python/kvwrite")]

# KVWRITE_BUILD_EXT=1: also build the C++/CUDA extension (csrc/) ahead of time as kvwrite._C,
# with the sources and flags of the JIT build (python/kvwrite/_ext.py; ninja via BuildExtension).
EXT = {}
if os.environ.get("KVWRITE_BUILD_EXT", "0") == "1":
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_kvwrite_ext_build", "python/kvwrite/_ext.py")
    _ext = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_ext)
    EXT["ext_modules"], EXT["cmdclass"] = _ext.aot_extension(os.path.abspath("csrc"))

CSRC_SUFFIXES = (".h", ".cuh", ".cpp", ".cu", ".md")


class BuildPy(build_py):
    """Also copies csrc/ into the package as kvwrite/csrc: a non-editable install (a wheel, `pip
    install .`) then JIT-builds the extension from it as the editable install does
    (kvwrite._ext.csrc_dir looks there)."""

    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "kvwrite", "csrc")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree("csrc", dst, ignore=lambda d, names: [
            n for n in names if not os.path.isdir(os.path.join(d, n)) and not n.endswith(CSRC_SUFFIXES)])


EXT.setdefault("cmdclass", {})
EXT["cmdclass"]["build_py"] = BuildPy

setup(
    name="kvwrite",
    version="0.1.0",
    description="Fast, bounds-checked stores of K/V into paged KV-cache pools",
    python_requires=">=3.9",
    packages=PACKAGES,
    package_dir={"kvwrite": "python/kvwrite", "kvwrite.kernels": "kernels"},
    install_requires=["torch>=2.4", "numpy"],
    extras_require={"triton": ["triton"], "cli": ["rich"], "hf": ["transformers"],
                    "nixl": ["nixl-cu13"], "nixl-cu12": ["nixl-cu12"]},
    entry_points={"console_scripts": ["kvwrite=kvwrite.cli:main"],
                  "vllm.general_plugins": ["kvwrite = kvwrite.integrations.vllm:register"]},
    **EXT,
)
