"""kvwrite's Triton kernels, one file per kernel family (imported as `kvwrite.kernels`).

Importing this package imports triton; `kvwrite.backends` does so lazily.
"""
