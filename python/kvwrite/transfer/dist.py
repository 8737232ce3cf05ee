"""`send_pages` / `recv_pages`: page transfers over torch.distributed (`transport="nixl"`, the
default where NIXL is installed: `kvwrite.transfer.dist_nixl`; below, the torch path). Both ranks
exchange their PageSpec and check their ids before any page moves, and raise together when either
refuses; then each buffer's pages are staged with copy_pages, sent as one tensor and scattered."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from kvwrite import validate
from kvwrite.errors import KIND_DST_PAGE, KIND_SRC_PAGE, OutOfBoundsWrite
from kvwrite.geometry import GeometryError, PageGeometry
from kvwrite.ops.pages import copy_pages
from kvwrite.transfer.layout import cache_buffers
from kvwrite.transfer.nixl import available, nixl_api

LAYOUTS = ("NHD", "HND")
TRANSPORTS = ("auto", "torch", "nixl")


@dataclass(frozen=True)
class PageSpec:
    """What both ends of a transfer must agree on."""

    dtypes: tuple[str, ...]                   # one per buffer
    row_shapes: tuple[tuple[int, ...], ...]   # one per buffer
    page_size: int
    loc_space_scale: int
    layout: str
    num_pages: int                            # pages moved in this call


def spec_of(bufs: list[torch.Tensor], n: int, geometry: PageGeometry | None, layout: str) -> PageSpec:
    """This side's PageSpec; `geometry` (page_size, loc_space_scale) must describe the buffers."""
    layout = validate.choice("layout", layout, LAYOUTS)
    rows, pages = bufs[0].shape[1], bufs[0].shape[0]
    if geometry is None:
        geometry = PageGeometry.from_pool(pages, rows)
    if geometry.pool_page_size != rows or geometry.num_pages != pages:
        raise GeometryError(f"geometry pages {geometry.num_pages} x pool_page_size "
                            f"{geometry.pool_page_size} does not describe the cache ({pages} pages of {rows} rows)")
    return PageSpec(tuple(str(b.dtype).replace("torch.", "") for b in bufs), tuple(tuple(b.shape[2:]) for b in bufs),
                    geometry.page_size, geometry.loc_space_scale, layout, n)


def agree(local: Exception | None, mine: dict, peer: int, group, sending: bool) -> dict:
    """Exchange `mine` (with this rank and its refusal `local`, None: it agrees) with `peer`, the
    sender first (so the pair never waits on each other); raise this rank's own refusal, else the
    peer's (a GeometryError stays one); else the peer's dict."""
    mine = {"rank": dist.get_rank(), "refusal": None if local is None else (type(local).__name__, str(local)),
            **mine}
    box = [None]
    if sending:
        dist.send_object_list([mine], dst=peer, group=group)
    dist.recv_object_list(box, src=peer, group=group)
    if not sending:
        dist.send_object_list([mine], dst=peer, group=group)
    theirs = box[0]
    if local is not None:
        raise local
    if theirs["refusal"] is not None:
        kind, msg = theirs["refusal"]
        cls = GeometryError if kind == "GeometryError" else ValueError
        raise cls(f"page transfer refused by rank {theirs['rank']} (the peer), nothing was moved: {kind}: {msg}")
    return theirs


def _page_ids(pages: object, bufs: list[torch.Tensor], side: int) -> torch.Tensor:
    """int64 CPU ids, every one a page of the pool (else OutOfBoundsWrite naming the first)."""
    t = validate.tensor("pages", pages, ndim=1, dtypes=validate.LOC_DTYPES)
    ids = t.to("cpu", torch.int64)
    num_pages, rows = bufs[0].shape[0], bufs[0].shape[1]
    bad = (ids < 0) | (ids >= num_pages)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise OutOfBoundsWrite("transfer", i, int(ids[i]), int(ids[i]), num_pages, rows, int(bad.sum()),
                               kind=side, target=int(ids[i]), limit=num_pages)
    return ids


def _handshake(cache, pages, peer, group, geometry, layout, sending: bool):
    """Validate locally, exchange with the peer, raise on both ranks when either refuses."""
    local, spec, ids, bufs = None, None, None, None
    try:
        bufs = cache_buffers(cache)
        ids = _page_ids(pages, bufs, KIND_SRC_PAGE if sending else KIND_DST_PAGE)
        spec = spec_of(bufs, ids.shape[0], geometry, layout)
    except (ValueError, TypeError, OutOfBoundsWrite) as exc:
        local = exc
    theirs = agree(local, {"spec": None if spec is None else asdict(spec)}, peer, group, sending)
    rank, mine, other = dist.get_rank(), asdict(spec), theirs["spec"]
    diff = [f"{k}: rank {rank} has {mine[k]!r}, rank {theirs['rank']} has {other[k]!r}"
            for k in mine if mine[k] != other[k]]
    if diff:
        raise GeometryError("the two ends of a page transfer disagree, nothing was moved: " + "; ".join(diff))
    return bufs, ids


def transport_of(transport: str) -> str:
    """"nixl" or "torch": `auto` is NIXL where it is installed."""
    validate.choice("transport", transport, TRANSPORTS)
    if transport == "nixl":
        nixl_api()   # NixlUnavailable when it is not installed
    return ("nixl" if available() else "torch") if transport == "auto" else transport


def _stages(cache, pages, peer, group, geometry, layout, transport, pool_layout, sending: bool):
    """NIXL: run the pair, yield nothing. torch: check the pair, then yield (buffer, its staging
    tensor, page ids, staging ids) for each buffer."""
    if transport_of(transport) == "nixl":
        from kvwrite.transfer.dist_nixl import handoff

        handoff(cache, pages, peer, group, geometry, layout, sending, pool_layout)
        return
    bufs, ids = _handshake(cache, pages, peer, group, geometry, layout, sending)
    n = ids.shape[0]
    for b in bufs:
        yield (b, torch.empty((n, *b.shape[1:]), dtype=b.dtype, device=b.device), ids.to(b.device),
               torch.arange(n, device=b.device))


def send_pages(cache: torch.Tensor | Sequence[torch.Tensor], pages: torch.Tensor, dst: int, group=None, *,
               geometry: PageGeometry | None = None, layout: str = "NHD", backend: str = "auto",
               transport: str = "auto", pool_layout=None) -> None:
    """Send pages `pages` of `cache` (a pool `[pages, rows, ...]` or a sequence of them, e.g.
    every layer's K and V) to rank `dst`, which calls `recv_pages` with as many pages. `geometry`
    (page_size, loc_space_scale of the pool) and `layout` are compared with the receiver's;
    without `geometry` the pool's rows per page are its page_size (loc_space_scale 1).
    `transport`: "nixl" (one NIXL WRITE, no staging; page sizes that divide are bridged, ids
    counting units of the smaller page), "torch" (staged through copy_pages, geometries must be
    equal) or "auto" (NIXL where installed). `pool_layout`: (PoolLayout, buffers) of a KVPool
    sub-pool (KVPool.send_pages passes it)."""
    for b, stage, ids, seq in _stages(cache, pages, dst, group, geometry, layout, transport, pool_layout, True):
        copy_pages(b, stage, ids, seq, backend=backend)
        dist.send(stage, dst=dst, group=group)

def recv_pages(cache: torch.Tensor | Sequence[torch.Tensor], pages: torch.Tensor, src: int, group=None, *,
               geometry: PageGeometry | None = None, layout: str = "NHD", backend: str = "auto",
               transport: str = "auto", pool_layout=None) -> None:
    """Receive the pages rank `src` sends with `send_pages` into pages `pages` of `cache` (same
    buffers, in the same order; the same `transport` on both ranks)."""
    for b, stage, ids, seq in _stages(cache, pages, src, group, geometry, layout, transport, pool_layout, False):
        dist.recv(stage, src=src, group=group)
        copy_pages(stage, b, seq, ids, backend=backend)

__all__ = ["PageSpec", "TRANSPORTS", "recv_pages", "send_pages", "spec_of", "transport_of"]
