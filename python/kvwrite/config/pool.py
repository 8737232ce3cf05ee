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
from kvwrite.config.pool_pages import PageMoves
from kvwrite.config.registry import planner_for
from kvwrite.config.scales import fp8_scale_names
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


class KVPool(PageMoves):
    """Every buffer of a `PoolPlan` on `device`, plus `store(layer_id, loc, *tensors, **scales)`.

    `check` / `backend` apply to every store (`check=None`: the process default, `KVWRITE_CHECK`);
    guard mode records into `self.errors` (check it with `pool.errors.raise_if_any()`).
    `scales`: the fp8 dequant scales of an fp8 pool (required there, an error elsewhere): a dict
    (e.g. `{"k_scale": ks, "v_scale": vs}` for MHA, `{"scale": s}` for MLA; floats or fp32
    tensors) or one number for all of them (`scales=1.0`: explicitly unit scales). A `store()`
    call may pass its own scales instead; a scale the pool's format does not use is an error. Hybrid SWA: `map_swa(full_locs, swa_locs)` fills the
    full->SWA loc map SWA layers translate through (-1 = not mapped, skipped).
    Page moves of every layer at once (`copy_pages`, `move_rows`, `gather`, `slot_mapping`,
    `send_pages` / `recv_pages`): `kvwrite.config.pool_pages.PageMoves`.
    """

    def __init__(self, plan, device: "torch.device | str" = "cpu", *, check: str | None = None,
                 backend: str = "auto", scales: "dict | float | None" = None) -> None:
        self.plan = plan
        self.device = torch.device(device)
        self.check = validate.check_mode(check)
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        if getattr(plan, "target", "gpu") == "npu" and backend not in ("auto", "torch"):
            raise KernelUnavailable(f"a target='npu' plan (SGLang's Ascend layouts) stores through the torch "
                                    f"backend only, got backend={backend!r}")
        self.backend = "torch" if getattr(plan, "target", "gpu") == "npu" else backend
        self.planner = planner_for(plan.variant)
        self.scales = self._build_scales(scales)
        what = lambda p: (f"variant {plan.variant!r} with kv_cache_dtype={plan.kv_cache_dtype!r} "  # noqa: E731
                          f"(sub-pool {p.name!r}, {p.addressing})")
        # a sub-pool without an op holds no K/V (vLLM's GDN states in KV blocks): nothing stores into it
        self.ops = {p.name: resolve_op(p.op, p.spec.needs, what(p)) for p in plan.pools if p.op}
        self.errors = ErrorBuffer(self.device)
        self.buffers: dict[str, list[dict[str, torch.Tensor]]] = {}
        self.shared: dict[str, dict[str, torch.Tensor]] = {}
        self._index: dict[str, dict[int, int]] = {}
        self._pages: dict[str, list[torch.Tensor]] = {}   # block-major copies: [pages, page bytes] each
        for p in sorted(plan.pools, key=lambda p: bool(p.spec.alias)):   # memory owners first
            self._index[p.name] = {lid: p.spec.slot(i) for i, lid in enumerate(p.layer_ids)}
            per_layer = [b for b in p.buffers if b.per_layer]
            if p.spec.block_major:
                pages = p.geometry.num_pages
                self._pages[p.name] = [torch.zeros(pages, sum(b.bytes for b in per_layer) // pages, dtype=torch.uint8,
                                                   device=self.device) for _ in range(p.spec.num_buffers)]
                self.buffers[p.name] = self._carve(self._pages[p.name], p, per_layer)
            elif p.spec.alias and p.spec.alias in self._pages:
                self.buffers[p.name] = self._carve(self._pages[p.spec.alias], p, per_layer)
            elif p.spec.alias:
                self.buffers[p.name] = self._alias_views(plan.pool(p.spec.alias), p, per_layer)
            else:
                self.buffers[p.name] = self._allocate(per_layer, p.spec.num_buffers)
            self.shared[p.name] = {b.name: torch.full(b.shape, -1, dtype=getattr(torch, b.dtype), device=self.device)
                                   for b in p.buffers if not b.per_layer}
        self._layers = {lid for p in plan.pools if p.op for lid in p.layer_ids}
        self.states: dict[str, list[dict[str, torch.Tensor]]] = {}
        self._state_index: dict[str, dict[int, int]] = {}
        for st in getattr(plan, "state_pools", ()):
            self.states[st.name] = self._allocate(st.buffers, len(st.layer_ids))
            self._state_index[st.name] = {lid: i for i, lid in enumerate(st.layer_ids)}
        self._fast: dict = {}   # layer_id -> bound C++ store (see _fast_stores)

    def _allocate(self, buffers, num_layers: int) -> list[dict[str, torch.Tensor]]:
        """Zeroed per-layer buffers; a `stacked` buffer is one `[num_layers, *shape]` tensor whose
        layer views the dicts hold (the Ascend pools' contiguous all-layer allocation)."""
        layers: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        for b in buffers:
            dtype = getattr(torch, b.dtype)
            if b.stacked:
                whole = torch.zeros((num_layers, *b.shape), dtype=dtype, device=self.device)
                for i in range(num_layers):
                    layers[i][b.name] = whole[i]
            else:
                for i in range(num_layers):
                    layers[i][b.name] = torch.zeros(b.shape, dtype=dtype, device=self.device)
        return layers

    def _carve(self, pages: list[torch.Tensor], sub, buffers) -> list[dict[str, torch.Tensor]]:
        """Sub-pool `sub`'s buffer copies cut from block-major copies `pages` (`[num_pages, page
        bytes]` each): buffer b of copy i is the bytes at b's offset in every page, strided by the page."""
        if sub.spec.num_buffers > len(pages):
            raise ValueError(f"sub-pool {sub.name!r} has {sub.spec.num_buffers} copies, its memory {len(pages)}")
        out = []
        for i in range(sub.spec.num_buffers):
            views, off = {}, 0
            for b in buffers:
                n = b.bytes // pages[i].shape[0]
                if off + n > pages[i].shape[1]:
                    raise ValueError(f"sub-pool {sub.name!r}: its buffers need {off + n} bytes a page, the pages "
                                     f"hold {pages[i].shape[1]}")
                views[b.name] = pages[i][:, off:off + n].view(getattr(torch, b.dtype)).view(b.shape)
                off += n
            out.append(views)
        return out

    def _alias_views(self, owner, sub, buffers) -> list[dict[str, torch.Tensor]]:
        """Sub-pool `sub`'s buffer copies as views of `owner`'s (PoolSpec.alias): copy i, buffer b
        is the bytes of the owner's copy i, buffer b, read with `sub`'s shape and dtype."""
        mine = {b.name: b for b in owner.buffers}
        bad = [b.name for b in buffers if b.name not in mine or mine[b.name].bytes != b.bytes]
        if bad or sub.spec.num_buffers > owner.spec.num_buffers:
            raise ValueError(f"sub-pool {sub.name!r} aliases {owner.name!r} but its buffers {bad or ''} (or its "
                             f"{sub.spec.num_buffers} copies) are not the same bytes")
        out = []
        for i in range(sub.spec.num_buffers):
            src = self.buffers[owner.name][i]
            out.append({b.name: src[b.name].view(torch.uint8).view(getattr(torch, b.dtype)).view(b.shape)
                        for b in buffers})
        return out

    def _build_scales(self, scales) -> dict[str, torch.Tensor]:
        """The build-time scales, checked: every fp8 scale given, nothing that does not apply."""
        kv = self.plan.kv_cache_dtype
        allowed = tuple(getattr(self.planner, "SCALES", ()))
        need = fp8_scale_names(allowed, kv)
        what = f"variant {self.plan.variant!r} with kv_cache_dtype={kv!r}"
        if scales is None:
            if need:
                raise ValueError(f"{what} needs its fp8 scales at build: build(..., scales={{"
                                 + ", ".join(f"{n!r}: ..." for n in need) + "}) (fp32, [] or [1] / [H]), "
                                 "or scales=1.0 for unit scales")
            return {}
        if isinstance(scales, (int, float)) and not isinstance(scales, bool):
            if not need:
                raise ValueError(f"scales={scales!r}: {what} has no fp8 scales")
            scales = {n: float(scales) for n in need}
        if not isinstance(scales, dict):
            raise TypeError(f"scales must be a dict of name -> scale or a number, got {type(scales).__name__}")
        bad = sorted(set(scales) - set(need))
        if bad:
            raise ValueError(f"scales {bad} do not apply to {what} (its build-time scales: {need or 'none'})")
        missing = [n for n in need if n not in scales]
        if missing:
            raise ValueError(f"{what} needs scales {missing} at build too (or scales=1.0)")
        out = {}
        for n, s in scales.items():
            t = torch.as_tensor(s, dtype=torch.float32).to(self.device) if not isinstance(s, torch.Tensor) else s
            out[n] = validate.scale(n, t, t.numel() if t.dim() == 1 else None, self.device)
        return out

    # --- access ---------------------------------------------------------------------------------
    def layer(self, pool: str, layer_id: int) -> dict[str, torch.Tensor]:
        """The buffers of `layer_id` in sub-pool `pool`."""
        try:
            return self.buffers[pool][self._index[pool][layer_id]]
        except KeyError:
            raise LayerHasNoKV(f"sub-pool {pool!r} holds layers {list(self._index.get(pool, {}))}, "
                               f"not {layer_id}") from None

    def state(self, layer_id: int, pool: str = "state") -> dict[str, torch.Tensor]:
        """The recurrent-state buffers (`conv`, `ssm`: `[slots, ...]`) of linear layer `layer_id`
        (vLLM's layout: `[blocks, ...]`, one state a KV block)."""
        if pool not in self.states and pool in self.buffers:
            return self.layer(pool, layer_id)
        try:
            return self.states[pool][self._state_index[pool][layer_id]]
        except KeyError:
            raise LayerHasNoKV(f"state pool {pool!r} holds layers {list(self._state_index.get(pool, {}))}, "
                               f"not {layer_id}") from None

    def op_kwargs(self, pool: str) -> dict:
        """Keywords every store into sub-pool `pool` takes (check, errors, backend, layout, DCP, loc_map)."""
        p = self.plan.pool(pool)
        kw = dict(check=self.check, errors=self.errors, backend=self.backend)
        if any(b.layout == "hnd" for b in p.spec.buffers):
            kw["layout"] = "HND"
        if p.sharded:
            kw.update(dcp_rank=p.dcp_rank, dcp_size=p.dcp_size)
        if "loc_map" in self.shared[pool]:
            kw["loc_map"] = self.shared[pool]["loc_map"]
        return kw

    @property
    def nbytes(self) -> int:
        aliases = {p.name for p in self.plan.pools if p.spec.alias}   # views of another sub-pool's memory
        per = sum(t.numel() * t.element_size() for group in (self.buffers, self.states)
                  for name, layers in group.items() if name not in aliases and name not in self._pages
                  for d in layers for t in d.values())
        per += sum(t.numel() for pages in self._pages.values() for t in pages)
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
        source = getattr(self.plan.model, "kv_source", lambda _: None)(layer_id)
        if source is not None:
            raise LayerHasNoKV(f"layer {layer_id} reuses layer {source}'s KV (the model's KV-shared layers, "
                               f"num_kv_shared_layers): it stores nothing; store into layer {source}")
        if layer_id not in self._layers:
            m = self.plan.model
            why = ("a linear-attention layer (no KV cache)" if 0 <= layer_id < m.num_layers
                   else f"outside the model's {m.num_layers} layers")
            raise LayerHasNoKV(f"layer {layer_id} is {why}; layers with KV: {sorted(self._layers)}")

    def store(self, layer_id: int, loc: torch.Tensor, *tensors: torch.Tensor, **scales) -> None:
        """Store layer `layer_id`'s tensors for tokens at `loc` (the allocator's locs; -1 = pad).

        Tensors per variant: mha / swa_hybrid / hybrid_linear `(k, v)`; mla `(kv_c, k_pe)`;
        dsa `(kv_c, k_pe, index_k)`; minimax_sparse `(k, v, index_k)`. Scales (keywords, only
        those the pool's format uses, else TypeError): fp8 `k_scale`/`v_scale` (MHA) or `scale`
        (MLA), default the build-time scales; nvfp4 `k_global_scale`/`v_global_scale` or
        `global_scale` (default none: 1); `index_scale`, `index_global_scale` (MiniMax index K);
        `index_scale_fmt` (DSA indexer, e.g. "ue8m0").
        """
        fast = self._fast.get(layer_id)
        if fast is not None and not scales and not torch.compiler.is_compiling():
            try:
                return fast(loc, *tensors)
            except Exception:  # nothing was written: the full path raises the error it deserves
                pass
        self._check_layer(layer_id)
        if self.scales:
            self.planner.store(self, layer_id, loc, tensors, {**self.scales, **scales})
        else:
            self.planner.store(self, layer_id, loc, tensors, scales)
        if not self._fast and _ext.LOADED:
            self._fast = self._fast_stores()

    def _fast_stores(self) -> dict:
        """{layer_id: store(loc, k, v)} calling the C++ op torch.ops.kvwrite.store_kv with this
        layer's arguments bound (what `store` would pass it, the build-time fp8 scales), for the layers of
        plain MHA-style store_kv sub-pools; the other layers take the full path. Built once the
        extension is loaded; `{"_": None}` when no layer qualifies (so it is not rebuilt)."""
        from kvwrite.ops import kv
        out: dict = {}
        cls = type(self.planner)   # a planner whose store is the plain MHA one (variants.MHAPlanner.FAST_STORE)
        if cls.store is getattr(cls, "FAST_STORE", None) and self.backend in ("auto", "cpu", "cuda"):
            for lid in self._layers:
                if self.plan.model.kv_source(lid) is not None:
                    continue   # a KV-shared layer stores nothing (_check_layer says so)
                sub = self.planner.route(self, lid)
                b, kw = self.layer(sub, lid), self.op_kwargs(sub)
                if self.ops[sub] is not kvwrite.store_kv or "v" not in b:
                    continue
                if b["k"].dtype == torch.int8 or "k_scale_cache" in b:
                    continue   # int8 / dynamic scales: store_kv's kv_quant kernels (full path)
                fp8 = b["k"].dtype in validate.FP8_MAX
                ks = self.scales.get("k_scale") if fp8 else None
                vs = self.scales.get("v_scale") if fp8 else None
                if fp8 and (ks is None or vs is None):
                    continue

                def store(loc, k, v, _call=kv._CALL, kc=b["k"], vc=b["v"], ks=ks, vs=vs, check=self.check,
                          errors=self.errors.tensor, loc_map=kw.get("loc_map"), r=kw.get("dcp_rank", 0),
                          n=kw.get("dcp_size", 1), backend=self.backend, layout=kw.get("layout", "NHD")):
                    return _call(k, v, kc, vc, loc, layout, ks, vs, check, errors, loc_map, r, n, backend)

                out[lid] = store
        return out or {"_": None}

    def __repr__(self) -> str:
        return (f"KVPool({self.plan.variant}, {len(self._layers)} layers, {self.nbytes} bytes on {self.device}, "
                f"check={self.check!r}, backend={self.backend!r})")
