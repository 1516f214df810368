"""Shared fixtures: the real demo model and the real data sets in ../shared/fixtures."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# What casp_core keeps per model (casp_core.artifacts.caches): one folder for the whole run, so that the suite
# dequantizes the SmolLM2 GGUF once and no figure measured by an earlier run is reused.
if "CASP_CACHE_DIR" not in os.environ:
    os.environ["CASP_CACHE_DIR"] = tempfile.mkdtemp(prefix="casp-test-cache-")
    atexit.register(shutil.rmtree, os.environ["CASP_CACHE_DIR"], ignore_errors=True)

import pytest
import torch

# The fixtures of the service tests (PostgreSQL, Redis, S3, workers), for every folder that needs them.
pytest_plugins = ["tests.service_fixtures"]

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"
DATASETS_DIR = FIXTURES / "data"
STORIES = REPO / "demo" / "stories260K"
PTBWIKI = FIXTURES / "models" / "ptbwiki-7M"
# A real pretrained model as people have it: SmolLM2-135M-Instruct, LLaMA with GQA, as llama.cpp's Q4_1 GGUF.
SMOLLM2_GGUF = FIXTURES / "models" / "smollm2-135m-instruct-gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def stories():
    """A fresh copy each time: the pipeline masks the model it is given."""
    from casp_core.model import load_model

    return load_model(str(STORIES))


@pytest.fixture(scope="session")
def datasets_dir() -> str:
    assert DATASETS_DIR.is_dir(), f"fixtures missing: {DATASETS_DIR}"
    return str(DATASETS_DIR)


def small_config(ratio: float, **overrides):
    """Settings small enough for a test, on real text: 16 windows of 128 tokens from WikiText-2 valid."""
    from casp_core.settings import CalibrationConfig, EvaluationConfig, PruneConfig

    calibration = CalibrationConfig(dataset="wikitext2:validation", n_samples=16, seq_len=128, batch_size=8)
    evaluation = EvaluationConfig(perplexity=["wikitext2"], seq_len=128, limit=20)
    settings = {"ratio": ratio, "calibration": calibration, "evaluation": evaluation, "datasets_dir": str(DATASETS_DIR)}
    settings.update(overrides)
    return PruneConfig(**settings)


def tiny_config(ratio: float, **overrides):
    """A whole job in seconds, for tests of what it writes rather than of the method: 2 windows of 32 tokens, the
    diagonal solver, uniform allocation, no perplexity."""
    from casp_core.settings import CalibrationConfig, EvaluationConfig

    calibration = CalibrationConfig(dataset="wikitext2:validation", n_samples=2, seq_len=32, batch_size=2)
    evaluation = EvaluationConfig(perplexity=[], seq_len=32, limit=1)
    settings = {"solver": "diagonal", "allocation": "uniform", "calibration": calibration, "evaluation": evaluation}
    return small_config(ratio, **{**settings, **overrides})
