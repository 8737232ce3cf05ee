"""`ParallelSpec`: tensor and decode-context parallelism of the worker whose pools are planned."""
from __future__ import annotations

from dataclasses import dataclass

from kvwrite.config.errors import SpecError


@dataclass(frozen=True)
class ParallelSpec:
    """`tp_size` divides KV heads (replicated when tp > heads); `dcp_size` ranks share one
    virtual loc space (token i on rank i % dcp_size); `is_draft_worker`: the speculative draft
    model's worker, whose replicated pools are indexed by the virtual loc."""

    tp_size: int = 1
    dcp_size: int = 1
    dcp_rank: int = 0
    is_draft_worker: bool = False

    def __post_init__(self) -> None:
        for k in ("tp_size", "dcp_size"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"ParallelSpec.{k} must be an int >= 1, got {v!r}")
        r = self.dcp_rank
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.dcp_size:
            raise SpecError(f"ParallelSpec.dcp_rank must be an int in [0, dcp_size={self.dcp_size}), got {r!r}")
        if not isinstance(self.is_draft_worker, bool):
            raise SpecError(f"ParallelSpec.is_draft_worker must be a bool, got {self.is_draft_worker!r}")

    def kv_heads_per_rank(self, num_kv_heads: int) -> int:
        """KV heads one TP rank holds: heads // tp, or 1 (replicated) when tp exceeds heads."""
        tp = self.tp_size
        if num_kv_heads >= tp:
            if num_kv_heads % tp:
                raise SpecError(f"num_kv_heads={num_kv_heads} is not divisible by tp_size={tp}")
            return num_kv_heads // tp
        if tp % num_kv_heads:
            raise SpecError(f"tp_size={tp} exceeds num_kv_heads={num_kv_heads} but is not a multiple of it "
                            "(heads cannot be replicated evenly)")
        return 1
