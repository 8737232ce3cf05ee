"""Page transfers between processes: a prefill worker's pool pages into a decode worker's pool.

Two transports, one set of checks (the layouts of both pools compared, every page id checked
against both pools before anything moves):
- `KVAgent` (`kvwrite.transfer.nixl`): NIXL, when installed (`pip install 'kvwrite[nixl]'`); one
  agent a process, pools registered once, one-sided WRITE/READ of the page bytes, page sizes
  bridged where the rows are the same.
- `send_pages` / `recv_pages` (`kvwrite.transfer.dist`): torch.distributed (gloo / NCCL), the
  fallback; `transport="nixl"` runs the same call pair on NIXL.
"""
from kvwrite.transfer.descriptors import DescriptorOutsidePool, PoolAddresses, Region, pair_descs
from kvwrite.transfer.dist import PageSpec, recv_pages, send_pages, spec_of
from kvwrite.transfer.layout import BufferLayout, Bridge, PoolLayout, bridge, kvpool_layout, tensors_layout
from kvwrite.transfer.nixl import KVAgent, NixlUnavailable, TransferFailed, TransferStats, available, nixl_api
from kvwrite.transfer.pages import CheckedPairs, TransferPageError, check_pairs

__all__ = ["Bridge", "BufferLayout", "CheckedPairs", "DescriptorOutsidePool", "KVAgent", "NixlUnavailable",
           "PageSpec", "PoolAddresses", "PoolLayout", "Region", "TransferFailed", "TransferPageError",
           "TransferStats", "available", "bridge", "check_pairs", "kvpool_layout", "nixl_api", "pair_descs",
           "recv_pages", "send_pages", "spec_of", "tensors_layout"]
