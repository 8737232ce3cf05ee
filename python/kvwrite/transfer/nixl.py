"""Page transfers on NIXL: `KVAgent`, every transfer checked against both pools first (docs/transfer.md)."""
from __future__ import annotations

import functools
import importlib
import json
import struct
import time
from dataclasses import astuple, dataclass, replace
from typing import Sequence

import torch

from kvwrite.errors import ErrorBuffer
from kvwrite.geometry import PageGeometry
from kvwrite.transfer.descriptors import PoolAddresses, Region, pair_descs
from kvwrite.transfer.layout import PoolLayout, bridge, kvpool_layout, tensors_layout
from kvwrite.transfer.pages import check_pairs

MAGIC = b"KVWX1"


class NixlUnavailable(ImportError):
    """NIXL is not installed (pip install kvwrite[nixl], i.e. nixl-cu13 or nixl-cu12)."""


class TransferFailed(RuntimeError):
    """NIXL reported an error or the transfer did not finish in time."""


@functools.cache   # the module once found (a failed search raises, so it is repeated: NIXL may be installed later)
def nixl_api():
    """The installed NIXL Python API module (`nixl`, else `nixl_cu13`, else `nixl_cu12`)."""
    errors = []
    for name in ("nixl", "nixl_cu13", "nixl_cu12"):
        try:
            mod = importlib.import_module(name)
            if hasattr(mod, "nixl_agent"):
                return mod
        except ImportError as exc:   # noqa: PERF203 - a few names
            errors.append(f"{name}: {exc}")
    raise NixlUnavailable("NIXL is not installed (pip install 'kvwrite[nixl]', i.e. nixl-cu13 or nixl-cu12): "
                          + "; ".join(errors))


def available() -> bool:
    """Whether NIXL imports here."""
    try:
        return nixl_api() is not None
    except NixlUnavailable:
        return False


@dataclass(frozen=True)
class TransferStats:
    """What one transfer moved."""

    pairs: int          # page units moved
    skipped: int        # pairs skipped (padding -1, or bad ids in guard mode)
    bytes: int
    descriptors: int    # after merging contiguous runs
    seconds: float


@dataclass
class _Pool:
    layout: PoolLayout
    addresses: PoolAddresses
    mem: str             # "DRAM" or "VRAM"
    tensors: tuple = ()  # kept alive while registered (local pools)


def _split(blob: bytes) -> tuple[dict, bytes]:
    """(kvwrite header, NIXL metadata) of a `KVAgent.metadata()` blob."""
    if not isinstance(blob, (bytes, bytearray)) or not bytes(blob).startswith(MAGIC):
        raise ValueError("blob must be the bytes of a peer's KVAgent.metadata()")
    blob = bytes(blob)
    n = struct.unpack(">I", blob[len(MAGIC):len(MAGIC) + 4])[0]
    return json.loads(blob[len(MAGIC) + 4:len(MAGIC) + 4 + n]), blob[len(MAGIC) + 4 + n:]


def peer_name(blob: bytes) -> str:
    """The agent name a `KVAgent.metadata()` blob publishes."""
    return _split(blob)[0]["agent"]


class KVAgent:
    """This process's NIXL agent and the pools it registered (usage: docs/transfer.md)."""

    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",), check: str | None = None) -> None:
        api = nixl_api()
        self.name = str(name)
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=list(backends)))
        self.check = check
        self.pools: dict[str, _Pool] = {}
        self.peers: dict[str, dict[str, _Pool]] = {}
        self._reg: list = []

    def register(self, name: str, tensors: Sequence[torch.Tensor], *, geometry: PageGeometry | None = None,
                 layout: str = "NHD", fmt: str = "auto", heads_per_rank: int | None = None) -> PoolLayout:
        """Register raw pool tensors (`[pages, rows, ...]` NHD or `[pages, H, rows, ...]` HND, one
        page-size namespace, contiguous) under `name`; returns the layout it publishes."""
        return self._add(name, tensors_layout(name, list(tensors), geometry, layout, fmt, heads_per_rank),
                         list(tensors))

    def register_pool(self, pool, sub: str | None = None, name: str | None = None) -> PoolLayout:
        """Register sub-pool `sub` of a built `KVPool` (every layer's buffers) as `name` (default: `sub`'s)."""
        layout, tensors = kvpool_layout(pool, sub)
        if name is not None:
            layout = replace(layout, name=name)
        return self._add(layout.name, layout, tensors)

    def _add(self, name: str, layout: PoolLayout, tensors: list[torch.Tensor]) -> PoolLayout:
        if name in self.pools:
            raise ValueError(f"agent {self.name!r} already registered a pool {name!r}")
        devs = {t.device for t in tensors}
        if len(devs) != 1:
            raise ValueError(f"pool {name!r} has buffers on {sorted(map(str, devs))}: register one device's pool "
                             f"at a time")
        d = devs.pop()
        if d.type not in ("cpu", "cuda"):
            raise ValueError(f"pool {name!r} is on {d}: NIXL moves host (cpu) or CUDA memory")
        mem = "DRAM" if d.type == "cpu" else "VRAM"
        dev = 0 if d.type == "cpu" else d.index if d.index is not None else torch.cuda.current_device()
        regions = [Region(t.data_ptr(), t.numel() * t.element_size(), dev) for t in tensors]
        addresses = PoolAddresses(layout, regions, f"agent {self.name!r}")
        self._reg.append(self.agent.register_memory([(r.addr, r.nbytes, r.device, "") for r in regions], mem))
        self.pools[name] = _Pool(layout, addresses, mem, tuple(tensors))
        return layout

    def metadata(self) -> bytes:
        """NIXL's agent metadata plus each registered pool's layout and regions (a later pool needs a new blob)."""
        pools = {n: dict(layout=p.layout.to_dict(), mem=p.mem, regions=[astuple(r) for r in p.addresses.regions])
                 for n, p in self.pools.items()}
        head = json.dumps(dict(agent=self.name, pools=pools)).encode()
        return MAGIC + struct.pack(">I", len(head)) + head + self.agent.get_agent_metadata()

    def add_peer(self, blob: bytes) -> str:
        """Load a peer's `metadata()` (its layouts checked first); returns its agent name."""
        head, md = _split(blob)
        name, pools = str(head["agent"]), {}
        for pname, p in head["pools"].items():
            layout = PoolLayout.from_dict(p["layout"])
            regions = [Region(int(a), int(b), int(c)) for a, b, c in p["regions"]]
            pools[pname] = _Pool(layout, PoolAddresses(layout, regions, f"agent {name!r}"), p["mem"])
        loaded = self.agent.add_remote_agent(md)
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            raise ValueError(f"peer metadata names agent {name!r} but NIXL loaded {loaded!r}")
        self.peers[name] = pools
        return name

    def peer_layout(self, peer: str, pool: str) -> PoolLayout:
        """The layout peer `peer` published for its pool `pool`."""
        return self._peer_pool(peer, pool).layout

    def _peer_pool(self, peer: str, pool: str) -> _Pool:
        if peer not in self.peers:
            raise ValueError(f"unknown peer {peer!r}: add_peer(its metadata) first (peers: {sorted(self.peers)})")
        if pool not in self.peers[peer]:
            raise ValueError(f"peer {peer!r} registered no pool {pool!r} (it has {sorted(self.peers[peer])})")
        return self.peers[peer][pool]

    def write_pages(self, peer: str, src_pages, dst_pages, *, pool: str, peer_pool: str | None = None,
                    check: str | None = None, errors: ErrorBuffer | None = None, notify: bytes = b"",
                    timeout: float = 120.0) -> TransferStats:
        """Write units `src_pages` of local pool `pool` into units `dst_pages` of the peer's pool
        `peer_pool` (default: the same name); `notify` is delivered to the peer when done."""
        return self._move("WRITE", peer, pool, peer_pool, src_pages, dst_pages, check, errors, notify, timeout)

    def read_pages(self, peer: str, src_pages, dst_pages, *, pool: str, peer_pool: str | None = None,
                   check: str | None = None, errors: ErrorBuffer | None = None, notify: bytes = b"",
                   timeout: float = 120.0) -> TransferStats:
        """Read units `src_pages` of the peer's pool `peer_pool` (default: `pool`) into units `dst_pages` of `pool`."""
        return self._move("READ", peer, pool, peer_pool, src_pages, dst_pages, check, errors, notify, timeout)

    def _move(self, op, peer, pool, peer_pool, src_pages, dst_pages, check, errors, notify, timeout):
        t0, peer_pool = time.perf_counter(), peer_pool or pool
        if pool not in self.pools:
            raise ValueError(f"agent {self.name!r} registered no pool {pool!r} (it has {sorted(self.pools)})")
        local, remote = self.pools[pool], self._peer_pool(peer, peer_pool)
        src, dst = (local, remote) if op == "WRITE" else (remote, local)
        me, them = f"agent {self.name!r}, pool {pool!r}", f"agent {peer!r}, pool {peer_pool!r}"
        where = {"src": me, "dst": them} if op == "WRITE" else {"src": them, "dst": me}
        br = bridge(src.layout, dst.layout, f"src ({where['src']})", f"dst ({where['dst']})")
        pairs = check_pairs(src_pages, dst_pages, br, where, self.check if check is None else check, errors)
        sd, dd = pair_descs(src.addresses, dst.addresses, pairs.src, pairs.dst, br)
        if sd.shape[0] == 0:
            if notify:
                self.agent.send_notif(peer, notify)
            return TransferStats(0, pairs.skipped, 0, 0, time.perf_counter() - t0)
        mine, theirs = (sd, dd) if op == "WRITE" else (dd, sd)
        a = self.agent
        handle = a.initialize_xfer(op, a.get_xfer_descs(mine, local.mem), a.get_xfer_descs(theirs, remote.mem),
                                   peer, notify)
        try:
            state = a.transfer(handle)
            deadline = time.monotonic() + timeout
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferFailed(f"{op} of {pairs.src.size} pages to agent {peer!r} not done after {timeout} s")
                state = a.check_xfer_state(handle)
            if state != "DONE":
                raise TransferFailed(f"NIXL {op} to agent {peer!r} failed (state {state})")
        finally:
            a.release_xfer_handle(handle)
        return TransferStats(int(pairs.src.size), pairs.skipped, int(sd[:, 1].sum()), int(sd.shape[0]),
                             time.perf_counter() - t0)

    def send_notif(self, peer: str, message: bytes) -> None:
        """A notification to `peer` outside any transfer (e.g. "pages read, free them")."""
        self.agent.send_notif(peer, message)

    def wait_notif(self, peer: str, *messages: bytes, timeout: float = 120.0) -> bytes:
        """Block until `peer` delivered one of `messages` (a transfer's `notify` or a send_notif); return it."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.agent.update_notifs().get(peer, [])
            for m in messages:
                if m in got:
                    got.remove(m)
                    return m
            if time.monotonic() > deadline:
                raise TransferFailed(f"no notification {messages} from agent {peer!r} after {timeout} s")
            time.sleep(0.0005)

    def close(self) -> None:
        """Deregister the pools (the agent is released with the object)."""
        for reg in self._reg:
            self.agent.deregister_memory(reg)
        self._reg.clear()
        self.pools.clear()

    def __enter__(self) -> "KVAgent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVAgent({self.name!r}, pools={sorted(self.pools)}, peers={sorted(self.peers)})"

