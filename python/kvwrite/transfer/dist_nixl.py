"""`send_pages` / `recv_pages` with `transport="nixl"`: the torch path's call pair and refusals,
the handshake (layouts, page ids, NIXL metadata) over torch.distributed, the page bytes moved by
one NIXL WRITE; the process's `KVAgent` registers each pool once (keyed by its buffers' memory)."""
from __future__ import annotations

import dataclasses
import itertools
import os
import uuid

import torch
import torch.distributed as dist

from kvwrite import validate
from kvwrite.errors import KIND_SRC_PAGE
from kvwrite.geometry import GeometryError
from kvwrite.transfer.dist import agree
from kvwrite.transfer.layout import PoolLayout, bridge, cache_buffers, tensors_layout
from kvwrite.transfer.nixl import KVAgent, TransferFailed, peer_name
from kvwrite.transfer.pages import TransferPageError, check_pairs

_STATE: dict = {"agent": None, "pools": {}, "peers": {}}
_NAMES = itertools.count()


def process_agent() -> KVAgent:
    """This process's KVAgent for send_pages / recv_pages (made on first use)."""
    if _STATE["agent"] is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        _STATE["agent"] = KVAgent(f"kvwrite-rank{rank}-{os.getpid()}")
    return _STATE["agent"]


def _registered(agent: KVAgent, layout: PoolLayout, raw: list[torch.Tensor]) -> str:
    """The agent's name for this pool, registering it on first use."""
    key = (tuple((t.data_ptr(), t.numel() * t.element_size(), str(t.device)) for t in raw),
           tuple(b.row_key() for b in layout.buffers), layout.page_size, layout.loc_space_scale)
    name = _STATE["pools"].get(key)
    if name is None:
        name = f"pool{next(_NAMES)}"
        agent._add(name, dataclasses.replace(layout, name=name), raw)
        _STATE["pools"][key] = name
    return name


def _load_peer(agent: KVAgent, blob: bytes) -> str:
    """Load a peer's metadata unless this exact blob is loaded already."""
    for name, old in _STATE["peers"].items():
        if old == blob:
            return name
    name = peer_name(blob)
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
            layout = validate.choice("layout", layout, ("NHD", "HND"))
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
    try:
        br = bridge(src, dst, f"src ({src_name})", f"dst ({dst_name})")   # the same verdict on both ranks
    except GeometryError as exc:
        raise GeometryError(f"the two ends of a page transfer disagree: {exc}") from None
    try:
        pairs = check_pairs(sp, dp, br, {"src": f"{src_name}'s pool", "dst": f"{dst_name}'s pool"}, "assert")
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
