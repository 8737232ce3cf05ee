"""Installs kvwrite: the Python API from python/kvwrite, the Triton kernels from kernels/."""
from setuptools import setup

setup(
    name="kvwrite",
    version="0.1.0",
    description="Fast, bounds-checked stores of K/V into paged KV-cache pools",
    python_requires=">=3.9",
    packages=["kvwrite", "kvwrite.ops", "kvwrite.reference", "kvwrite.kernels"],
    package_dir={"kvwrite": "python/kvwrite", "kvwrite.kernels": "kernels"},
    install_requires=["torch>=2.4", "numpy"],
    extras_require={"triton": ["triton"], "cli": ["rich"]},
    entry_points={"console_scripts": ["kvwrite=kvwrite.cli:main"]},
)
