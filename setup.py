"""Installs kvwrite: the Python API from python/kvwrite, the Triton kernels from kernels/."""
from setuptools import find_packages, setup

# python/kvwrite is the `kvwrite` package; kernels/ is installed as `kvwrite.kernels`.
PACKAGES = ["kvwrite", "kvwrite.kernels"] + [f"kvwrite.{p}" for p in find_packages("python/kvwrite")]

setup(
    name="kvwrite",
    version="0.1.0",
    description="Fast, bounds-checked stores of K/V into paged KV-cache pools",
    python_requires=">=3.9",
    packages=PACKAGES,
    package_dir={"kvwrite": "python/kvwrite", "kvwrite.kernels": "kernels"},
    install_requires=["torch>=2.4", "numpy"],
    extras_require={"triton": ["triton"], "cli": ["rich"]},
    entry_points={"console_scripts": ["kvwrite=kvwrite.cli:main"]},
)
