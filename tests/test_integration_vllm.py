"""kvwrite.integrations.vllm (the vLLM general plugin) without vLLM: fake vLLM modules, the real
adapters; routing, idempotence, uninstall, guard mode raising at the bad store, the off switch."""
from __future__ import annotations

import types

import pytest
import torch

import kvwrite
from conftest import DEVICE
from kvwrite import validate
from kvwrite.integrations import vllm as plugin


def fake_vllm(with_cpu_attn=True):
    """Fake `vllm._custom_ops` / Triton writer modules whose writers record their calls."""
    seen = []

    def original(name):
        def fn(*args, **kwargs):
            seen.append(name)
        return fn

    ops = types.SimpleNamespace(reshape_and_cache_flash=original("flash"), reshape_and_cache=original("hm"),
                                concat_and_cache_mla=original("mla"), unrelated=original("other"))
    if with_cpu_attn:
        ops.cpu_attn_reshape_and_cache = original("cpu_attn")
    triton = types.SimpleNamespace(triton_reshape_and_cache_flash=original("triton"))
    modules = {"vllm._custom_ops": ops, "vllm.v1.attention.ops.triton_reshape_and_cache_flash": triton,
               "vllm": types.SimpleNamespace(__version__="0.32.0")}

    def import_module(name):
        if name not in modules:
            raise ImportError(name)
        return modules[name]
    return modules, import_module, seen


def test_install_routes_every_writer_and_uninstall_restores():
    modules, imp, seen = fake_vllm(with_cpu_attn=False)
    ops = modules["vllm._custom_ops"]
    before = dict(vars(ops))
    calls = []
    adapters = types.SimpleNamespace(**{name: (lambda name: lambda *a, **k: calls.append((name, a, k)))(name)
                                        for name in ("cpu_attn_reshape_and_cache", "reshape_and_cache_flash",
                                                     "reshape_and_cache", "concat_and_cache_mla")})
    state = plugin.Installed()
    plugin.install(imp, adapters, backend="torch", state=state)
    assert set(state.originals) == {"vllm._custom_ops.reshape_and_cache_flash", "vllm._custom_ops.reshape_and_cache",
                                    "vllm._custom_ops.concat_and_cache_mla",
                                    "vllm.v1.attention.ops.triton_reshape_and_cache_flash.triton_reshape_and_cache_flash"}
    assert state.skipped == {"vllm._custom_ops.cpu_attn_reshape_and_cache": "not in this vLLM"}
    ops.reshape_and_cache_flash(1, 2, slot=3)
    modules["vllm.v1.attention.ops.triton_reshape_and_cache_flash"].triton_reshape_and_cache_flash(4)
    ops.unrelated()
    assert calls[0] == ("reshape_and_cache_flash", (1, 2), dict(slot=3, check=validate.DEFAULT_CHECK, backend="torch"))
    assert calls[1][0] == "reshape_and_cache_flash" and seen == ["other"]     # vLLM's writers never ran
    assert state.calls == {"reshape_and_cache_flash": 1, "triton_reshape_and_cache_flash": 1}
    routed = ops.concat_and_cache_mla
    plugin.install(imp, adapters, backend="torch", state=state)                   # idempotent
    assert ops.concat_and_cache_mla is routed
    plugin.uninstall(state)
    assert dict(vars(ops)) == before and not state.originals


def test_routed_cpu_attn_store_writes_what_the_adapter_writes():
    modules, imp, _ = fake_vllm()
    state = plugin.Installed()
    plugin.install(imp, backend="torch", state=state)
    key = torch.randn(3, 2, 16, device=DEVICE).bfloat16()
    kv = torch.zeros(4, 2, 2 * 8, 16, dtype=torch.bfloat16, device=DEVICE)
    twin = kv.clone()
    sm = torch.tensor([5, -1, 17], device=DEVICE)
    modules["vllm._custom_ops"].cpu_attn_reshape_and_cache(key, key, *kv.chunk(2, dim=2), sm, "vec")
    from kvwrite.compat import vllm as adapters
    adapters.cpu_attn_reshape_and_cache(key, key, *twin.chunk(2, dim=2), sm, "vec", backend="torch")
    assert torch.equal(kv, twin) and bool(kv.any())
    plugin.uninstall(state)


def test_guard_mode_raises_at_the_store_that_recorded_the_bad_slot(monkeypatch):
    """vLLM #47056's mismatch: slots encoded with 4x the cache's block size land past the pool."""
    modules, imp, _ = fake_vllm()
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    state = plugin.Installed()
    plugin.install(imp, backend="torch", state=state)
    nb, bs = 4, 8
    key = torch.ones(3, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    kc = torch.zeros(nb, bs, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    good = torch.tensor([1, 9, 30], device=DEVICE)
    bad = (good // bs) * (4 * bs) + good % bs            # encoded with block size 32, decoded with 8
    ops = modules["vllm._custom_ops"]
    ops.reshape_and_cache_flash(key, key, kc, kc.clone(), good, "auto", None, None)
    with pytest.raises(kvwrite.OutOfBoundsWrite) as exc:
        ops.reshape_and_cache_flash(key, key, kc, kc.clone(), bad, "auto", None, None)
    assert exc.value.token_index == 1 and exc.value.loc == int(bad[1]) and exc.value.page == int(bad[1]) // bs
    ops.reshape_and_cache_flash(key, key, kc, kc.clone(), good, "auto", None, None)   # buffer was reset
    plugin.uninstall(state)


def test_register_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(plugin.ENABLE_ENV, "0")
    called = []
    monkeypatch.setattr(plugin, "install", lambda *a, **k: called.append(1))
    plugin.register()
    assert called == []
    monkeypatch.setenv(plugin.ENABLE_ENV, "1")
    plugin.register()     # vllm is not installed here: install() still runs (and skips what is missing)
    assert called == [1]
