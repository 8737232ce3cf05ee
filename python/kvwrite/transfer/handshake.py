"""The two-sided handshake of `send_pages` / `recv_pages` over torch.distributed: each rank sends
what it holds (or why it refuses) and receives the peer's; a refusal is raised on both ranks."""
from __future__ import annotations

import torch.distributed as dist

from kvwrite.geometry import GeometryError


def exchange(mine: dict, peer: int, group, first: bool) -> dict:
    """Send `mine` to `peer` and receive theirs (the sender sends first, so the pair never waits
    on each other)."""
    box = [None]
    if first:
        dist.send_object_list([mine], dst=peer, group=group)
        dist.recv_object_list(box, src=peer, group=group)
    else:
        dist.recv_object_list(box, src=peer, group=group)
        dist.send_object_list([mine], dst=peer, group=group)
    return box[0]


def agree(local: Exception | None, mine: dict, peer: int, group, sending: bool) -> dict:
    """Exchange `mine` (with this rank and its refusal `local`, None: it agrees) with `peer`; raise
    this rank's own refusal, else the peer's (a GeometryError stays one); else the peer's dict."""
    mine = {"rank": dist.get_rank(), "refusal": None if local is None else (type(local).__name__, str(local)),
            **mine}
    theirs = exchange(mine, peer, group, first=sending)
    if local is not None:
        raise local
    if theirs["refusal"] is not None:
        kind, msg = theirs["refusal"]
        cls = GeometryError if kind == "GeometryError" else ValueError
        raise cls(f"page transfer refused by rank {theirs['rank']} (the peer), nothing was moved: {kind}: {msg}")
    return theirs
