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
