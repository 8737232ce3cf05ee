"""Checked page moves: `copy_pages` (pool -> pool, also host <-> GPU), `gather` (rows at locs in
the cache's own dtype), `slot_mapping` (block table -> slots) and `move_rows` (rows inside a pool).

Every pool is a tensor `[pages, rows, ...]`: `rows` token rows per page, each row of the shape
`...` (any strides for pages and rows, the innermost dim contiguous). Kernels see it as a canonical
`[pages, rows, heads, feat]` view (`canonical_pool`). Checks and records: docs/checks.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import validate
from kvwrite.errors import ErrorBuffer
from kvwrite.geometry import GeometryError, PageGeometry
from kvwrite.ops import spec
from kvwrite.ops._common import (POOL_DTYPES, Check, Locs, canonical_pool,  # noqa: F401  (re-exported)
                                 dispatch, impls, prepare)
from kvwrite.pagetable import PageTable

OP_COPY, OP_GATHER, OP_SLOTS, OP_MOVE = "copy_pages", "gather", "slot_mapping", "move_rows"
COPY_IMPLS = impls("pages:copy_pages", "pages:copy_pages", "copy_pages")
GATHER_IMPLS = impls("pages:gather", "pages:gather", "gather")
SLOTS_IMPLS = impls("pages:slot_mapping", "pages:slot_mapping", "slot_mapping")
# move_rows is a gather then a copy_pages, each on the backend the call asked for.
MOVE_IMPLS = tuple((b, "kvwrite.ops.pages:move") for b in ("torch", "triton", "cpu", "cuda"))


# --- copy_pages ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Units:
    """How a pool's pages are counted by a page copy: unit u is rows [(u % factor) * rows, +rows)
    of page u // factor; the pool has `count` units."""

    factor: int
    rows: int
    count: int


@dataclass(slots=True, eq=False)
class CopyPages:
    """A validated copy_pages call on one device: canonical `[pages, rows, H, F]` pools."""

    src: torch.Tensor
    dst: torch.Tensor
    src_pages: torch.Tensor
    dst_pages: torch.Tensor
    src_units: Units
    dst_units: Units
    check: Check

    @property
    def n(self) -> int:
        return self.src_pages.shape[0]

    @property
    def locs(self) -> Locs:
        """The dst pages as the call's addressing (dispatch reads its device and count)."""
        return Locs(self.dst_pages)


def page_units(src: torch.Tensor, dst: torch.Tensor) -> tuple[Units, Units]:
    """(src, dst) units of canonical pools whose page sizes divide, else a GeometryError."""
    ps, pd = src.shape[1], dst.shape[1]
    if ps % pd and pd % ps:
        raise GeometryError(f"src pages hold {ps} rows and dst pages {pd}: {OP_COPY} needs one to be "
                            f"a whole multiple of the other (pages are counted in units of the smaller)")
    unit = min(ps, pd)
    return (Units(ps // unit, unit, src.shape[0] * (ps // unit)),
            Units(pd // unit, unit, dst.shape[0] * (pd // unit)))


def same_rows(src: torch.Tensor, dst: torch.Tensor) -> None:
    """GeometryError unless two pools `[pages, rows, ...]` have one row shape and dtype."""
    if src.dtype != dst.dtype:
        raise GeometryError(f"{OP_COPY}: src rows are {src.dtype} but dst rows are {dst.dtype}; pages move "
                            f"as they are, so the dtypes must match")
    if tuple(src.shape[2:]) != tuple(dst.shape[2:]):
        raise GeometryError(f"{OP_COPY}: src rows have shape {list(src.shape[2:])} but dst rows "
                            f"{list(dst.shape[2:])}; pages move as they are, so the row shapes must match")


@spec.rule(expr="dtype($src) == dtype($dst) && dim($src) == dim($dst) && same_sizes($src, 2, $dst, 2); "
           "size($src, 1) % size($dst, 1) == 0 || size($dst, 1) % size($src, 1) == 0")
def _page_pools(env: dict, v: dict) -> None:
    """src and dst: one row shape and dtype, page sizes a whole multiple of one another."""
    same_rows(v["src"], v["dst"])
    page_units(canonical_pool("src", v["src"]), canonical_pool("dst", v["dst"]))


def _build_copy(v: dict, env: dict, locs: Locs, chk: Check) -> CopyPages:
    s, d = canonical_pool("src", v["src"]), canonical_pool("dst", v["dst"])
    return CopyPages(s, d, v["src_pages"], locs.loc, *page_units(s, d), chk)


TAIL = (spec.CHECK, spec.ERRORS, spec.BACKEND)
IDS = validate.LOC_DTYPES
COPY_SPEC = spec.Op(
    OP_COPY,
    args=(spec.T("src", None, POOL_DTYPES), spec.cache("dst", None, POOL_DTYPES), spec.T("src_pages", "N", IDS),
          spec.Arg("dst_pages", role="addressing"), *TAIL),
    checks=("src", spec.pool("src", bind=False), "dst", spec.pool("dst"), _page_pools, "src_pages",
            spec.pairs("src_pages", "dst_pages")),
    build=_build_copy, impls=COPY_IMPLS, page_table=False, loc="dst_pages", claims="pairs", table_tail=False)


def _to(t: object, device: torch.device) -> object:
    """An index tensor on the pools' device (ids on the host for a GPU pool are moved)."""
    return t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) and t.device != device else t


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor,
               *, check: str | None = None, errors: ErrorBuffer | None = None,
               backend: str = "auto") -> None:
    """Copy page `src_pages[i]` of pool `src` to page `dst_pages[i]` of pool `dst` for every i.

    Pools are `[pages, rows, ...]` tensors with one row shape and dtype (fp8 and quantised pools
    move as bytes), on one device or on two (host <-> GPU: pin the host pool for an asynchronous
    copy). A pair with a -1 on either side is skipped. When the pools page differently by an
    integer factor, page ids count units of the smaller page: a larger page p holds units
    p * factor ... p * factor + factor - 1. Different row shapes or dtypes, or page sizes that do
    not divide, raise GeometryError before anything moves. check="assert"/"guard" check every id
    against its pool's units (KIND_SRC_PAGE / KIND_DST_PAGE records; a bad pair is not copied);
    "off" skips only negative ids. Pairs that write one dst page twice: assert fails, guard
    copies the lowest pair and records the others (KIND_DUPLICATE), off leaves either copy; src
    and dst may be one pool when no page is both read and written by the call (`move_rows`
    reads every source first).
    """
    if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor):
        device = dst.device
        if src.device != device:
            return _copy_across(src, dst, src_pages, dst_pages, check, errors, backend)
        src_pages, dst_pages = _to(src_pages, device), _to(dst_pages, device)
    COPY_SPEC.entry(src, dst, src_pages, dst_pages, check, errors, backend)


def _copy_across(src, dst, src_pages, dst_pages, check, errors, backend) -> None:
    """The page copy between devices: ids checked on the GPU side's record, the src units gathered
    into a (pinned) staging buffer, moved, and scattered into dst, each a same-device page copy."""
    from kvwrite.reference.pages import checked_pairs

    s, d = canonical_pool("src", src), canonical_pool("dst", dst)
    same_rows(src, dst)
    su, du = page_units(s, d)
    side = dst.device if dst.device.type != "cpu" else src.device   # where the record lives
    sp = validate.tensor("src_pages", _to(src_pages, side), ndim=1, dtypes=validate.LOC_DTYPES)
    dp = _to(dst_pages, side)
    spec.pairs("src_pages", "dst_pages")({"N": sp.shape[0]}, {"dst_pages": dp})
    locs, chk = prepare(OP_COPY, side, sp.shape[0], dp, None, 0, 1, check, errors, "dst_pages")
    sp, dp = validate.loc("src_pages", sp, sp.shape[0], side), locs.loc
    n = sp.shape[0]
    if n == 0:
        return
    if chk.mode != "off":   # duplicate dst pages (and bad pairs) first: kvwrite.ops.claims
        from kvwrite.reference.claims import unique_pairs

        dp = unique_pairs(sp, dp, su, du, chk)
    sp, dp = checked_pairs(sp, dp, su, du, chk)       # bad or skipped pairs -> -1 on both sides
    pinned = src.device.type == "cpu" and dst.device.type != "cpu"
    stage = torch.empty((n, su.rows, *s.shape[2:]), dtype=s.dtype, device=src.device, pin_memory=pinned)
    live = torch.where(sp >= 0, torch.arange(n, device=side), -1)
    copy_pages(s, stage, sp.to(src.device), live.to(src.device), check="off", backend=_on(backend, src.device))
    moved = stage.to(dst.device, non_blocking=True)
    copy_pages(moved, d, live.to(dst.device), dp.to(dst.device), check="off", backend=_on(backend, dst.device))


def _on(backend: str, device: torch.device) -> str:
    """The backend of one side of a cross-device copy ("auto" unless it can run there)."""
    if backend in ("cpu", "cuda") and backend != device.type:
        return "auto"
    if backend == "triton" and device.type == "cpu":
        return "auto"
    return backend


# --- gather ----------------------------------------------------------------------------------------

@dataclass(slots=True, eq=False)
class Gather:
    """A validated gather: `cache` canonical `[pages, rows, H, F]`, `out` `[N, H, F]`."""

    cache: torch.Tensor
    out: torch.Tensor
    geometry: PageGeometry
    locs: Locs
    check: Check


@spec.rule(expr="dim($loc) == 1; N = size($loc, 0); dim($out) == dim($cache) - 1 && size($out, 0) == N && "
           "same_sizes($out, 1, $cache, 2)")
def _gather_out(env: dict, v: dict) -> None:
    """out: one row of the cache's row shape per loc, rows `[heads, feat]` runs; binds N."""
    loc, cache, out = v["loc"], v["cache"], v["out"]
    if not (isinstance(loc, torch.Tensor) and loc.dim() == 1):
        validate.tensor("loc", loc, ndim=1)
    n = env["N"] = loc.shape[0]
    validate.shape("out", out, (n, *cache.shape[2:]), "tokens, the cache's row shape")
    c = canonical_pool("cache", cache)
    try:
        o = out.view(n, c.shape[2], c.shape[3])
    except RuntimeError:
        raise ValueError(f"out rows must be [heads, feat] runs (a view of shape [{n}, {c.shape[2]}, "
                         f"{c.shape[3]}]), got strides {out.stride()}") from None
    if c.shape[2] > 1 and o.stride(1) != c.shape[3]:
        raise ValueError(f"out rows must be contiguous, got strides {out.stride()}")


def _build_gather(v: dict, env: dict, locs: Locs, chk: Check) -> Gather:
    c = canonical_pool("cache", v["cache"])
    return Gather(c, v["out"].view(locs.n, c.shape[2], c.shape[3]), env["geometry"], locs, chk)


GATHER_SPEC = spec.Op(
    OP_GATHER,
    args=(spec.T("cache", None, POOL_DTYPES), spec.LOC, spec.cache("out", None, ("=cache",)), *TAIL),
    checks=("cache", spec.pool("cache"), spec.geometry("cache"), "out", _gather_out),
    build=_build_gather, impls=GATHER_IMPLS, claims="read")


def gather(cache: torch.Tensor, loc: torch.Tensor | PageTable, *, check: str | None = None,
           errors: ErrorBuffer | None = None, backend: str = "auto",
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The rows of `cache` `[pages, rows, ...]` at `loc` as `[N, ...]` in the cache's own dtype
    (fp8 stays fp8, quantised rows stay bytes): row `loc[i] % rows` of page `loc[i] // rows`.

    `loc` is int32/int64 `[N]` (-1: a zero row) or a `kvwrite.PageTable` (positions through a
    page table, as the stores take it). check="assert"/"guard": a loc outside the pool is
    reported like a store's (a zero row in guard mode); "off" gives a zero row for negative locs
    and does not check the upper bound on a GPU. `out`: write into this `[N, ...]` tensor.
    """
    if out is None:   # of the cache's row shape and dtype (a bad argument: its error)
        pos = loc.positions if isinstance(loc, PageTable) else loc
        if not (isinstance(cache, torch.Tensor) and isinstance(pos, torch.Tensor) and pos.dim() == 1):
            canonical_pool("cache", cache)
            validate.tensor("loc", pos, ndim=1)
        out = cache.new_empty((pos.shape[0], *cache.shape[2:]))
    GATHER_SPEC.entry(cache, loc, out, check, errors, backend)
    return out


# --- slot_mapping ----------------------------------------------------------------------------------

@dataclass(slots=True, eq=False)
class SlotMapping:
    """A validated slot_mapping: `block_table` `[B, W]` (row stride, unit inner stride)."""

    block_table: torch.Tensor
    batch_indices: torch.Tensor
    positions: torch.Tensor
    out: torch.Tensor
    geometry: PageGeometry
    check: Check

    @property
    def n(self) -> int:
        return self.positions.shape[0]

    @property
    def locs(self) -> Locs:
        """The positions as the call's addressing (dispatch reads its device and count)."""
        return Locs(self.positions)


@spec.rule(expr="isint($page_size) && $page_size >= 1 && isint($num_pages) && $num_pages >= 1")
def _slot_geometry(env: dict, v: dict) -> None:
    env["geometry"] = PageGeometry.from_pool(v["num_pages"], v["page_size"])


def _build_slots(v: dict, env: dict, locs: Locs, chk: Check) -> SlotMapping:
    return SlotMapping(v["block_table"], v["batch_indices"], locs.loc, v["out"], env["geometry"], chk)


SLOTS_SPEC = spec.Op(
    OP_SLOTS,
    args=(spec.T("block_table", "B W", IDS), spec.T("batch_indices", "N", IDS), spec.Arg("positions", role="addressing"),
          spec.cache("out", "N", (torch.int64,), what="one int64 slot per token"), spec.option("page_size", "int"),
          spec.option("num_pages", "int"), *TAIL),
    checks=("block_table", "batch_indices", spec.pairs("batch_indices", "positions"), "out", _slot_geometry),
    build=_build_slots, impls=SLOTS_IMPLS, page_table=False, loc="positions", claims="read", table_tail=False,
    raw_args={"pool_page_size": "a:page_size"})


def slot_mapping(block_table: torch.Tensor, batch_indices: torch.Tensor, positions: torch.Tensor,
                 geometry: PageGeometry, *, check: str | None = None, errors: ErrorBuffer | None = None,
                 backend: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's slot (int64 `[N]`): `block_table[b, pos // ps] * ps + pos % ps`, b =
    `batch_indices[i]`, pos = `positions[i]`, ps = `geometry.pool_page_size` (vLLM's slot
    mapping; the slots a store's `loc` takes).

    -1 where b or pos is -1 (padding), where the table holds a negative page, and, in every mode,
    where b is outside the table's rows or pos // ps past a row's width (the table is never read
    out of bounds). check="assert"/"guard" also report those (KIND_BLOCK_ROW / KIND_BLOCK_INDEX)
    and a page outside the pool's `geometry.num_pages` (KIND_BLOCK_PAGE; its slot is -1 too);
    "off" lets such a page through (the store that takes the slot checks it). `out`: write the
    slots into this int64 `[N]` tensor.
    """
    if not isinstance(geometry, PageGeometry):
        raise TypeError(f"geometry must be a kvwrite.PageGeometry (the pool's page size and pages), "
                        f"got {type(geometry).__name__}")
    if out is None:
        out = validate.tensor("positions", positions).new_empty(positions.shape[:1], dtype=torch.int64)
    SLOTS_SPEC.entry(block_table, batch_indices, positions, out, geometry.pool_page_size, geometry.num_pages,
                     check, errors, backend)
    return out


# --- move_rows -------------------------------------------------------------------------------------

@dataclass(slots=True, eq=False)
class MoveRows:
    """A validated move_rows: `cache` canonical `[pages, rows, H, F]`; `locs` the dst locs."""

    cache: torch.Tensor
    src_loc: torch.Tensor
    geometry: PageGeometry
    locs: Locs
    check: Check
    backend: str


def _build_move(v: dict, env: dict, locs: Locs, chk: Check) -> MoveRows:
    return MoveRows(canonical_pool("cache", v["cache"]), v["src_loc"], env["geometry"], locs, chk, v["backend"])


MOVE_SPEC = spec.Op(
    OP_MOVE,
    args=(spec.cache("cache", None, POOL_DTYPES), spec.T("src_loc", "N", IDS), spec.Arg("dst_loc", role="addressing"),
          *TAIL),
    checks=("cache", spec.pool("cache"), spec.geometry("cache"), "src_loc", spec.pairs("src_loc", "dst_loc")),
    build=_build_move, impls=MOVE_IMPLS, page_table=False, loc="dst_loc", claims="pairs", table_tail=False,
    raw="move_rows")


def move(a: MoveRows) -> None:
    """move_rows on the call's backend: a gather of the source rows, then a copy of one-row units."""
    c, s, n = a.cache, a.src_loc, a.src_loc.shape[0]
    rows = Gather(c, c.new_empty((n, c.shape[2], c.shape[3])), a.geometry, Locs(s), a.check)
    dispatch(OP_GATHER, GATHER_IMPLS, a.backend, c.device, rows)
    capacity = a.geometry.capacity
    ids = torch.where((s >= 0) & (s < capacity), torch.arange(n, device=c.device), -1)
    pairs = CopyPages(rows.out.unsqueeze(1), c, ids, a.locs.loc, Units(1, 1, n), Units(c.shape[1], 1, capacity),
                      a.check)
    dispatch(OP_COPY, COPY_IMPLS, a.backend, c.device, pairs)


def move_rows(cache: torch.Tensor, src_loc: torch.Tensor, dst_loc: torch.Tensor, *,
              check: str | None = None, errors: ErrorBuffer | None = None,
              backend: str = "auto") -> None:
    """Token-granular moves inside one pool `[pages, rows, ...]`: row `dst_loc[i]` takes the row
    that was at `src_loc[i]` (every source row is read before any row is written, as
    `cache[dst] = cache[src]`). A -1 on either side skips the pair; bad locs are reported (op
    "move_rows") and their pair skipped. Runs as a gather then a page copy of one-row units."""
    if isinstance(cache, torch.Tensor):
        src_loc, dst_loc = _to(src_loc, cache.device), _to(dst_loc, cache.device)
    MOVE_SPEC.entry(cache, src_loc, dst_loc, check, errors, backend)
