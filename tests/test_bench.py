"""`kvwrite bench` in a tiny configuration: it runs, writes JSON / markdown / plot, and its
rows are consistent; the case registry and the paged locs behave."""
import json

import pytest
import torch

import kvwrite
from kvwrite.bench import cases, report, run
from kvwrite.cli import main


def test_paged_locs_are_unique_whole_shuffled_pages_inside_the_pool():
    gen = torch.Generator().manual_seed(1)
    loc, num_pages = cases.paged_locs(100, 16, torch.device("cpu"), gen)
    assert loc.dtype == torch.int64 and loc.shape == (100,)
    assert loc.unique().numel() == 100
    assert int(loc.min()) >= 16 and int(loc.max()) < num_pages * 16  # page 0 kept for padding
    pages = (loc // 16).tolist()
    starts = [pages[i] for i in range(0, 100, 16)]
    assert starts != sorted(starts)  # shuffled pages ...
    assert all(int(loc[i + 1] - loc[i]) == 1 for i in range(99) if (i + 1) % 16)  # ... filled in order


def test_registry_skips_ops_missing_from_this_kvwrite(monkeypatch):
    monkeypatch.setitem(cases.REGISTRY, "store_nonexistent",
                        [cases.Case("ghost", "store_nonexistent", "not an op", lambda *a: None)])
    chosen, skipped = cases.available()
    assert "store_nonexistent" in skipped and all(c.op != "store_nonexistent" for c in chosen)
    assert {c.name for c in chosen} >= {"mha-bf16", "mha-fp8"}
    with pytest.raises(ValueError, match="unknown case"):
        cases.available(["no-such-case"])


ALL_CASES = [c for g in cases.REGISTRY.values() for c in g]


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.name for c in ALL_CASES])
def test_every_case_stores_and_agrees_with_its_baselines(case):
    """Each available case's kvwrite call writes its outputs; every baseline writes the same bytes."""
    if not hasattr(kvwrite, case.op) or case.missing():
        pytest.skip(f"{case.op} / {case.name} not in this build")
    setup = case.build(40, torch.device("cpu"), torch.Generator().manual_seed(2))
    assert setup.bytes_moved > 0 and setup.outputs
    setup.call("torch", "off", None)
    expected = [t.view(torch.uint8).clone() for t in setup.outputs]
    assert any(bool(e.any()) for e in expected)
    for name, baseline in setup.baselines.items():
        for t in setup.outputs:
            t.view(torch.uint8).zero_()
        baseline()
        assert all(torch.equal(t.view(torch.uint8), e) for t, e in zip(setup.outputs, expected)), name


def test_bench_tiny_run_writes_json_report_and_plot(tmp_path):
    threads = torch.get_num_threads()
    rc = main(["bench", "--device", "cpu", "--sizes", "1,8", "--cases", "mha-bf16",
               "--backends", "torch", "--checks", "off,guard", "--min-time", "0.001",
               "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["machine"]["kind"] == "cpu" and result["versions"]["torch"] == torch.__version__
    rows = result["rows"]
    assert {(r["impl"], r["check"], r["n"]) for r in rows if r["kind"] == "kvwrite"} == {
        ("torch", c, n) for c in ("off", "guard") for n in (1, 8)}
    assert {r["impl"] for r in rows if r["kind"] == "baseline"} >= {"torch-index", "index_copy_"}
    assert all(r["exact"] for r in rows if r["kind"] != "copy")
    assert "all bit-exact" in (tmp_path / "report.md").read_text()
    for r in rows:
        assert r["us"] > 0 and r["bytes"] > 0 and r["gbps"] > 0
        copy = next(c for c in rows if c["kind"] == "copy" and c["n"] == r["n"])
        assert r["pct_copy"] == pytest.approx(100 * copy["us"] / r["us"], rel=0.01, abs=0.1)
    assert {h["what"] for h in result["host"]} == {"wrapper", "raw index_put_", "raw cache[loc] = k"}
    assert [t["target"] for t in result["targets"]] == [t["target"] for t in report.targets(result)]
    text = (tmp_path / "report.md").read_text()
    assert "kvwrite bench — cpu" in text and result["machine"]["cpu"] in text and "## Targets" in text
    assert "mha-bf16" in text and torch.get_num_threads() == threads  # restored
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert kvwrite.default_errors("cpu").error() is None


def test_bench_values_outliers_draws_outlier_rows_and_says_so(tmp_path):
    """`--values outliers`: every 64th input value x OUTLIER in every case's rows, the stores still
    bit-exact, and the report and its command say which rows were used."""
    from kvwrite.bench import cases
    gen = torch.Generator().manual_seed(0)
    with cases.values("outliers"):
        x = cases._randn((4, 128), torch.float32, torch.device("cpu"), gen)
    big = torch.zeros(4 * 128, dtype=torch.bool)
    big[::64] = True
    assert x.view(-1)[~big].abs().max() < 10 and x.view(-1)[big].abs().min() > 10
    assert cases._values == "normal"   # restored after the block
    with pytest.raises(ValueError, match="values: 'heavy' is not one of normal, outliers"):
        with cases.values("heavy"):
            pass
    rc = main(["bench", "--device", "cpu", "--sizes", "8", "--cases", "mla-fp8ds", "--backends", "torch",
               "--checks", "off", "--min-time", "0.001", "--values", "outliers", "--out", str(tmp_path),
               "--quiet", "--no-plot"])
    assert rc == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["config"]["values"] == "outliers" and "--values outliers" in result["command"]
    assert all(r["exact"] for r in result["rows"] if r["kind"] != "copy")
    assert "input rows: outliers" in (tmp_path / "report.md").read_text()


def test_a_store_that_writes_wrong_bytes_is_flagged(monkeypatch, tmp_path):
    mha = next(c for c in cases.REGISTRY["store_kv"] if c.name == "mha-bf16")

    def build(n, device, gen):
        setup = mha.build(n, device, gen)
        good = setup.baselines["index_copy_"]

        def bad():
            good()
            setup.outputs[0].view(torch.uint8).view(-1)[-1] ^= 1  # one flipped bit

        setup.baselines = {"index_copy_": good, "off-by-a-bit": bad}
        return setup

    monkeypatch.setitem(cases.REGISTRY, "store_kv", [cases.Case("sabotaged", "store_kv", "test", build)])
    result = run.sweep(run.Config(sizes=(16,), cases=["sabotaged"], backends=["torch"], checks=("off",),
                                  min_time=0.001))
    exact = {r["impl"]: r["exact"] for r in result["rows"] if r["kind"] != "copy"}
    assert exact == {"torch": True, "index_copy_": True, "off-by-a-bit": False}
    assert "**differ: sabotaged/off-by-a-bit**" in report.markdown(result, None)


def test_host_overhead_is_measured_at_one_token(monkeypatch):
    """The report calls the host overhead "N=1": it is timed on an N=1 setup even when the sweep's
    smallest size is larger (a sweep of N=1024 once judged the wrapper against a 600 µs index_put_)."""
    mha = next(c for c in cases.REGISTRY["store_kv"] if c.name == "mha-bf16")
    built, timed = [], []

    def build(n, device, gen):
        built.append(n)
        setup = mha.build(n, device, gen)
        setup.n = n
        return setup

    real = run.host_overhead
    monkeypatch.setattr(run, "host_overhead", lambda case, setup, *a: timed.append(setup.n) or real(case, setup, *a))
    monkeypatch.setitem(cases.REGISTRY, "store_kv", [cases.Case("mha-bf16", "store_kv", "test", build)])
    result = run.sweep(run.Config(sizes=(16, 32), cases=["mha-bf16"], backends=["torch"], checks=("off",),
                                  min_time=0.001))
    assert built == [16, 1, 32] and timed == [1]
    assert {h["what"] for h in result["host"]} == {"wrapper", "raw index_put_", "raw cache[loc] = k"}


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.name for c in ALL_CASES])
def test_host_overhead_calls_reach_no_backend(case):
    """Under noop_backends a case's call validates and dispatches but writes nothing, whatever
    dispatch table its op uses."""
    if not hasattr(kvwrite, case.op) or case.missing():
        pytest.skip(f"{case.op} / {case.name} not in this build")
    setup = case.build(8, torch.device("cpu"), torch.Generator().manual_seed(3))
    for t in setup.outputs:
        t.view(torch.uint8).zero_()
    with run.noop_backends():
        for backend in ("auto", "torch"):
            setup.call(backend, "guard", None)
    assert not any(bool(t.view(torch.uint8).any()) for t in setup.outputs)
    setup.call("torch", "off", None)  # and the real backends are back
    assert any(bool(t.view(torch.uint8).any()) for t in setup.outputs)
