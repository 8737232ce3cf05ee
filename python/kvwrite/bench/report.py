"""A sweep's result as a terminal table, JSON, a markdown report and a PNG plot, plus where it
stands against the performance targets (figures, not pass/fail tests)."""
from __future__ import annotations

import datetime as _dt
import json
from collections import defaultdict
from pathlib import Path

from kvwrite.bench import host as host_costs

GPU_BACKENDS = ("cuda", "triton")
REFERENCE_CASE = "mha-bf16"
SCATTER = "memcpy-scatter"  # the extension's plain per-row memcpy loop (bench_memcpy_scatter)
STREAM_SCATTER = "stream-scatter"  # the same loop, whole lines by streaming stores (shown beside it)
# Every quantised format's case: the cpu backend against the same-run scatter of the
# bytes it writes, one target row each (a layout no row scatter expresses says so in its row).
QUANT_SCATTER_TARGET = 0.4
QUANT_FORMATS = (("mha-fp8", "fp8 store_kv"), ("mla-fp8ds", "fp8_ds_mla"),
                 ("mha-int8-token", "per-token int8 store_kv"), ("mha-int8-head", "per-token-head int8 store_kv"),
                 ("mha-fp8-token", "per-token fp8 store_kv"), ("mha-fp8-head", "per-token-head fp8 store_kv"),
                 ("mha-nvfp4", "NVFP4 store_kv_nvfp4"), ("mla-nvfp4", "NVFP4 store_mla"),
                 ("indexer-k", "DSA indexer K (e4m3 + fp32 scale)"), ("dsv4-kv", "DeepSeek V4 fp8 KV record"),
                 ("dsv4-indexer-mxfp4", "DeepSeek V4 MXFP4 indexer K"),
                 ("dsv4-kv-nvfp4", "DeepSeek V4 nvfp4 record"), ("dsv4-kv-mxfp4", "DeepSeek V4 mxfp4 record"),
                 ("dsv4-kv-nvfp4-v41", "DeepSeek V4.1 nvfp4_v41 record"))


def _series(rows, case, impl, check="off", mode="eager") -> dict[int, dict]:
    return {r["n"]: r for r in rows
            if r["case"] == case and r["impl"] == impl and r["check"] == check and r["mode"] == mode}


def _fmt_us(us: float) -> str:
    return f"{us:.3g}" if us < 100 else f"{us:.0f}"


def targets(result: dict) -> list[dict]:
    """Each performance target with this run's figure and whether it is met (None: not measured
    here, with why)."""
    rows, host = result["rows"], result["host"]
    gpu = result["config"]["device"].startswith("cuda")
    out = []

    def add(target, figure, met, detail=""):
        out.append({"target": target, "figure": figure, "met": met, "detail": detail})

    # CPU: the C++ cpu backend vs index_copy_ at N >= 1024.
    t = "CPU: C++ cpu backend >= index_copy_ at N >= 1024 (MHA bf16, check off)"
    if gpu:
        add(t, "not measured (CUDA run)", None)
    else:
        base = _series(rows, REFERENCE_CASE, "index_copy_", None)
        cpu = _series(rows, REFERENCE_CASE, "cpu")
        ns = sorted(n for n in base if n >= 1024)
        if not cpu:
            why = result["backend_notes"].get("cpu", "not selected")
            torch_ = _series(rows, REFERENCE_CASE, "torch")
            ctx = ", ".join(f"N={n}: torch backend {base[n]['us'] / torch_[n]['us']:.2f}x index_copy_ speed"
                            for n in ns if n in torch_)
            add(t, f"cpu backend not available ({why})" + (f"; for context {ctx}" if ctx else ""), None)
        elif not ns:
            add(t, "no N >= 1024 in this run", None)
        else:
            fig = ", ".join(f"N={n}: {base[n]['us'] / cpu[n]['us']:.2f}x ({_fmt_us(cpu[n]['us'])} vs "
                            f"{_fmt_us(base[n]['us'])} us)" for n in ns if n in cpu)
            add(t, fig + " (speed relative to index_copy_)",
                all(cpu[n]["us"] <= base[n]["us"] for n in ns if n in cpu))

    # CPU: the cpu backend against the same-run per-row memcpy scatter and contiguous copy.
    def vs_scatter(case, need_scatter, need_copy, label):
        if gpu:
            add(label, "not measured (CUDA run)", None)
            return
        scat, stream = _series(rows, case, SCATTER, None), _series(rows, case, STREAM_SCATTER, None)
        parts, ok = [], True
        for check in ("off", "guard"):
            cpu = _series(rows, case, "cpu", check)
            for n in sorted(x for x in cpu if x >= 1024 and x in scat):
                r = scat[n]["us"] / cpu[n]["us"]
                ok &= r >= need_scatter and (need_copy is None or cpu[n]["pct_copy"] >= 100 * need_copy)
                parts.append(f"{check} N={n}: {100 * r:.0f}% of scatter"
                             + (f" ({100 * stream[n]['us'] / cpu[n]['us']:.0f}% of stream-scatter)" if n in stream else "")
                             + (f", {cpu[n]['pct_copy']:.0f}% of copy" if need_copy is not None else ""))
        why = result.get("notes", {}).get(f"{case}: {SCATTER}", "") if not scat else ""
        add(label, "; ".join(parts) or ("no cpu / memcpy-scatter rows at N >= 1024" + (f" ({why})" if why else "")),
            ok if parts else None)

    threads = result["machine"].get("torch_threads")
    vs_scatter(REFERENCE_CASE, 0.9, 0.5, f"CPU ({threads} thread(s)): MHA bf16 >= 90% of memcpy-scatter "
               "and >= 50% of contiguous copy at N >= 1024 (off, guard)")
    for case, what in QUANT_FORMATS:
        vs_scatter(case, QUANT_SCATTER_TARGET, None,
                   f"CPU ({threads} thread(s)): {what} >= {100 * QUANT_SCATTER_TARGET:.0f}% of memcpy-scatter at N >= 1024")

    # Host overhead of the wrapper vs one raw torch op.
    # the Python path a call takes without the C++ fast path (no extension, or backend="triton")
    t = "Python-path wrapper host overhead <= 2x a raw torch op call (N=1, backend a no-op)"
    raw = [h for h in host if h["case"] == REFERENCE_CASE and h["what"] == "raw index_put_"]
    setitem = [h for h in host if h["case"] == REFERENCE_CASE and h["what"] == "raw cache[loc] = k"]
    wrap = [h for h in host if h["case"] == REFERENCE_CASE and h["what"] == "wrapper"]
    if raw and wrap:
        r = raw[0]["us"]
        parts = [f"{h['backend']}/{h['check']}: {h['us']:.1f} us = {h['us'] / r:.2f}x" for h in wrap]
        first = wrap[0]
        also = (f"; vs `cache[loc] = k` ({setitem[0]['us']:.1f} us): {first['us'] / setitem[0]['us']:.2f}x"
                if setitem else "")
        add(t, f"raw index_put_ {r:.1f} us; wrapper " + "; ".join(parts) + also, first["us"] <= 2 * r,
            f"judged on {first['backend']}/{first['check']} vs index_put_")
    else:
        add(t, "not measured", None)

    for h in result.get("host_cost", []):  # host cost per call at N = 1 (kvwrite.bench.host)
        add(f"host cost at N=1: `{h['what']}` <= {h['target']}x {h['vs']}",
            f"{h['us']:.2f} vs {h['vs_us']:.2f} us = {h['ratio']:.2f}x", h["met"])

    if not gpu:
        for t in ("GPU: MHA bf16 >= 90% of same-run copy bandwidth at N >= 4096",
                  "GPU: guard <= 5% slower than off at N >= 4096",
                  "GPU: decode N <= 64 under CUDA-graph replay within 1.5x an empty kernel",
                  "GPU: faster than torch indexing at every N"):
            add(t, "not measured (no GPU in this run)", None)
        return out

    def best(n, check="off", mode="eager"):
        cands = [_series(rows, REFERENCE_CASE, b, check, mode).get(n) for b in GPU_BACKENDS]
        cands = [c for c in cands if c]
        return min(cands, key=lambda r: r["us"]) if cands else None

    ns = sorted({r["n"] for r in rows if r["case"] == REFERENCE_CASE})
    big = [n for n in ns if n >= 4096]
    b = {n: best(n) for n in big}
    fig = ", ".join(f"N={n}: {b[n]['pct_copy']}% ({b[n]['impl']})" for n in big if b[n])
    add("GPU: MHA bf16 >= 90% of same-run copy bandwidth at N >= 4096", fig or "no data",
        all(b[n]["pct_copy"] >= 90 for n in big if b[n]) if fig else None)
    parts, ok = [], True
    for n in big:
        if not b[n]:
            continue
        g = _series(rows, REFERENCE_CASE, b[n]["impl"], "guard").get(n)
        if g:
            slow = g["us"] / b[n]["us"] - 1
            ok &= slow <= 0.05
            parts.append(f"N={n}: {100 * slow:+.1f}% ({b[n]['impl']})")
    add("GPU: guard <= 5% slower than off at N >= 4096", ", ".join(parts) or "no data", ok if parts else None)
    empty = result.get("empty_kernel_graph_us")
    parts, ok = [], True
    for n in (n for n in ns if n <= 64):
        g = best(n, mode="graph")
        if g and empty:
            ok &= g["us"] <= 1.5 * empty
            parts.append(f"N={n}: {g['us'] / empty:.2f}x")
    add("GPU: decode N <= 64 under CUDA-graph replay within 1.5x an empty kernel",
        (f"empty kernel {empty:.2f} us; " if empty else "") + (", ".join(parts) or "no data"),
        ok if parts else None)
    ti = _series(rows, REFERENCE_CASE, "torch-index", None)
    parts, ok = [], True
    for n in ns:
        if n in ti and best(n):
            ok &= best(n)["us"] < ti[n]["us"]
            parts.append(f"N={n}: {ti[n]['us'] / best(n)['us']:.1f}x")
    add("GPU: faster than torch indexing at every N", "speedup " + ", ".join(parts) if parts else "no data",
        ok if parts else None)
    return out


def _grid(result: dict, case: str) -> tuple[list[int], list[tuple], dict]:
    rows = [r for r in result["rows"] if r["case"] == case]
    ns = sorted({r["n"] for r in rows})
    order = {"kvwrite": 0, "baseline": 1, "copy": 2}
    keys = sorted({(r["kind"], r["impl"], r["check"] or "", r["mode"]) for r in rows},
                  key=lambda k: (order[k[0]], k[1], k[3], k[2]))
    cell = {(r["kind"], r["impl"], r["check"] or "", r["mode"], r["n"]): r for r in rows}
    return ns, keys, cell


def _cell(r: dict | None, copy: bool) -> str:
    if r is None:
        return "-"
    return f"{_fmt_us(r['us'])}" if copy else f"{_fmt_us(r['us'])} ({r['pct_copy']:.0f}%)"


def print_table(result: dict, console=None) -> None:
    """Per case: latency in us (and % of same-run copy bandwidth) for every impl and N."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    for case, meta in result["cases"].items():
        ns, keys, cell = _grid(result, case)
        if not ns:
            continue
        table = Table(title=f"{case}: {meta['label']} — median us (% of copy bandwidth)",
                      title_justify="left")
        for col in ("impl", "check", "mode"):
            table.add_column(col)
        for n in ns:
            table.add_column(f"N={n}", justify="right")
        for k in keys:
            table.add_row(escape(k[1]), k[2], k[3], *(_cell(cell.get((*k, n)), k[0] == "copy") for n in ns))
        console.print(table)
    t = Table(title="targets", title_justify="left")
    for col in ("target", "figure", "met"):
        t.add_column(col)
    for tg in targets(result):
        t.add_row(escape(tg["target"]), escape(tg["figure"]), {True: "yes", False: "NO", None: "n/a"}[tg["met"]])
    console.print(t)


def markdown(result: dict, plot_name: str | None) -> str:
    m, v = result["machine"], result["versions"]
    where = m.get("gpu") or m.get("cpu")
    lines = [f"# kvwrite bench — {m['kind']}: {where}", ""]
    values = result["config"].get("values", "normal")
    lines.append(f"Command: `{result['command']}` ({'quick' if result['quick'] else 'full'} sweep, "
                 f"{result['wall_s']} s, {result.get('date', '')}; input rows: {values}).")
    lines.append("")
    mach = (f"Machine: host `{m['hostname']}`, {m['cpu']}, {m.get('cpus_usable', m['cpu_count'])} usable "
            f"of {m['cpu_count']} CPUs, {m.get('memory_gib', '?')} GiB RAM, torch threads {m['torch_threads']}")
    if m.get("cpu_stream_bytes") is not None:
        b = m["cpu_stream_bytes"]
        mach += ("; cpu K/V stores stream their rows " + (f"from {b / 2**20:.3g} MiB of tensors a call" if b >= 0
                                                           else "never") + " (KVWRITE_CPU_STREAM_BYTES)")
    if m.get("gpu"):
        mach += f"; GPU {m['gpu']} (sm {m['gpu_capability']}, {m['gpu_memory_gib']} GiB, {m['gpu_sms']} SMs)"
    lines += [mach + ".", "", "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + ".", ""]
    if result.get("interrupted"):
        lines += [f"**Sweep {result['interrupted']}.**", ""]
    inexact = sorted({f"{r['case']}/{r['impl']}" for r in result["rows"] if r.get("exact") is False})
    lines += ["Before timing, every backend and baseline is run once and its output bytes compared "
              "with the torch reference's: " + (f"**differ: {', '.join(inexact)}**." if inexact
                                                else "all bit-exact."), ""]
    lines += ["Each figure is the median latency of one store call; `%` is the same-run contiguous "
              "copy of the same number of bytes (reads + writes) divided by it, i.e. the store's "
              "effective bandwidth as a share of copy bandwidth. Locs are random unique rows, in random order, "
              "of a pool 4x the tokens stored. " + ("CUDA: triton.testing.do_bench (CUDA events, L2 flushed), "
              "`graph` rows replay 20 calls captured in one CUDA graph." if m.get("gpu") else
              "CPU: time.perf_counter_ns loops, median of batches."), ""]
    lines += ["## Targets", "", "| target | this run | met |", "|---|---|---|"]
    for t in targets(result):
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} | {t['figure']}{' — ' + t['detail'] if t['detail'] else ''} | {met} |")
    lines.append("")
    notes = [f"- backend `{b}`: {why}" for b, why in result["backend_notes"].items()]
    notes += [f"- op `{op}`: {why}" for op, why in result["skipped"].items()]
    notes += [f"- {k}: {why}" for k, why in result["notes"].items()]
    if notes:
        lines += ["## Not measured", ""] + notes + [""]
    lines += ["## Latency per case", "", "Median µs per call (% of same-run copy bandwidth).", ""]
    for case, meta in result["cases"].items():
        ns, keys, cell = _grid(result, case)
        if not ns:
            continue
        lines += [f"### {case} — {meta['label']}", "",
                  "| impl | check | mode | " + " | ".join(f"N={n}" for n in ns) + " |",
                  "|---|---|---|" + "---:|" * len(ns)]
        for k in keys:
            lines.append(f"| {k[1]} | {k[2]} | {k[3]} | "
                         + " | ".join(_cell(cell.get((*k, n)), k[0] == "copy") for n in ns) + " |")
        lines.append("")
    lines += ["## % of copy per op", "",
              "Every kvwrite backend (check off) at every N: latency, % of the same-run contiguous copy "
              "of the same bytes, and % of the same-run per-row memcpy scatter (`memcpy-scatter`, the "
              "extension's plain loop; for quantising formats a scatter of the finished rows).", "",
              "| case | op | impl | N | µs | % of copy | % of memcpy-scatter |", "|---|---|---|---:|---:|---:|---:|"]
    for case, meta in result["cases"].items():
        scat = _series(result["rows"], case, SCATTER, None)
        for b in result["backends"]:
            for n, r in sorted(_series(result["rows"], case, b).items()):
                pct_s = f"{100 * scat[n]['us'] / r['us']:.0f}" if n in scat else "-"
                lines.append(f"| {case} | {meta['op']} | {b} | {n} | {_fmt_us(r['us'])} | "
                             f"{r['pct_copy'] if r['pct_copy'] is not None else '-'} | {pct_s} |")
    lines += ["", "## Check-mode overhead", "", "Latency of `assert` / `guard` relative to `off` (same backend, eager).", "",
              "| case | backend | " + " | ".join(f"N={n}" for n in result["config"]["sizes"]) + " |",
              "|---|---|" + "---:|" * len(result["config"]["sizes"])]
    for case in result["cases"]:
        for b in result["backends"]:
            off = _series(result["rows"], case, b)
            if not off:
                continue
            a, g = _series(result["rows"], case, b, "assert"), _series(result["rows"], case, b, "guard")
            cells = []
            for n in result["config"]["sizes"]:
                if n in off and (n in a or n in g):
                    cells.append(" / ".join(f"{x[n]['us'] / off[n]['us']:.2f}" if n in x else "-" for x in (a, g)))
                else:
                    cells.append("-")
            lines.append(f"| {case} | {b} | " + " | ".join(cells) + " |")
    lines += [""] + host_costs.markdown(result.get("host_cost", []))
    lines += ["## Host overhead of the Python wrapper", "",
              "Host time of one call at the smallest N through the Python validation path (the C++ "
              "fast path switched off) with every check done and the backend replaced by a no-op, against one raw torch op on the same tensors (`x raw`: "
              "relative to `index_put_`).", "",
              "| case | what | backend | check | µs | x raw |", "|---|---|---|---|---:|---:|"]
    raw = {h["case"]: h["us"] for h in result["host"] if h["what"] == "raw index_put_"}
    for h in result["host"]:
        ratio = f"{h['us'] / raw[h['case']]:.2f}" if h["case"] in raw else "-"
        lines.append(f"| {h['case']} | {h['what']} | {h['backend'] or ''} | {h['check'] or ''} | {h['us']:.2f} | {ratio} |")
    if plot_name:
        lines += ["", f"![latency and % of copy vs N]({plot_name})"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> bool:
    """Latency and % of copy vs N, one line per backend / baseline (check off); False if no
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = [c for c in result["cases"] if any(r["case"] == c for r in result["rows"])]
    if not cases:
        return False
    fig, axes = plt.subplots(len(cases), 2, figsize=(12, 3.4 * len(cases)), squeeze=False)
    impls = sorted({r["impl"] for r in result["rows"]})
    palette = plt.get_cmap("tab10" if len(impls) <= 10 else "tab20")
    color = {impl: palette(i % palette.N) for i, impl in enumerate(impls)}
    for i, case in enumerate(cases):
        lines = defaultdict(list)
        for r in result["rows"]:
            if r["case"] == case and (r["check"] in (None, "off")):
                lines[(r["impl"], r["mode"])].append((r["n"], r["us"], r["pct_copy"]))
        for (impl, mode), pts in sorted(lines.items()):
            pts.sort()
            ns, us, pct = zip(*pts)
            style = "--" if mode == "graph" else (":" if impl == "copy" else "-")
            label = impl + (" (graph)" if mode == "graph" else "")
            axes[i][0].plot(ns, us, style, marker="o", ms=3, label=label, color=color[impl])
            if impl != "copy":
                axes[i][1].plot(ns, pct, style, marker="o", ms=3, label=label, color=color[impl])
        axes[i][0].set(xscale="log", yscale="log", xlabel="N tokens", ylabel="median µs",
                       title=f"{case}: latency")
        axes[i][1].set(xscale="log", xlabel="N tokens", ylabel="% of copy bandwidth",
                       title=f"{case}: % of same-run copy")
        axes[i][1].axhline(100, color="grey", lw=0.5)
        axes[i][0].legend(fontsize=7)
        axes[i][0].grid(True, which="both", lw=0.3)
        axes[i][1].grid(True, lw=0.3)
    m = result["machine"]
    fig.suptitle(f"kvwrite bench on {m['kind']} ({m.get('gpu') or m.get('cpu')})", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def write(result: dict, out_dir: Path, with_plot: bool = True) -> dict[str, Path]:
    """results.json, report.md and plot.png under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result.setdefault("date", _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    result["targets"] = targets(result)
    paths = {"json": out_dir / "results.json", "report": out_dir / "report.md"}
    png = out_dir / "plot.png"
    if with_plot and plot(result, png):
        paths["plot"] = png
    paths["json"].write_text(json.dumps(result, indent=1, default=str) + "\n")
    paths["report"].write_text(markdown(result, png.name if "plot" in paths else None))
    return paths
