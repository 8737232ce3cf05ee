#!/usr/bin/env bash
# bench/gpu_check.sh [OUT_DIR] — on a machine with a CUDA GPU and nothing else prepared:
# installs kvwrite (editable, no deps: torch/triton/pytest/hypothesis come with the machine),
# runs the suite on CUDA with compiled Triton (assert cases in subprocesses, since a device
# assert kills the CUDA context), and writes logs and results into OUT_DIR.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${1:-$ROOT/bench/results/gpu}" && cd "${1:-$ROOT/bench/results/gpu}" && pwd)
PY=${PYTHON:-python3}
cd "$ROOT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$ROOT/build/triton-cache}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0
step() { echo "== $*" | tee -a "$OUT/summary.txt"; }

step "environment"
{ nvidia-smi; $PY -c "import torch, triton, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name()); print('triton', triton.__version__)"; } > "$OUT/env.txt" 2>&1
tail -4 "$OUT/env.txt" | tee -a "$OUT/summary.txt"

step "install"
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { echo "install failed" | tee -a "$OUT/summary.txt"; exit 1; }

step "C++/CUDA extension: JIT build (ninja, cached in ~/.cache/kvwrite) for the visible GPU"
$PY -c "from kvwrite import _ext; d, s = _ext.build(); print(f'built/loaded {d} in {s:.1f} s'); print('cuda backend:', _ext.unavailable_reason('cuda') or 'available')" \
    > "$OUT/ext_build.log" 2>&1 || status=1
tail -2 "$OUT/ext_build.log" | tee -a "$OUT/summary.txt"

step "test suite on CUDA"
( cd tests && KVWRITE_TEST_DEVICE=cuda timeout ${KVWRITE_GPU_TEST_TIMEOUT:-420} $PY -m pytest -q -n 4 -p no:cacheprovider \
    --junitxml "$OUT/junit.xml" ) > "$OUT/tests.log" 2>&1 || status=1
tail -3 "$OUT/tests.log" | tee -a "$OUT/summary.txt"

step "store_mla / store_indexer_k at DeepSeek sizes: bit-exact vs reference, guard, time per call"
$PY bench/mla_check.py --device cuda --out "$OUT/mla.json" > "$OUT/mla.log" 2>&1 || status=1
tail -1 "$OUT/mla.log" | tee -a "$OUT/summary.txt"

step "nvfp4: every kernel backend bit-exact vs the reference on CUDA; round-trip error bound"
timeout 300 $PY bench/nvfp4_check.py --device cuda > "$OUT/nvfp4.json" 2> "$OUT/nvfp4.log" || status=1
tail -c 600 "$OUT/nvfp4.json" | tee -a "$OUT/summary.txt"

step "C++/CUDA extension under compute-sanitizer memcheck (off and guard; CUDA matrix is in the suite above)"
if command -v compute-sanitizer > /dev/null; then
  timeout 600 compute-sanitizer --tool memcheck --error-exitcode 3 $PY bench/ext_sanitize.py --modes off,guard \
      > "$OUT/sanitizer.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|mismatches" "$OUT/sanitizer.log" | tail -2 | tee -a "$OUT/summary.txt"
else
  echo "compute-sanitizer not found" | tee -a "$OUT/summary.txt"; status=1
fi

step "benchmark sweep (kvwrite bench, full)"
timeout ${KVWRITE_GPU_BENCH_TIMEOUT:-420} $PY -m kvwrite.cli bench --min-time ${KVWRITE_GPU_BENCH_REP:-0.03} \
    --out "$OUT/bench" > "$OUT/bench.log" 2>&1 || status=1
grep -A12 "^## Targets" "$OUT/bench/report.md" 2>/dev/null | tee -a "$OUT/summary.txt" || tail -5 "$OUT/bench.log" | tee -a "$OUT/summary.txt"

step "DeepSeek V4 stores: tests on CUDA, bit-exact bench at V4 sizes, memcheck"
( cd tests && KVWRITE_TEST_DEVICE=cuda timeout 300 $PY -m pytest -q -n 0 -p no:cacheprovider test_dsv4.py test_dsv4_plan.py ) \
    > "$OUT/dsv4_tests.log" 2>&1 || status=1
tail -1 "$OUT/dsv4_tests.log" | tee -a "$OUT/summary.txt"
timeout 300 $PY -m kvwrite.cli bench --device cuda --cases dsv4-kv,dsv4-indexer-mxfp4,dsv4-state-rows \
    --min-time ${KVWRITE_GPU_BENCH_REP:-0.03} --out "$OUT/bench_dsv4" > "$OUT/bench_dsv4.log" 2>&1 || status=1
grep -m1 "bit-exact" "$OUT/bench_dsv4/report.md" 2>/dev/null | tee -a "$OUT/summary.txt" || tail -3 "$OUT/bench_dsv4.log"
if command -v compute-sanitizer > /dev/null; then
  ( cd tests && KVWRITE_TEST_DEVICE=cuda timeout 600 compute-sanitizer --tool memcheck --error-exitcode 3 \
      $PY -m pytest -q -n 0 -p no:cacheprovider test_dsv4.py -k "guard or dcp or offsets" ) > "$OUT/dsv4_sanitizer.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/dsv4_sanitizer.log" | tail -2 | tee -a "$OUT/summary.txt"
fi
step "page-table addressing (FlashInfer adapter): tests, example, end-to-end decoders on CUDA; Triton table variants"
( cd tests && KVWRITE_TEST_DEVICE=cuda timeout 300 $PY -m pytest -q -n 0 -p no:cacheprovider \
    test_pagetable.py test_compat_flashinfer.py test_e2e_decoder.py ) > "$OUT/pagetable.log" 2>&1 || status=1
tail -1 "$OUT/pagetable.log" | tee -a "$OUT/summary.txt"
timeout 300 $PY -m kvwrite.cli bench --cases mha-bf16,mha-bf16-pagetable --min-time ${KVWRITE_GPU_BENCH_REP:-0.03} \
    --out "$OUT/bench-pagetable" > "$OUT/bench-pagetable.log" 2>&1 || status=1
tail -3 "$OUT/bench-pagetable.log" | tee -a "$OUT/summary.txt"

step "engine adapters (kvwrite.compat) incl. vLLM's legacy head-major layout on every CUDA backend vs engine re-statements"
( cd tests && KVWRITE_TEST_DEVICE=cuda timeout 300 $PY -m pytest -q -n 0 -p no:cacheprovider test_compat_vllm.py test_compat_sglang.py ) \
    > "$OUT/compat.log" 2>&1 || status=1
tail -1 "$OUT/compat.log" | tee -a "$OUT/summary.txt"

step "rope_store_kv / rope_store_mla / dynamic int8-fp8 caches: tests on CUDA, fused vs unfused"
( cd tests && KVWRITE_TEST_DEVICE=cuda timeout 300 $PY -m pytest -q -n 0 -p no:cacheprovider \
    test_rope.py test_dynamic_quant.py ) > "$OUT/rope.log" 2>&1 || status=1
tail -1 "$OUT/rope.log" | tee -a "$OUT/summary.txt"
timeout 300 $PY -m kvwrite.bench.rope --device cuda --n 1 64 1024 > "$OUT/bench-rope.md" 2>&1 || status=1
timeout 300 $PY -m kvwrite.bench.rope --device cuda --n 1 64 1024 --no-norm >> "$OUT/bench-rope.md" 2>&1 || status=1
tee -a "$OUT/summary.txt" < "$OUT/bench-rope.md"

step "rope stores: eager / CUDA graph replay / torch.compile vs reference (cuda, triton)"; timeout 600 $PY bench/gpu/rope.py > "$OUT/rope_gpu.jsonl" 2>&1 || status=1; tail -1 "$OUT/rope_gpu.jsonl" | tee -a "$OUT/summary.txt"
step "GPU readiness: CUDA-graph capture+replay of every op, records, NaN under assert builds, 2 GPUs, PTX"; timeout 420 $PY bench/gpu/readiness.py --out "$OUT/readiness.json" > "$OUT/readiness.log" 2>&1 || status=1; tail -1 "$OUT/readiness.log" | tee -a "$OUT/summary.txt"
step "page moves: tests on CUDA, pinned host <-> GPU copy_pages, CUDA-graph capture, bandwidth"; ( cd tests && KVWRITE_TEST_DEVICE=cuda timeout 300 $PY -m pytest -q -n 0 -p no:cacheprovider test_pages.py && cd .. && timeout 300 $PY bench/gpu/pages.py ) > "$OUT/pages.log" 2>&1 || status=1; grep -E "passed|failed|\"ok\": false|pct_of_copy" "$OUT/pages.log" | tee -a "$OUT/summary.txt"
step "store_kv int8 / dynamic-scale modes: every CUDA backend vs reference, CUDA-graph capture + replay (guard)"; timeout 300 $PY bench/gpu/quant.py --out "$OUT/quant.json" > "$OUT/quant.log" 2>&1 || status=1; tail -1 "$OUT/quant.log" | tee -a "$OUT/summary.txt"
step "DeepSeek V4 FP4 records (nvfp4 384 B, mxfp4 368 B, nvfp4_v41 288 B): tests on CUDA incl. the fused RoPE store bit-exact vs rope-then-store, bench bit-exact at V4 sizes"
( cd tests && KVWRITE_TEST_DEVICE=cuda timeout 300 $PY -m pytest -q -n 0 -p no:cacheprovider test_dsv4_fp4.py \
    test_dsv4_plan.py -k "fp4" ) > "$OUT/dsv4_fp4_tests.log" 2>&1 || status=1
tail -1 "$OUT/dsv4_fp4_tests.log" | tee -a "$OUT/summary.txt"
timeout 300 $PY -m kvwrite.cli bench --device cuda --cases dsv4-kv-nvfp4,dsv4-kv-mxfp4,dsv4-kv-nvfp4-v41,dsv4-kv-nvfp4-rope,dsv4-kv \
    --min-time ${KVWRITE_GPU_BENCH_REP:-0.03} --out "$OUT/bench_dsv4_fp4" > "$OUT/bench_dsv4_fp4.log" 2>&1 || status=1
grep -m1 "bit-exact" "$OUT/bench_dsv4_fp4/report.md" 2>/dev/null | tee -a "$OUT/summary.txt" || tail -3 "$OUT/bench_dsv4_fp4.log"
step "duplicate rows: tests on CUDA (every store and page move), guard with vs without the pre-pass, CUDA-graph capture + replay of a guarded duplicate"
( cd tests && KVWRITE_TEST_DEVICE=cuda timeout 300 $PY -m pytest -q -n 0 -p no:cacheprovider test_duplicates.py ) \
    > "$OUT/duplicates_tests.log" 2>&1 || status=1
tail -1 "$OUT/duplicates_tests.log" | tee -a "$OUT/summary.txt"
timeout 300 $PY bench/duplicates.py --device cuda --cases mha-bf16,mha-fp8,mla-fp8ds,indexer-k --sizes 1024 4096 \
    --out "$OUT/duplicates" > "$OUT/duplicates.log" 2>&1 || status=1
grep -E "CUDA graph|ratio|skipped" "$OUT/duplicates.log" | tee -a "$OUT/summary.txt"
step "store_kv int4 (vLLM INT4_PER_TOKEN_HEAD): every CUDA backend bit-exact vs the reference, guard skips + records a bad slot with no stray byte, decode bound; tests on CUDA"
timeout 300 $PY bench/gpu/int4.py --out "$OUT/int4.json" > "$OUT/int4.log" 2>&1 || status=1
tail -1 "$OUT/int4.log" | tee -a "$OUT/summary.txt"
( cd tests && KVWRITE_TEST_DEVICE=cuda timeout 300 $PY -m pytest -q -n 0 -p no:cacheprovider test_int4.py ) \
    > "$OUT/int4_tests.log" 2>&1 || status=1
tail -1 "$OUT/int4_tests.log" | tee -a "$OUT/summary.txt"
# New steps (sanitizer, benchmarks) go above this line.
step "vLLM plugin guard: eager / torch.compile / CUDA-graph replay, records read once per step, layers named"; timeout 300 $PY bench/peers/guard_graph_check.py --device cuda > "$OUT/guard_graph.jsonl" 2>&1 || status=1; tail -1 "$OUT/guard_graph.jsonl" | tee -a "$OUT/summary.txt"
step "NIXL page transfers from device memory (VRAM over UCX): bytes equal, kvwrite vs raw NIXL throughput"
if $PY -c "from kvwrite.transfer import nixl_api; nixl_api()" > "$OUT/transfer_nixl.log" 2>&1 || \
   { $PY -m pip install -q ${NIXL_WHEEL:-nixl-cu13} >> "$OUT/transfer_nixl.log" 2>&1 && $PY -c "from kvwrite.transfer import nixl_api; nixl_api()" >> "$OUT/transfer_nixl.log" 2>&1; }; then
    timeout 300 $PY bench/transfer_nixl.py --device ${KVWRITE_NIXL_DEVICE:-cuda} --layers 8 --heads 8 --out "$OUT/transfer" >> "$OUT/transfer_nixl.log" 2>&1 || status=1
    grep -E "ratio|DIFFER|Error" "$OUT/transfer_nixl.log" | tee -a "$OUT/summary.txt"
else
    echo "skipped: NIXL does not import here (no network? set NIXL_WHEEL=/path/to/nixl_cu13-*.whl)" | tee -a "$OUT/summary.txt"
fi
step "done (status $status)"
exit $status
