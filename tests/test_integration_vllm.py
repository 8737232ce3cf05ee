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
    assert f"torch.ops.{ns}.reshape_and_cache_flash [CPU" in plugin.report(state)
    del lib


CPU_ATTN_SCHEMA = ("(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, Tensor slot_mapping, "
                   "str isa, float k_scale=1., float v_scale=1., str kv_cache_dtype=\"auto\") -> ()")


@pytest.fixture
def native_ops(monkeypatch):
    """Fake vLLM operators (vLLM's schemas, C++-registered stand-ins) routed by the plugin with
    backend "auto": the C++ route of csrc/engines.h runs their common call."""
    if kvwrite.backends(DEVICE).get(DEVICE.type) is not None:
        pytest.skip(f"the C++ extension has no {DEVICE.type} kernels here")
    ns = "kvw_native_ops"
    lib = torch.library.Library(ns, "DEF")
    lib.define("reshape_and_cache_flash" + SCHEMA)
    lib.define("cpu_attn_reshape_and_cache" + CPU_ATTN_SCHEMA)
    ran = []
    for op in ("reshape_and_cache_flash", "cpu_attn_reshape_and_cache"):
        for key in {"CPU", DEVICE.type.upper()}:
            lib.impl(op, lambda *a, op=op: ran.append(op), key)
            torch.library._impls.discard(f"{ns}/{op}/{key}")
    monkeypatch.setattr(plugin, "OP_ROUTES", {f"{ns}::reshape_and_cache_flash": plugin.ROUTES[1],
                                              f"{ns}::cpu_attn_reshape_and_cache": plugin.ROUTES[0]})
    st = plugin.Installed()
    modules, imp, _ = fake_vllm()
    plugin.install(imp, backend="auto", state=st, modules={})
    yield types.SimpleNamespace(ops=getattr(torch.ops, ns), state=st, ran=ran, modules=modules)
    plugin.uninstall(st)
    plugin.sync_mode("auto")
    del lib


def native_calls(st, qual):
    return st.native_calls()[qual]


def test_native_route_runs_the_common_call_in_cpp(native_ops):
    """The common call ("auto" caches) runs on the C++ route (no Python frame: the Python writer
    is not called) and writes the adapter's bytes; the Python wrapper of the operator is left as
    vLLM's own; other calls (an fp8 cache) go to the Python writer."""
    st, ops = native_ops.state, native_ops.ops
    qual = "kvw_native_ops::reshape_and_cache_flash"
    assert sorted(st.native) == ["kvw_native_ops::cpu_attn_reshape_and_cache", qual]
    assert "vllm._custom_ops.reshape_and_cache_flash" not in st.originals
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(5, 2, 8, generator=g).bfloat16().to(DEVICE), torch.randn(5, 2, 8, generator=g).bfloat16().to(DEVICE)
    sm = torch.tensor([3, -1, 14, 0, 9], device=DEVICE)
    kc, vc = (torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    twin_k, twin_v = kc.clone(), vc.clone()
    one = torch.ones((), device=DEVICE)
    ops.reshape_and_cache_flash(key, value, kc, vc, sm, "auto", one, one)
    adapters.reshape_and_cache_flash(key, value, twin_k, twin_v, sm, "auto", one, one, backend="torch")
    assert torch.equal(kc, twin_k) and torch.equal(vc, twin_v) and bool(kc.any())
    assert native_calls(st, qual) == 1 and st.calls.get("reshape_and_cache_flash", 0) == 0
    # vLLM's CPU attention layout: [blocks, H, 2 * bs, D] chunked into K and V
    kv, twin = (torch.zeros(4, 2, 8, 8, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    ops.cpu_attn_reshape_and_cache(key, value, *kv.chunk(2, dim=2), sm, "vec")
    adapters.cpu_attn_reshape_and_cache(key, value, *twin.chunk(2, dim=2), sm, "vec", backend="torch")
    assert torch.equal(kv, twin) and native_calls(st, "kvw_native_ops::cpu_attn_reshape_and_cache") == 1
    fp8 = torch.zeros(4, 4, 2, 8, dtype=torch.uint8, device=DEVICE)
    ops.reshape_and_cache_flash(key, value, fp8, fp8.clone(), sm, "fp8", one, one)
    assert st.calls["reshape_and_cache_flash"] == 1 and bool(fp8.any())   # the Python writer ran
    assert native_ops.ran == []


@pytest.mark.parametrize("mode", ["assert", "guard"])
def test_native_route_bad_slot_changes_no_byte(native_ops, mode, monkeypatch, fresh_guard):
    """A bad slot through the C++ route: assert raises the named error (via the Python writer,
    nothing written); guard with the step hook records into the layer's row (handed to C++ by the
    first store, which went through Python) and the step's check names the layer."""
    if mode == "assert" and DEVICE.type == "cuda":
        pytest.skip("a device assert ends the CUDA context (the CUDA assert path: test_store_kv.py's subprocess)")
    monkeypatch.setattr(validate, "DEFAULT_CHECK", mode)
    plugin.sync_mode("auto")
    st, ops = native_ops.state, native_ops.ops
    qual = "kvw_native_ops::reshape_and_cache_flash"
    key = torch.ones(3, 2, 8, dtype=torch.bfloat16, device=DEVICE)
    kc = torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16, device=DEVICE)
    vc = torch.zeros_like(kc)
    fresh_guard.register({"model.layers.0.attn": kc}, {"model.layers.0.attn": 4}, {"model.layers.0.attn": 16})
    fresh_guard.stepped = True
    one = torch.ones((), device=DEVICE)
    ops.reshape_and_cache_flash(key, key, kc, vc, torch.tensor([0, 1, 2], device=DEVICE), "auto", one, one)
    before = native_calls(st, qual)
    snapshot = kc.clone()
    bad = torch.tensor([5, 16, 6], device=DEVICE)                   # one past the last row
    if mode == "assert":
        with pytest.raises(kvwrite.OutOfBoundsWrite, match="loc 16"):
            ops.reshape_and_cache_flash(key, key, kc, vc, bad, "auto", one, one)
        assert torch.equal(kc, snapshot)
        return
    ops.reshape_and_cache_flash(key, key, kc, vc, bad, "auto", one, one)
    assert native_calls(st, qual) == before + 1      # the C++ route ran it
    with pytest.raises(kvwrite.OutOfBoundsWrite) as exc:
        fresh_guard.check()
    assert exc.value.loc == 16 and exc.value.token_index == 1 and "model.layers.0.attn" in str(exc.value)
    expect = snapshot.clone()
    expect[1, 1] = 1
    expect[1, 2] = 1
    assert torch.equal(kc, expect)                  # the good rows, no other byte


def kv_views(kv):
    """vLLM's CPU backend's key / value caches of a layer's tensor."""
    nb, h, bs, d2 = kv.shape
    return kv.view(nb, h, 2 * bs, d2 // 2).chunk(2, dim=2)


class FakeRunner:
    """The parts of vLLM's GPUModelRunner the plugin reads, and a step that stores every layer."""

    def __init__(self, store, nb=4, bs=8, pages=None, page=None, names=("model.layers.0.attn", "model.layers.1.attn"),
                 backend="FLASH_ATTN"):
        self.store, self.names, self.backend = store, names, backend
        self.nb, self.bs = nb, bs
        self.pages, self.page = pages or nb, page or bs

    def initialize_kv_cache(self, kv_cache_config):
        self.kv_cache_config = kv_cache_config
        # vLLM 0.32's CPU attention cache: [blocks, H, block_size, 2 * D]
        self.caches = {n: torch.zeros(self.pages, 2, self.page, 2 * 8, device=DEVICE) for n in self.names}
        backend = types.SimpleNamespace(get_name=lambda: self.backend)
        self.compilation_config = types.SimpleNamespace(static_forward_context={
            n: types.SimpleNamespace(kv_cache=c, get_attn_backend=lambda: backend) for n, c in self.caches.items()})
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
            self.store(key, key, *kv_views(self.caches[name]), torch.tensor(sm, device=DEVICE), "vec")
        return self.make_output()

    def make_output(self):
        return "output"

    def sample_tokens(self, grammar_output):   # async scheduling: the step's output comes from here
        return self.async_output


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
    adapters.cpu_attn_reshape_and_cache(key, key, *kv_views(twin), torch.tensor([2, 3, -1], device=DEVICE),
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


def test_guard_fail_policy_fails_only_the_requests_that_wrote_badly(monkeypatch, state):
    """KVWRITE_VLLM_GUARD=fail: the step goes on; the request whose token wrote out of bounds rides
    on the runner's output to the scheduler, whose error path (vLLM: FINISHED_ERROR) ends it, and the
    others keep running; a layer with more bad writes than its record names fails every request of
    that step; a duplicated row fails both writers; async scheduling's output (sample_tokens) too."""
    monkeypatch.setenv(plugin.POLICY_ENV, "fail")
    g = plugin.new_guard()
    monkeypatch.setattr(plugin, "GUARD", g)
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    runner = runner_env(state)
    runner.make_output = lambda: types.SimpleNamespace(sampled_token_ids=[])

    class Scheduler:   # the parts of vLLM's scheduler the hook touches
        def __init__(self):
            self.requests, self.grammar_compile_error_reqs, self.ended = dict.fromkeys("abc"), set(), []

        def update_from_output(self, scheduler_output, model_runner_output):
            self.ended.append(set(self.grammar_compile_error_reqs))
            self.grammar_compile_error_reqs.clear()
            return model_runner_output

    plugin.hook_runners({"vllm.v1.core.sched.scheduler": types.SimpleNamespace(Scheduler=Scheduler)}, state)
    sched = Scheduler()
    step_out = lambda s, out: s.update_from_output(None, out) and s.ended[-1]  # noqa: E731
    step = lambda *a: step_out(sched, runner.execute_model(*a))  # noqa: E731
    bad = 4 * 8 + 3                                           # one past the last block
    before = {n: c.clone() for n, c in runner.caches.items()}
    assert step(["a", "b"], [2, 1], [[0, 1, bad], [0, 1, bad]]) == {"b"}
    assert len(g.faults) == 2 and all("request b" in str(e) for e in g.faults)
    twin = before["model.layers.0.attn"]
    key = torch.ones(3, 2, 8, device=DEVICE)
    adapters.cpu_attn_reshape_and_cache(key, key, *kv_views(twin), torch.tensor([0, 1, -1], device=DEVICE),
                                        "vec", backend="torch")
    assert torch.equal(runner.caches["model.layers.0.attn"], twin)   # the good rows, no other byte
    assert step(["a", "c"], [1, 1], [[2, 3], [2, 3]]) == set()          # a clean step fails nobody
    assert step(["a", "c"], [1, 1], [[-7, bad], [4, 5]]) == {"a", "c"}  # two bad writes, one named
    assert step(["a", "b", "c"], [1, 1, 1], [[8, 9, 9], [8, 9, 10]]) == {"b", "c"}   # a duplicated row
    # async scheduling: execute_model returns nothing, the failed ids ride on sample_tokens' output
    runner.make_output = lambda: None
    assert runner.execute_model(["a", "b"], [1, 1], [[11, bad], [11, 12]]) is None
    runner.async_output = types.SimpleNamespace(get_output=lambda: types.SimpleNamespace(sampled_token_ids=[]))
    assert step_out(sched, runner.sample_tokens(None).get_output()) == {"b"}
    runner.parallel_config = types.SimpleNamespace(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="one pipeline stage"):
        plugin.register_runner(runner)


def test_namespace_mismatch_is_refused_with_both_numbers(monkeypatch, state, fresh_guard):
    """vLLM #47056: slot_mapping encoded with blocks of 16, the cache tensor has pages of 4 (and
    as many pages as the allocator has blocks): refused at the first store into it."""
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    runner = runner_env(state, nb=4, bs=16, page=4)
    with pytest.raises(plugin.NamespaceMismatch, match=r"64 rows \(blocks of 16\).*4 pages of 4 rows = 16"):
        runner.execute_model(["a"], [1], [[0], [0]])
    other = plugin.Installed()
    try:
        runner = runner_env(other, nb=4, bs=16, page=6)
        with pytest.raises(plugin.NamespaceMismatch, match="block size 16 .* pages of 6 rows"):
            runner.execute_model(["a"], [1], [[0], [0]])
    finally:
        plugin.uninstall(other)


def test_namespace_of_cpu_attention_caches_is_checked_at_startup(monkeypatch, state, fresh_guard):
    """vLLM's CPU backend's whole cache tensor has its writer's layout: refused when vLLM
    allocates the KV cache, before any store."""
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    with pytest.raises(plugin.NamespaceMismatch, match=r"64 rows \(blocks of 16\).*4 pages of 4 rows"):
        runner_env(state, nb=4, bs=16, page=4, backend="CPU_ATTN")
    other = plugin.Installed()
    try:
        runner_env(other, nb=4, bs=16, backend="CPU_ATTN")                  # a consistent one passes
    finally:
        plugin.uninstall(other)


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


def test_grouped_mla_route_checks_the_registered_caches(monkeypatch, state, fresh_guard):
    """concat_and_cache_mla_grouped gets raw cache addresses: the caches registered at startup
    bound its writes (guard mode raises the bad slot; the other rows are written)."""
    modules, imp, _ = fake_vllm()
    modules["vllm._custom_ops"].concat_and_cache_mla_grouped = lambda *a: None
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    plugin.install(imp, backend="torch", state=state, modules={}, ops=False)
    caches = torch.zeros(2, 4, 8, 48, dtype=torch.bfloat16, device=DEVICE)
    adapters.register_caches([caches[0], caches[1]])
    ptrs = torch.tensor([caches[0].data_ptr(), caches[1].data_ptr()])
    kv_c = torch.ones(2, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    k_pe = torch.ones(2, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    sm = torch.tensor([[1, 2], [3, 4 * 8]], device=DEVICE)
    with pytest.raises(kvwrite.OutOfBoundsWrite, match="token 1 writes loc 32 into page 4"):
        modules["vllm._custom_ops"].concat_and_cache_mla_grouped(kv_c, k_pe, ptrs, sm, 8, caches.stride(1),
                                                                 caches.stride(2), None, "auto")
    assert bool(caches[0, 0, 1].eq(1).all()) and bool(caches[1, 0, 3].eq(1).all())
    assert int(caches.ne(0).sum()) == 3 * 48
