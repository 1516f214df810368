# The two commands of the README: `make demo` (the main job on the embedded default) and `make test`.
# Both build .venv on first use: pip, with torch pinned to the CPU wheel by constraints.txt.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

.PHONY: demo test lint bench install

install: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt -c constraints.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(OFFLINE) $(BIN)/casp prune --model demo/stories260K --ratio 0.3 --alpha 1.0 --out out/demo-$$(date +%Y%m%d-%H%M%S) \
		--datasets-dir demo/datasets --calibration-data wikitext2:validation --n-samples 32 --seq-len 256 \
		--eval-data wikitext2 --eval-seq-len 256 --eval-limit 100

test: $(STAMP)
	bash scripts/services.sh
	$(OFFLINE) $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
