"""Guard mode inside an engine (`StepGuard`): one record row per registered cache, written by its
stores with no host read, read once per engine step; and `check_namespace`, vLLM #47056's check.
Behaviour and policies: docs/engines.md."""
from __future__ import annotations

import bisect
import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

POLICIES = ("raise", "log", "fail")


@dataclass(frozen=True)
class Route:
    """One engine writer: where it lives, the adapter that replaces it, and where its cache is
    (positional argument `cache_arg`, page-size dim `page_dim`; None: no single cache)."""

    module: str
    attr: str
    adapter: str
    cache_arg: int | None = 2
    page_dim: int = 1


class NamespaceMismatch(ValueError):
    """A layer's cache tensor does not hold the slots its slot_mapping is encoded for (vLLM #47056)."""


@dataclass
class LayerInfo:
    """What the namespace check knows of one registered cache: its layer(s), the block size the
    slot_mapping is encoded with and the rows the allocator's blocks address."""

    names: list[str]
    row: int
    tensor: Any = None          # a weak reference to the registered tensor
    block_size: int | None = None
    rows: int | None = None
    checked: set = field(default_factory=set)


class _Row:
    """An ErrorBuffer over one row of a stacked record tensor (all layers read in one host read)."""

    def __new__(cls, tensor: torch.Tensor):
        from kvwrite.errors import ErrorBuffer

        buf = ErrorBuffer.__new__(ErrorBuffer)
        buf.tensor = tensor
        return buf


class StepGuard:
    """Guard mode for an engine: one record row per registered cache, read once per step.
    `engine` names it in messages; `policy_env` picks what a bad write does, one of `policies`
    (those the engine's hooks implement); errors are logged on `logger`."""

    def __init__(self, engine: str = "engine", policy_env: str = "KVWRITE_GUARD",
                 logger: str = "kvwrite", policies: tuple = POLICIES) -> None:
        self.engine, self.policy_env, self.log = engine, policy_env, logging.getLogger(logger)
        self.layers: dict[tuple[str, int], LayerInfo] = {}
        self.names: list[str] = ["(a cache kvwrite was not told about)"]
        self.records: dict[torch.device, torch.Tensor] = {}
        self.rows: dict[torch.device, list] = {}
        self.stepped = False     # a step hook reads the records: stores do not
        self.step = 0
        self.faults: list[Any] = []
        self.failed: set[str] = set()   # policy "fail": requests the engine is to end with an error
        self.policy = os.environ.get(policy_env, "raise")
        if self.policy not in policies:
            raise ValueError(f"{policy_env} must be one of {policies} for {engine}, got {self.policy!r}")

    def register(self, caches: dict[str, torch.Tensor], block_size: dict[str, int] | None = None,
                 rows: dict[str, int] | None = None) -> None:
        """Name each cache tensor (by data_ptr) after its layer; `block_size` / `rows`: per layer,
        the slot_mapping's block size and the rows the allocator addresses (namespace check).
        Allocates the record rows (call outside any graph capture)."""
        for name, t in caches.items():
            if not isinstance(t, torch.Tensor):
                continue
            key = (t.device.type, t.data_ptr())
            info = self.layers.get(key)
            if info is not None and info.tensor is not None and info.tensor() is None:
                # the memory of a freed cache, reused by a new one: the row gets the new name(s)
                info.names, info.block_size, info.rows, info.checked = [], None, None, set()
            if info is None:
                info = self.layers[key] = LayerInfo([], len(self.names))
                self.names.append(name)
            info.tensor = weakref.ref(t)
            if name not in info.names:
                info.names.append(name)
                self.names[info.row] = ", ".join(info.names)
            info.block_size = (block_size or {}).get(name, info.block_size)
            info.rows = (rows or {}).get(name, info.rows)
            self._allocate(t.device)
        forget_native_rows()

    def _allocate(self, device: torch.device) -> None:
        from kvwrite.errors import NUM_SLOTS, ErrorBuffer

        old = self.records.get(device)
        if old is not None and old.shape[0] >= len(self.names):
            return
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kvwrite: the guard's records are first needed inside a CUDA graph "
                               "capture; register the KV caches (StepGuard.register) before it")
        rec = torch.empty(max(len(self.names), 8) * 2, NUM_SLOTS, dtype=torch.int64, device=device)
        self.records[device] = rec
        self.rows[device] = [_Row(rec[i]) for i in range(rec.shape[0])]
        for r in self.rows[device]:
            ErrorBuffer.reset(r)
        if old is not None:
            rec[:old.shape[0]].copy_(old)
        forget_native_rows()

    def errors_for(self, cache: torch.Tensor | None, route: Route, device: torch.device | None = None):
        """The record row of `cache`'s layer (row 0 for an unregistered cache, or no single cache:
        then on `device`); checks the cache's page size against the layer's namespace the first
        time a shape is seen."""
        device = cache.device if isinstance(cache, torch.Tensor) else (device or torch.device("cpu"))
        info = None
        if isinstance(cache, torch.Tensor):
            info = self.layers.get((device.type, cache.data_ptr()))
            if info is not None and info.block_size and (cache.shape, route.page_dim) not in info.checked:
                check_namespace(info, cache, route)
                info.checked.add((cache.shape, route.page_dim))
        if device not in self.records:
            self._allocate(device)
        return self.rows[device][0 if info is None else info.row]

    def layer_of(self, cache: torch.Tensor) -> str:
        """The registered name of `cache` (by data_ptr), or that it is not registered."""
        info = self.layers.get((cache.device.type, cache.data_ptr()))
        return self.names[0] if info is None else self.names[info.row]

    def raise_now(self, errors, cache: Any) -> None:
        """Without a step hook: read `errors` right after the store (a host read per store) and
        raise its error, with the layer named when `cache` is a tensor."""
        err = errors.error()
        if err is not None:
            errors.reset()
            if isinstance(cache, torch.Tensor):
                err.layer = self.layer_of(cache)
                err.args = (f"kvwrite guard ({self.engine}, layer {err.layer}): {err}",)
            raise err

    def check(self, batch: Callable[[], tuple[list[str], list[int]]] | None = None) -> list:
        """Read every record once (one host read per device); a bad write is raised (policy
        "raise") or logged and counted ("log", "fail"), its message naming step, layer and
        request. `batch()`: the step's request ids and their first tokens (plus the end), read
        only when a record holds a bad write. Policy "fail" adds the requests it leaves without a
        K/V row to `failed` (`_requests_of`)."""
        from kvwrite.errors import COUNT, ErrorBuffer, decode

        found, step = [], None
        for device, rec in self.records.items():
            values = rec.tolist()
            for row, slots in enumerate(values):
                if slots[COUNT] == 0:
                    continue
                err = decode(slots)
                ErrorBuffer.reset(self.rows[device][row])
                if step is None:
                    step = StepBatch(*batch()) if batch is not None else StepBatch([], [])
                layer = self.names[row] if row < len(self.names) else "?"
                where = f"{self.engine} step {self.step}, layer {layer}"
                i = step.request_of(getattr(err, "token_index", None))
                if i is not None:
                    where += f", request {step.ids[i]} (its token {err.token_index - step.starts[i]} of this step)"
                err.layer, err.step = layer, self.step
                err.args = (f"kvwrite guard ({where}): {err}",)
                found.append(err)
                if self.policy == "fail":
                    self.failed.update(_requests_of(err, slots[COUNT], step))
        self.step += 1
        for err in found:
            self.faults.append(err)
            self.log.error("%s", err.args[0])
        if found and self.policy == "raise":
            raise found[0]
        return found

    def take_failed(self) -> set[str]:
        """The requests failed since the last call (policy "fail"), for the engine to end."""
        out, self.failed = self.failed, set()
        return out


@dataclass(frozen=True)
class StepBatch:
    """An engine step's requests: their ids and first tokens (`starts`, one more: the end)."""

    ids: list[str]
    starts: list[int]

    def request_of(self, token: int | None) -> int | None:
        """The index of the request token `token` belongs to (None: no such token)."""
        if token is None:
            return None
        i = bisect.bisect_right(self.starts, token) - 1
        return i if 0 <= i < len(self.ids) else None


def _requests_of(err: Any, count: int, step: StepBatch) -> list[str]:
    """The requests a recorded bad write leaves without a K/V row: its token's (and, for a
    duplicated row, the first writer's, whose row went elsewhere); all of the step's when the
    record counted more bad writes than it names or names no request."""
    mine = [step.request_of(getattr(err, "token_index", None)), step.request_of(getattr(err, "first_token", None))]
    if count != 1 or mine[0] is None:
        return list(step.ids)
    return [step.ids[i] for i in mine if i is not None]


def forget_native_rows() -> None:
    """The C++ routes (csrc/engines.h) forget their record rows: caches were (re)registered or the
    records reallocated; each cache's next store goes through Python, which hands its row over again."""
    from kvwrite import _ext

    if _ext.LOADED:
        torch.ops.kvwrite_ext.engine_guard_clear()


def check_namespace(info: LayerInfo, cache: torch.Tensor, route: Route) -> None:
    """Refuse a cache whose pages do not hold the slots the layer's slot_mapping encodes:
    the block size must be a whole number of the cache's pages and the cache must hold every
    row the allocator's blocks address (vLLM #47056: encoded with 16, decoded with 4)."""
    if cache.dim() <= route.page_dim:
        return
    page = int(cache.shape[route.page_dim])
    pages = int(cache.shape[0])
    layer = ", ".join(info.names)
    if page <= 0 or info.block_size % page:
        raise NamespaceMismatch(
            f"kvwrite: layer {layer}: slot_mapping is encoded with block size {info.block_size} but "
            f"the cache tensor its backend writes has pages of {page} rows (shape {list(cache.shape)}): "
            f"a block is not a whole number of pages, slots decode to the wrong rows")
    if info.rows is not None and pages * page < info.rows:
        raise NamespaceMismatch(
            f"kvwrite: layer {layer}: the allocator addresses {info.rows} rows (blocks of "
            f"{info.block_size}) but the cache tensor its backend writes holds {pages} pages of "
            f"{page} rows = {pages * page} (shape {list(cache.shape)}): slots encoded with block "
            f"size {info.block_size} decode past the cache's pages (vLLM #47056)")


