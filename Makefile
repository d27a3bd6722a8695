# Two commands: `make demo` (set up, build the tiny model, train it) and `make test`.
# Setup makes .venv; on a machine without CUDA it installs the CPU build of torch first, so
# that pip does not pull a multi-GB CUDA build. GPU users: install your torch into .venv
# first (or set TORCH=skip) and setup keeps it.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# PyPI's Linux torch is the CUDA build (with ~15 nvidia packages); PyTorch's CPU index holds
# the CPU build, which pip ranks above it (2.13.0+cpu > 2.13.0). Empty: pip's indexes only.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.honing-installed

.PHONY: setup demo test test-fast test-transformers lint clean bench-setup bench image

setup: $(STAMP)

# $(call venv_with_torch,DIR): make the virtualenv DIR (if missing) with pip and uv in it and,
# on a machine without CUDA, install the CPU build of torch unless a torch is there. pip picks the
# wheel (its configuration may name local wheels); uv installs it and compiles its bytecode on
# every core (15 s instead of pip's 32 s on the 2-core VM); pip installs it where uv fails.
define venv_with_torch
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q uv || echo "setup: uv could not be installed; pip installs"
	@if $(1)/bin/python -c "import torch" 2>/dev/null; then \
		echo "keeping installed torch $$($(1)/bin/python -c 'import torch; print(torch.__version__)')"; \
	elif [ "$(TORCH)" != "skip" ] && ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "no CUDA here: installing the CPU build ($(TORCH))"; \
		where=""; \
		if [ -n "$(TORCH_INDEX)" ] && $(1)/bin/python -c "$$INDEX_ANSWERS" "$(TORCH_INDEX)"; then \
			where="--extra-index-url $(TORCH_INDEX)"; \
		else \
			echo "setup: PyTorch's CPU index ($(TORCH_INDEX)) cannot be reached; torch from pip's own indexes"; \
		fi; \
		rm -rf $(1)/.torch-wheel; \
		if $(1)/bin/python -m pip download -q --no-deps -d $(1)/.torch-wheel "$(TORCH)" $$where \
			&& $(1)/bin/uv pip install -q --python $(1)/bin/python --compile-bytecode $(1)/.torch-wheel/*.whl; \
		then :; else \
			echo "setup: uv did not install torch; installing with pip"; \
			$(1)/bin/python -m pip install -q "$(TORCH)" $$where; \
		fi; \
		rm -rf $(1)/.torch-wheel; \
	fi
endef

# Exits 0 when the index at argv[1] answers over HTTP (any status: it is reachable).
define INDEX_ANSWERS
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=10).close()
except urllib.error.HTTPError:
    pass
except OSError:
    sys.exit(1)
endef
export INDEX_ANSWERS

# uv installs the rest (21 s instead of pip's 230 s on the 2-core VM, the same versions), with
# bytecode compiled as pip does; pip does it where uv cannot be had or fails (say, an index that
# only pip's configuration names).
# On an x86-64 machine without CUDA the extras include vllm (vLLM built for CPUs), so that the
# suite runs rollout.engine=vllm for real; its CUDA builds of torchvision, torchaudio and
# torchcodec are left out (they break transformers' imports beside the CPU torch). GPU
# machines: install upstream vllm yourself (README); EXTRAS=dev leaves vLLM out.
EXTRAS ?= $(shell [ "$$(uname -m)" = x86_64 ] && ! command -v nvidia-smi >/dev/null 2>&1 \
	&& echo dev,vllm || echo dev)
LEFT_OUT := torchvision torchaudio torchcodec

$(STAMP): pyproject.toml
	$(call venv_with_torch,$(VENV))
	printf '%s\n' $(LEFT_OUT) > $(VENV)/left-out.txt
	$(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode -e ".[$(EXTRAS)]" \
		--excludes $(VENV)/left-out.txt \
		|| (echo "setup: uv did not install; installing with pip" \
			&& $(PY) -m pip install -q -e ".[$(EXTRAS)]" \
			&& $(PY) -m pip uninstall -q -y $(LEFT_OUT))
	touch $(STAMP)

demo: setup
	rm -rf runs/demo
	$(VENV)/bin/honing train examples/arithmetic.yaml --output-dir runs/demo --resume never

# The suite runs on every CPU (pytest-xdist; at most 4 workers, as each may hold a 3-rank
# torchrun run); tests/conftest.py says which tests stay together or run alone.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= logical

test: setup
	$(VENV)/bin/ruff check honing tests benchmarks examples deploy
	$(VENV)/bin/ruff format --check honing tests benchmarks examples deploy
	$(PY) -m pytest -n $(TEST_WORKERS) --maxprocesses 4

# The inner loop: the suite without the end-to-end runs marked slow (Ray clusters, torchrun
# and spawned ranks, served engines, supervised and signalled runs).
test-fast: setup
	$(VENV)/bin/ruff check honing tests benchmarks examples deploy
	$(PY) -m pytest -n $(TEST_WORKERS) --maxprocesses 4 -m "not slow"

# make test-transformers: honing's use of transformers' internals at both ends of the range
# pyproject.toml declares (TF_VERSIONS): the lean decode and packed logprob passes against the
# Hugging Face forward and its KV cache, speculative decoding, activation checkpointing, model
# loading and saving, chat templates, LoRA, the MoE routers of every MoE family, the MTP
# heads, the critic, the tiny model's build and short training runs (291 tests: 28 s of
# pytest at 5.25.0 on the 2-core VM, minutes while other work shares its cores). Each version
# has a virtualenv of its own, .venv-tf-VERSION, with the dev extras and not vllm, whose pin
# (transformers<5.20) would move the version under test.
TF_VERSIONS ?= 5.16.1 5.25.0
TF_TESTS ?= tests/models/test_moe.py tests/models/test_moe_families.py tests/data/test_render.py \
	$(addprefix tests/rollout/,test_fast_decode.py test_transformers_engine.py test_speculative.py) \
	$(addprefix tests/trainer/,test_packed.py test_batch.py test_head.py test_autocast.py \
		test_policy_update.py) \
	$(addprefix tests/pipeline/,test_lean_paths.py test_lora.py test_moe_run.py test_mtp.py \
		test_critic.py test_hf_model_dir.py test_train_e2e.py)

test-transformers: $(addprefix test-transformers-,$(TF_VERSIONS))

test-transformers-%: .venv-tf-%/.honing-installed
	.venv-tf-$*/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	.venv-tf-$*/bin/python -m pytest $(TF_TESTS)

.PRECIOUS: .venv-tf-%/.honing-installed
.venv-tf-%/.honing-installed: pyproject.toml
	$(call venv_with_torch,.venv-tf-$*)
	.venv-tf-$*/bin/uv pip install -q --python .venv-tf-$*/bin/python --compile-bytecode \
		-e ".[dev]" "transformers==$*" \
		|| .venv-tf-$*/bin/python -m pip install -q -e ".[dev]" "transformers==$*"
	touch $@

# Side-by-side benchmark against TRL's GRPOTrainer (benchmarks/grpo_step.py). TRL lives in a
# virtualenv of its own (.venv-peers) so its pins never touch honing's.
PEERS_VENV ?= .venv-peers
PEERS_PY := $(PEERS_VENV)/bin/python
PEERS_STAMP := $(PEERS_VENV)/.peers-installed
BENCH_ARGS ?=

bench-setup: $(PEERS_STAMP)

$(PEERS_STAMP):
	$(call venv_with_torch,$(PEERS_VENV))
	$(PEERS_PY) -m pip install -q "trl==1.16.0" "transformers==5.24.0" "datasets==5.2.0"
	touch $(PEERS_STAMP)

bench: setup bench-setup
	$(PY) -m benchmarks.grpo_step $(BENCH_ARGS)

# The container image (Containerfile), with podman or docker, whichever is installed. CUDA:
#   make image IMAGE=localhost/honing:cuda IMAGE_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#       IMAGE_TORCH_INDEX=https://download.pytorch.org/whl/cu128
# IMAGE_ARGS adds build options, e.g. a local wheel directory (podman):
#   IMAGE_ARGS='--volume /opt/wheels:/tmp/wheels:ro --build-arg PIP_OPTIONS="--find-links /tmp/wheels"'
CONTAINER ?= $(shell command -v podman >/dev/null 2>&1 && echo podman || echo docker)
IMAGE ?= localhost/honing:cpu
IMAGE_BASE ?= python:3.11-slim-bookworm
IMAGE_TORCH ?= $(TORCH)
IMAGE_TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
IMAGE_ARGS ?=

image:
	$(CONTAINER) build $(if $(filter podman,$(notdir $(CONTAINER))),--format docker) \
		-f Containerfile --build-arg BASE=$(IMAGE_BASE) --build-arg TORCH=$(IMAGE_TORCH) \
		--build-arg TORCH_INDEX=$(IMAGE_TORCH_INDEX) $(IMAGE_ARGS) -t $(IMAGE) .

lint: setup
	$(VENV)/bin/ruff format honing tests benchmarks
	$(VENV)/bin/ruff check --fix honing tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
