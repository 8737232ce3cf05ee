"""kvwrite.integrations.vllm (the vLLM general plugin) without vLLM: fake vLLM modules, the real
adapters. Routing of the Python names, of names bound at import (before and after install), of
the torch operators' kernels; idempotence, uninstall; guard mode read once per step with the
layer and request named, no host read inside a store; the namespace check (vLLM #47056)."""
from __future__ import annotations

import sys
import textwrap
import types

import pytest
import torch

import kvwrite
from conftest import DEVICE
from kvwrite import validate
from kvwrite.compat import vllm as adapters
from kvwrite.integrations import vllm as plugin

STORE_ADAPTERS = ("cpu_attn_reshape_and_cache", "reshape_and_cache_flash", "reshape_and_cache",
                  "concat_and_cache_mla", "concat_and_cache_mla_grouped", "indexer_k_quant_and_cache",
                  "triton_reshape_and_cache_flash_per_token_head_quant")


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


@pytest.fixture
def state():
    st = plugin.Installed()
    yield st
    plugin.uninstall(st)


@pytest.fixture
def fresh_guard(monkeypatch):
    g = plugin.new_guard()
    monkeypatch.setattr(plugin, "GUARD", g)
    return g


def test_install_routes_every_writer_and_uninstall_restores(state):
    modules, imp, seen = fake_vllm(with_cpu_attn=False)
    ops = modules["vllm._custom_ops"]
    before = dict(vars(ops))
    calls = []
    fake = types.SimpleNamespace(**{name: (lambda name: lambda *a, **k: calls.append((name, a, k)))(name)
                                    for name in STORE_ADAPTERS})
    plugin.install(imp, fake, backend="torch", state=state, modules={}, ops=False)
    assert set(state.originals) == {"vllm._custom_ops.reshape_and_cache_flash", "vllm._custom_ops.reshape_and_cache",
                                    "vllm._custom_ops.concat_and_cache_mla",
                                    "vllm.v1.attention.ops.triton_reshape_and_cache_flash.triton_reshape_and_cache_flash"}
    assert state.skipped["vllm._custom_ops.cpu_attn_reshape_and_cache"] == "not in this vLLM"
    assert state.skipped["vllm._custom_ops.concat_and_cache_mla_grouped"] == "not in this vLLM"
    ops.reshape_and_cache_flash(1, 2, slot=3)
    modules["vllm.v1.attention.ops.triton_reshape_and_cache_flash"].triton_reshape_and_cache_flash(4)
    ops.unrelated()
    assert calls[0] == ("reshape_and_cache_flash", (1, 2), dict(slot=3, check=validate.DEFAULT_CHECK, backend="torch"))
    assert calls[1][0] == "reshape_and_cache_flash" and seen == ["other"]     # vLLM's writers never ran
    assert state.calls == {"reshape_and_cache_flash": 1, "triton_reshape_and_cache_flash": 1}
    routed = ops.concat_and_cache_mla
    plugin.install(imp, fake, backend="torch", state=state, modules={}, ops=False)   # idempotent
    assert ops.concat_and_cache_mla is routed
    assert "not routed" in plugin.report(state) and "reshape_and_cache_flash" in plugin.report(state)
    plugin.uninstall(state)
    assert dict(vars(ops)) == before and not state.originals


def test_routed_cpu_attn_store_writes_what_the_adapter_writes(state):
    modules, imp, _ = fake_vllm()
    plugin.install(imp, backend="torch", state=state, modules={}, ops=False)
    key = torch.randn(3, 2, 16, device=DEVICE).bfloat16()
    kv = torch.zeros(4, 2, 2 * 8, 16, dtype=torch.bfloat16, device=DEVICE)
    twin = kv.clone()
    sm = torch.tensor([5, -1, 17], device=DEVICE)
    modules["vllm._custom_ops"].cpu_attn_reshape_and_cache(key, key, *kv.chunk(2, dim=2), sm, "vec")
    adapters.cpu_attn_reshape_and_cache(key, key, *twin.chunk(2, dim=2), sm, "vec", backend="torch")
    assert torch.equal(kv, twin) and bool(kv.any())


PKG = {
    "__init__.py": "",
    "_custom_ops.py": """
        CALLS = []
        def reshape_and_cache_flash(*args, **kwargs):
            CALLS.append(args)
        """,
    "early.py": "from kvwfake._custom_ops import reshape_and_cache_flash\n",
    "late.py": "from kvwfake._custom_ops import reshape_and_cache_flash\n",
}


def test_names_bound_at_import_are_routed_whatever_the_order(tmp_path, monkeypatch, state):
    """flash_attn / triton_attn bind their writer with `from ... import`: a module imported before
    install is rebound; one imported after binds the routed writer."""
    root = tmp_path / "kvwfake"
    root.mkdir()
    for name, text in PKG.items():
        (root / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("kvwfake")]:
        monkeypatch.delitem(sys.modules, name)
    import importlib
    early = importlib.import_module("kvwfake.early")
    cops = importlib.import_module("kvwfake._custom_ops")
    original = cops.reshape_and_cache_flash

    def imp(name):
        if name == "vllm._custom_ops":
            return cops
        raise ImportError(name)
    plugin.install(imp, backend="torch", state=state, prefix="kvwfake", ops=False)
    late = importlib.import_module("kvwfake.late")
    assert early.reshape_and_cache_flash is cops.reshape_and_cache_flash is late.reshape_and_cache_flash
    assert cops.reshape_and_cache_flash is not original
    key = torch.randn(2, 1, 8, device=DEVICE)
    kc = torch.zeros(2, 4, 1, 8, device=DEVICE)
    late.reshape_and_cache_flash(key, key, kc, kc.clone(), torch.tensor([1, 6], device=DEVICE), "auto", None, None)
    assert cops.CALLS == [] and torch.equal(kc[0, 1], key[0]) and torch.equal(kc[1, 2], key[1])
    assert "kvwfake.early.reshape_and_cache_flash" in state.rebound
    plugin.uninstall(state)
    assert early.reshape_and_cache_flash is original and late.reshape_and_cache_flash is original


SCHEMA = ("(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, Tensor slot_mapping, "
          "str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()")


def test_operator_kernels_are_overridden(monkeypatch, state):
    """Backends that call `torch.ops._C_cache_ops.reshape_and_cache_flash` directly (FlashInfer,
    FlexAttention, ...) reach kvwrite: the operator's CPU kernel is replaced, not a Python name.
    The fake operator stands for vLLM's C++ registration (so it is dropped from torch.library's
    record of Python kernels, as a C++ kernel is not in it)."""
    ns = "kvw_fake_cache_ops"
    lib = torch.library.Library(ns, "DEF")
    lib.define("reshape_and_cache_flash" + SCHEMA)
    ran = []
    lib.impl("reshape_and_cache_flash", lambda *a: ran.append(1), "CPU")
    torch.library._impls.discard(f"{ns}/reshape_and_cache_flash/CPU")
    monkeypatch.setattr(plugin, "OP_ROUTES", {f"{ns}::reshape_and_cache_flash": plugin.ROUTES[1]})
    modules, imp, _ = fake_vllm()
    plugin.install(imp, backend="torch", state=state, modules={})
    assert state.ops == {f"{ns}::reshape_and_cache_flash": ["CPU"]}
    key = torch.randn(3, 2, 8)
    kc, twin = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    sm = torch.tensor([3, -1, 14])
    one = torch.ones(())
    getattr(torch.ops, ns).reshape_and_cache_flash(key, key, kc, kc.clone(), sm, "auto", one, one)
    adapters.reshape_and_cache_flash(key, key, twin, twin.clone(), sm, "auto", one, one, backend="torch")
    assert ran == [] and torch.equal(kc, twin) and bool(kc.any())
    assert state.calls["reshape_and_cache_flash"] == 1
    assert f"torch.ops.{ns}.reshape_and_cache_flash [CPU]" in plugin.report(state)
    del lib


class FakeRunner:
    """The parts of vLLM's GPUModelRunner the plugin reads, and a step that stores every layer."""

    def __init__(self, store, nb=4, bs=8, pages=None, page=None, names=("model.layers.0.attn", "model.layers.1.attn")):
        self.store, self.names = store, names
        self.nb, self.bs = nb, bs
        self.pages, self.page = pages or nb, page or bs

    def initialize_kv_cache(self, kv_cache_config):
        self.kv_cache_config = kv_cache_config
        self.caches = {n: torch.zeros(self.pages, 2, 2 * self.page, 8, device=DEVICE) for n in self.names}
        self.compilation_config = types.SimpleNamespace(static_forward_context={
            n: types.SimpleNamespace(kv_cache=c) for n, c in self.caches.items()})
        self.input_batch = types.SimpleNamespace(
            block_table=types.SimpleNamespace(block_tables=[types.SimpleNamespace(block_size=self.bs)]),
            num_reqs=0, req_ids=[])

    def execute_model(self, req_ids, lens, slots):
        """One step: requests `req_ids` with `lens` tokens; `slots[layer]`: that layer's slots."""
        self.input_batch.num_reqs, self.input_batch.req_ids = len(req_ids), list(req_ids)
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        self.query_start_loc = types.SimpleNamespace(np=starts)
        for name, sm in zip(self.names, slots):
            key = torch.ones(len(sm), 2, 8, device=DEVICE)
            self.store(key, key, *self.caches[name].chunk(2, dim=2), torch.tensor(sm, device=DEVICE), "vec")
        return "output"


def runner_env(state, **kw):
    modules, imp, _ = fake_vllm()
    plugin.install(imp, backend="torch", state=state, modules={}, ops=False)
    cls = type("GPUModelRunner", (FakeRunner,), {})
    plugin.hook_runners({"vllm.v1.worker.gpu_model_runner": types.SimpleNamespace(GPUModelRunner=cls)}, state)
    runner = cls(modules["vllm._custom_ops"].cpu_attn_reshape_and_cache, **kw)
    spec = types.SimpleNamespace(block_size=runner.bs)
    runner.initialize_kv_cache(types.SimpleNamespace(
        num_blocks=runner.nb, kv_cache_groups=[types.SimpleNamespace(layer_names=list(runner.names),
                                                                     kv_cache_spec=spec)]))
    return runner


def test_guard_reads_once_per_step_and_names_layer_and_request(monkeypatch, state, fresh_guard):
    """No record read inside a store (stores of layers 0 and 1 both run); one read after the
    step, raising with the step, the layer, the request and the token's slot and block."""
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    runner = runner_env(state)
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.shape) or real_tolist(self))
    assert runner.execute_model(["a", "b"], [2, 1], [[0, 1, 9], [0, 1, 9]]) == "output"
    assert len(reads) == 1                                    # the per-step read, nothing per store
    bad = 4 * 8 + 3                                           # one past the last block
    reads.clear()
    twin = runner.caches["model.layers.1.attn"].clone()
    key = torch.ones(3, 2, 8, device=DEVICE)
    adapters.cpu_attn_reshape_and_cache(key, key, *twin.chunk(2, dim=2), torch.tensor([2, 3, -1], device=DEVICE),
                                        "vec", backend="torch")
    with pytest.raises(kvwrite.OutOfBoundsWrite) as exc:
        runner.execute_model(["a", "b"], [2, 1], [[2, 3, 10], [2, 3, bad]])
    assert len(reads) == 1
    msg = str(exc.value)
    assert "vLLM step 1" in msg and "layer model.layers.1.attn" in msg and "request b" in msg
    assert exc.value.token_index == 2 and exc.value.loc == bad and exc.value.page == 4
    assert exc.value.layer == "model.layers.1.attn"
    assert torch.equal(runner.caches["model.layers.1.attn"], twin)   # the good rows written, no other byte
    runner.execute_model(["c"], [1], [[11], [11]])           # the row was reset: serving goes on


def test_guard_log_policy_counts_and_keeps_serving(monkeypatch, state):
    monkeypatch.setenv(plugin.POLICY_ENV, "log")
    g = plugin.new_guard()
    monkeypatch.setattr(plugin, "GUARD", g)
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    runner = runner_env(state)
    runner.execute_model(["a"], [2], [[-7, 1], [1, 2]])
    runner.execute_model(["a"], [1], [[3], [3]])
    assert len(g.faults) == 1 and "layer model.layers.0.attn" in str(g.faults[0])
    assert g.faults[0].loc == -7 and "request a" in str(g.faults[0])
    monkeypatch.setenv(plugin.POLICY_ENV, "silent")
    with pytest.raises(ValueError, match="KVWRITE_VLLM_GUARD"):
        plugin.new_guard()


def test_namespace_mismatch_is_refused_with_both_numbers(monkeypatch, state, fresh_guard):
    """vLLM #47056: slot_mapping encoded with blocks of 16, the cache tensor has pages of 4 (and
    as many pages as the allocator has blocks): refused at the first store into it."""
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    runner = runner_env(state, nb=4, bs=16, page=4)
    with pytest.raises(plugin.NamespaceMismatch, match=r"64 rows \(blocks of 16\).*4 pages of 4 rows = 16"):
        runner.execute_model(["a"], [1], [[0], [0]])
    runner = runner_env(plugin.Installed(), nb=4, bs=16, page=6)
    with pytest.raises(plugin.NamespaceMismatch, match="block size 16 .* pages of 6 rows"):
        runner.execute_model(["a"], [1], [[0], [0]])


def test_guard_without_a_step_hook_raises_at_the_store(monkeypatch, state, fresh_guard):
    """vLLM #47056's mismatch seen by the store itself when no runner hook reads the records."""
    modules, imp, _ = fake_vllm()
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    plugin.install(imp, backend="torch", state=state, modules={}, ops=False)
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


def test_register_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(plugin.ENABLE_ENV, "0")
    called = []
    monkeypatch.setattr(plugin, "install", lambda *a, **k: called.append(1))
    plugin.register()
    assert called == []
    monkeypatch.setenv(plugin.ENABLE_ENV, "1")
    plugin.register()     # vllm is not installed here: install() still runs (and skips what is missing)
    assert called == [1]
