# Two commands: `make demo` (set up, build the tiny model, train it) and `make test`.
# Setup makes .venv; on a machine without CUDA it installs the CPU build of torch first, so
# that pip does not pull a multi-GB CUDA build. GPU users: install your torch into .venv
# first (or set TORCH=skip) and setup keeps it.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.honing-installed

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "keeping installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif [ "$(TORCH)" != "skip" ] && ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "no CUDA here: installing the CPU build ($(TORCH))"; \
		$(PY) -m pip install -q "$(TORCH)"; \
	fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: setup
	rm -rf runs/demo
	$(VENV)/bin/honing train examples/arithmetic.yaml --output-dir runs/demo --resume never

test: setup
	$(VENV)/bin/ruff check honing tests benchmarks examples
	$(VENV)/bin/ruff format --check honing tests benchmarks examples
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff format honing tests benchmarks
	$(VENV)/bin/ruff check --fix honing tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
