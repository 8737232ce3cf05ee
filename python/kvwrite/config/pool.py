"""`KVPool`: a built plan: the buffers on a device, and `store` routing each layer to its
sub-pool(s) and kernel(s)."""
from __future__ import annotations

import inspect
import sys
from typing import Callable

import torch

import kvwrite
from kvwrite import _ext, validate
from kvwrite.config.errors import KernelUnavailable, LayerHasNoKV
from kvwrite.config.registry import planner_for
from kvwrite.errors import ErrorBuffer


def resolve_op(op: str, needs: tuple[str, ...], what: str) -> Callable:
    """The kvwrite store op `op`, checked to accept every keyword in `needs` ("name" or
    "name=value"; a value of `kv_cache_dtype` must be one of the op module's FORMATS)."""
    fn = getattr(kvwrite, op, None)
    if fn is None:
        raise KernelUnavailable(f"{what} needs kvwrite.{op}, which this kvwrite does not provide")
    params = inspect.signature(fn).parameters
    missing = [k for k in needs if k.partition("=")[0] not in params]
    if missing:
        raise KernelUnavailable(f"{what} needs kvwrite.{op}({', '.join(k.partition('=')[0] + '=' for k in missing)}"
                                f"...), which this kvwrite's {op} does not take")
    formats = getattr(sys.modules.get(fn.__module__), "FORMATS", None)
    for k in needs:
        key, _, value = k.partition("=")
        if value and key == "kv_cache_dtype" and formats is not None and value not in formats:
            raise KernelUnavailable(f"{what} needs kvwrite.{op}(kv_cache_dtype={value!r}), which this kvwrite's "
                                    f"{op} does not support (it has {', '.join(formats)})")
    return fn


class KVPool:
    """Every buffer of a `PoolPlan` on `device`, plus `store(layer_id, loc, *tensors, **scales)`.

    `check` / `backend` apply to every store; guard mode records into `self.errors` (check it
    with `pool.errors.raise_if_any()`). Hybrid SWA: `map_swa(full_locs, swa_locs)` fills the
    full->SWA loc map SWA layers translate through (-1 = not mapped, skipped).
    """

    def __init__(self, plan, device: "torch.device | str" = "cpu", *, check: str = "off",
                 backend: str = "auto") -> None:
        self.plan = plan
        self.device = torch.device(device)
        self.check = validate.check_mode(check)
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        self.backend = backend
        self.planner = planner_for(plan.variant)
        what = lambda p: (f"variant {plan.variant!r} with kv_cache_dtype={plan.kv_cache_dtype!r} "  # noqa: E731
                          f"(sub-pool {p.name!r}, {p.addressing})")
        self.ops = {p.name: resolve_op(p.op, p.spec.needs, what(p)) for p in plan.pools}
        self.errors = ErrorBuffer(self.device)
        self.unit_scale = torch.ones((), dtype=torch.float32, device=self.device)
        self.buffers: dict[str, list[dict[str, torch.Tensor]]] = {}
        self.shared: dict[str, dict[str, torch.Tensor]] = {}
        self._index: dict[str, dict[int, int]] = {}
        for p in plan.pools:
            self._index[p.name] = {lid: i for i, lid in enumerate(p.layer_ids)}
            per_layer = [b for b in p.buffers if b.per_layer]
            self.buffers[p.name] = [
                {b.name: torch.zeros(b.shape, dtype=getattr(torch, b.dtype), device=self.device)
                 for b in per_layer} for _ in p.layer_ids]
            self.shared[p.name] = {b.name: torch.full(b.shape, -1, dtype=getattr(torch, b.dtype), device=self.device)
                                   for b in p.buffers if not b.per_layer}
        self._layers = {lid for p in plan.pools for lid in p.layer_ids}
        self._fast: dict = {}   # layer_id -> bound C++ store (see _fast_stores)

    # --- access ---------------------------------------------------------------------------------
    def layer(self, pool: str, layer_id: int) -> dict[str, torch.Tensor]:
        """The buffers of `layer_id` in sub-pool `pool`."""
        try:
            return self.buffers[pool][self._index[pool][layer_id]]
        except KeyError:
            raise LayerHasNoKV(f"sub-pool {pool!r} holds layers {list(self._index.get(pool, {}))}, "
                               f"not {layer_id}") from None

    def op_kwargs(self, pool: str) -> dict:
        """Keywords every store into sub-pool `pool` takes (check, errors, backend, DCP, loc_map)."""
        p = self.plan.pool(pool)
        kw = dict(check=self.check, errors=self.errors, backend=self.backend)
        if p.sharded:
            kw.update(dcp_rank=p.dcp_rank, dcp_size=p.dcp_size)
        if "loc_map" in self.shared[pool]:
            kw["loc_map"] = self.shared[pool]["loc_map"]
        return kw

    @property
    def nbytes(self) -> int:
        per = sum(t.numel() * t.element_size() for layers in self.buffers.values() for d in layers for t in d.values())
        return per + sum(t.numel() * t.element_size() for d in self.shared.values() for t in d.values())

    def allocator(self, space: str = "full"):
        return self.plan.allocator(space)

    def map_swa(self, full_locs: torch.Tensor, swa_locs: torch.Tensor) -> None:
        """Hybrid SWA: full loc `full_locs[i]` is held in the SWA pool at `swa_locs[i]`
        (-1 unmaps it)."""
        maps = [d["loc_map"] for d in self.shared.values() if "loc_map" in d]
        if not maps:
            raise LayerHasNoKV(f"variant {self.plan.variant!r} has no SWA loc map")
        full_locs, swa_locs = torch.as_tensor(full_locs), torch.as_tensor(swa_locs)
        if full_locs.shape != swa_locs.shape:
            raise ValueError(f"full_locs and swa_locs must have one shape, got {tuple(full_locs.shape)} "
                             f"and {tuple(swa_locs.shape)}")
        n = maps[0].shape[0]
        if full_locs.numel() and not (0 <= int(full_locs.min()) and int(full_locs.max()) < n):
            raise ValueError(f"full_locs must be in [0, {n}) (the full allocator's loc space)")
        for m in maps:
            m[full_locs.to(self.device, torch.int64)] = swa_locs.to(self.device, torch.int64)

    def sample_inputs(self, layer_id: int, n: int, generator: torch.Generator | None = None,
                      scale: float = 1.0) -> tuple[torch.Tensor, ...]:
        """Random inputs of the shapes `store(layer_id, loc, *tensors)` takes, for n tokens."""
        self._check_layer(layer_id)
        out = []
        for _, shape, dtype in self.planner.inputs(self.plan, layer_id):
            out.append((torch.randn((n, *shape), generator=generator) * scale).to(dtype).to(self.device))
        return tuple(out)

    def input_names(self, layer_id: int) -> tuple[str, ...]:
        return tuple(n for n, _, _ in self.planner.inputs(self.plan, layer_id))

    # --- the store ------------------------------------------------------------------------------
    def _check_layer(self, layer_id: int) -> None:
        if layer_id not in self._layers:
            m = self.plan.model
            why = ("a linear-attention layer (no KV cache)" if 0 <= layer_id < m.num_layers
                   else f"outside the model's {m.num_layers} layers")
            raise LayerHasNoKV(f"layer {layer_id} is {why}; layers with KV: {sorted(self._layers)}")

    def store(self, layer_id: int, loc: torch.Tensor, *tensors: torch.Tensor, **scales) -> None:
        """Store layer `layer_id`'s tensors for tokens at `loc` (the allocator's locs; -1 = pad).

        Tensors per variant: mha / swa_hybrid / hybrid_linear `(k, v)`; mla `(kv_c, k_pe)`;
        dsa `(kv_c, k_pe, index_k)`; minimax_sparse `(k, v, index_k)`. Scales (keywords): fp8
        `k_scale`/`v_scale` (MHA) or `scale` (MLA), default 1.0; nvfp4 `k_global_scale`/
        `v_global_scale` or `global_scale`; `index_scale`, `index_global_scale` (MiniMax
        index K); `index_scale_fmt` (DSA indexer, e.g. "ue8m0").
        """
        fast = self._fast.get(layer_id)
        if fast is not None and not scales and not torch.compiler.is_compiling():
            try:
                return fast(loc, *tensors)
            except Exception:  # nothing was written: the full path raises the error it deserves
                pass
        self._check_layer(layer_id)
        self.planner.store(self, layer_id, loc, tensors, scales)
        if not self._fast and _ext.LOADED:
            self._fast = self._fast_stores()

    def _fast_stores(self) -> dict:
        """{layer_id: store(loc, k, v)} calling the C++ op torch.ops.kvwrite.store_kv with this
        layer's arguments bound (what `store` would pass it, unit fp8 scales), for the layers of
        plain MHA-style store_kv sub-pools; the other layers take the full path. Built once the
        extension is loaded; `{"_": None}` when no layer qualifies (so it is not rebuilt)."""
        from kvwrite.ops import kv
        from kvwrite.config.variants import MHAPlanner

        out: dict = {}
        if type(self.planner).store is MHAPlanner.store and self.backend in ("auto", "cpu", "cuda"):
            for lid in self._layers:
                sub = self.planner.route(self, lid)
                b, kw = self.layer(sub, lid), self.op_kwargs(sub)
                if self.ops[sub] is not kvwrite.store_kv or "v" not in b:
                    continue
                unit = self.unit_scale if b["k"].dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else None

                def store(loc, k, v, _call=kv._CALL, kc=b["k"], vc=b["v"], s=unit, check=self.check,
                          errors=self.errors.tensor, loc_map=kw.get("loc_map"), r=kw.get("dcp_rank", 0),
                          n=kw.get("dcp_size", 1), backend=self.backend):
                    return _call(k, v, kc, vc, loc, "NHD", s, s, check, errors, loc_map, r, n, backend)

                out[lid] = store
        return out or {"_": None}

    def __repr__(self) -> str:
        return (f"KVPool({self.plan.variant}, {len(self._layers)} layers, {self.nbytes} bytes on {self.device}, "
                f"check={self.check!r}, backend={self.backend!r})")
