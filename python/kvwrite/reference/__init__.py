"""Pure-PyTorch implementations of every op: the oracle of the tests and the `torch` backend.

They implement the same semantics as the kernels (all three check modes, the same guard
record). They use boolean indexing, so on CUDA they synchronise: not CUDA-graph safe.
"""
