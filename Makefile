# Two commands matter: `make demo` and `make test`. Both create .venv on first use.
#
# Torch: a torch importable by $(PYTHON) (your own CUDA or ROCm build, say) is kept: the venv then sees the
# system site-packages. Otherwise $(TORCH_SPEC) is installed, by default the pinned CPU-capable release;
# set TORCH_INDEX to pull it from another wheel index (e.g. https://download.pytorch.org/whl/rocm6.4).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.zaya-installed
# the demo needs fewer packages than the tests (no transformers, lm-eval, datasets, W&B): a fresh clone's
# `make demo` installs only those, and a venv made by `make test` serves both
DEMO_STAMP := $(VENV)/.zaya-demo

.PHONY: setup demo test lint bench clean venv

setup: $(STAMP)

# the venv, with a torch in it
venv:
	@if [ ! -x $(BIN)/python ]; then \
		if $(PYTHON) -c 'import torch' >/dev/null 2>&1; then \
			echo "using the torch already installed for $(PYTHON)"; \
			$(PYTHON) -m venv --system-site-packages $(VENV); \
		else \
			$(PYTHON) -m venv $(VENV); \
		fi; \
	fi
	@$(BIN)/python -c 'import torch' >/dev/null 2>&1 || \
		$(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH_SPEC)'

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory venv
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $(STAMP) $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml
	@$(MAKE) --no-print-directory venv
	$(BIN)/python -m pip install -q -e '.[report]'
	@touch $(DEMO_STAMP)

# The demo: build a dataset from the Python standard library, train a tiny ZAYA1-style model on it for six
# minutes (a time budget: configs/tiny.toml; resuming if runs/tiny already has checkpoints), sample from it,
# evaluate it and write the run report.
DEMO_RUN ?= runs/tiny
DEMO_PROMPT ?= def read_config(path):

demo: $(DEMO_STAMP)
	@test -f data/stdlib/manifest.json || $(BIN)/zaya data build --input stdlib --out data/stdlib --val-fraction 0.02
	$(BIN)/zaya train configs/tiny.toml --run-dir $(DEMO_RUN)
	@echo "--- greedy continuation:"
	@$(BIN)/zaya generate --model $(DEMO_RUN) --prompt '$(DEMO_PROMPT)' --max-new-tokens 60 --greedy
	@echo "--- sampled continuation (temperature 0.8, top-p 0.95):"
	@$(BIN)/zaya generate --model $(DEMO_RUN) --prompt '$(DEMO_PROMPT)' --max-new-tokens 60 \
		--temperature 0.8 --top-p 0.95 --seed 0
	$(BIN)/zaya eval --model $(DEMO_RUN) --data data/stdlib --seq-len 256
	$(BIN)/zaya report $(DEMO_RUN)

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
