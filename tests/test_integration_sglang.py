"""kvwrite.integrations.sglang without SGLang: fake pool / model-runner classes with SGLang's
method names, the real adapters. Routing of the MHA and MLA physical writes (bytes as the
adapters write them), what stays SGLang's own, guard mode naming the layer (after the store, or
once per ModelRunner.forward), uninstall."""
from __future__ import annotations

import types

import pytest
import torch

import kvwrite
from conftest import DEVICE
from kvwrite import validate
from kvwrite.compat import sglang as adapters
from kvwrite.errors import DuplicateWrite
from kvwrite.integrations import guard as guard_mod
from kvwrite.integrations import sglang as hook

SIZE, PAGE, LAYERS = 32, 8, 2


class MHATokenToKVPool:
    def __init__(self, dtype=torch.bfloat16, layout=None):
        store = torch.uint8 if dtype == torch.float8_e4m3fn else dtype
        self.dtype, self.store_dtype, self.page_size, self.start_layer = dtype, store, PAGE, 0
        self.kv_cache_layout = layout
        self.k_buffer = [torch.zeros(SIZE + PAGE, 2, 16, dtype=store, device=DEVICE) for _ in range(LAYERS)]
        self.v_buffer = [torch.zeros(SIZE + PAGE, 2, 16, dtype=store, device=DEVICE) for _ in range(LAYERS)]
        self.own = []

    def _store_kv_layer(self, layer_idx, loc, cache_k, cache_v):
        self.own.append(layer_idx)


class MLATokenToKVPool:
    def __init__(self):
        self.dtype = self.store_dtype = torch.bfloat16
        self.page_size, self.start_layer, self.write_loc_is_dcp_resolved = PAGE, 0, True
        self.kv_buffer = [torch.zeros(SIZE + PAGE, 1, 24, dtype=torch.bfloat16, device=DEVICE) for _ in range(LAYERS)]

    def _scatter_mla_rows(self, dst_buffer, loc, nope, rope):
        raise AssertionError("SGLang's own scatter ran")


class ModelRunner:
    def __init__(self, step):
        self.step = step

    def forward(self, *args):
        return self.step(*args)


@pytest.fixture
def env(monkeypatch):
    pools = types.SimpleNamespace(__name__=hook.POOLS, MHATokenToKVPool=type("MHATokenToKVPool", (MHATokenToKVPool,), {}),
                                  MLATokenToKVPool=type("MLATokenToKVPool", (MLATokenToKVPool,), {}))
    runner = types.SimpleNamespace(__name__=hook.RUNNER, ModelRunner=type("ModelRunner", (ModelRunner,), {}))
    mods = {hook.POOLS: pools, hook.RUNNER: runner}

    def imp(name):
        if name not in mods:
            raise ImportError(name)
        return mods[name]
    monkeypatch.setattr(hook, "GUARD", guard_mod.StepGuard("SGLang", hook.POLICY_ENV))
    state = hook.Installed()
    # patch only the fake classes' own attributes (vars(cls)): subclasses carry copies
    for cls in (pools.MHATokenToKVPool, pools.MLATokenToKVPool):
        for name in ("_store_kv_layer", "_scatter_mla_rows", "__init__"):
            if hasattr(cls, name) and name not in vars(cls):
                setattr(cls, name, getattr(cls, name))
    runner.ModelRunner.forward = ModelRunner.forward
    hook.install(imp, backend="torch", state=state)
    yield types.SimpleNamespace(pools=pools, runner=runner, state=state)
    hook.uninstall(state)


def test_mha_and_mla_writes_land_in_kvwrite(env):
    pool = env.pools.MHATokenToKVPool()
    k = torch.randn(3, 2, 16, device=DEVICE).bfloat16()
    loc = torch.tensor([8, 13, 39], device=DEVICE)
    pool._store_kv_layer(1, loc, k, k)
    kb, vb = torch.zeros_like(pool.k_buffer[1]), torch.zeros_like(pool.v_buffer[1])
    adapters.set_kv_buffer(kb, vb, loc, k, k, PAGE, backend="torch")
    assert pool.own == [] and torch.equal(pool.k_buffer[1], kb) and torch.equal(pool.v_buffer[1], vb) and bool(kb.any())
    mla = env.pools.MLATokenToKVPool()
    nope, rope = torch.randn(3, 1, 16, device=DEVICE).bfloat16(), torch.randn(3, 1, 8, device=DEVICE).bfloat16()
    mla._scatter_mla_rows(mla.kv_buffer[0], torch.tensor([0, 9, 20], device=DEVICE), nope, rope)
    assert torch.equal(mla.kv_buffer[0][9, 0], torch.cat([nope[1, 0], rope[1, 0]]))
    assert not bool(mla.kv_buffer[0][0].any())                       # loc 0: SGLang's reserved slot
    assert env.state.calls == {"set_kv_buffer": 1, "set_mla_kv_buffer": 1}
    shuffled = env.pools.MHATokenToKVPool(layout="vectorized_5d")
    shuffled._store_kv_layer(0, loc, k, k)
    assert shuffled.own == [0] and env.state.fallbacks == {"vectorized_5d": 1}
    assert "not routed" in hook.report(env.state)


def test_fp8_pool_bytes(env):
    pool = env.pools.MHATokenToKVPool(dtype=torch.float8_e4m3fn)
    k8 = torch.randn(2, 2, 16, device=DEVICE).to(torch.float8_e4m3fn)
    pool._store_kv_layer(0, torch.tensor([10, 33], device=DEVICE), k8.view(torch.uint8), k8.view(torch.uint8))
    assert torch.equal(pool.k_buffer[0][33], k8[1].view(torch.uint8))


def test_guard_names_the_layer_after_the_store_and_per_forward(monkeypatch, env):
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    pool = env.pools.MHATokenToKVPool()
    k = torch.ones(2, 2, 16, device=DEVICE).bfloat16()
    with pytest.raises(kvwrite.OutOfBoundsWrite, match=r"layer MHATokenToKVPool layer 1 K\): store_kv: token 1 writes loc -7"):
        pool._store_kv_layer(1, torch.tensor([9, -7], device=DEVICE), k, k)
    assert torch.equal(pool.k_buffer[1][9], k[0]) and int(pool.k_buffer[1].ne(0).sum()) == 32
    runner = env.runner.ModelRunner(lambda: pool._store_kv_layer(0, torch.tensor([SIZE + PAGE, 12], device=DEVICE), k, k))
    with pytest.raises(kvwrite.OutOfBoundsWrite, match=r"SGLang step 0, layer MHATokenToKVPool layer 0 K\)"):
        runner.forward()
    ok = env.runner.ModelRunner(lambda: pool._store_kv_layer(0, torch.tensor([12], device=DEVICE), k[:1], k[:1]))
    ok.forward()


def test_uninstall_restores(env):
    hook.uninstall(env.state)
    pool = env.pools.MHATokenToKVPool()
    pool._store_kv_layer(0, torch.tensor([1]), torch.ones(1, 2, 16), torch.ones(1, 2, 16))
    assert pool.own == [0]


def test_the_launcher_hook_installs_when_sglangs_pool_module_is_imported(tmp_path, monkeypatch):
    """SGLang spawns its schedulers: the launcher's sitecustomize installs the hook in each of them
    as soon as the pool module is imported (a stand-in package here)."""
    import importlib
    import sys

    pkg = tmp_path / "kvwfakesglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "pools.py").write_text("class MHATokenToKVPool:\n    def _store_kv_layer(self, *a):\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hook, "POOLS", "kvwfakesglang.pools")
    installed = []
    monkeypatch.setattr(hook, "install", lambda *a, **k: installed.append(sys.modules["kvwfakesglang.pools"]))
    hook.install_when_imported()
    assert installed == []
    module = importlib.import_module("kvwfakesglang.pools")
    assert installed == [module]
    assert "install_when_imported()" in hook.SITE and "KVWRITE_SGLANG" in hook.SITE


# --- the quantised stores: DSA / V4 index-K, V4 KV pages, V4 compress state, DCP-sharded MLA ------

IPAGE = 32      # index-K / V4 pages of 32 tokens (SGLang: 64; index-K rows need page_size % 32 == 0), 3 pages


def _sglang_kernel(name):
    def execute(cls, *args, **kwargs):
        raise AssertionError(f"SGLang's own {name} ran")
    return type("SetKAndS", (), {"execute": classmethod(execute)})


class KVAndScore:
    def __init__(self, kv_score):
        self.kv_score = kv_score

    def __getitem__(self, i):      # SGLang's clear(): kv zeroed, score -inf; here one marker value
        return types.SimpleNamespace(clear=lambda: self.kv_score[i].fill_(0.5))


class CompressStatePool:
    def __init__(self, rows=12, width=8):
        self.ratio = 4
        self.kv_score_buffer = KVAndScore(torch.rand(rows, width, device=DEVICE) + 2)

    def set_state_by_state_loc(self, state_loc, value):
        raise AssertionError("SGLang's own state store ran")


class DeepSeekV4SingleKVPool:
    def __init__(self, layout="v4", page_bytes=None):
        from kvwrite.facts import kv_page_bytes, v41_fp8_page_bytes
        self.page_size, self.start_layer, self.kv_layout, self.own = IPAGE, 0, layout, []
        page_bytes = page_bytes or {"v4": kv_page_bytes(IPAGE), "v41": v41_fp8_page_bytes(IPAGE),
                                    "v41_new": v41_fp8_page_bytes(IPAGE, True)}.get(layout, IPAGE * V41_FP4_TOKEN)
        self.kv_buffer = [_random_bytes(3, page_bytes) for _ in range(LAYERS)]

    def set_key_buffer_fused(self, layer_id, loc, cache_k, freqs_cis=None):
        self.own.append(layer_id)        # SGLang's JIT store_cache


class DeepSeekV4TokenToKVPool:
    """V4's hybrid pool as the SWA stores see it: its SWA sub-pool, the SWA page size, the stage's
    first layer, an optional request window (a ring buffer no pool owns), a uniform-FP8 flag."""

    def __init__(self, swa_kv_pool, swa_page_size=IPAGE, request_window=None, stage_start=2, uniform_fp8=False):
        self.swa_kv_pool, self.swa_page_size, self.request_window = swa_kv_pool, swa_page_size, request_window
        self.kv_layout, self._stage_start, self.own = swa_kv_pool.kv_layout, stage_start, []
        self.uniform_fp8 = uniform_fp8

    def _swa_local_layer_id(self, layer_id):
        return layer_id - self._stage_start

    def get_swa_raw_buffer(self, layer_id):
        if self.request_window is not None:
            return self.request_window[self._swa_local_layer_id(layer_id)]
        return self.swa_kv_pool.kv_buffer[self._swa_local_layer_id(layer_id)]

    def set_swa_key_buffer_radix_fused(self, layer_id, swa_loc, cache_k):
        self.own.append(layer_id)        # SGLang's fused_store_cache on the raw buffer

    def set_swa_key_buffer_radix_fused_norm_rope(self, layer_id, swa_loc, kv, kv_weight, eps, freqs_cis,
                                                 positions, q=None):
        self.own.append(layer_id)        # SGLang's fused_k_norm_rope_flashmla


class DeepSeekV4IndexerPool:
    def __init__(self, fp4=False, rne=False):
        self.page_size, self.start_layer, self.use_fp4_indexer, self.index_k_rne = IPAGE, 0, fp4, rne
        self.uses_aiter_fp4_layout, self.own = False, []
        self.index_k_with_scale_buffer = [_random_bytes(3, IPAGE * (68 if fp4 else 132)) for _ in range(LAYERS)]

    def set_index_fused(self, layer_id, loc, cache_k):
        raise AssertionError("SGLang's own fused index store ran")

    def set_index_fp4(self, layer_id, loc, cache_k):
        self.own.append(layer_id)        # SGLang's store_fp4_index_k_cache (or the HIP split store)


V41_FP4_TOKEN = 288     # FlashMLA V41_FP4: 256 bytes of e2m1 + 32 e4m3 scales a token


def fake_fp4_quantiser(x, rne=False):
    """Stands in for SGLang's `quantize_fp4_indexer_tensor` (the route copies its bytes): payload
    int8 [N, 64] and int32 [N] of four scale bytes, derived from x (and rne) so each token differs."""
    n = x.shape[0]
    base = (x.float().abs().sum(-1) * 16).to(torch.int64) + (7 if rne else 0)
    payload = ((base[:, None] + torch.arange(64, device=x.device)) % 256).to(torch.uint8).view(torch.int8)
    sf = (((base[:, None] + torch.arange(4, device=x.device) * 3) % 200) + 20).to(torch.uint8)
    return payload, sf.contiguous().view(torch.int32).reshape(n)


@pytest.fixture
def qenv(monkeypatch, env):
    """The fixture's hook plus fake SGLang kernel modules for the quantised stores."""
    mods = {hook.INDEX_K: types.SimpleNamespace(__name__=hook.INDEX_K, SetKAndS=_sglang_kernel("index-K SetKAndS")),
            hook.DSV4_KV: types.SimpleNamespace(__name__=hook.DSV4_KV, SetKAndS=_sglang_kernel("V4 SetKAndS")),
            hook.DSV4_STATE: types.SimpleNamespace(__name__=hook.DSV4_STATE,
                                                   CompressStatePool=type("CompressStatePool", (CompressStatePool,), {}))}
    mods[hook.DSV4_STATE].CompressStatePool.set_state_by_state_loc = CompressStatePool.set_state_by_state_loc
    mods[hook.POOLS], mods[hook.RUNNER] = env.pools, env.runner      # already patched: install skips them
    mods[hook.DSV4_POOLS] = types.SimpleNamespace(
        __name__=hook.DSV4_POOLS, DeepSeekV4SingleKVPool=type("DeepSeekV4SingleKVPool", (DeepSeekV4SingleKVPool,), {}),
        DeepSeekV4IndexerPool=type("DeepSeekV4IndexerPool", (DeepSeekV4IndexerPool,), {}),
        DeepSeekV4TokenToKVPool=type("DeepSeekV4TokenToKVPool", (DeepSeekV4TokenToKVPool,), {}))
    mods[hook.DSV4_POOLS].DeepSeekV4SingleKVPool.set_key_buffer_fused = DeepSeekV4SingleKVPool.set_key_buffer_fused
    for attr in ("set_swa_key_buffer_radix_fused", "set_swa_key_buffer_radix_fused_norm_rope"):
        setattr(mods[hook.DSV4_POOLS].DeepSeekV4TokenToKVPool, attr, getattr(DeepSeekV4TokenToKVPool, attr))
    mods[hook.DSV4_POOLS].DeepSeekV4IndexerPool.set_index_fused = DeepSeekV4IndexerPool.set_index_fused
    mods[hook.DSV4_POOLS].DeepSeekV4IndexerPool.set_index_fp4 = DeepSeekV4IndexerPool.set_index_fp4
    mods[hook.DSV4_FP4_INDEX] = types.SimpleNamespace(__name__=hook.DSV4_FP4_INDEX,
                                                      quantize_fp4_indexer_tensor=fake_fp4_quantiser)
    hook.install(lambda name: mods[name] if name in mods else (_ for _ in ()).throw(ImportError(name)),
                 backend="torch", state=env.state)
    env.mods = mods
    return env


def _random_bytes(*shape):
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=DEVICE)


def test_index_k_store_copies_sglangs_bytes_into_the_page_layout(qenv):
    buf = _random_bytes(3, IPAGE * 132)
    before = buf.clone()
    k = torch.randn(3, 128, device=DEVICE).to(torch.float8_e4m3fn)
    s = torch.rand(3, device=DEVICE)
    loc = torch.tensor([5, 75, -1], device=DEVICE)
    pool = types.SimpleNamespace(index_page_size=IPAGE)
    qenv.mods[hook.INDEX_K].SetKAndS.execute(pool=pool, buf=buf, loc=loc, index_k=k, index_k_scale=s)
    want = before.clone()
    for i, l in enumerate((5, 75)):     # page l // 32: keys at (l % 32) * 128, scales after the page's keys
        p, o = divmod(l, IPAGE)
        want[p, o * 128:(o + 1) * 128] = k[i].view(torch.uint8)
        want[p, IPAGE * 128 + o * 4:IPAGE * 128 + o * 4 + 4] = s[i:i + 1].view(torch.uint8)
    assert torch.equal(buf, want)       # canaries: every other byte (and token 2's -1) unchanged
    assert qenv.state.calls["set_index_k_scale_buffer"] == 1


def test_dsv4_pack_store_writes_data_and_scale_rows_not_the_pad(qenv):
    from kvwrite.facts import kv_page_bytes
    buf = _random_bytes(3, kv_page_bytes(IPAGE))
    before = buf.clone()
    nope = torch.randn(2, 448, device=DEVICE).to(torch.float8_e4m3fn)
    rope = torch.randn(2, 64, device=DEVICE).bfloat16()
    sc = _random_bytes(2, 7)
    pack = types.SimpleNamespace(k_nope_fp8=nope, k_rope_bf16=rope, scale_k_nope_ue8m0=sc)
    qenv.mods[hook.DSV4_KV].SetKAndS.execute(types.SimpleNamespace(page_size=IPAGE), buf,
                                             torch.tensor([2, 70], device=DEVICE), pack)
    want = before.clone()
    for i, l in enumerate((2, 70)):
        p, o = divmod(l, IPAGE)
        want[p, o * 576:o * 576 + 448] = nope[i].view(torch.uint8)
        want[p, o * 576 + 448:(o + 1) * 576] = rope[i].view(torch.uint8)
        want[p, IPAGE * 576 + o * 8:IPAGE * 576 + o * 8 + 7] = sc[i]     # byte 8 of the scale row: pad, kept
    assert torch.equal(buf, want)


def test_compress_state_rows_and_the_sentinel_row(qenv):
    pool = qenv.mods[hook.DSV4_STATE].CompressStatePool()
    before = pool.kv_score_buffer.kv_score.clone()
    v = torch.randn(3, 8, device=DEVICE)
    pool.set_state_by_state_loc(torch.tensor([3, -1, 7], device=DEVICE), types.SimpleNamespace(kv_score=v))
    want = before.clone()
    want[3], want[7], want[-1] = v[0], v[2], 0.5      # -1 skipped; SGLang's sentinel row cleared
    assert torch.equal(pool.kv_score_buffer.kv_score, want)


@pytest.mark.parametrize("bad", [3 * IPAGE, 3 * IPAGE + 1000 * IPAGE, -7])
def test_guard_catches_a_bad_index_k_loc_and_names_the_layer(monkeypatch, qenv, bad):
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    owner = types.SimpleNamespace(index_k_with_scale_buffer=[_random_bytes(3, IPAGE * 132)], start_layer=4)
    hook.register_pool(owner)
    buf = owner.index_k_with_scale_buffer[0]
    before = buf.clone()
    k = torch.randn(2, 128, device=DEVICE).to(torch.float8_e4m3fn)
    s = torch.rand(2, device=DEVICE)
    with pytest.raises(kvwrite.OutOfBoundsWrite, match=rf"layer SimpleNamespace layer 4 index-K\): store_rows: token 0 with loc {bad},"):
        qenv.mods[hook.INDEX_K].SetKAndS.execute(pool=types.SimpleNamespace(index_page_size=IPAGE), buf=buf,
                                                 loc=torch.tensor([bad, 34], device=DEVICE), index_k=k, index_k_scale=s)
    want = before.clone()      # only the good token (loc 34: page 1, row 2) written
    want[1, 2 * 128:3 * 128] = k[1].view(torch.uint8)
    want[1, IPAGE * 128 + 8:IPAGE * 128 + 12] = s[1:2].view(torch.uint8)
    assert torch.equal(buf, want)


def test_guard_keeps_the_first_writer_of_a_duplicated_state_row(monkeypatch, qenv):
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    pool = qenv.mods[hook.DSV4_STATE].CompressStatePool()
    v = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(kvwrite.OutOfBoundsWrite, match="token 1 writes loc 5"):
        pool.set_state_by_state_loc(torch.tensor([5, 5], device=DEVICE), types.SimpleNamespace(kv_score=v))
    assert torch.equal(pool.kv_score_buffer.kv_score[5], v[0])


def test_dcp_sharded_mla_keeps_this_ranks_widened_locs(monkeypatch, env):
    monkeypatch.setattr(hook, "_dcp_rank", lambda: 1)
    mla = env.pools.MLATokenToKVPool()
    mla.write_loc_is_dcp_resolved, mla.dcp_replicated, mla._write_loc_dcp_span = False, False, 2
    before = mla.kv_buffer[0].clone()
    nope, rope = torch.randn(4, 1, 16, device=DEVICE).bfloat16(), torch.randn(4, 1, 8, device=DEVICE).bfloat16()
    mla._scatter_mla_rows(mla.kv_buffer[0], torch.tensor([1, 6, 17, 33], device=DEVICE), nope, rope)
    want = before.clone()
    for i, l in ((0, 1), (2, 17), (3, 33)):        # odd widened locs: rank 1's, at row loc // 2
        want[l // 2, 0] = torch.cat([nope[i, 0], rope[i, 0]])
    assert torch.equal(mla.kv_buffer[0], want)
    assert env.state.calls == {"set_mla_kv_buffer (DCP-sharded)": 1}
    norope = env.pools.MLATokenToKVPool()
    norope.write_loc_is_dcp_resolved, norope.dcp_replicated, norope._write_loc_dcp_span = False, False, 2
    with pytest.raises(AssertionError, match="SGLang's own scatter ran"):   # no rope under DCP: SGLang's
        norope._scatter_mla_rows(norope.kv_buffer[0], torch.tensor([1], device=DEVICE), nope[:1], None)
    assert env.state.fallbacks == {"mla_dcp_sharded_norope": 1}


def test_report_lists_every_route_and_what_stays_sglangs(qenv):
    text = hook.report(qenv.state)
    for route in ("dsa_index_k_cache.SetKAndS.execute", "dsv4_main_kv_store.SetKAndS.execute",
                  "CompressStatePool.set_state_by_state_loc", "MLATokenToKVPool._scatter_mla_rows",
                  "DeepSeekV4SingleKVPool.set_key_buffer_fused", "DeepSeekV4IndexerPool.set_index_fused"):
        assert route in text.split("not routed")[0]
    assert "DeepSeekV4IndexerPool.set_index_fp4" in text.split("not routed")[0]
    not_routed = text.split("not routed")[1]
    assert "vectorized_5d" in not_routed and "uniform-FP8" in not_routed and "set_index_fp4 on HIP" in not_routed


def test_strided_page_major_views_stay_sglangs(env):
    """Views whose rows are not dense (strided heads, page-major 4-D views) are not kvwrite's row
    layout: SGLang's own write runs."""
    pool = env.pools.MHATokenToKVPool()
    pool.k_buffer = [torch.zeros(SIZE + PAGE, 4, 16, device=DEVICE)[:, ::2] for _ in range(LAYERS)]
    pool._store_kv_layer(0, torch.tensor([9]), torch.ones(1, 2, 16), torch.ones(1, 2, 16))
    assert pool.own == [0] and env.state.fallbacks == {"mha_page_major_views": 1}
    mla = env.pools.MLATokenToKVPool()
    with pytest.raises(AssertionError, match="SGLang's own scatter ran"):
        mla._scatter_mla_rows(mla.kv_buffer[0].view(-1, PAGE, 1, 24), torch.tensor([9]), None, None)


def test_v4_fused_stores_are_kvwrites_dsv4_stores(qenv):
    """SGLang's JIT store_cache entries of the V4 pools: kvwrite's store_dsv4_kv /
    store_dsv4_indexer_k on the layer's buffer (every other byte unchanged); the uniform-FP8 layout
    and in-kernel RoPE on V4 stay SGLang's."""
    mods = qenv.mods[hook.DSV4_POOLS]
    pool = mods.DeepSeekV4SingleKVPool()
    want = pool.kv_buffer[1].clone()
    x = torch.randn(3, 512, device=DEVICE).bfloat16()
    loc = torch.tensor([3, 40, -1], device=DEVICE)
    kvwrite.store_dsv4_kv(x, want, loc, page_size=IPAGE, backend="torch")
    pool.set_key_buffer_fused(1, loc, x)
    assert torch.equal(pool.kv_buffer[1], want) and pool.own == []
    pool.set_key_buffer_fused(1, loc, x, freqs_cis=torch.ones(3, 64))     # no in-kernel RoPE in V4
    uniform = mods.DeepSeekV4SingleKVPool(layout="uniform_fp8", page_bytes=IPAGE * 512)
    uniform.set_key_buffer_fused(0, loc, x)
    assert pool.own == [1] and uniform.own == [0]
    assert qenv.state.fallbacks == {"dsv4_fused_v4_rope": 1, "dsv4_fused_uniform_fp8": 1}
    idx = mods.DeepSeekV4IndexerPool()
    want = idx.index_k_with_scale_buffer[0].clone()
    k = torch.randn(3, 128, device=DEVICE).bfloat16()
    kvwrite.store_dsv4_indexer_k(k, want, loc, page_size=IPAGE, fmt="fp8", backend="torch")
    idx.set_index_fused(0, loc, k)
    assert torch.equal(idx.index_k_with_scale_buffer[0], want)
    assert qenv.state.calls == {"set_key_buffer_fused": 1, "set_index_fused": 1}


def test_v4_swa_radix_fused_store_writes_the_swa_buffer(qenv):
    """The SWA cache's radix-path store (SGLang's fused_store_cache on `get_swa_raw_buffer`): the SWA
    pool's buffer at the stage-local layer, or a request window's ring buffer, bytes as
    store_dsv4_kv and no other byte; another physical page size or a uniform-FP8 pool stays SGLang's."""
    mods = qenv.mods[hook.DSV4_POOLS]
    swa = mods.DeepSeekV4SingleKVPool()
    pool = mods.DeepSeekV4TokenToKVPool(swa)
    want = [b.clone() for b in swa.kv_buffer]
    x = torch.randn(3, 512, device=DEVICE).bfloat16()
    loc = torch.tensor([5, 33, -1], device=DEVICE)
    kvwrite.store_dsv4_kv(x, want[1], loc, page_size=IPAGE, backend="torch")
    pool.set_swa_key_buffer_radix_fused(3, loc, x)                       # layer 3 = SWA-local layer 1
    assert all(torch.equal(a, b) for a, b in zip(swa.kv_buffer, want)) and pool.own == [] and swa.own == []
    ring = [_random_bytes(2, swa.kv_buffer[0].shape[1]) for _ in range(LAYERS)]
    ring_want = [b.clone() for b in ring]
    kvwrite.store_dsv4_kv(x, ring_want[0], loc, page_size=IPAGE, backend="torch")
    mods.DeepSeekV4TokenToKVPool(swa, request_window=ring).set_swa_key_buffer_radix_fused(2, loc, x)
    assert all(torch.equal(a, b) for a, b in zip(ring, ring_want))
    assert qenv.state.calls == {"set_swa_key_buffer_radix_fused": 2}
    mods.DeepSeekV4TokenToKVPool(swa, swa_page_size=4 * IPAGE).set_swa_key_buffer_radix_fused(3, loc, x)
    mods.DeepSeekV4TokenToKVPool(swa, uniform_fp8=True).set_swa_key_buffer_radix_fused(3, loc, x)
    assert qenv.state.fallbacks == {"swa_radix_fused_v4": 2}
    assert all(torch.equal(a, b) for a, b in zip(swa.kv_buffer, want))


def _norm_rope_statement(kv, weight, eps, freqs_cis, positions):
    """SGLang's fused K norm + RoPE restated: fp32 RMSNorm times the weight, then the last 64 values
    as 32 complex numbers times freqs_cis[position]."""
    x = torch.nn.functional.rms_norm(kv.float(), (kv.shape[-1],), weight.float(), eps)
    rope = torch.view_as_complex(x[:, 448:].reshape(-1, 32, 2).contiguous()) * freqs_cis[positions.long()]
    return torch.cat([x[:, :448], torch.view_as_real(rope).flatten(-2)], -1)


@pytest.mark.parametrize("layout", ["v4", "v41_fp4", "v41"])
def test_v4_swa_norm_rope_store_norms_ropes_and_stores(qenv, layout):
    """SGLang's DeepSeek V4 SWA store (`set_swa_key_buffer_radix_fused_norm_rope`, RMSNorm + RoPE +
    store in one kernel): routed, the bytes those of store_dsv4_kv (V4: from the fp32 normed and
    roped values) or of the V4.1 fp4 record (normed values rounded to bf16, rotated, rounded again),
    no other byte; the HIP query RoPE stays SGLang's."""
    mods = qenv.mods[hook.DSV4_POOLS]
    swa = mods.DeepSeekV4SingleKVPool(layout=layout)
    pool = mods.DeepSeekV4TokenToKVPool(swa)
    gen = torch.Generator().manual_seed(5)
    kv = (torch.randn(4, 512, generator=gen) * 3).bfloat16().to(DEVICE)
    weight = (torch.rand(512, generator=gen) + 0.5).bfloat16().to(DEVICE)
    freqs = torch.polar(torch.ones(40, 32), torch.rand(40, 32, generator=gen) * 6.3).to(DEVICE)
    positions = torch.tensor([0, 7, 39, 12], device=DEVICE, dtype=torch.int32)
    loc = torch.tensor([5, 33, -1, 70], device=DEVICE)
    want = [b.clone() for b in swa.kv_buffer]
    rows = _norm_rope_statement(kv, weight, 1e-6, freqs, positions)
    if layout == "v4":
        kvwrite.store_dsv4_kv(rows, want[1], loc, page_size=IPAGE, backend="torch")
    else:       # the V4.1 branch rounds the normed values before the rotation
        normed = torch.nn.functional.rms_norm(kv.float(), (512,), weight.float(), 1e-6).bfloat16()
        rope = torch.view_as_complex(normed[:, 448:].float().reshape(-1, 32, 2).contiguous()) * freqs[positions.long()]
        rows = torch.cat([normed[:, :448], torch.view_as_real(rope).flatten(-2).bfloat16()], -1)
        if layout == "v41_fp4":
            kvwrite.store_dsv4_kv_fp4(rows, want[1], loc, fmt="nvfp4_v41", page_size=IPAGE, backend="torch")
        else:
            data, scales = _v41_fp8_record(rows)
            for i, l in enumerate(loc.tolist()):
                if l >= 0:
                    p, o = divmod(l, IPAGE)
                    want[1][p, o * 512:(o + 1) * 512] = data[i]
                    want[1][p, IPAGE * 512 + o * 16:IPAGE * 512 + (o + 1) * 16] = scales[i]
    pool.set_swa_key_buffer_radix_fused_norm_rope(3, loc, kv, weight, 1e-6, freqs, positions)
    assert all(torch.equal(a, b) for a, b in zip(swa.kv_buffer, want)) and pool.own == []
    assert qenv.state.calls == {"set_swa_key_buffer_radix_fused_norm_rope": 1}
    pool.set_swa_key_buffer_radix_fused_norm_rope(3, loc, kv, weight, 1e-6, freqs, positions, q=kv[:, None])
    assert pool.own == [3] and qenv.state.fallbacks == {"swa_norm_rope_q": 1}


def test_v4_swa_norm_rope_store_guard_catches_a_bad_swa_loc(monkeypatch, qenv):
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    mods = qenv.mods[hook.DSV4_POOLS]
    swa = mods.DeepSeekV4SingleKVPool()
    pool = mods.DeepSeekV4TokenToKVPool(swa)
    before = [b.clone() for b in swa.kv_buffer]
    kv = torch.randn(2, 512, device=DEVICE).bfloat16()
    freqs = torch.polar(torch.ones(8, 32), torch.zeros(8, 32)).to(DEVICE)
    with pytest.raises(kvwrite.OutOfBoundsWrite) as e:
        pool.set_swa_key_buffer_radix_fused_norm_rope(3, torch.tensor([3 * IPAGE, -1], device=DEVICE), kv,
                                                      torch.ones(512, device=DEVICE), 1e-6, freqs,
                                                      torch.tensor([1, 2], device=DEVICE))
    assert e.value.token_index == 0 and e.value.loc == 3 * IPAGE
    assert all(torch.equal(a, b) for a, b in zip(swa.kv_buffer, before))


def test_a_duplicated_index_k_loc_keeps_the_first_writers_key_and_scale(monkeypatch, qenv):
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    buf = _random_bytes(3, IPAGE * 132)
    k = torch.randn(3, 128, device=DEVICE).to(torch.float8_e4m3fn)
    s = torch.rand(3, device=DEVICE)
    with pytest.raises(kvwrite.OutOfBoundsWrite, match="store_rows: token 2 writes loc 40"):
        qenv.mods[hook.INDEX_K].SetKAndS.execute(pool=types.SimpleNamespace(index_page_size=IPAGE), buf=buf,
                                                 loc=torch.tensor([40, 41, 40], device=DEVICE), index_k=k, index_k_scale=s)
    assert torch.equal(buf[1, 8 * 128:9 * 128], k[0].view(torch.uint8))
    assert torch.equal(buf[1, IPAGE * 128 + 32:IPAGE * 128 + 36], s[0:1].view(torch.uint8))


def _v41_fp4_reference(x, loc, freqs=None):
    """SGLang's V4.1 fp4 store as the route must write it: (rotated) x, kvwrite's nvfp4_v41 record
    on a block-split buffer of 3 pages."""
    if freqs is not None:     # pairs (2i, 2i + 1) times complex freqs, rounded to x's dtype
        t = torch.view_as_complex(x[:, 448:].float().unflatten(-1, (-1, 2)).contiguous())
        x = torch.cat([x[:, :448], torch.view_as_real(t * freqs).flatten(-2).to(x.dtype)], -1)
    return x


@pytest.mark.parametrize("layout", ["v41_fp4", "v41_fp4_new"])
@pytest.mark.parametrize("rope", [False, True])
def test_v41_fp4_fused_store_is_kvwrites_nvfp4_v41_record(qenv, layout, rope):
    """V4.1 fp4 pools: set_key_buffer_fused writes kvwrite's nvfp4_v41 records (block-split, or each
    token's 256 data bytes then its 32 scales for v41_fp4_new), every other byte unchanged; with
    freqs_cis the RoPE tail is rotated first."""
    pool = qenv.mods[hook.DSV4_POOLS].DeepSeekV4SingleKVPool(layout=layout)
    before = pool.kv_buffer[1].clone()
    # bf16 values and bf16-exact cos / sin: every rotation product exact in fp32
    x = torch.randn(3, 512, device=DEVICE).bfloat16()
    ang = torch.rand(3, 32, device=DEVICE) * 6
    freqs = torch.complex(ang.cos().bfloat16().float(), ang.sin().bfloat16().float()) if rope else None
    loc = torch.tensor([3, 70, -1], device=DEVICE)
    pool.set_key_buffer_fused(1, loc, x, freqs)
    split = torch.zeros(3, IPAGE * V41_FP4_TOKEN, dtype=torch.uint8, device=DEVICE)
    kvwrite.store_dsv4_kv_fp4(_v41_fp4_reference(x, loc, freqs), split, loc, fmt="nvfp4_v41", page_size=IPAGE,
                              backend="torch")
    want = before.clone()
    for l in (3, 70):
        p, o = divmod(l, IPAGE)
        data, scale = split[p, o * 256:(o + 1) * 256], split[p, IPAGE * 256 + o * 32:IPAGE * 256 + (o + 1) * 32]
        if layout == "v41_fp4":
            want[p, o * 256:(o + 1) * 256], want[p, IPAGE * 256 + o * 32:IPAGE * 256 + (o + 1) * 32] = data, scale
        else:
            want[p, o * 288:o * 288 + 256], want[p, o * 288 + 256:(o + 1) * 288] = data, scale
    assert torch.equal(pool.kv_buffer[1], want) and pool.own == []
    assert qenv.state.calls == {f"set_key_buffer_fused ({layout}{', RoPE' if rope else ''})": 1}


def _v41_fp8_record(x):
    """SGLang's V4.1 fp8 record restated: per 32 values scale = 2^ceil(log2(max(amax / 448, 1e-4))),
    e4m3 of x / scale, the scale's ue8m0 byte (exponent + 127)."""
    v = x.float().view(-1, 16, 32)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp_min(v.abs().amax(-1) / 448, 1e-4))))
    data = (v / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).view(-1, 512)
    return data, (torch.log2(scale).to(torch.int32) + 127).to(torch.uint8)


@pytest.mark.parametrize("layout", ["v41", "v41_new"])
@pytest.mark.parametrize("rope", [False, True])
def test_v41_fp8_fused_store_writes_sglangs_record(qenv, layout, rope):
    """V4.1 fp8 pools: set_key_buffer_fused writes the 528-byte record (512 e4m3, 16 ue8m0; block-split
    pages padded to 512 bytes, or each token's data then its scales for v41_new), every other byte
    unchanged; with freqs_cis the RoPE tail is rotated first; a bad loc is caught in guard mode."""
    pool = qenv.mods[hook.DSV4_POOLS].DeepSeekV4SingleKVPool(layout=layout)
    before = pool.kv_buffer[1].clone()
    x = (torch.randn(3, 512, device=DEVICE) * torch.logspace(-3, 2, 16, device=DEVICE).repeat_interleave(32)).bfloat16()
    x[1, :32] = 0                                   # the 1e-4 floor
    ang = torch.rand(3, 32, device=DEVICE) * 6
    freqs = torch.complex(ang.cos().bfloat16().float(), ang.sin().bfloat16().float()) if rope else None
    loc = torch.tensor([3, 70, -1], device=DEVICE)
    pool.set_key_buffer_fused(1, loc, x, freqs)
    data, scales = _v41_fp8_record(_v41_fp4_reference(x, loc, freqs))
    want = before.clone()
    for i, l in enumerate((3, 70)):
        p, o = divmod(l, IPAGE)
        at, sat = (o * 512, IPAGE * 512 + o * 16) if layout == "v41" else (o * 528, o * 528 + 512)
        want[p, at:at + 512], want[p, sat:sat + 16] = data[i], scales[i]
    assert torch.equal(pool.kv_buffer[1], want) and pool.own == []
    assert qenv.state.calls == {f"set_key_buffer_fused ({layout}{', RoPE' if rope else ''})": 1}


def test_v41_fp8_store_guard_catches_a_bad_loc(monkeypatch, qenv):
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    pool = qenv.mods[hook.DSV4_POOLS].DeepSeekV4SingleKVPool(layout="v41")
    x = torch.randn(2, 512, device=DEVICE).bfloat16()
    want = pool.kv_buffer[1].clone()
    adapters.set_dsv4_v41_fp8_key_buffer(want, torch.tensor([5], device=DEVICE), x[:1], IPAGE, check="off")
    with pytest.raises(kvwrite.OutOfBoundsWrite) as e:
        pool.set_key_buffer_fused(1, torch.tensor([5, 3 * IPAGE], device=DEVICE), x)
    assert e.value.token_index == 1 and e.value.loc == 3 * IPAGE
    assert torch.equal(pool.kv_buffer[1], want)     # the good token written, no other byte


def test_a_padded_v41_fp4_page_stays_sglangs(qenv):
    pool = qenv.mods[hook.DSV4_POOLS].DeepSeekV4SingleKVPool(layout="v41_fp4", page_bytes=IPAGE * V41_FP4_TOKEN + 256)
    pool.set_key_buffer_fused(0, torch.tensor([1], device=DEVICE), torch.randn(1, 512, device=DEVICE).bfloat16())
    assert pool.own == [0] and qenv.state.fallbacks == {"dsv4_fused_v41_fp4": 1}


@pytest.mark.parametrize("rne", [False, True])
def test_fp4_index_store_copies_sglangs_quantised_bytes(qenv, rne):
    """set_index_fp4: SGLang's quantiser (with the pool's index_k_rne), its payload at (loc % page)
    * 64 and its four scale bytes after the page's payloads, every other byte unchanged."""
    idx = qenv.mods[hook.DSV4_POOLS].DeepSeekV4IndexerPool(fp4=True, rne=rne)
    before = idx.index_k_with_scale_buffer[1].clone()
    k = torch.randn(3, 128, device=DEVICE).bfloat16()
    loc = torch.tensor([5, 75, -1], device=DEVICE)
    idx.set_index_fp4(1, loc, k)
    payload, sf = fake_fp4_quantiser(k, rne)
    want = before.clone()
    for i, l in enumerate((5, 75)):
        p, o = divmod(l, IPAGE)
        want[p, o * 64:(o + 1) * 64] = payload[i].view(torch.uint8)
        want[p, IPAGE * 64 + o * 4:IPAGE * 64 + o * 4 + 4] = sf[i:i + 1].view(torch.uint8)
    assert torch.equal(idx.index_k_with_scale_buffer[1], want) and idx.own == []
    hip = qenv.mods[hook.DSV4_POOLS].DeepSeekV4IndexerPool(fp4=True)
    hip.uses_aiter_fp4_layout, hip.index_k_with_scale_buffer = True, None
    hip.set_index_fp4(0, loc, k)
    assert hip.own == [0] and qenv.state.fallbacks == {"index_fp4_hip_split_layout": 1}


@pytest.mark.parametrize("bad", [3 * IPAGE, 3 * IPAGE + 1000 * IPAGE, -7, 40])
def test_guard_catches_a_bad_fp4_store_loc_without_touching_other_bytes(monkeypatch, qenv, bad):
    """Guard on the two new routes: a loc past the end, a page >= pages, -7, a duplicate (of token
    1's loc 40): raised naming the layer; only the good token's bytes written."""
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    mods = qenv.mods[hook.DSV4_POOLS]
    idx, kv = mods.DeepSeekV4IndexerPool(fp4=True), mods.DeepSeekV4SingleKVPool(layout="v41_fp4_new")
    idx.start_layer = kv.start_layer = 4
    hook.register_pool(idx), hook.register_pool(kv)
    loc = torch.tensor([bad, 40], device=DEVICE)
    k, x = torch.randn(2, 128, device=DEVICE).bfloat16(), torch.randn(2, 512, device=DEVICE).bfloat16()
    for pool, store, name, buf in ((idx, lambda: idx.set_index_fp4(4, loc, k), "index-K", idx.index_k_with_scale_buffer[0]),
                                    (kv, lambda: kv.set_key_buffer_fused(0, loc, x), "KV", kv.kv_buffer[0])):
        before = buf.clone()
        err = DuplicateWrite if bad == 40 else kvwrite.OutOfBoundsWrite
        with pytest.raises(err, match=rf"layer DeepSeekV4\w+ layer 4 {name}\)"):
            store()
        changed = (buf != before).any(-1).nonzero().flatten().tolist()
        assert changed == [1]       # page 1 (loc 40) only
        if pool is idx:
            payload, sf = fake_fp4_quantiser(k)
            first = 0 if bad == 40 else 1      # a duplicate: the first writer (token 0) kept
            assert torch.equal(buf[1, 8 * 64:9 * 64], payload[first].view(torch.uint8))
            assert torch.equal(buf[1, IPAGE * 64 + 32:IPAGE * 64 + 36], sf[first:first + 1].view(torch.uint8))
            for part in (slice(8 * 64, 9 * 64), slice(IPAGE * 64 + 32, IPAGE * 64 + 36)):
                buf[1, part] = before[1, part]
        else:
            buf[1, 8 * 288:9 * 288] = before[1, 8 * 288:9 * 288]
        assert torch.equal(buf, before)     # nothing else


def test_the_new_adapters_name_a_bad_argument_before_writing():
    buf = _random_bytes(2, IPAGE * V41_FP4_TOKEN)
    before = buf.clone()
    x, loc = torch.randn(2, 512, device=DEVICE).bfloat16(), torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match=r"kv_buffer must be contiguous \[num_pages, page_size \* 288\]"):
        adapters.set_dsv4_v41_fp4_key_buffer(buf[:, :-32], loc, x, IPAGE, backend="torch")
    with pytest.raises(ValueError, match=r"freqs_cis must be \[N, 32\] complex64 or \[N, 64\] fp32"):
        adapters.set_dsv4_v41_fp4_key_buffer(buf, loc, x, IPAGE, torch.ones(2, 32, device=DEVICE), backend="torch")
    idx = _random_bytes(2, IPAGE * 68)
    with pytest.raises(ValueError, match=r"k_fp4 must be int8/uint8 \[N, 64\]"):
        adapters.set_fp4_index_k_buffer(idx, loc, torch.zeros(2, 128, dtype=torch.int8, device=DEVICE),
                                        torch.zeros(2, dtype=torch.int32, device=DEVICE), IPAGE, backend="torch")
    with pytest.raises(ValueError, match=r"k_sf must hold one int32 of four ue8m0 bytes per token \(2\)"):
        adapters.set_fp4_index_k_buffer(idx, loc, torch.zeros(2, 64, dtype=torch.int8, device=DEVICE),
                                        torch.zeros(3, dtype=torch.int32, device=DEVICE), IPAGE, backend="torch")
    assert torch.equal(buf, before)


def test_a_store_of_no_tokens_writes_nothing(qenv):
    """SGLang calls its stores with 0 tokens (an idle batch): the byte-copy routes take them."""
    idx = qenv.mods[hook.DSV4_POOLS].DeepSeekV4IndexerPool(fp4=True)
    before = idx.index_k_with_scale_buffer[0].clone()
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    idx.set_index_fp4(0, none, torch.zeros(0, 128, device=DEVICE).bfloat16())
    assert torch.equal(idx.index_k_with_scale_buffer[0], before)
    buf = _random_bytes(3, IPAGE * 132)
    before = buf.clone()
    qenv.mods[hook.INDEX_K].SetKAndS.execute(pool=types.SimpleNamespace(index_page_size=IPAGE), buf=buf, loc=none,
                                             index_k=torch.zeros(0, 128, device=DEVICE).to(torch.float8_e4m3fn),
                                             index_k_scale=torch.zeros(0, device=DEVICE))
    assert torch.equal(buf, before)


def test_unified_pools_token_major_views_are_routed(env):
    """SGLang's unified pools hand `_store_kv_layer` / `_scatter_mla_rows` token-major views of one
    shared buffer (dense rows, a whole entry apart): routed, bytes as on contiguous buffers, and no
    byte of the shared buffer outside the written rows changes."""
    entry = 2 * 2 * 16 + 8                          # K row, V row and 8 elements of another sub-pool a slot
    shared = torch.randn(SIZE + PAGE, entry, device=DEVICE).bfloat16()
    pool = env.pools.MHATokenToKVPool()
    pool.k_buffer = [shared[:, :32].view(-1, 2, 16)] * LAYERS
    pool.v_buffer = [shared[:, 32:64].view(-1, 2, 16)] * LAYERS
    want = shared.clone()
    k, v = torch.randn(3, 2, 16, device=DEVICE).bfloat16(), torch.randn(3, 2, 16, device=DEVICE).bfloat16()
    loc = torch.tensor([9, 33, 17], device=DEVICE)
    kb, vb = want[:, :32].contiguous().view(-1, 2, 16), want[:, 32:64].contiguous().view(-1, 2, 16)
    adapters.set_kv_buffer(kb, vb, loc, k, v, PAGE, backend="torch")
    want[:, :32], want[:, 32:64] = kb.view(-1, 32), vb.view(-1, 32)
    pool._store_kv_layer(0, loc, k, v)
    assert torch.equal(shared, want) and pool.own == [] and env.state.calls == {"set_kv_buffer": 1}
    mla = env.pools.MLATokenToKVPool()
    shared = torch.randn(SIZE + PAGE, 40, device=DEVICE).bfloat16()
    want = shared.clone()
    nope, rope = torch.randn(3, 1, 16, device=DEVICE).bfloat16(), torch.randn(3, 1, 8, device=DEVICE).bfloat16()
    rows = want[:, 8:32].contiguous().view(-1, 1, 24)
    adapters.set_mla_kv_buffer(rows, loc, nope, rope, PAGE, backend="torch")
    want[:, 8:32] = rows.view(-1, 24)
    mla._scatter_mla_rows(shared[:, 8:32].view(-1, 1, 24), loc, nope, rope)
    assert torch.equal(shared, want)


def test_guard_fail_policy_is_refused_for_sglang(monkeypatch):
    """Failing single requests is vLLM's hook only: SGLang's guard names the policies it has."""
    monkeypatch.setenv(hook.POLICY_ENV, "fail")
    monkeypatch.setattr(hook, "GUARD", None)
    with pytest.raises(ValueError, match=r"KVWRITE_SGLANG_GUARD must be one of \('raise', 'log'\) for SGLang"):
        hook.guard()
