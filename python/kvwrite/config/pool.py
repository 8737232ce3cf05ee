"""`KVPool`: a built plan: the buffers on a device, and `store` routing each layer to its
sub-pool(s) and kernel(s)."""
from __future__ import annotations

import inspect
import sys
from typing import Callable

import torch

import kvwrite
from kvwrite import validate
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
        if getattr(plan, "target", "gpu") == "npu" and backend not in ("auto", "torch"):
            raise KernelUnavailable(f"a target='npu' plan (SGLang's Ascend layouts) stores through the torch "
                                    f"backend only, got backend={backend!r}")
        self.backend = "torch" if getattr(plan, "target", "gpu") == "npu" else backend
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
            self.buffers[p.name] = self._allocate([b for b in p.buffers if b.per_layer], len(p.layer_ids))
            self.shared[p.name] = {b.name: torch.full(b.shape, -1, dtype=getattr(torch, b.dtype), device=self.device)
                                   for b in p.buffers if not b.per_layer}
        self._layers = {lid for p in plan.pools for lid in p.layer_ids}
        self.states: dict[str, list[dict[str, torch.Tensor]]] = {}
        self._state_index: dict[str, dict[int, int]] = {}
        for st in getattr(plan, "state_pools", ()):
            self.states[st.name] = self._allocate(st.buffers, len(st.layer_ids))
            self._state_index[st.name] = {lid: i for i, lid in enumerate(st.layer_ids)}

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

    # --- access ---------------------------------------------------------------------------------
    def layer(self, pool: str, layer_id: int) -> dict[str, torch.Tensor]:
        """The buffers of `layer_id` in sub-pool `pool`."""
        try:
            return self.buffers[pool][self._index[pool][layer_id]]
        except KeyError:
            raise LayerHasNoKV(f"sub-pool {pool!r} holds layers {list(self._index.get(pool, {}))}, "
                               f"not {layer_id}") from None

    def state(self, layer_id: int, pool: str = "state") -> dict[str, torch.Tensor]:
        """The recurrent-state buffers (`conv`, `ssm`: `[slots, ...]`) of linear layer `layer_id`."""
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
        per = sum(t.numel() * t.element_size() for group in (self.buffers, self.states)
                  for layers in group.values() for d in layers for t in d.values())
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
        self._check_layer(layer_id)
        self.planner.store(self, layer_id, loc, tensors, scales)

    def __repr__(self) -> str:
        return (f"KVPool({self.plan.variant}, {len(self._layers)} layers, {self.nbytes} bytes on {self.device}, "
                f"check={self.check!r}, backend={self.backend!r})")
