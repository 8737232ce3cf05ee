"""The plan: every sub-pool's geometry and buffers, the allocator loc space each serves, bytes.

Planners (`kvwrite.config.variants`) describe buffers per row (`BufferSpec`) and group layers
into sub-pools (`PoolSpec`); the configurator turns them into a `PoolPlan` of concrete shapes.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvwrite.config.errors import EngineMismatch
from kvwrite.config.pool import KVPool
from kvwrite.geometry import GeometryError, PageGeometry, require_positive_int

LAYOUTS = ("rows", "hnd", "page_major", "map", "slots", "dsv4_kv", "block")


@dataclass(frozen=True)
class BufferSpec:
    """One buffer of a sub-pool, per layer unless `per_layer` is False.

    `layout`: "rows" -> `[num_pages, pool_page_size, *row_shape]` (NHD); "hnd" -> `[num_pages,
    heads, pool_page_size, *rest]` for `row_shape = (heads, *rest)`; "page_major" (uint8) ->
    `[num_pages, pool_page_size * prod(row_shape)]` (a page's rows then its scales, like the DSA
    indexer cache); "map" -> `[num_locs of the "full" loc space]` (the full->SWA loc map);
    "slots" -> `[request slots, *row_shape]` (a recurrent-state buffer, sized per request);
    "block" -> `[num_pages, *row_shape]` (one row a block: vLLM's recurrent states in KV blocks).
    """

    name: str
    row_shape: tuple[int, ...]
    dtype: str
    layout: str = "rows"
    per_layer: bool = True

    def __post_init__(self) -> None:
        assert self.layout in LAYOUTS, self.layout
        object.__setattr__(self, "row_shape", tuple(int(d) for d in self.row_shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * torch.empty((), dtype=self.torch_dtype).element_size()

    def shape(self, geometry: PageGeometry, full_locs: int) -> tuple[int, ...]:
        if self.layout == "rows":
            return (geometry.num_pages, geometry.pool_page_size, *self.row_shape)
        if self.layout == "hnd":
            return (geometry.num_pages, self.row_shape[0], geometry.pool_page_size, *self.row_shape[1:])
        if self.layout == "slots":
            raise ValueError(f"buffer {self.name!r} is per request slot, not paged")
        if self.layout == "block":
            return (geometry.num_pages, *self.row_shape)
        if self.layout == "page_major":
            return (geometry.num_pages, geometry.pool_page_size * math.prod(self.row_shape))
        if self.layout == "dsv4_kv":  # DeepSeek V4 KV pages: 584 B a token, padded to 576 B
            from kvwrite.ops.dsv4 import kv_page_bytes

            return (geometry.num_pages, kv_page_bytes(geometry.pool_page_size))
        return (full_locs,)


@dataclass(frozen=True)
class PoolSpec:
    """A planner's description of one sub-pool before sizing.

    `space`: the allocator loc space it serves ("full", or "swa" for a hybrid-SWA model's SWA
    layers). `virtual`: addressed by the DCP virtual loc even on a target worker (the DSA indexer
    cache), so its pages are `page_size * dcp_size` rows. `op`: the kvwrite store op;
    `needs`: keywords that op must accept for this sub-pool (checked by `build()`).
    `alias`: the sub-pool whose buffer copies this one views instead of allocating its own (vLLM's
    page-size-unified KV cache groups: copy i of both is the same bytes, each sub-pool reading
    them with its own page size and row shape; `build()` checks the bytes agree). `block_major`:
    each copy is one `[num_pages, page bytes]` allocation, every buffer a strided view at its
    offset in the page (vLLM's K | V pages); an alias of it carves its buffers from the same pages
    (a recurrent state a block, the rest of the page padding).
    """

    name: str
    layer_ids: tuple[int, ...]
    buffers: tuple[BufferSpec, ...]
    op: str
    space: str = "full"
    virtual: bool = False
    needs: tuple[str, ...] = ()
    note: str = ""
    slots: tuple[int, ...] = ()   # per layer of layer_ids, the buffer copy it uses (layers sharing memory)
    regrouped: bool = False       # its rows regrouped into smaller pages than the allocator's (one flat
    #                               slot space, no per-page padding: SGLang's NVFP4 DeepSeek V4 pool)
    alias: str = ""
    block_major: bool = False

    @property
    def num_buffers(self) -> int:
        """Per-layer buffer copies allocated: one a layer, or the distinct `slots` (vLLM's KV cache
        groups share one tensor per position in the group)."""
        return max(self.slots) + 1 if self.slots else len(self.layer_ids)

    def slot(self, i: int) -> int:
        """The buffer copy of the i-th layer of layer_ids."""
        return self.slots[i] if self.slots else i


@dataclass(frozen=True)
class StatePoolSpec:
    """A planner's recurrent-state pool (hybrid-linear models): per layer of `layer_ids`, one
    row per request slot of each buffer (layout "slots")."""

    name: str
    layer_ids: tuple[int, ...]
    buffers: tuple[BufferSpec, ...]


@dataclass(frozen=True)
class LocSpace:
    """An allocator's loc space: `[0, num_locs)` paged in `page_size`-loc units (page 0 is the
    padding page unless `reserve_padding_page` is False: the -1 padding convention). Under DCP
    this is the virtual space of all `dcp_size` ranks."""

    name: str
    page_size: int
    num_locs: int
    dcp_size: int = 1
    reserve_padding_page: bool = True

    def allocator(self):
        from kvwrite.allocator import PagedAllocator

        return PagedAllocator(self.num_locs, self.page_size, reserve_padding_page=self.reserve_padding_page)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BufferPlan:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int            # one copy (one layer)
    per_layer: bool = True
    stacked: bool = False  # all layers in one tensor [num_layers, *shape] (the Ascend pools)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclass(frozen=True)
class SubPoolPlan:
    """One sub-pool: its layers, geometry, buffers, the op that stores into it, the allocator
    loc space it serves and how it is addressed ("local", "sharded" by DCP rank, "virtual")."""

    name: str
    layer_ids: tuple[int, ...]
    geometry: PageGeometry
    buffers: tuple[BufferPlan, ...]
    op: str
    kernel: str
    space: LocSpace
    addressing: str
    dcp_rank: int
    dcp_size: int
    spec: PoolSpec = field(compare=False, repr=False)

    @property
    def bytes(self) -> int:
        """Bytes this sub-pool allocates (0 for an `alias` of another sub-pool's memory)."""
        if self.spec.alias:
            return 0
        return sum(b.bytes * (self.spec.num_buffers if b.per_layer else 1) for b in self.buffers)

    @property
    def sharded(self) -> bool:
        return self.addressing == "sharded"

    def check_allocator(self, page_granularity: int, num_locs: int) -> None:
        """Raise GeometryError unless an allocator paging `[0, num_locs)` in `page_granularity`
        units only hands out locs this sub-pool backs (for a DCP-sharded pool: after the
        virtual -> local translation `loc // dcp_size`)."""
        g = require_positive_int("page_granularity", page_granularity)
        n = require_positive_int("num_locs", num_locs)
        if ((self.spec.virtual and self.addressing != "local") or self.spec.regrouped) and \
                g % self.geometry.pool_page_size == 0:
            g = self.geometry.pool_page_size   # index / regrouped pages: an allocator page is whole pages
        if self.sharded:
            d = self.dcp_size
            if g % d or n % d:
                raise GeometryError(
                    f"sub-pool {self.name!r} is sharded over dcp_size={d} ranks: the allocator's "
                    f"page granularity ({g}) and loc count ({n}) must be multiples of {d}")
            g, n = g // d, n // d
        try:
            self.geometry.check_allocator(g, n)
        except GeometryError as err:
            raise GeometryError(f"sub-pool {self.name!r} ({self.addressing}"
                                f"{f' by {self.dcp_size} ranks' if self.sharded else ''}): {err}") from None

    def to_dict(self) -> dict[str, Any]:
        g = self.geometry
        return dict(
            name=self.name, layer_ids=list(self.layer_ids), num_layers=len(self.layer_ids),
            geometry=dict(page_size=g.page_size, loc_space_scale=g.loc_space_scale,
                          pool_page_size=g.pool_page_size, num_pages=g.num_pages, capacity=g.capacity),
            buffers=[b.to_dict() for b in self.buffers], bytes=self.bytes, op=self.op,
            kernel=self.kernel, addressing=self.addressing, allocator=self.space.to_dict(),
            **({"buffer_slots": list(self.spec.slots)} if self.spec.slots else {}),
            **({"aliases": self.spec.alias} if self.spec.alias else {}),
        )


def buffer_plans(spec: PoolSpec, geometry: PageGeometry, full_locs: int, stacked: bool = False
                 ) -> tuple[BufferPlan, ...]:
    """The concrete buffers of sub-pool `spec` at `geometry` (`full_locs`: the full loc space)."""
    out = []
    for b in spec.buffers:
        shape = b.shape(geometry, full_locs)
        nbytes = math.prod(shape) * torch.empty((), dtype=b.torch_dtype).element_size()
        out.append(BufferPlan(b.name, shape, b.dtype, nbytes, b.per_layer, stacked and b.per_layer))
    return tuple(out)


@dataclass(frozen=True)
class StatePoolPlan:
    """A recurrent-state pool: per layer of `layer_ids`, each buffer `[slots, ...]` with
    `slots = max_running_requests + 1` (one padding slot, as SGLang's Mamba pool)."""

    name: str
    layer_ids: tuple[int, ...]
    slots: int
    buffers: tuple[BufferPlan, ...]

    @property
    def bytes_per_slot(self) -> int:
        return sum(b.bytes for b in self.buffers) * len(self.layer_ids) // self.slots

    @property
    def bytes(self) -> int:
        return sum(b.bytes for b in self.buffers) * len(self.layer_ids)

    def to_dict(self) -> dict[str, Any]:
        return dict(name=self.name, layer_ids=list(self.layer_ids), num_layers=len(self.layer_ids),
                    slots=self.slots, buffers=[b.to_dict() for b in self.buffers],
                    bytes_per_slot=self.bytes_per_slot, bytes=self.bytes)


def state_plan(spec: StatePoolSpec, slots: int, stacked: bool = False) -> StatePoolPlan:
    out = []
    for b in spec.buffers:
        shape = (slots, *b.row_shape)
        out.append(BufferPlan(b.name, shape, b.dtype, math.prod(shape) * torch.empty((), dtype=b.torch_dtype)
                              .element_size(), stacked=stacked))
    return StatePoolPlan(spec.name, spec.layer_ids, slots, tuple(out))


@dataclass(frozen=True)
class PoolPlan:
    """What `KVCacheConfigurator.plan()` decided. `max_total_num_tokens`: the loc space the main
    pools cover (per rank on a target worker; the virtual space on a DCP draft worker)."""

    variant: str
    model: Any                      # the ModelSpec planned (the draft model's on a draft worker)
    parallel: Any
    kv_cache_dtype: str
    page_size: int
    loc_space_scale: int
    pool_page_size: int
    max_total_num_tokens: int
    cell_size_bytes: float
    memory_bytes: int | None
    pools: tuple[SubPoolPlan, ...]
    spaces: dict[str, LocSpace] = field(compare=False)
    state_pools: tuple[StatePoolPlan, ...] = ()
    max_running_requests: int | None = None
    layout: str = "NHD"
    target: str = "gpu"
    sizing: str = "engine"
    fixed_bytes: int = 0
    engine: str = "kvwrite"         # whose layout this is (kvwrite.config.engines)
    engine_notes: tuple[str, ...] = ()   # where the engine's layout differs from the spec as read

    def require_engine(self, engine: str) -> None:
        """Raise EngineMismatch unless this plan is `engine`'s layout: an engine adapter calls it
        before it writes into the plan's pools (a SGLang plan in vLLM's adapters, or the other
        way round, addresses pools the engine's code does not have)."""
        if engine != self.engine:
            raise EngineMismatch(f"this plan is {self.engine}'s layout of {self.model.name or self.variant}; "
                                 f"it cannot be built into {engine}'s adapters: plan it with "
                                 f"KVCacheConfigurator(..., engine={engine!r})")

    @property
    def overhead_bytes(self) -> int:
        """Bytes beside `max_total_num_tokens * cell_size_bytes + fixed_bytes`: the padding page of
        every pool, the SWA loc map, page rounding of compressed pools. Engine sizing allocates
        them beside `memory_bytes`, as SGLang does (its pools take `size + page_size` rows and its
        full->SWA map `size + page_size` int64 entries, neither in `cell_size`)."""
        return self.total_bytes - self.fixed_bytes - round(self.max_total_num_tokens * self.cell_size_bytes)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the paged KV pools (scale with the token count)."""
        return sum(p.bytes for p in self.pools)

    @property
    def state_bytes(self) -> int:
        """Bytes of the recurrent-state pools (scale with max_running_requests, not tokens)."""
        return sum(s.bytes for s in self.state_pools)

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes

    def state_pool(self, name: str = "state") -> StatePoolPlan:
        for s in self.state_pools:
            if s.name == name:
                return s
        raise KeyError(f"no state pool {name!r}; state pools: {[s.name for s in self.state_pools]}")

    def pool(self, name: str) -> SubPoolPlan:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(f"no sub-pool {name!r}; sub-pools: {[p.name for p in self.pools]}")

    def check_allocator(self, page_granularity: int, num_locs: int, space: str = "full") -> None:
        """`SubPoolPlan.check_allocator` for every sub-pool serving `space`'s allocator."""
        serving = [p for p in self.pools if p.space.name == space]
        if not serving:
            raise KeyError(f"no sub-pool serves loc space {space!r}; spaces: {sorted(self.spaces)}")
        for p in serving:
            p.check_allocator(page_granularity, num_locs)

    def verify(self) -> None:
        """Every sub-pool against the allocator of the loc space it serves."""
        for p in self.pools:
            p.check_allocator(p.space.page_size, p.space.num_locs)

    def allocator(self, space: str = "full"):
        """A `PagedAllocator` over `space` (the one this plan's pools are sized for)."""
        if space not in self.spaces:
            raise KeyError(f"no loc space {space!r}; spaces: {sorted(self.spaces)}")
        return self.spaces[space].allocator()

    def replace_geometry(self, pool: str, geometry: PageGeometry) -> "PoolPlan":
        """This plan with one sub-pool's geometry replaced (buffers re-shaped); for experiments
        such as replaying SGLang #33348. `build()` refuses a plan that fails its own allocator
        check unless told `verify=False`."""
        full_locs = self.spaces["full"].num_locs
        pools = tuple(dataclasses.replace(p, geometry=geometry, buffers=buffer_plans(
                          p.spec, geometry, full_locs, self.target == "npu"))
                      if p.name == pool else p for p in self.pools)
        self.pool(pool)
        return dataclasses.replace(self, pools=pools)

    def build(self, device: "torch.device | str" = "cpu", check: str | None = None, backend: str = "auto",
              *, verify: bool = True, scales: "dict | float | None" = None, engine: str | None = None):
        """Allocate every buffer on `device` and return a `KVPool` whose `.store(layer_id, loc,
        *tensors, **scales)` routes each layer to its sub-pool and kernel. `check=None`: the
        process default (`KVWRITE_CHECK`); `scales`: an fp8 pool's scales (see `KVPool`);
        `engine`: the engine whose adapters the pool is for (refused unless it is the plan's)."""
        if engine is not None:
            self.require_engine(engine)
        if verify:
            self.verify()
        return KVPool(self, device, check=check, backend=backend, scales=scales)

    def to_dict(self) -> dict[str, Any]:
        par = self.parallel
        return dict(
            variant=self.variant, model=self.model.to_dict(),
            parallel=dict(tp_size=par.tp_size, dcp_size=par.dcp_size, dcp_rank=par.dcp_rank,
                          is_draft_worker=par.is_draft_worker, engine=par.engine,
                          kv_heads_per_rank=(par.kv_heads_per_rank(self.model.num_kv_heads)
                                             if self.model.num_kv_heads else None)),
            kv_cache_dtype=self.kv_cache_dtype, page_size=self.page_size,
            loc_space_scale=self.loc_space_scale, pool_page_size=self.pool_page_size,
            max_total_num_tokens=self.max_total_num_tokens, cell_size_bytes=self.cell_size_bytes,
            total_bytes=self.total_bytes, kv_bytes=self.kv_bytes, state_bytes=self.state_bytes,
            memory_bytes=self.memory_bytes, layout=self.layout, target=self.target,
            max_running_requests=self.max_running_requests, sizing=self.sizing, fixed_bytes=self.fixed_bytes,
            engine=self.engine, engine_notes=list(self.engine_notes),
            overhead_bytes=self.overhead_bytes,
            allocators={k: v.to_dict() for k, v in self.spaces.items()},
            pools=[p.to_dict() for p in self.pools], state_pools=[s.to_dict() for s in self.state_pools],
        )

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kw})
