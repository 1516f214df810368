#!/usr/bin/env bash
# Reruns the CPU benchmarks (quality, then speed) and rewrites bench/results/.
# Set PYTHON to the interpreter of the project's environment (default: python on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
start=$SECONDS
"$PYTHON" -m bench.quality
"$PYTHON" -m bench.speed
"$PYTHON" -m bench.engines
echo "CPU benchmarks done in $((SECONDS - start)) s; results in bench/results/"
