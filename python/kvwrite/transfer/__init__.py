"""Page transfers between processes, both pools checked before anything moves: `KVAgent` (NIXL) and
`send_pages` / `recv_pages` (torch.distributed). How to use them, and figures: docs/transfer.md."""
from kvwrite.transfer.descriptors import DescriptorOutsidePool, PoolAddresses, Region, pair_descs
from kvwrite.transfer.dist import PageSpec, recv_pages, send_pages, spec_of
from kvwrite.transfer.layout import BufferLayout, Bridge, PoolLayout, bridge, kvpool_layout, tensors_layout
from kvwrite.transfer.nixl import KVAgent, NixlUnavailable, TransferFailed, TransferStats, available, nixl_api
from kvwrite.transfer.pages import CheckedPairs, TransferPageError, check_pairs

__all__ = ["Bridge", "BufferLayout", "CheckedPairs", "DescriptorOutsidePool", "KVAgent", "NixlUnavailable",
           "PageSpec", "PoolAddresses", "PoolLayout", "Region", "TransferFailed", "TransferPageError",
           "TransferStats", "available", "bridge", "check_pairs", "kvpool_layout", "nixl_api", "pair_descs",
           "recv_pages", "send_pages", "spec_of", "tensors_layout"]
