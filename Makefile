# The two commands of the README: `make demo` (the main job on the embedded default) and `make test`.
# Both build .venv on first use with pip, every package at the version constraints.txt locks (`make lock` writes it).
# The demo installs the runtime alone; the tests add the development requirements (llama-cpp-python builds from
# source, about 5 minutes on 2 cores) and the lowest supported transformers, beside the venv.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUNTIME_STAMP := $(VENV)/.runtime-installed
DEV_STAMP := $(VENV)/.installed
# The lowest transformers that requirements.txt admits, with the hub and tokenizers it takes, installed apart:
# tests/core/artifacts/test_generation.py runs the written checkpoints under it in a fresh process.
LOWEST := $(VENV)/transformers-lowest
# The CPU wheel on local disk in dev and CI; any other torch pulls a multi-GB CUDA build.
TORCH_VERSION := 2.13.0
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# llama-cpp-python compiles llama.cpp. Left to itself it tunes for the building CPU (GGML_NATIVE), AMX included
# where the CPU lists it, and pip caches that wheel under the release's name alone: on a VM whose CPU lists AMX
# that the VM does not enable (a Firecracker guest on Sapphire Rapids), every quantized decode segfaults. Built
# once for any x86-64 with AVX2 into a folder of its own, named by the version and the flags, and installed from it.
LLAMA_CPP_VERSION := $(shell sed -n 's/^llama_cpp_python==//p' constraints.txt)
LLAMA_CPP_FLAGS := -DGGML_NATIVE=OFF
LLAMA_CPP_WHEELS := $(HOME)/.cache/casp/wheels/llama-cpp-python-$(LLAMA_CPP_VERSION)-native-off
# The tests that exercise the libraries whose releases change under us: transformers, peft, lm-eval, gguf, llama.cpp.
LIBRARY_TESTS := tests/core/artifacts/test_generation.py tests/core/families/test_families.py \
	tests/core/method/test_surgery.py tests/core/method/test_uniform_shape.py tests/core/artifacts/gguf/test_gguf.py \
	tests/core/artifacts/gguf/test_engine.py tests/core/recovery/test_recovery.py tests/core/eval

.PHONY: demo test test-slow lint install lock test-latest screenshots

install: $(DEV_STAMP)

$(RUNTIME_STAMP): requirements.txt constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt pip
	$(BIN)/python -m pip install -q -r requirements.txt -c constraints.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(RUNTIME_STAMP)

$(DEV_STAMP): $(RUNTIME_STAMP) requirements-dev.txt requirements-gguf.txt requirements-lowest.txt
	ls $(LLAMA_CPP_WHEELS)/*.whl >/dev/null 2>&1 || CMAKE_ARGS="$(LLAMA_CPP_FLAGS)" $(BIN)/python -m pip wheel -q \
		--no-deps --no-cache-dir -w $(LLAMA_CPP_WHEELS) llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(BIN)/python -m pip install -q --find-links $(LLAMA_CPP_WHEELS) -r requirements-dev.txt -c constraints.txt
	rm -rf $(LOWEST)
	$(BIN)/python -m pip install -q --no-deps --target $(LOWEST) -r requirements-lowest.txt
	touch $(DEV_STAMP)

demo: $(RUNTIME_STAMP)
	$(OFFLINE) $(BIN)/casp demo

test: $(DEV_STAMP) lint
	bash scripts/services.sh
	bash scripts/chromium.sh
	$(OFFLINE) $(BIN)/python -m pytest -q -m "not slow" --durations=15

# The console's screenshots in docs/console/ (the README shows them), taken by its browser tests.
screenshots: $(DEV_STAMP)
	bash scripts/services.sh
	bash scripts/chromium.sh
	CASP_CONSOLE_SCREENSHOTS=$(CURDIR)/docs/console $(OFFLINE) $(BIN)/python -m pytest -q tests/console

# The 1B-scale checks and SmolLM2's whole-job memory bound (tests/core/method/test_host_memory.py, minutes each:
# before a change to memory or placement), the load and quality benches' own runs (tests/test_bench.py,
# tests/service/test_load_bench.py), distillation jobs on both toy fixtures, compensation's quality claim on
# ptbwiki-7M, the budget and float32-verification tests at their other ratios and solvers, the mixtures of experts'
# command-line prunes at their other ratios, the pipeline's other solvers and the K-quants of SmolLM2's shape but
# q4_k_m, which `make test` leaves out to stay under 20 minutes.
test-slow: $(DEV_STAMP)
	$(OFFLINE) $(BIN)/python -m pytest -q -m slow

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Regenerates constraints.txt: the newest releases requirements*.txt allow, resolved in a scratch venv. Review the
# diff, run `make test`, and commit it as one change.
lock:
	bash scripts/lock.sh $(PYTHON) $(TORCH_VERSION)

# The newest releases requirements*.txt allow, in a scratch venv (.venv-latest), against the library tests:
# what `make lock` would bring, tried before it is locked.
test-latest:
	rm -rf .venv-latest
	$(PYTHON) -m venv .venv-latest
	.venv-latest/bin/python -m pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMA_CPP_FLAGS)" .venv-latest/bin/python -m pip install -q --no-cache-dir torch==$(TORCH_VERSION) \
		-r requirements-dev.txt
	.venv-latest/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	.venv-latest/bin/python -m pip list 2>/dev/null | grep -iE '^(transformers|peft|lm.eval|gguf|llama.cpp.python|tokenizers|huggingface.hub) '
	bash scripts/services.sh
	$(OFFLINE) .venv-latest/bin/python -m pytest -q -k "not lowest" $(LIBRARY_TESTS)
