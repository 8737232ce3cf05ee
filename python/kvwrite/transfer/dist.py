"""`send_pages` / `recv_pages`: page transfers over torch.distributed; both ranks exchange what they hold and
check their ids before any page moves, and raise together when either refuses. NIXL: the handshake carries
layouts, page ids and NIXL metadata, then one WRITE; the process's `KVAgent` registers each pool once (keyed by
its memory). torch: equal PageSpecs; each buffer's pages staged with copy_pages, sent as one tensor, scattered."""
from __future__ import annotations

import functools
import itertools
import os
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Sequence

import torch
import torch.distributed as dist

from kvwrite import validate
from kvwrite.errors import KIND_DST_PAGE, KIND_SRC_PAGE, OutOfBoundsWrite
from kvwrite.geometry import GeometryError, PageGeometry
from kvwrite.ops.pages import copy_pages
from kvwrite.transfer.layout import PoolLayout, bridge, cache_buffers, tensors_layout
from kvwrite.transfer.nixl import KVAgent, TransferFailed, available, nixl_api, peer_name
from kvwrite.transfer.pages import TransferPageError, check_pairs

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
    geometry = geometry or PageGeometry.from_pool(pages, rows)
    if geometry.pool_page_size != rows or geometry.num_pages != pages:
        raise GeometryError(f"geometry pages {geometry.num_pages} x pool_page_size "
                            f"{geometry.pool_page_size} does not describe the cache ({pages} pages of {rows} rows)")
    return PageSpec(tuple(str(b.dtype).replace("torch.", "") for b in bufs), tuple(tuple(b.shape[2:]) for b in bufs),
                    geometry.page_size, geometry.loc_space_scale, layout, n)


def agree(local: Exception | None, mine: dict, peer: int, group, sending: bool) -> dict:
    """Exchange `mine` (plus this rank and its refusal `local`, None: it agrees) with `peer`, sender first;
    raise this rank's refusal, else the peer's (a GeometryError stays one); else return the peer's dict."""
    mine = {"rank": dist.get_rank(), "refusal": None if local is None else (type(local).__name__, str(local)), **mine}
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


def transport_of(transport: str) -> str:
    """"nixl" or "torch": `auto` is NIXL where it is installed."""
    validate.choice("transport", transport, TRANSPORTS)
    if transport == "nixl":
        nixl_api()   # NixlUnavailable when it is not installed
    return ("nixl" if available() else "torch") if transport == "auto" else transport


_STATE: dict = {"pools": {}, "peers": {}}
_NAMES = itertools.count()


@functools.cache
def process_agent() -> KVAgent:
    """This process's KVAgent for send_pages / recv_pages (made on first use)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return KVAgent(f"kvwrite-rank{rank}-{os.getpid()}")


def _registered(agent: KVAgent, layout: PoolLayout, raw: list[torch.Tensor]) -> str:
    """The agent's name for this pool, registering it on first use."""
    key = (tuple((t.data_ptr(), t.numel() * t.element_size(), str(t.device)) for t in raw),
           tuple(b.row_key() for b in layout.buffers), layout.page_size, layout.loc_space_scale)
    name = _STATE["pools"].get(key)
    if name is None:
        name = f"pool{next(_NAMES)}"
        agent._add(name, replace(layout, name=name), raw)
        _STATE["pools"][key] = name
    return name


def _load_peer(agent: KVAgent, blob: bytes) -> str:
    """Load a peer's metadata unless this exact blob is loaded already."""
    name = peer_name(blob)
    if _STATE["peers"].get(name) == blob:
        return name
    if name in agent.peers:
        agent.agent.remove_remote_agent(name)
        del agent.peers[name]
    name = agent.add_peer(blob)
    _STATE["peers"][name] = blob
    return name


def handoff(cache, pages, peer: int, group, geometry, layout: str, sending: bool, pool_layout) -> None:
    """One side of a NIXL send/recv pair (the handshake over torch.distributed, then one write)."""
    local, lay, raw, ids, meta, name = None, None, None, None, None, None
    try:
        if pool_layout is not None:
            lay, raw = pool_layout
        else:
            bufs = cache_buffers(cache)
            layout = validate.choice("layout", layout, LAYOUTS)
            raw = [b.transpose(1, 2) if layout == "HND" else b for b in bufs]   # HND: back to [pages, H, rows, ...]
            for i, t in enumerate(raw):
                if not t.is_contiguous():
                    raise ValueError(f"cache[{i}] is not a contiguous {layout} pool: NIXL moves registered memory "
                                     f"as it is laid out")
            lay = tensors_layout("cache", raw, geometry, layout)
        ids = validate.tensor("pages", pages, ndim=1, dtypes=validate.LOC_DTYPES).to("cpu", torch.int64)
        agent = process_agent()
        name = _registered(agent, lay, raw)
        meta = agent.metadata()
    except (ValueError, TypeError) as exc:
        local = exc
    tag = uuid.uuid4().hex.encode() if sending else None
    theirs = agree(local, {"layout": None if lay is None else lay.to_dict(), "pool": name, "meta": meta,
                           "pages": None if ids is None else ids.tolist(), "tag": tag}, peer, group, sending)
    mine = (lay, f"rank {dist.get_rank()}", ids)
    other = (PoolLayout.from_dict(theirs["layout"]), f"rank {theirs['rank']}",
             torch.tensor(theirs["pages"], dtype=torch.int64))
    (src, src_name, sp), (dst, dst_name, dp) = (mine, other) if sending else (other, mine)
    try:   # the same verdicts on both ranks
        br = bridge(src, dst, f"src ({src_name})", f"dst ({dst_name})")
        pairs = check_pairs(sp, dp, br, {"src": f"{src_name}'s pool", "dst": f"{dst_name}'s pool"}, "assert")
    except GeometryError as exc:
        raise GeometryError(f"the two ends of a page transfer disagree: {exc}") from None
    except TransferPageError as exc:
        if (exc.kind == KIND_SRC_PAGE) == sending:   # the bad id is this side's
            raise
        raise ValueError(f"page transfer refused by rank {theirs['rank']} (the peer), nothing was moved: "
                         f"{type(exc).__name__}: {exc}") from None
    peer_agent = _load_peer(agent, theirs["meta"])
    if sending:
        try:
            agent.write_pages(peer_agent, pairs.src, pairs.dst, pool=name, peer_pool=theirs["pool"], notify=tag)
        except Exception:
            agent.send_notif(peer_agent, tag + b":failed")
            raise
    else:
        got = agent.wait_notif(peer_agent, theirs["tag"], theirs["tag"] + b":failed")
        if got.endswith(b":failed"):
            raise TransferFailed(f"rank {theirs['rank']}'s NIXL write of {len(pairs.src)} pages failed")


def _stages(cache, pages, peer, group, geometry, layout, transport, pool_layout, sending: bool):
    """NIXL: run the pair. torch: check the pair, then yield (buffer, staging tensor, ids, staging ids) per buffer."""
    if transport_of(transport) == "nixl":
        handoff(cache, pages, peer, group, geometry, layout, sending, pool_layout)
        return
    local, spec, ids, bufs = None, None, None, None
    try:
        bufs = cache_buffers(cache)
        ids = validate.tensor("pages", pages, ndim=1, dtypes=validate.LOC_DTYPES).to("cpu", torch.int64)
        num_pages, rows = bufs[0].shape[0], bufs[0].shape[1]
        bad = (ids < 0) | (ids >= num_pages)   # every id a page of the pool, else the first is named
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0, 0])
            raise OutOfBoundsWrite("transfer", i, int(ids[i]), int(ids[i]), num_pages, rows, int(bad.sum()),
                                   kind=KIND_SRC_PAGE if sending else KIND_DST_PAGE, target=int(ids[i]),
                                   limit=num_pages)
        spec = spec_of(bufs, ids.shape[0], geometry, layout)
    except (ValueError, TypeError, OutOfBoundsWrite) as exc:
        local = exc
    theirs = agree(local, {"spec": None if spec is None else asdict(spec)}, peer, group, sending)
    rank, mine, other = dist.get_rank(), asdict(spec), theirs["spec"]
    diff = [f"{k}: rank {rank} has {mine[k]!r}, rank {theirs['rank']} has {other[k]!r}"
            for k in mine if mine[k] != other[k]]
    if diff:
        raise GeometryError("the two ends of a page transfer disagree, nothing was moved: " + "; ".join(diff))
    n = ids.shape[0]
    for b in bufs:
        yield (b, torch.empty((n, *b.shape[1:]), dtype=b.dtype, device=b.device), ids.to(b.device),
               torch.arange(n, device=b.device))


def send_pages(cache: torch.Tensor | Sequence[torch.Tensor], pages: torch.Tensor, dst: int, group=None, *,
               geometry: PageGeometry | None = None, layout: str = "NHD", backend: str = "auto",
               transport: str = "auto", pool_layout=None) -> None:
    """Send pages `pages` of `cache` (a pool `[pages, rows, ...]` or a sequence of them, e.g. every layer's K
    and V) to rank `dst`, which calls `recv_pages` with as many pages. `geometry` (page_size, loc_space_scale
    of the pool) and `layout` are compared with the receiver's; without `geometry` the pool's rows per page
    are its page_size (loc_space_scale 1). `transport`: "nixl" (one NIXL WRITE, no staging; page sizes that
    divide are bridged, ids counting units of the smaller page), "torch" (staged through copy_pages,
    geometries must be equal) or "auto" (NIXL where installed). `pool_layout`: (PoolLayout, buffers) of a
    KVPool sub-pool (KVPool.send_pages passes it)."""
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
