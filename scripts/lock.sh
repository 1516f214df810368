#!/usr/bin/env bash
# `make lock`: resolves requirements.txt and requirements-dev.txt to the newest releases they allow, in a scratch
# venv, and writes every installed package at its exact version to constraints.txt (pip, setuptools included).
# torch stays at the CPU build's version given by the Makefile.
set -euo pipefail
python=${1:-python3}
torch_version=${2:?usage: lock.sh PYTHON TORCH_VERSION}
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$python" -m venv "$scratch/venv"
"$scratch/venv/bin/python" -m pip install -q --upgrade pip
"$scratch/venv/bin/python" -m pip install -q "torch==$torch_version" -r requirements-dev.txt
{
  echo "# The lock: every runtime and development package at an exact version. Written by \`make lock\` from"
  echo "# requirements.txt and requirements-dev.txt on $(date -u +%Y-%m-%d); install with"
  echo "#   pip install -r requirements.txt -c constraints.txt"
  echo "# torch is the CPU wheel on local disk in dev and CI (its +cpu label dropped, so the Dockerfile's CUDA build of"
  echo "# the same version satisfies it); any other version pulls a multi-GB CUDA build."
  "$scratch/venv/bin/python" -m pip freeze --all --exclude-editable | sed -E 's/^(torch==[^+]+)\+.*/\1/' | sort -f
} > constraints.txt
echo "constraints.txt: $(grep -c '==' constraints.txt) packages locked"
