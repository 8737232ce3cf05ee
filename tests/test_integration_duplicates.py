"""The engine integrations report a duplicate slot like a bad one (kvwrite.integrations): the
vLLM plugin's per-step read names the step, layer and request of the later token and the token
that first wrote the row; the SGLang hook names the layer. Fake engines as in
test_integration_vllm.py / test_integration_sglang.py (their fixtures and helpers)."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from kvwrite import validate
from kvwrite.errors import DuplicateWrite
from test_integration_sglang import env  # noqa: F401  (fixture)
from test_integration_vllm import fresh_guard, runner_env, state  # noqa: F401  (fixtures)


def test_vllm_step_reports_a_slot_two_requests_share(monkeypatch, state, fresh_guard):  # noqa: F811
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    runner = runner_env(state)
    # request b's token reuses slot 1 of request a (a freed-and-still-used block)
    with pytest.raises(DuplicateWrite) as exc:
        runner.execute_model(["a", "b"], [2, 1], [[0, 1, 9], [0, 1, 1]])
    err = exc.value
    msg = str(err)
    assert "vLLM step 0" in msg and "layer model.layers.1.attn" in msg and "request b" in msg
    assert (err.token_index, err.first_token, err.loc, err.page, err.offset) == (2, 1, 1, 0, 1)
    runner.execute_model(["c"], [1], [[11], [11]])           # the record was reset: serving goes on


def test_vllm_log_policy_counts_duplicates(monkeypatch, state):  # noqa: F811
    from kvwrite.integrations import vllm as plugin

    monkeypatch.setenv(plugin.POLICY_ENV, "log")
    g = plugin.new_guard()
    monkeypatch.setattr(plugin, "GUARD", g)
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    runner = runner_env(state)
    runner.execute_model(["a"], [3], [[4, 5, 4], [1, 2, 3]])
    assert len(g.faults) == 1 and isinstance(g.faults[0], DuplicateWrite)
    assert "layer model.layers.0.attn" in str(g.faults[0]) and g.faults[0].first_token == 0


def test_sglang_hook_names_the_layer_of_a_duplicate(monkeypatch, env):  # noqa: F811
    monkeypatch.setattr(validate, "DEFAULT_CHECK", "guard")
    pool = env.pools.MHATokenToKVPool()
    k = torch.arange(3 * 2 * 16, dtype=torch.float32, device=DEVICE).view(3, 2, 16).bfloat16()
    with pytest.raises(DuplicateWrite, match=r"layer MHATokenToKVPool layer 1 K\): store_kv: token 2 .*which token 0"):
        pool._store_kv_layer(1, torch.tensor([9, 12, 9], device=DEVICE), k, k)
    assert torch.equal(pool.k_buffer[1][9], k[0]) and torch.equal(pool.k_buffer[1][12], k[1])   # first writer kept
