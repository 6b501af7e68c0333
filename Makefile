# Two front-door targets: `make demo` and `make test`. Both create .venv, install the
# development environment once (torch==2.13.0 and friends), and build the Rust extension in
# release mode.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
STAMP := $(VENV)/.deps-stamp
export PYO3_PYTHON := $(abspath $(VPY))

.PHONY: demo test build venv rust-test loom py-test lint bench clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip uv

$(STAMP): requirements-dev.txt | $(VPY)
	$(UV) pip install --python $(VPY) -r requirements-dev.txt
	touch $(STAMP)

venv: $(STAMP)

build: venv
	$(VENV)/bin/maturin develop --release --uv -q

demo: build
	$(VPY) examples/quickstart.py

rust-test:
	cargo test --all-targets

# Exhaustive model check of the lock-free entry state (loom), in its own target dir so the
# --cfg loom build does not invalidate the regular one.
loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test --release --test loom_entry_state

py-test: build
	$(VPY) -m pytest -q tests

test: build rust-test loom py-test

lint: venv
	cargo clippy --all-targets -- -D warnings
	PYO3_PYTHON=$(PYO3_PYTHON) cargo clippy --features python --lib -- -D warnings
	$(VENV)/bin/ruff check python tests benches examples
	$(VENV)/bin/ruff format --check python tests benches examples

bench: build
	cargo bench --bench index
	$(VPY) -m pytest benches -q
	$(VPY) benches/bench_manager.py
	$(VPY) benches/bench_policies.py

clean:
	rm -rf target $(VENV) python/kvtier_rs/*.so
