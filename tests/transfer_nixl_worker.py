"""One process of test_transfer_nixl (imported by the spawned processes). "prefill" and "decode"
each build every case's pools (random bytes from fixed seeds, so either side can rebuild the
other's), register them with one KVAgent, exchange metadata over a pipe and run the cases in
order; the destination side checks every byte of its buffers against an oracle written here
with plain indexing (not the descriptor code), and the canary bytes around raw buffers."""
from __future__ import annotations

import json
import traceback
from dataclasses import dataclass

import torch

CANARY = 0xA5
PAD = 64   # canary bytes before and after each raw buffer


@dataclass(frozen=True)
class Pool:
    kind: str        # "kvpool" or "raw"
    variant: str     # kvpool: model variant; raw: "NHD" / "HND"
    fmt: str         # kvpool: kv_cache_dtype; raw: torch dtype name
    page_size: int
    tokens: int      # kvpool: max_total_num_tokens; raw: pages
    seed: int
    scale: int = 1   # loc_space_scale (raw pools)


@dataclass(frozen=True)
class Case:
    name: str
    src: Pool        # on "prefill"
    dst: Pool        # on "decode"
    src_pages: tuple
    dst_pages: tuple
    op: str = "WRITE"          # WRITE: prefill initiates; READ: decode initiates
    check: str = "assert"
    expect: str = ""           # "" (moves) or the error class name the initiator must raise
    text: str = ""             # ... and text its message must hold


def _mha(ps, fmt="auto", seed=0):
    return Pool("kvpool", "mha", fmt, ps, 256, seed)


def _mla(ps, fmt="auto", seed=0):
    return Pool("kvpool", "mla", fmt, ps, 256, seed)


CASES = [
    Case("mha_same_page", _mha(16, seed=1), _mha(16, seed=2), (1, 2, 3, 7), (4, 5, 6, 0)),
    Case("mha_16_into_64", _mha(16, seed=3), _mha(64, seed=4), (1, 2, 3, 4, 9, 10), (4, 5, 6, 7, 13, 8)),
    Case("mha_64_into_16", _mha(64, seed=5), _mha(16, seed=6), (4, 5, 6, 7, 15), (9, 10, 11, 12, 1)),
    Case("mla_16_into_64", _mla(16, seed=7), _mla(64, seed=8), (3, 2, 1, 16), (4, 5, 6, 19)),
    Case("fp8_ds_mla_64_into_16", _mla(64, "fp8_ds_mla", 9), _mla(16, "fp8_ds_mla", 10), (4, 5, 6, 7, 12), (1, 2, 3, 4, 16)),
    Case("nvfp4_mha_16_into_64", _mha(16, "nvfp4", 11), _mha(64, "nvfp4", 12), (1, 2, 3, 4, 5), (8, 9, 10, 11, 19)),
    Case("nvfp4_mla_64_into_16", _mla(64, "nvfp4", 13), _mla(16, "nvfp4", 14), (4, 5, 6, 7), (16, 15, 14, 13)),
    Case("raw_hnd_16_into_64", Pool("raw", "HND", "bfloat16", 16, 8, 15), Pool("raw", "HND", "bfloat16", 64, 3, 16),
         (0, 1, 2, 3, 7, -1), (4, 5, 6, 7, 0, 3)),
    Case("raw_nhd_read_64_from_16", Pool("raw", "NHD", "float16", 16, 12, 17), Pool("raw", "NHD", "float16", 64, 3, 18),
         (0, 1, 2, 3, 11), (8, 9, 10, 11, 1), op="READ"),
    Case("padding_skipped", _mha(16, seed=19), _mha(16, seed=20), (1, -1, 3), (2, 3, -1)),
    # refusals: nothing moves, the destination's bytes are its own
    Case("bad_src_page", _mha(16, seed=21), _mha(16, seed=22), (1, 17), (2, 3), expect="TransferPageError",
         text="pair 1 names src page 17 of src agent 'prefill', pool 'bad_src_page', which has pages [0, 17)"),
    Case("bad_dst_page", _mha(16, seed=23), _mha(64, seed=24), (1, 2), (3, 20), expect="TransferPageError",
         text="pair 1 names dst page 20 of dst agent 'decode', pool 'bad_dst_page', which has pages [0, 20)"),
    Case("bad_remote_src_on_read", _mha(16, seed=25), _mha(16, seed=26), (1, -5), (2, 3), op="READ",
         expect="TransferPageError", text="names src page -5 of src agent 'prefill'"),
    Case("bad_page_off_mode", _mha(16, seed=27), _mha(16, seed=28), (1, 2), (3, 99), check="off",
         expect="TransferPageError", text="names dst page 99"),
    Case("guard_skips_bad", _mha(16, seed=29), _mha(16, seed=30), (1, 2, 3), (4, 40, 6), check="guard"),
    Case("mha_vs_mla", _mha(16, seed=31), _mla(16, seed=32), (1,), (1,), expect="GeometryError",
         text="buffer 0 row_shape"),
    Case("fp8_ds_mla_vs_nvfp4", _mla(16, "fp8_ds_mla", 33), _mla(16, "nvfp4", 34), (1,), (1,), expect="GeometryError",
         text="format: src"),
    Case("pages_do_not_divide", Pool("raw", "NHD", "bfloat16", 16, 4, 35), Pool("raw", "NHD", "bfloat16", 24, 4, 36),
         (0,), (0,), expect="GeometryError", text="pool_page_size: src"),
    Case("loc_space_scale", Pool("raw", "NHD", "bfloat16", 8, 4, 37, scale=2), Pool("raw", "NHD", "bfloat16", 16, 4, 38),
         (0,), (0,), expect="GeometryError", text="loc_space_scale: src"),
]


def _fill(tensors, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        b = t.view(-1).view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))


class Built:
    """A case's pool on one side: its buffers, NHD views, and (raw) the arenas with canaries."""

    def __init__(self, spec: Pool) -> None:
        from kvwrite import PageGeometry

        self.spec, self.kvpool, self.arenas = spec, None, []
        if spec.kind == "kvpool":
            from config_models import TINY
            from kvwrite import KVCacheConfigurator, ParallelSpec

            plan = KVCacheConfigurator(TINY[spec.variant], ParallelSpec(), page_size=spec.page_size,
                                       kv_cache_dtype=spec.fmt, max_total_num_tokens=spec.tokens).plan()
            self.kvpool = plan.build("cpu")
            self.tensors = [t for layer in self.kvpool.buffers["kv"] for t in layer.values()]
            self.views = self.tensors
            self.geometry = plan.pools[0].geometry
        else:
            dtype = getattr(torch, spec.fmt)
            rows = spec.page_size * spec.scale
            shape = (spec.tokens, rows, 2, 8) if spec.variant == "NHD" else (spec.tokens, 2, rows, 8)
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            self.tensors = []
            for _ in range(2):   # K and V
                arena = torch.full((n + 2 * PAD,), CANARY, dtype=torch.uint8)
                self.arenas.append(arena)
                self.tensors.append(arena[PAD:PAD + n].view(dtype).view(shape))
            self.views = self.tensors if spec.variant == "NHD" else [t.transpose(1, 2) for t in self.tensors]
            self.geometry = PageGeometry(spec.page_size, spec.tokens, spec.scale)
        _fill(self.tensors, spec.seed)

    def register(self, agent, name: str) -> None:
        if self.kvpool is not None:
            agent.register_pool(self.kvpool, name=name)
        else:
            agent.register(name, self.tensors, geometry=self.geometry, layout=self.spec.variant)

    def canaries_ok(self) -> bool:
        return all(bool((a[:PAD] == CANARY).all()) and bool((a[-PAD:] == CANARY).all()) for a in self.arenas)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (random bytes hold NaNs: compare bytes, never values)."""
    return t.contiguous().view(-1).view(torch.uint8)


def expected(src: Built, dst: Built, sp, dp, skip=()) -> list[torch.Tensor]:
    """dst's buffers after moving unit sp[i] of src to unit dp[i] of dst (plain indexing)."""
    ps, pd = src.views[0].shape[1], dst.views[0].shape[1]
    unit = min(ps, pd)
    out = [v.clone() for v in dst.views]
    for i, (s, d) in enumerate(zip(sp, dp)):
        if s < 0 or d < 0 or i in skip:
            continue
        for o, sv in zip(out, src.views):
            o[d * unit // pd, d * unit % pd:d * unit % pd + unit] = sv[s * unit // ps, s * unit % ps:s * unit % ps + unit]
    return out


def run(role: str, conn, out: str) -> None:
    import time

    t0, lines = time.perf_counter(), []
    try:
        from kvwrite import ErrorBuffer, GeometryError   # noqa: F401 - GeometryError is a case's expect
        from kvwrite.transfer import KVAgent, TransferPageError   # noqa: F401

        agent = KVAgent(role)
        mine = {}
        for c in CASES:
            mine[c.name] = Built(c.src if role == "prefill" else c.dst)
            mine[c.name].register(agent, c.name)
        lines.append(dict(case="(setup)", role=role, ok=True, why="", t=round(time.perf_counter() - t0, 3)))
        conn.send(agent.metadata())
        peer = agent.add_peer(conn.recv())
        for c in CASES:
            initiator = "prefill" if c.op == "WRITE" else "decode"
            local_is_dst = role == "decode"
            before = [t.clone() for t in mine[c.name].views]
            errors = ErrorBuffer("cpu")
            outcome = "moved"
            if role == initiator:
                fn = agent.write_pages if c.op == "WRITE" else agent.read_pages
                try:
                    st = fn(peer, c.src_pages, c.dst_pages, pool=c.name, check=c.check, errors=errors,
                            notify=c.name.encode() if c.op == "WRITE" else b"")
                    outcome = f"moved {st.pairs} skipped {st.skipped} descriptors {st.descriptors}"
                except Exception as exc:   # noqa: BLE001 - the case says which error it expects
                    outcome = f"{type(exc).__name__}: {exc}"
                conn.send(outcome)
            else:
                outcome = conn.recv()
            ok, why = True, outcome
            if c.expect:
                ok = outcome.startswith(c.expect + ":") and c.text in outcome
            elif not outcome.startswith("moved"):
                ok = False
            if local_is_dst:
                if c.op == "WRITE" and not c.expect:
                    agent.wait_notif(peer, c.name.encode(), timeout=120)
                built = mine[c.name]
                if c.expect:
                    want = before
                else:
                    other = Built(c.src)   # the sender's pool, rebuilt from its seed
                    skip = {i for i, d in enumerate(c.dst_pages) if d * min(c.src.page_size, c.dst.page_size)
                            >= built.geometry.capacity} if c.check == "guard" else set()
                    want = expected(other, built, c.src_pages, c.dst_pages, skip)
                same = all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(built.views, want))
                if not same:
                    ok, why = False, f"destination bytes differ from the oracle ({outcome})"
                if not built.canaries_ok():
                    ok, why = False, "canary bytes around a destination buffer changed"
            else:
                if not all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(mine[c.name].views, before)):
                    ok, why = False, "the source pool changed"
            if c.check == "guard" and role == initiator:
                err = errors.error()
                if err is None or "dst page 40" not in str(err):
                    ok, why = False, f"guard record: {err}"
            lines.append(dict(case=c.name, role=role, ok=ok, why=why, t=round(time.perf_counter() - t0, 3)))
            conn.send("next")
            assert conn.recv() == "next"
        agent.close()
    except Exception:   # noqa: BLE001 - reported to the test
        lines.append(dict(case="*", role=role, ok=False, why=traceback.format_exc()))
    with open(f"{out}.{role}", "w") as f:
        json.dump(lines, f)
