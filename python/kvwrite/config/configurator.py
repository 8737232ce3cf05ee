"""`KVCacheConfigurator`: model + parallel setup + budget -> `PoolPlan` -> built pool.

The one place that derives `loc_space_scale` and `pool_page_size` (SGLang's
`pool_configurator.py` accessors, the fix of SGLang #33348) and sizes every sub-pool from them.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvwrite.config.engines import engine_layout
from kvwrite.config.errors import BudgetTooSmall, ConfigError, UnsupportedCombination, WindowDoesNotFit
from kvwrite.config.model import ModelSpec
from kvwrite.config.parallel import ParallelSpec
from kvwrite.config.plan import LocSpace, PoolPlan, PoolSpec, SubPoolPlan, buffer_plans, state_plan
from kvwrite.config.registry import PlanContext, plan_defaults, planner_for
from kvwrite.config.variants import KV_CACHE_DTYPES
from kvwrite.geometry import PageGeometry, require_positive_int


LAYOUTS = ("NHD", "HND")
TARGETS = ("gpu", "npu")
SIZINGS = ("engine", "strict")
MAMBA_FULL_MEMORY_RATIO = 0.9   # SGLang's --mamba-full-memory-ratio fallback (arg_groups/fields/schedule.py)


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
    Give `max_total_num_tokens` (rounded down to whole pages), `memory_bytes`, or both (the
    token count must then fit the budget).

    `sizing="engine"` (default) sizes as SGLang's pool configurator does: tokens =
    `(memory_bytes - fixed) // cell_size_bytes`, rounded down to whole pages, where `fixed` is
    what does not scale with tokens (recurrent-state pools, DeepSeek V4's c128 state); the
    padding page of every pool and the SWA loc map are allocated beside that budget, as the
    engine does (so `total_bytes` exceeds `memory_bytes` by `overhead_bytes` at most).
    `sizing="strict"`: the largest whole number of pages whose pools, padding page and loc map
    included, fit `memory_bytes`.

    Defaults shared with `kvwrite plan` (`plan_defaults`): `page_size` (the variant's, else
    64), `kv_cache_dtype="auto"` (the model's native format: its dtype, fp8 for DeepSeek V4;
    a float32 model gets float16 as SGLang's `--dtype auto` does), `swa_full_tokens_ratio`
    (SGLang's: 0.8, DeepSeek V4 0.1).

    `max_running_requests`: request slots of the recurrent-state pools (hybrid-linear models,
    `+ 1` padding slot) and of DeepSeek V4's c128 state; left unset, the engines' default:
    state memory = `mamba_full_memory_ratio` (0.9) x KV memory (SGLang's
    `mamba_full_memory_ratio`), DeepSeek V4's estimate from the token count and context length.
    `layout="HND"`: paged K/V buffers `[pages, heads, page, dim]`. `reserve_padding_page=False`:
    the -1 padding convention (vLLM), no page 0 held back. `target="npu"`: SGLang's Ascend pool
    layouts (every layer's buffer in one tensor, MLA as nope + rope buffers), stored through
    the torch backend.
    """

    def __init__(self, model: ModelSpec, parallel: ParallelSpec | None = None, *, page_size: int | None = None,
                 kv_cache_dtype: str = "auto", memory_bytes: int | None = None,
                 max_total_num_tokens: int | None = None, swa_full_tokens_ratio: float | None = None,
                 max_running_requests: int | None = None, layout: str = "NHD",
                 reserve_padding_page: bool = True, target: str = "gpu", sizing: str = "engine",
                 mamba_full_memory_ratio: float = MAMBA_FULL_MEMORY_RATIO, engine: str | None = None) -> None:
        if not isinstance(model, ModelSpec):
            raise TypeError(f"model must be a kvwrite.ModelSpec, got {type(model).__name__}")
        parallel = ParallelSpec() if parallel is None else parallel
        if not isinstance(parallel, ParallelSpec):
            raise TypeError(f"parallel must be a kvwrite.ParallelSpec, got {type(parallel).__name__}")
        if engine is not None:
            parallel = dataclasses.replace(parallel, engine=engine)
        self.model, self.parallel, self.engine = model, parallel, parallel.engine
        defaults = plan_defaults(model.variant)
        self.page_size = require_positive_int("page_size", defaults["page_size"] if page_size is None else page_size)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        self.layout_of_engine = engine_layout(self.engine, model, parallel, kv_cache_dtype, self.page_size)
        self.requested_page_size = self.page_size
        if self.layout_of_engine.page_size:   # the engine's block size (vLLM raises it for GDN hybrids)
            self.page_size = self.layout_of_engine.page_size
        served = self.layout_of_engine.model
        self.planned_model = served.draft() if parallel.is_draft_worker else served
        self.planner = planner_for(self.planned_model.variant)
        defaults = plan_defaults(self.planned_model.variant)
        self.requested_kv_cache_dtype = kv_cache_dtype
        kv_cache_dtype = self.layout_of_engine.kv_cache_dtype
        self.kv_cache_dtype = self.planner.native_kv_cache_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
        if memory_bytes is None and max_total_num_tokens is None:
            raise ConfigError("give memory_bytes (per rank) or max_total_num_tokens (per rank)")
        self.memory_bytes = None if memory_bytes is None else require_positive_int("memory_bytes", memory_bytes)
        self.max_total_num_tokens_per_rank = (None if max_total_num_tokens is None else
                                              require_positive_int("max_total_num_tokens", max_total_num_tokens))
        ratio = defaults["swa_full_tokens_ratio"] if swa_full_tokens_ratio is None else swa_full_tokens_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ConfigError(f"swa_full_tokens_ratio must be in (0, 1], got {ratio!r}")
        self.swa_full_tokens_ratio = float(ratio)
        r = mamba_full_memory_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0:
            raise ConfigError(f"mamba_full_memory_ratio must be a number > 0, got {r!r}")
        self.mamba_full_memory_ratio = float(r)
        if layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if target not in TARGETS:
            raise ConfigError(f"target must be one of {TARGETS}, got {target!r}")
        if sizing not in SIZINGS:
            raise ConfigError(f"sizing must be one of {SIZINGS}, got {sizing!r}")
        if not isinstance(reserve_padding_page, bool):
            raise ConfigError(f"reserve_padding_page must be a bool, got {reserve_padding_page!r}")
        if target == "npu" and (self.kv_cache_dtype != self.planner.native_kv_cache_dtype or layout != "NHD"):
            raise UnsupportedCombination(f"target='npu' (SGLang's Ascend pool layouts) takes kv_cache_dtype='auto' "
                                         f"and layout='NHD', got {kv_cache_dtype!r} and {layout!r}")
        self.layout, self.target, self.reserve_padding_page, self.sizing = layout, target, reserve_padding_page, sizing
        context = PlanContext(self.planned_model, parallel, self.kv_cache_dtype, self.page_size, layout, target)
        self.planner.check_dtype(context)
        self.state_specs = tuple(self.planner.state_pools(context))
        takes_requests = bool(self.state_specs) or self.planner.request_slots
        if max_running_requests is not None:
            if not takes_requests:
                raise ConfigError(f"max_running_requests sizes request-slot pools (recurrent state), and the "
                                  f"planned model ({self.planned_model.name or self.planned_model.variant}, "
                                  f"variant {self.planned_model.variant!r}) has none; leave it unset")
            max_running_requests = require_positive_int("max_running_requests", max_running_requests)
        self.max_running_requests_given = max_running_requests
        self.context = context
        if takes_requests and max_running_requests is None:
            max_running_requests = self._default_requests(context)
        self.max_running_requests = max_running_requests
        self.context = dataclasses.replace(context, max_running_requests=max_running_requests)
        self.pool_specs: tuple[PoolSpec, ...] = tuple(self.planner.pools(self.context))
        names = [p.name for p in self.pool_specs]
        if len(set(names)) != len(names) or not names:
            raise ConfigError(f"planner {self.planner.name!r} returned sub-pool names {names}")

    def _default_requests(self, context: PlanContext) -> int:
        """The engines' request-slot count when max_running_requests is unset."""
        own = self.planner.default_requests(context, self.swa_full_tokens_ratio, self.memory_bytes,
                                            self.max_total_num_tokens_per_rank)
        if own is not None:
            return own
        # SGLang (kv_cache_configurator, mamba pool): state share = total * r / (1 + r) of the memory
        # (r = mamba_full_memory_ratio), slots K = (share - per_slot) // per_slot, K + 1 allocated.
        per_slot = sum(state_plan(st, 1).bytes for st in self.state_specs)
        r = self.mamba_full_memory_ratio
        if self.memory_bytes is not None:
            share = self.memory_bytes * r / (1 + r)
            k = int((share - per_slot) // per_slot)
        else:  # a token count only: state memory = r x the KV memory of those tokens
            tokens = self.max_total_num_tokens_per_rank // self.page_size * self.page_size
            k = int(tokens * self._cell(context) * r // per_slot) - 1
        if k < 1:
            raise BudgetTooSmall(f"the recurrent state ({per_slot} bytes per request slot, "
                                 f"mamba_full_memory_ratio={r}) leaves no request slot in this budget; give "
                                 f"max_running_requests or more memory", 2 * per_slot)
        return k

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
        """Virtual loc rows per local token: a sub-pool indexed by the virtual loc (the DSA
        indexer cache) holds all `dcp_size` ranks' tokens."""
        return self.parallel.dcp_size if spec.virtual else self.loc_space_scale

    # --- sizing ---------------------------------------------------------------------------------
    @property
    def _has_swa(self) -> bool:
        return any(p.space == "swa" for p in self.pool_specs)

    def _sizing(self, pages: int) -> _Sizing:
        # SGLang: swa_tokens = int(full_tokens * ratio) rounded down to whole pages
        P = self.page_size
        swa = int(pages * P * self.swa_full_tokens_ratio) // P if self._has_swa else 0
        return _Sizing(pages, swa)

    def _window_ok(self, s: _Sizing) -> bool:
        if not self._has_swa:
            return True
        window, P = self.planned_model.sliding_window, self.page_size
        swa_tokens = s.swa_pages * P * self.parallel.dcp_size
        if self.sizing == "engine":   # SGLang's admission floor: more than one window plus a page
            return swa_tokens > window + P
        return s.swa_pages >= 1 and swa_tokens >= window

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
            pages = space.num_locs // (P * dcp)
            if spec.virtual:   # SGLang's index pages: page_size rows over the whole virtual space
                geometry = PageGeometry(P, pages * dcp)
            else:
                geometry = PageGeometry(P, pages, loc_space_scale=scale)
            addressing = "sharded" if dcp > 1 and scale == 1 else ("virtual" if dcp > 1 else "local")
            own = self.planner.sub_pool(spec, self.context, pages, scale)
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
        slots = None if self.max_running_requests is None else self.max_running_requests + 1
        return PoolPlan(
            variant=self.planned_model.variant, model=self.planned_model, parallel=self.parallel,
            kv_cache_dtype=self.kv_cache_dtype, page_size=P, loc_space_scale=self.loc_space_scale,
            pool_page_size=self.pool_page_size, max_total_num_tokens=s.pages * self.pool_page_size,
            cell_size_bytes=self.cell_size_bytes, memory_bytes=self.memory_bytes, pools=tuple(pools),
            spaces=spaces, max_running_requests=self.max_running_requests, layout=self.layout, target=self.target,
            state_pools=tuple(state_plan(st, slots, npu) for st in self.state_specs), sizing=self.sizing,
            fixed_bytes=self.fixed_bytes, engine=self.engine, engine_notes=self.layout_of_engine.notes)

    def _kernel(self, spec: PoolSpec, addressing: str) -> str:
        extra = [spec.note] if spec.note else []
        if "loc_map" in spec.needs:
            extra.append("loc_map full->swa")
        if addressing == "sharded":
            extra.append(f"dcp_rank={self.parallel.dcp_rank}/{self.parallel.dcp_size}")
        elif addressing == "virtual":
            extra.append("virtual loc" + (f", {self.page_size}-row index pages" if spec.virtual else ""))
        return spec.op + (f" ({', '.join(extra)})" if extra else "")

    def _cell(self, context: PlanContext) -> float:
        own = self.planner.cell_size(context, self.swa_full_tokens_ratio)
        if own is not None:
            return own
        total = 0.0
        lss = self.loc_space_scale
        specs = self.pool_specs if hasattr(self, "pool_specs") else self.planner.pools(context)
        for spec in specs:
            if spec.alias:   # views another sub-pool's memory
                continue
            rows_per_token = self._pool_scale(spec) / lss
            if spec.space == "swa":
                rows_per_token *= self.swa_full_tokens_ratio
            for b in spec.buffers:
                if b.layout != "map":
                    total += b.row_bytes * rows_per_token * (spec.num_buffers if b.per_layer else 1)
        return total

    @property
    def cell_size_bytes(self) -> float:
        """Bytes per token of `plan().max_total_num_tokens` (SGLang's `cell_size`): every layer's
        K/V rows and their scales, the DSA indexer rows (x dcp_size on a DCP target: it holds all
        ranks' tokens), SWA rows weighted by `swa_full_tokens_ratio`. Not in it, as in SGLang:
        the SWA loc map and the padding page (`overhead_bytes`), request-slot pools (`fixed_bytes`)."""
        return _number(round(self._cell(self.context), 6))

    @property
    def fixed_bytes(self) -> int:
        """Bytes that do not scale with tokens: recurrent-state pools and a variant's own fixed
        pools (DeepSeek V4's c128 state), taken from the budget first."""
        slots = None if self.max_running_requests is None else self.max_running_requests + 1
        state = sum(state_plan(st, slots).bytes for st in self.state_specs) if self.state_specs else 0
        return state + self.planner.fixed_bytes(self.context)

    def total_bytes_for(self, pages: int) -> int:
        """Bytes of the plan whose full loc space has `pages` usable pool pages (plus padding)."""
        return self._assemble(self._sizing(pages)).total_bytes

    @property
    def _pad_inside(self) -> int:
        """1 where the padding page is inside the budget: vLLM's block pool holds its null block
        (block 0) among the num_blocks = memory // bytes-per-block it allocates."""
        return int(self.engine == "vllm" and self.reserve_padding_page)

    def _engine_bytes(self, pages: int) -> float:
        return (pages + self._pad_inside) * self.pool_page_size * self._cell(self.context) + self.fixed_bytes

    def _fits(self, pages: int) -> bool:
        if self.sizing == "engine":
            return self._engine_bytes(pages) <= self.memory_bytes
        return self.total_bytes_for(pages) <= self.memory_bytes

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
            if self.memory_bytes is not None and not self._fits(pages):
                need = math.ceil(self._engine_bytes(pages)) if self.sizing == "engine" else plan.total_bytes
                raise BudgetTooSmall(
                    f"max_total_num_tokens={self.max_total_num_tokens_per_rank} needs {need} "
                    f"bytes per rank ({self.sizing} sizing) but memory_bytes={self.memory_bytes}", need)
            return plan
        budget = self.memory_bytes
        if not self._fits(n_min) and self.sizing == "engine" and self.fixed_bytes and \
                self._engine_bytes(n_min) - self.fixed_bytes <= budget:
            raise BudgetTooSmall(self._fixed_message(budget, n_min), math.ceil(self._engine_bytes(n_min)))
        if not self._fits(n_min):
            minimum = math.ceil(self._engine_bytes(n_min)) if self.sizing == "engine" else self.total_bytes_for(n_min)
            extra = (" plus the padding page" if self.reserve_padding_page and self.sizing == "strict" else "")
            why = (("one page per pool" + extra
                    + (f", and the request-slot pools of {self.max_running_requests} + 1 slots"
                       if self.max_running_requests is not None else "")) if n_min == 1 else
                   f"{n_min} pages: an SWA pool holding the {self.planned_model.sliding_window}-token "
                   f"window at swa_full_tokens_ratio={self.swa_full_tokens_ratio}")
            raise BudgetTooSmall(f"memory_bytes={budget} is too small: the smallest plan ({why}) needs "
                                 f"{minimum} bytes per rank", minimum)
        if self.sizing == "engine":   # SGLang: int(available // cell) // page_size * page_size
            tokens = int((budget - self.fixed_bytes) // self._cell(self.context))
            pages = tokens // self.pool_page_size - self._pad_inside
            while pages > n_min and not self._fits(pages):   # float rounding at the edge
                pages -= 1
            return self._assemble(self._sizing(max(pages, n_min)))
        lo, hi = n_min, n_min * 2
        while self._fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # invariant: fits(lo) and not fits(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._fits(mid) else (lo, mid)
        return self._assemble(self._sizing(lo))

    def _fixed_message(self, budget: int, n_min: int) -> str:
        """The request-slot pools (not the KV pools) exhaust the budget: say so, with the knob."""
        kv_min = math.ceil(self._engine_bytes(n_min) - self.fixed_bytes)
        what = self.planner.fixed_what or "the recurrent-state pools"
        given = self.max_running_requests_given is not None
        origin = ("max_running_requests" if given else
                  "max_running_requests unset: the engine's default")
        fit = 0   # the most request slots that leave room for the smallest KV plan
        lo, hi = 1, self.max_running_requests
        while lo <= hi:
            mid = (lo + hi) // 2
            ctx = dataclasses.replace(self.context, max_running_requests=mid)
            fixed = self.planner.fixed_bytes(ctx) + sum(state_plan(st, mid + 1).bytes for st in self.state_specs)
            lo, hi, fit = (mid + 1, hi, mid) if fixed + kv_min <= budget else (lo, mid - 1, fit)
        hint = (f"give max_running_requests={fit} or fewer" if fit else "no request slot fits: give more memory")
        return (f"memory_bytes={budget} is too small: {what} for {self.max_running_requests} request slots "
                f"({origin}) takes {self.fixed_bytes} bytes per rank, "
                + (f"leaving {budget - self.fixed_bytes} for" if budget > self.fixed_bytes else "all of it and more, none for")
                + f" the KV pools, whose smallest plan needs {kv_min}; {hint} (each slot costs "
                f"{self.fixed_bytes // (self.max_running_requests + 1)} bytes)")

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
            ("max_running_requests", self.max_running_requests_given, None), ("sizing", self.sizing, "engine"),
            ("engine", self.engine, "kvwrite"))
            if v != d)
        return (f"KVCacheConfigurator({self.model.name or self.model.variant}, {self.parallel}, "
                f"page_size={self.page_size}, kv_cache_dtype={self.kv_cache_dtype!r}{extra})")
