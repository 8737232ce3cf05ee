"""`ParallelSpec`: tensor and decode-context parallelism of the worker whose pools are planned."""
from __future__ import annotations

from dataclasses import dataclass

from kvwrite.config.errors import SpecError

ENGINES = ("kvwrite", "sglang", "vllm")


@dataclass(frozen=True)
class ParallelSpec:
    """`tp_size` divides KV heads (replicated when tp > heads); `dcp_size` ranks share one
    virtual loc space (token i on rank i % dcp_size); `is_draft_worker`: the speculative draft
    model's worker, whose replicated pools are indexed by the virtual loc.

    `engine`: whose layout the configurator plans (`kvwrite.config.engines`): "sglang" or "vllm"
    (the model as that engine's code lays it out, refused where it has none), or "kvwrite"
    (default: every variant as the spec says, kvwrite's own pools and allocator). It also picks the
    DCP head rule (`kv_heads_per_rank`): SGLang's (DCP ranks are carved out of the TP group, heads
    shard over `tp // dcp` groups; also "kvwrite") or vLLM's (heads shard over `tp`; DCP only removes
    replication, so a GQA model needs `tp > H` and `dcp <= tp // H`).
    """

    tp_size: int = 1
    dcp_size: int = 1
    dcp_rank: int = 0
    is_draft_worker: bool = False
    engine: str = "kvwrite"

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
        if self.engine not in ENGINES:
            raise SpecError(f"ParallelSpec.engine must be one of {ENGINES}, got {self.engine!r}")
        tp, dcp = self.tp_size, self.dcp_size
        if dcp > 1 and tp > 1 and tp % dcp:
            raise SpecError(f"tp_size={tp} must be a multiple of dcp_size={dcp} (DCP ranks are TP ranks)")

    @property
    def kv_tp_size(self) -> int:
        """Ranks the KV heads are split over. SGLang (`ModelConfig.get_num_kv_heads(tp, dcp)`):
        `tp // dcp` on a target worker (each DCP rank attends its group's query heads over its
        token shard), `tp` on a draft worker (drafts never join the DCP group). vLLM: `tp`.
        `tp_size=1` with `dcp_size > 1` reads as DCP ranks that are not modelled as TP ranks
        (one head group)."""
        if self.engine == "vllm" or self.is_draft_worker or self.dcp_size == 1:
            return self.tp_size
        return max(1, self.tp_size // self.dcp_size)

    def kv_heads_per_rank(self, num_kv_heads: int, *, mla: bool = False) -> int:
        """KV heads one rank holds: `max(1, H // kv_tp_size)` (replicated when the split exceeds
        the heads). Under vLLM's DCP a GQA model (not `mla`) must have `tp > H` and
        `dcp <= tp // H` (vLLM's `ModelConfig.verify_with_parallel_config`)."""
        tp = self.kv_tp_size
        if self.engine == "vllm" and self.dcp_size > 1 and not mla and not self.is_draft_worker:
            if self.tp_size <= num_kv_heads or self.dcp_size > self.tp_size // num_kv_heads:
                raise SpecError(f"vLLM's DCP for a GQA model needs tp_size > num_kv_heads and dcp_size <= "
                                f"tp_size // num_kv_heads; got tp_size={self.tp_size}, num_kv_heads="
                                f"{num_kv_heads}, dcp_size={self.dcp_size}")
        if num_kv_heads >= tp:
            if num_kv_heads % tp:
                raise SpecError(f"num_kv_heads={num_kv_heads} is not divisible by the {tp} ranks the heads "
                                f"are split over (tp_size={self.tp_size}, dcp_size={self.dcp_size})")
            return num_kv_heads // tp
        if tp % num_kv_heads:
            raise SpecError(f"the {tp} ranks the heads are split over (tp_size={self.tp_size}, dcp_size="
                            f"{self.dcp_size}) exceed num_kv_heads={num_kv_heads} but are not a multiple of "
                            "it (heads cannot be replicated evenly)")
        return 1
