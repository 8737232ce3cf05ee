"""`KVCacheConfigurator`: model + parallel setup + budget -> `PoolPlan` -> built pool.

The one place that derives `loc_space_scale` and `pool_page_size` (SGLang's
`pool_configurator.py` accessors, the fix of SGLang #33348) and sizes every sub-pool from them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvwrite.config.errors import BudgetTooSmall, ConfigError, UnsupportedCombination, WindowDoesNotFit
from kvwrite.config.model import ModelSpec
from kvwrite.config.parallel import ParallelSpec
from kvwrite.config.plan import LocSpace, PoolPlan, PoolSpec, SubPoolPlan, buffer_plans, state_plan
from kvwrite.config.registry import PlanContext, planner_for
from kvwrite.config.variants import KV_CACHE_DTYPES
from kvwrite.geometry import PageGeometry, require_positive_int


LAYOUTS = ("NHD", "HND")
TARGETS = ("gpu", "npu")


def _number(x: float) -> float:
    return int(x) if float(x).is_integer() else x


@dataclass(frozen=True)
class _Sizing:
    pages: int         # usable pages of the full space (pool pages; the padding page excluded)
    swa_pages: int     # usable pages of the SWA space (0 without one)


class KVCacheConfigurator:
    """Plan (and build) the KV-cache pools of one worker rank.

    `max_total_num_tokens` / `memory_bytes` are per rank (what the target worker's pools hold on
    one rank). A draft worker under DCP covers the virtual loc space: its token count is scaled
    by `loc_space_scale` and its pools page in `pool_page_size = page_size * loc_space_scale`.
    Give `max_total_num_tokens` (rounded down to whole pages), `memory_bytes` (the largest whole
    number of pool pages whose pools, one padding page each, fit), or both (the token count
    must then fit the budget).

    `max_running_requests`: request slots of a hybrid-linear model's recurrent-state pools
    (`+ 1` padding slot; required for such a model, refused for any other); their bytes count
    in the budget beside the KV pools'. `layout="HND"`: paged K/V buffers `[pages, heads, page,
    dim]`. `reserve_padding_page=False`: the -1 padding convention (vLLM), no page 0 held back.
    `target="npu"`: SGLang's Ascend pool layouts (every layer's buffer in one tensor, MLA as
    nope + rope buffers), stored through the torch backend.
    """

    def __init__(self, model: ModelSpec, parallel: ParallelSpec | None = None, *, page_size: int,
                 kv_cache_dtype: str = "auto", memory_bytes: int | None = None,
                 max_total_num_tokens: int | None = None, swa_full_tokens_ratio: float = 0.8,
                 max_running_requests: int | None = None, layout: str = "NHD",
                 reserve_padding_page: bool = True, target: str = "gpu") -> None:
        if not isinstance(model, ModelSpec):
            raise TypeError(f"model must be a kvwrite.ModelSpec, got {type(model).__name__}")
        parallel = ParallelSpec() if parallel is None else parallel
        if not isinstance(parallel, ParallelSpec):
            raise TypeError(f"parallel must be a kvwrite.ParallelSpec, got {type(parallel).__name__}")
        self.model, self.parallel = model, parallel
        self.page_size = require_positive_int("page_size", page_size)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        if memory_bytes is None and max_total_num_tokens is None:
            raise ConfigError("give memory_bytes (per rank) or max_total_num_tokens (per rank)")
        self.memory_bytes = None if memory_bytes is None else require_positive_int("memory_bytes", memory_bytes)
        self.max_total_num_tokens_per_rank = (None if max_total_num_tokens is None else
                                              require_positive_int("max_total_num_tokens", max_total_num_tokens))
        ratio = swa_full_tokens_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ConfigError(f"swa_full_tokens_ratio must be in (0, 1], got {ratio!r}")
        self.swa_full_tokens_ratio = float(ratio)
        if layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if target not in TARGETS:
            raise ConfigError(f"target must be one of {TARGETS}, got {target!r}")
        if not isinstance(reserve_padding_page, bool):
            raise ConfigError(f"reserve_padding_page must be a bool, got {reserve_padding_page!r}")
        if target == "npu" and (kv_cache_dtype != "auto" or layout != "NHD"):
            raise UnsupportedCombination(f"target='npu' (SGLang's Ascend pool layouts) takes kv_cache_dtype='auto' "
                                         f"and layout='NHD', got {kv_cache_dtype!r} and {layout!r}")
        self.layout, self.target, self.reserve_padding_page = layout, target, reserve_padding_page
        self.planned_model = model.draft() if parallel.is_draft_worker else model
        self.planner = planner_for(self.planned_model.variant)
        self.context = PlanContext(self.planned_model, parallel, kv_cache_dtype, self.page_size, layout, target)
        self.planner.check_dtype(self.context)
        self.pool_specs: tuple[PoolSpec, ...] = tuple(self.planner.pools(self.context))
        names = [p.name for p in self.pool_specs]
        if len(set(names)) != len(names) or not names:
            raise ConfigError(f"planner {self.planner.name!r} returned sub-pool names {names}")
        self.state_specs = tuple(self.planner.state_pools(self.context))
        if self.state_specs and max_running_requests is None:
            raise ConfigError(f"{self.planned_model.name or self.planned_model.variant} has a recurrent state on "
                              f"{len(self.state_specs[0].layer_ids)} linear layers, sized per request: give "
                              f"max_running_requests")
        if not self.state_specs and max_running_requests is not None:
            raise ConfigError(f"max_running_requests sizes recurrent-state pools, and the planned model "
                              f"({self.planned_model.name or self.planned_model.variant}, variant "
                              f"{self.planned_model.variant!r}) has none; leave it unset")
        self.max_running_requests = (None if max_running_requests is None else
                                     require_positive_int("max_running_requests", max_running_requests))

    # --- the single source of the page-size namespace -----------------------------------------
    @property
    def loc_space_scale(self) -> int:
        """`dcp_size` for a draft worker with `dcp_size > 1` (its replicated pools are indexed by
        the virtual loc), else 1."""
        p = self.parallel
        return p.dcp_size if p.is_draft_worker and p.dcp_size > 1 else 1

    @property
    def pool_page_size(self) -> int:
        """Rows per page of this worker's pools: the allocator's page granularity as they see it."""
        return self.page_size * self.loc_space_scale

    def _pool_scale(self, spec: PoolSpec) -> int:
        """A sub-pool indexed by the virtual loc (the DSA indexer cache) pages like a draft pool."""
        return self.parallel.dcp_size if spec.virtual else self.loc_space_scale

    # --- sizing ---------------------------------------------------------------------------------
    @property
    def _has_swa(self) -> bool:
        return any(p.space == "swa" for p in self.pool_specs)

    def _sizing(self, pages: int) -> _Sizing:
        swa = math.floor(self.swa_full_tokens_ratio * pages + 1e-9) if self._has_swa else 0
        return _Sizing(pages, swa)

    def _window_ok(self, s: _Sizing) -> bool:
        if not self._has_swa:
            return True
        window = self.planned_model.sliding_window
        return s.swa_pages >= 1 and s.swa_pages * self.page_size * self.parallel.dcp_size >= window

    def _min_pages(self) -> int:
        n = 1
        while not self._window_ok(self._sizing(n)):
            n = n * 2
        lo, hi = n // 2 + 1 if n > 1 else 1, n
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._window_ok(self._sizing(mid)) else (mid + 1, hi)
        return lo

    def _assemble(self, s: _Sizing) -> PoolPlan:
        P, dcp, pad, npu = self.page_size, self.parallel.dcp_size, int(self.reserve_padding_page), self.target == "npu"
        spaces = {"full": LocSpace("full", P * dcp, (s.pages + pad) * P * dcp, dcp, self.reserve_padding_page)}
        if self._has_swa:
            spaces["swa"] = LocSpace("swa", P * dcp, (s.swa_pages + pad) * P * dcp, dcp, self.reserve_padding_page)
        pools = []
        for spec in self.pool_specs:
            space = spaces[spec.space]
            scale = self._pool_scale(spec)
            geometry = PageGeometry(P, space.num_locs // (P * dcp), loc_space_scale=scale)
            addressing = "sharded" if dcp > 1 and scale == 1 else ("virtual" if dcp > 1 else "local")
            own = self.planner.sub_pool(spec, self.context, space.num_locs // (P * dcp), scale)
            if own is not None:  # rows that are not the allocator's pages (DeepSeek V4)
                geometry = own["geometry"]
                space = own.get("space") or space
                addressing = own.get("addressing") or addressing
                spaces.setdefault(space.name, space)
            pools.append(SubPoolPlan(
                name=spec.name, layer_ids=spec.layer_ids, geometry=geometry,
                buffers=buffer_plans(spec, geometry, spaces["full"].num_locs, npu), op=spec.op,
                kernel=self._kernel(spec, addressing), space=space, addressing=addressing,
                dcp_rank=self.parallel.dcp_rank, dcp_size=dcp, spec=spec))
        return PoolPlan(
            variant=self.planned_model.variant, model=self.planned_model, parallel=self.parallel,
            kv_cache_dtype=self.kv_cache_dtype, page_size=P, loc_space_scale=self.loc_space_scale,
            pool_page_size=self.pool_page_size, max_total_num_tokens=s.pages * self.pool_page_size,
            cell_size_bytes=self.cell_size_bytes, memory_bytes=self.memory_bytes, pools=tuple(pools),
            spaces=spaces, max_running_requests=self.max_running_requests, layout=self.layout, target=self.target,
            state_pools=tuple(state_plan(st, self.max_running_requests + 1, npu) for st in self.state_specs))

    def _kernel(self, spec: PoolSpec, addressing: str) -> str:
        extra = [spec.note] if spec.note else []
        if "loc_map" in spec.needs:
            extra.append("loc_map full->swa")
        if addressing == "sharded":
            extra.append(f"dcp_rank={self.parallel.dcp_rank}/{self.parallel.dcp_size}")
        elif addressing == "virtual":
            extra.append("virtual loc")
        return spec.op + (f" ({', '.join(extra)})" if extra else "")

    @property
    def cell_size_bytes(self) -> float:
        """Bytes per token of `plan().max_total_num_tokens`, over all layers and all buffers
        (scales and the SWA loc map included; SWA buffers weighted by `swa_full_tokens_ratio`)."""
        own = self.planner.cell_size(self.context, self.swa_full_tokens_ratio)
        if own is not None:
            return _number(round(own, 6))
        total = 0.0
        dcp, lss = self.parallel.dcp_size, self.loc_space_scale
        for spec in self.pool_specs:
            rows_per_token = self._pool_scale(spec) / lss
            if spec.space == "swa":
                rows_per_token *= self.swa_full_tokens_ratio
            for b in spec.buffers:
                per = dcp / lss if b.layout == "map" else rows_per_token
                total += b.row_bytes * per * (len(spec.layer_ids) if b.per_layer else 1)
        return _number(round(total, 6))

    def total_bytes_for(self, pages: int) -> int:
        """Bytes of the plan whose full loc space has `pages` usable pool pages (plus padding)."""
        return self._assemble(self._sizing(pages)).total_bytes

    def plan(self) -> PoolPlan:
        n_min = self._min_pages()
        if self.max_total_num_tokens_per_rank is not None:
            pages = self.max_total_num_tokens_per_rank // self.page_size
            if pages < 1:
                raise ConfigError(f"max_total_num_tokens={self.max_total_num_tokens_per_rank} is less than "
                                  f"one page of {self.page_size} tokens")
            if pages < n_min:
                raise WindowDoesNotFit(self._window_message(pages, n_min))
            plan = self._assemble(self._sizing(pages))
            if self.memory_bytes is not None and plan.total_bytes > self.memory_bytes:
                raise BudgetTooSmall(
                    f"max_total_num_tokens={self.max_total_num_tokens_per_rank} needs {plan.total_bytes} "
                    f"bytes per rank but memory_bytes={self.memory_bytes}", plan.total_bytes)
            return plan
        budget = self.memory_bytes
        minimum = self.total_bytes_for(n_min)
        if minimum > budget:
            why = (("one page per pool" + (" plus the padding page" if self.reserve_padding_page else "")
                    + (f", and the recurrent state of {self.max_running_requests} + 1 request slots"
                       if self.state_specs else "")) if n_min == 1 else
                   f"{n_min} pages: an SWA pool holding the {self.planned_model.sliding_window}-token "
                   f"window at swa_full_tokens_ratio={self.swa_full_tokens_ratio}")
            raise BudgetTooSmall(f"memory_bytes={budget} is too small: the smallest plan ({why}) needs "
                                 f"{minimum} bytes per rank", minimum)
        lo, hi = n_min, n_min * 2
        while self.total_bytes_for(hi) <= budget:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # invariant: bytes(lo) <= budget < bytes(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.total_bytes_for(mid) <= budget else (lo, mid)
        return self._assemble(self._sizing(lo))

    def _window_message(self, pages: int, n_min: int) -> str:
        s = self._sizing(pages)
        return (f"the SWA pool of {s.swa_pages} page(s) x {self.page_size} x dcp {self.parallel.dcp_size} "
                f"(swa_full_tokens_ratio={self.swa_full_tokens_ratio} of {pages} full pages) cannot hold "
                f"the sliding window of {self.planned_model.sliding_window} tokens; plan at least "
                f"{n_min * self.page_size} tokens per rank or raise swa_full_tokens_ratio")

    def check_allocator(self, page_granularity: int, num_locs: int, space: str = "full") -> None:
        self.plan().check_allocator(page_granularity, num_locs, space)

    def build(self, device="cpu", check: str | None = None, backend: str = "auto", *,
              scales: "dict | float | None" = None):
        return self.plan().build(device, check=check, backend=backend, scales=scales)

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v, d in (
            ("layout", self.layout, "NHD"), ("target", self.target, "gpu"),
            ("reserve_padding_page", self.reserve_padding_page, True),
            ("max_running_requests", self.max_running_requests, None)) if v != d)
        return (f"KVCacheConfigurator({self.model.name or self.model.variant}, {self.parallel}, "
                f"page_size={self.page_size}, kv_cache_dtype={self.kv_cache_dtype!r}{extra})")
