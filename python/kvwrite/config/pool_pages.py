"""Page moves on a built pool (`KVPool`): every layer's paged buffers of a sub-pool in one call
(copy_pages to another pool, move_rows, gather, slot_mapping, send/recv over torch.distributed)."""
from __future__ import annotations

import torch

from kvwrite.config.errors import LayerHasNoKV


class PageMoves:
    """Mixed into KVPool (which provides plan, buffers, device, check, errors, backend)."""

    def _sub_pool(self, pool: str | None) -> str:
        names = [p.name for p in self.plan.pools]
        if pool is None:
            if len(names) != 1:
                raise ValueError(f"this plan has sub-pools {names} with their own page ids: pass pool=")
            return names[0]
        if pool not in names:
            raise LayerHasNoKV(f"no sub-pool {pool!r}; sub-pools: {names}")
        return pool

    def page_buffers(self, pool: str | None = None) -> list[torch.Tensor]:
        """`[pages, pool_page_size, ...]` views of sub-pool `pool`'s paged buffers, every layer (in
        layer order, buffers in plan order): NHD as they are, HND transposed, byte pages (the DSA
        indexer's, DeepSeek V4's) as `[pages, pool_page_size, page bytes / pool_page_size]`."""
        name = self._sub_pool(pool)
        return [v for layer in self.buffers[name] for v in self._views(name, layer).values()]

    def _views(self, name: str, layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        sub = self.plan.pool(name)
        pps = sub.geometry.pool_page_size
        layouts = {b.name: b.layout for b in sub.spec.buffers}
        out = {}
        for bname, t in layer.items():
            layout = layouts.get(bname, "rows")
            if layout == "hnd":
                t = t.transpose(1, 2)
            elif layout in ("page_major", "dsv4_kv"):
                if t.shape[1] % pps:
                    raise ValueError(f"buffer {bname!r}: a page of {t.shape[1]} bytes is not {pps} equal "
                                     f"rows; it cannot be moved as pages of rows")
                t = t.view(t.shape[0], pps, t.shape[1] // pps)
            elif layout != "rows":
                continue
            out[bname] = t
        return out

    def _kw(self, device: torch.device) -> dict:
        return dict(check=self.check, errors=self.errors if device == self.device else None, backend=self.backend)

    def copy_pages(self, dst: "PageMoves", src_pages: torch.Tensor, dst_pages: torch.Tensor, *,
                   pool: str | None = None) -> None:
        """kvwrite.copy_pages of every layer's buffers of sub-pool `pool` into pool `dst` (the
        same plan's buffers, e.g. a pinned host pool; page sizes may differ by an integer factor)."""
        from kvwrite.ops.pages import copy_pages

        mine, theirs = self.page_buffers(pool), dst.page_buffers(pool)
        if len(mine) != len(theirs):
            raise ValueError(f"dst holds {len(theirs)} paged buffers, this pool {len(mine)}: build both "
                             f"from one plan")
        for a, b in zip(mine, theirs):
            side = b.device if b.device.type != "cpu" else a.device   # where copy_pages records
            copy_pages(a, b, src_pages, dst_pages, **self._kw(side))

    def move_rows(self, src_loc: torch.Tensor, dst_loc: torch.Tensor, *, pool: str | None = None) -> None:
        """kvwrite.move_rows in every layer's buffers of sub-pool `pool` (token-granular moves)."""
        from kvwrite.ops.pages import move_rows

        for t in self.page_buffers(pool):
            move_rows(t, src_loc, dst_loc, **self._kw(t.device))

    def gather(self, layer_id: int, loc: torch.Tensor, *, pool: str | None = None) -> dict[str, torch.Tensor]:
        """{buffer name: kvwrite.gather of layer `layer_id`'s rows at `loc`} (the cache's dtype)."""
        from kvwrite.ops.pages import gather

        name = self._sub_pool(pool)
        views = self._views(name, self.layer(name, layer_id))
        return {b: gather(t, loc, **self._kw(t.device)) for b, t in views.items()}

    def slot_mapping(self, block_table: torch.Tensor, batch_indices: torch.Tensor, positions: torch.Tensor,
                     *, pool: str | None = None) -> torch.Tensor:
        """kvwrite.slot_mapping with sub-pool `pool`'s geometry."""
        from kvwrite.ops.pages import slot_mapping

        geometry = self.plan.pool(self._sub_pool(pool)).geometry
        return slot_mapping(block_table, batch_indices, positions, geometry, **self._kw(block_table.device))

    def send_pages(self, pages: torch.Tensor, dst: int, group=None, *, pool: str | None = None,
                   transport: str = "auto") -> None:
        """kvwrite.transfer.send_pages of every layer's buffers of sub-pool `pool` (`transport`: auto,
        nixl or torch)."""
        from kvwrite.transfer import kvpool_layout, send_pages

        sub = self.plan.pool(self._sub_pool(pool))
        send_pages(self.page_buffers(sub.name), pages, dst, group, geometry=sub.geometry,
                   layout=self._layout(sub), backend=self.backend, transport=transport,
                   pool_layout=kvpool_layout(self, sub.name))

    def recv_pages(self, pages: torch.Tensor, src: int, group=None, *, pool: str | None = None,
                   transport: str = "auto") -> None:
        """kvwrite.transfer.recv_pages into every layer's buffers of sub-pool `pool`."""
        from kvwrite.transfer import kvpool_layout, recv_pages

        sub = self.plan.pool(self._sub_pool(pool))
        recv_pages(self.page_buffers(sub.name), pages, src, group, geometry=sub.geometry,
                   layout=self._layout(sub), backend=self.backend, transport=transport,
                   pool_layout=kvpool_layout(self, sub.name))

    @staticmethod
    def _layout(sub) -> str:
        return "HND" if any(b.layout == "hnd" for b in sub.spec.buffers) else "NHD"
