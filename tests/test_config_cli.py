"""`kvwrite plan`, `kvwrite presets` and `kvwrite demo` (on the configurator)."""
from __future__ import annotations

import json

import pytest

from kvwrite import cli
from kvwrite.config.presets import PRESETS
from kvwrite.cli.plan import parse_bytes


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_table_deepseek_dcp_draft(capsys):
    rc, out, _ = run(capsys, "plan", "--preset", "deepseek-v3", "--tp", "4", "--dcp", "4", "--draft", "--page-size",
                     "64", "--memory", "20GiB")
    assert rc == 0 and "layout of engine=sglang" in out
    assert "loc_space_scale=4" in out and "pool_page_size=256" in out
    # SGLang's sizing: 20 GiB // 1152 B per virtual token, in whole 256-token pages; + the padding page
    assert "max_total_num_tokens=18,641,152" in out and "store_mla (virtual loc)" in out
    assert "[72818, 256, 576] bfloat16" in out and "engine sizing" in out


def test_plan_refuses_what_the_engine_has_no_layout_for(capsys):
    rc, _, err = run(capsys, "plan", "--preset", "deepseek-v3", "--dcp", "4", "--draft", "--memory", "20GiB")
    assert rc == 2 and "tp_size=1 with dcp_size=4" in err and "parallel_hook.py" in err
    rc, out, _ = run(capsys, "plan", "--preset", "deepseek-v3", "--dcp", "4", "--draft", "--memory", "20GiB",
                     "--engine", "kvwrite")
    assert rc == 0 and "layout of engine=kvwrite" in out


def test_plan_json_matches_the_api(capsys):
    rc, out, _ = run(capsys, "plan", "--preset", "gpt-oss-120b", "--kv-cache-dtype", "fp8_e4m3", "--memory",
                     "40GiB", "--json")
    d = json.loads(out)
    assert rc == 0 and d["variant"] == "swa_hybrid" and d["kv_cache_dtype"] == "fp8_e4m3"
    assert [p["name"] for p in d["pools"]] == ["full", "swa"]
    assert d["max_total_num_tokens"] * d["cell_size_bytes"] <= 40 * 2**30 and d["sizing"] == "engine"
    assert d["total_bytes"] == pytest.approx(d["max_total_num_tokens"] * d["cell_size_bytes"] + d["overhead_bytes"],
                                             abs=1)
    assert d["pools"][1]["buffers"][0]["dtype"] == "float8_e4m3fn"


def test_plan_from_config_and_max_tokens(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen3-next-80b-a3b"][1]))
    rc, out, _ = run(capsys, "plan", "--config", str(tmp_path), "--max-tokens", "1000", "--tp", "2",
                     "--max-running-requests", "8", "--json")
    d = json.loads(out)
    assert rc == 0 and d["max_total_num_tokens"] == 960 and d["pools"][0]["num_layers"] == 12


def test_plan_errors_exit_2(capsys):
    rc, _, err = run(capsys, "plan", "--preset", "nope")
    assert rc == 2 and "UnknownPreset" in err
    rc, _, err = run(capsys, "plan", "--preset", "llama-3.1-8b", "--memory", "1MiB")
    assert rc == 2 and "BudgetTooSmall" in err
    rc, _, err = run(capsys, "plan", "--preset", "llama-3.1-8b", "--kv-cache-dtype", "fp8_ds_mla")
    assert rc == 2 and "UnsupportedCombination" in err
    with pytest.raises(SystemExit):
        cli.main(["plan", "--preset", "llama-3.1-8b", "--memory", "lots"])


def test_parse_bytes():
    assert parse_bytes("40GiB") == 40 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("512 MiB") == 512 * 2**20 and parse_bytes("1000") == 1000


def test_presets_command(capsys):
    rc, out, _ = run(capsys, "presets")
    assert rc == 0 and all(name in out for name in PRESETS)
    rc, out, _ = run(capsys, "presets", "--json")
    assert json.loads(out)["gemma-3-27b"]["sliding_window"] == 1024


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_demo_runs_on_the_configurator(capsys):
    rc, out, _ = run(capsys, "demo", "--device", "cpu", "--backend", "torch")
    assert rc == 0, out
    assert "bit-exact with the torch reference" in out
    assert "check_allocator refuses it" in out and "token 2, loc 1040, page 65" in out
    assert "same store is clean: True" in out


def test_plan_table_names_the_engine_layout_and_shared_buffers(capsys):
    rc, out, _ = run(capsys, "plan", "--preset", "gemma-3-27b", "--engine", "vllm", "--page-size", "16",
                     "--memory", "20GiB")
    assert rc == 0 and "variant=swa_grouped" in out and "7 groups of 10" in out and "10 buffer copies" in out
    rc, out, _ = run(capsys, "plan", "--preset", "gemma-3-27b", "--memory", "20GiB")
    assert rc == 0 and "variant=mha" in out and "disable_hybrid_swa_memory" in out
