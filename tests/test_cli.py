"""`casp prune` end to end on the real model, and its one-line errors."""

import json
import os
import subprocess
import sys

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from casp_core.checkpoint import load_pruned
from tests.conftest import DATASETS_DIR, REPO, STORIES

SMALL = [
    "--datasets-dir",
    str(DATASETS_DIR),
    "--calibration-data",
    "wikitext2:validation",
    "--n-samples",
    "8",
    "--seq-len",
    "128",
    "--eval-data",
    "wikitext2,ptb",
    "--eval-seq-len",
    "128",
    "--eval-limit",
    "10",
]


def casp(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "casp_core", *args], capture_output=True, text=True, env=env, timeout=600, cwd=REPO
    )


def test_prune_end_to_end(tmp_path):
    out = tmp_path / "pruned"
    completed = casp("prune", "--model", str(STORIES), "--ratio", "0.3", "--alpha", "1.5", "--out", str(out), *SMALL)
    assert completed.returncode == 0, completed.stderr
    summary = json.loads(completed.stdout)
    assert abs(summary["achieved_ratio"] - 0.3) <= 0.01
    assert set(summary["perplexity"]) == {"wikitext2", "ptb"}
    assert "casp: pruning:" in completed.stderr  # stage progress, one line per stage in a log
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["alpha"] == 1.5 and report["settings"]["calibration"]["n_samples"] == 8
    assert report["perplexity"]["ptb"]["n_windows"] == 10
    model, tokenizer = load_pruned(out)
    generated = model.generate(**tokenizer("Once upon a time", return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > 5


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (
            ["--model", "/no/such/model", "--ratio", "0.3"],
            "model_not_found: model path '/no/such/model' does not exist",
        ),
        (["--model", str(STORIES), "--ratio", "1.5"], "argument --ratio: must be in (0, 1), got 1.5"),
        (["--model", str(STORIES), "--ratio", "0"], "argument --ratio: must be in (0, 1), got 0.0"),
        (["--model", str(STORIES), "--ratio", "0.3", "--alpha", "-1"], "argument --alpha: must be >= 0, got -1.0"),
    ],
)
def test_bad_input_gets_one_line_and_exit_2(tmp_path, arguments, expected):
    completed = casp("prune", *arguments, "--out", str(tmp_path / "out"), *SMALL)
    assert completed.returncode == 2
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], completed.stderr
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path):
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)).save_pretrained(gpt2)
    completed = casp("prune", "--model", str(gpt2), "--ratio", "0.3", "--out", str(tmp_path / "out"), *SMALL)
    assert completed.returncode == 2
    assert "unsupported_model: model type 'gpt2' is not a LLaMA-family decoder" in completed.stderr
    assert "num_key_value_heads" in completed.stderr


def test_missing_local_split_names_the_file(tmp_path):
    completed = casp(
        "prune",
        "--model",
        str(STORIES),
        "--ratio",
        "0.3",
        "--out",
        str(tmp_path / "out"),
        *SMALL[:2],
        "--calibration-data",
        "wikitext2",  # the train split is not among the fixtures
    )
    assert completed.returncode == 2
    assert f"wikitext2 train: looked for {DATASETS_DIR}/wikitext-2-raw/wiki.train.raw" in completed.stderr
