"""End to end: tiny decoders (2 layers; GQA, and MLA) run a ragged prefill and greedy decode with
their KV cache written through each engine's adapter (kvwrite.compat) and read back with plain
torch gathers; the logits and the generated tokens equal a contiguous-cache reference exactly,
and the gathered cache rows equal the reference's bytes.

An adapter is a small plug-in (`Adapter`): allocate its per-layer caches, store one step's new
tokens, gather a sequence's first `length` rows. The model code is shared, so any difference can
only come from where the adapter put the bytes.
"""
from __future__ import annotations

import math

import pytest
import torch

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS
from kvwrite.compat import flashinfer as fi

PAGE, PAGES = 4, 24
VOCAB, HIDDEN, LAYERS = 40, 32, 2
HQ, HKV, HD = 4, 2, 8              # GQA: 2 query heads per KV head
LORA, ROPE = 16, 8                 # MLA latent and rope widths
CACHE_DTYPE = torch.bfloat16
PROMPTS = [[3, 17, 5, 9, 22], [8, 1, 30], [4, 4, 11, 2, 19, 25, 7]]
DECODE_STEPS = 3


class Pages:
    """A toy engine allocator: each sequence's pages, drawn in a shuffled order (page 0 kept
    back when the engine reserves it for padding, as SGLang does)."""

    def __init__(self, seed: int, reserve_first: bool = False):
        gen = torch.Generator().manual_seed(seed)
        first = 1 if reserve_first else 0
        self.free = (torch.randperm(PAGES - first, generator=gen) + first).tolist()
        self.tables: dict[int, list[int]] = {}

    def ensure(self, seq: int, length: int) -> list[int]:
        t = self.tables.setdefault(seq, [])
        while len(t) * PAGE < length:
            t.append(self.free.pop())
        return t

    def slot(self, seq: int, pos: int) -> int:
        return self.tables[seq][pos // PAGE] * PAGE + pos % PAGE


class Adapter:
    """One engine's cache convention. `mla`: stores (kv_c, k_pe) rows instead of (k, v)."""

    name = "?"
    mla = False
    backend = "auto"

    def __init__(self):
        self.pages = Pages(seed=len(self.name), reserve_first=False)
        self.errors = kvwrite.ErrorBuffer(DEVICE)

    def store(self, layer: int, a: torch.Tensor, b: torch.Tensor, seqs: list[int], pos: list[int]) -> None:
        raise NotImplementedError

    def gather(self, layer: int, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def _rows(cache: torch.Tensor, pages: list[int], length: int) -> torch.Tensor:
    """[length, ...] rows of a [P, page, ...] cache over `pages` (a plain gather)."""
    return cache[torch.tensor(pages, device=cache.device)].flatten(0, 1)[:length]


class KvwriteLocs(Adapter):
    """kvwrite's own call: store_kv / store_mla with locs page * page_size + row."""

    name = "kvwrite.store_kv"

    def __init__(self, mla: bool, backend: str = "auto"):
        self.mla, self.backend = mla, backend
        super().__init__()
        shape = [(PAGES, PAGE, LORA + ROPE)] if mla else [(PAGES, PAGE, HKV, HD)] * 2
        self.caches = [[torch.zeros(s, dtype=CACHE_DTYPE, device=DEVICE) for s in shape] for _ in range(LAYERS)]

    def store(self, layer, a, b, seqs, pos):
        loc = torch.tensor([self.pages.slot(s, p) for s, p in zip(seqs, pos)], device=DEVICE)
        c = self.caches[layer]
        if self.mla:
            kvwrite.store_mla(a, b, c[0], loc, check="guard", errors=self.errors, backend=self.backend)
        else:
            kvwrite.store_kv(a, b, c[0], c[1], loc, check="guard", errors=self.errors, backend=self.backend)

    def gather(self, layer, seq, length):
        c, pages = self.caches[layer], self.pages.tables[seq]
        if self.mla:
            rows = _rows(c[0], pages, length)
            return rows[:, :LORA], rows[:, LORA:]
        return _rows(c[0], pages, length), _rows(c[1], pages, length)


class FlashInfer(Adapter):
    """flashinfer.page: append_paged_kv_cache into one [P, 2, page, H, D] tensor per layer (NHD)
    or a (k, v) tuple of HND caches; append_paged_mla_kv_cache into separate ckv / kpe caches.
    The step's page table covers the sequences of the step; batch indices and positions come
    from get_batch_indices_positions."""

    def __init__(self, mla: bool, layout: str = "NHD", backend: str = "auto"):
        self.mla, self.layout, self.backend = mla, layout, backend
        self.name = f"flashinfer.{layout}"
        super().__init__()
        z = lambda *s: torch.zeros(s, dtype=CACHE_DTYPE, device=DEVICE)  # noqa: E731
        if mla:
            self.caches = [(z(PAGES, PAGE, LORA), z(PAGES, PAGE, ROPE)) for _ in range(LAYERS)]
        elif layout == "NHD":
            self.caches = [z(PAGES, 2, PAGE, HKV, HD) for _ in range(LAYERS)]
        else:
            self.caches = [(z(PAGES, HKV, PAGE, HD), z(PAGES, HKV, PAGE, HD)) for _ in range(LAYERS)]

    def store(self, layer, a, b, seqs, pos):
        # the engine's view of the step: requests in order, each appending its tokens
        order = list(dict.fromkeys(seqs))
        assert seqs == sorted(seqs, key=order.index), "tokens are grouped per request"
        counts = [seqs.count(s) for s in order]
        seq_lens = torch.tensor([max(p for s2, p in zip(seqs, pos) if s2 == s) + 1 for s in order], device=DEVICE)
        append_indptr = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32, device=DEVICE)
        tables = [self.pages.tables[s] for s in order]
        kv_indptr = torch.tensor([0] + list(torch.tensor([len(t) for t in tables]).cumsum(0)), dtype=torch.int32,
                                 device=DEVICE)
        kv_indices = torch.tensor([p for t in tables for p in t], dtype=torch.int32, device=DEVICE)
        last = ((seq_lens - 1) % PAGE + 1).to(torch.int32)
        bi, positions = fi.get_batch_indices_positions(append_indptr, fi.get_seq_lens(kv_indptr, last, PAGE), len(seqs))
        assert positions.tolist() == pos
        c = self.caches[layer]
        if self.mla:
            fi.append_paged_mla_kv_cache(a, b, bi, positions, c[0], c[1], kv_indices, kv_indptr, last,
                                         check="guard", errors=self.errors, backend=self.backend)
        else:
            fi.append_paged_kv_cache(a, b, bi, positions, c, kv_indices, kv_indptr, last, self.layout,
                                     check="guard", errors=self.errors, backend=self.backend)

    def gather(self, layer, seq, length):
        c, pages = self.caches[layer], self.pages.tables[seq]
        if self.mla:
            return _rows(c[0], pages, length), _rows(c[1], pages, length)
        if self.layout == "NHD":
            return _rows(c[:, 0], pages, length), _rows(c[:, 1], pages, length)
        return _rows(c[0].transpose(1, 2), pages, length), _rows(c[1].transpose(1, 2), pages, length)


class Contiguous:
    """The reference: one contiguous [max_len, ...] cache per (layer, sequence)."""

    def __init__(self, mla: bool):
        self.mla = mla
        self.rows: dict[tuple[int, int], list[torch.Tensor]] = {}

    def store(self, layer, a, b, seqs, pos):
        for i, (s, p) in enumerate(zip(seqs, pos)):
            ka, kb = self.rows.setdefault((layer, s), [torch.zeros(64, *a.shape[1:], dtype=CACHE_DTYPE, device=DEVICE),
                                                       torch.zeros(64, *b.shape[1:], dtype=CACHE_DTYPE, device=DEVICE)])
            ka[p], kb[p] = a[i].to(CACHE_DTYPE), b[i].to(CACHE_DTYPE)

    def gather(self, layer, seq, length):
        ka, kb = self.rows[(layer, seq)]
        return ka[:length], kb[:length]


def weights(mla: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(s, generator=gen) / math.sqrt(s[0])).to(DEVICE)  # noqa: E731
    w = {"emb": torch.randn(VOCAB, HIDDEN, generator=gen).to(DEVICE), "out": r(HIDDEN, VOCAB)}
    for l in range(LAYERS):
        if mla:
            w |= {f"{l}.q_nope": r(HIDDEN, HQ * LORA), f"{l}.q_pe": r(HIDDEN, HQ * ROPE),
                  f"{l}.kv_c": r(HIDDEN, LORA), f"{l}.k_pe": r(HIDDEN, ROPE), f"{l}.o": r(HQ * LORA, HIDDEN)}
        else:
            w |= {f"{l}.q": r(HIDDEN, HQ * HD), f"{l}.k": r(HIDDEN, HKV * HD), f"{l}.v": r(HIDDEN, HKV * HD),
                  f"{l}.o": r(HQ * HD, HIDDEN)}
        w |= {f"{l}.up": r(HIDDEN, 2 * HIDDEN), f"{l}.down": r(2 * HIDDEN, HIDDEN)}
    return w


def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rope(x, pos):
    """Rotary embedding over the last dim (pairs), so a row stored at the wrong position shows."""
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device).float() / d))
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    while cos.dim() < x.dim():
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def step(w, cache, mla: bool, tokens: list[int], seqs: list[int], pos: list[int]) -> torch.Tensor:
    """One forward step over the step's tokens (grouped per sequence); returns logits [N, VOCAB]."""
    p = torch.tensor(pos, device=DEVICE)
    x = w["emb"][torch.tensor(tokens, device=DEVICE)]
    n = len(tokens)
    for l in range(LAYERS):
        h = rms(x)
        if mla:
            q_nope = (h @ w[f"{l}.q_nope"]).view(n, HQ, LORA)
            q_pe = rope((h @ w[f"{l}.q_pe"]).view(n, HQ, ROPE), p)
            a, b = (h @ w[f"{l}.kv_c"]).to(CACHE_DTYPE), rope(h @ w[f"{l}.k_pe"], p).to(CACHE_DTYPE)
        else:
            q = rope((h @ w[f"{l}.q"]).view(n, HQ, HD), p)
            a = rope((h @ w[f"{l}.k"]).view(n, HKV, HD), p).to(CACHE_DTYPE)
            b = (h @ w[f"{l}.v"]).view(n, HKV, HD).to(CACHE_DTYPE)
        cache.store(l, a, b, seqs, pos)
        outs = []
        for i in range(n):  # causal: token i sees its sequence's rows [0, pos_i]
            ka, kb = (t.float() for t in cache.gather(l, seqs[i], pos[i] + 1))
            if mla:
                scores = q_nope[i] @ ka.T + q_pe[i] @ kb.T                     # [HQ, L]
                outs.append((torch.softmax(scores / math.sqrt(LORA + ROPE), -1) @ ka).flatten())
            else:
                kk = ka.repeat_interleave(HQ // HKV, dim=1)                  # [L, HQ, HD]
                vv = kb.repeat_interleave(HQ // HKV, dim=1)
                scores = torch.einsum("hd,lhd->hl", q[i], kk) / math.sqrt(HD)
                outs.append(torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), vv).flatten())
        x = x + torch.stack(outs) @ w[f"{l}.o"]
        x = x + torch.relu(rms(x) @ w[f"{l}.up"]) @ w[f"{l}.down"]
    return rms(x) @ w["out"]


def generate(cache, mla: bool, alloc=None):
    """Ragged prefill of PROMPTS, then DECODE_STEPS greedy steps; (logits per step, tokens)."""
    w = weights(mla)
    seqs = [s for s, pr in enumerate(PROMPTS) for _ in pr]
    pos = [i for pr in PROMPTS for i in range(len(pr))]
    toks = [t for pr in PROMPTS for t in pr]
    lens = [len(pr) for pr in PROMPTS]
    out, logits_all = [[] for _ in PROMPTS], []
    for _ in range(DECODE_STEPS + 1):
        if alloc is not None:
            for s in set(seqs):
                alloc.ensure(s, max(p for s2, p in zip(seqs, pos) if s2 == s) + 1)
        logits = step(w, cache, mla, toks, seqs, pos)
        logits_all.append(logits)
        last = [max(i for i, s2 in enumerate(seqs) if s2 == s) for s in range(len(PROMPTS))]
        nxt = [int(logits[i].argmax()) for i in last]
        for s, t in enumerate(nxt):
            out[s].append(t)
        seqs, pos, toks = list(range(len(PROMPTS))), lens, nxt
        lens = [x + 1 for x in lens]
    return logits_all, out, lens


# name -> (factory(mla, backend), supports MLA). Engines whose adapters live elsewhere plug in
# here with one entry.
ADAPTERS = {
    "kvwrite-locs": (lambda mla, be: KvwriteLocs(mla, be), True),
    "flashinfer-NHD": (lambda mla, be: FlashInfer(mla, "NHD", be), True),
    "flashinfer-HND": (lambda mla, be: FlashInfer(mla, "HND", be), False),
}
CASES = [(name, mla, be) for name, (_, has_mla) in ADAPTERS.items() for mla in (False, True)
         if has_mla or not mla for be in ["torch", *BACKENDS]]


@pytest.fixture(scope="module")
def reference():
    out = {}
    for mla in (False, True):
        cache = Contiguous(mla)
        out[mla] = (*generate(cache, mla), cache)
    return out


@pytest.mark.parametrize("adapter,mla,backend", CASES,
                         ids=[f"{a}-{'mla' if m else 'gqa'}-{b}" for a, m, b in CASES])
def test_decoder_through_adapter_equals_contiguous_cache(reference, adapter, mla, backend):
    eng = ADAPTERS[adapter][0](mla, backend)
    logits, tokens, lens = generate(eng, mla, eng.pages)
    ref_logits, ref_tokens, _, ref_cache = reference[mla]
    eng.errors.raise_if_any()
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) == DECODE_STEPS + 1
    for got, want in zip(logits, ref_logits):
        assert torch.equal(got, want)
    for l in range(LAYERS):
        for s, n in enumerate(lens):
            n -= 1  # the last generated token is never fed back
            for got, want in zip(eng.gather(l, s, n), ref_cache.gather(l, s, n)):
                assert torch.equal(got.view(torch.int16), want.view(torch.int16))
