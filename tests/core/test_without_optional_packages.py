"""The pruning path runs where `datasets` and `lm_eval` are not installed (the GPU workers): a whole `casp prune`
from local data files, in a process where importing either fails; zero-shot tasks asked there are refused in one
line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from casp_core.cli.main import main
from tests.conftest import REPO, STORIES
from tests.core.cli.test_cli import SMALL

# None in sys.modules makes `import name` raise ImportError, as on a machine without the package.
WITHOUT = """
import sys
for name in ("datasets", "lm_eval"):
    sys.modules[name] = None
from casp_core.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def casp_without_optional_packages(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, *args], capture_output=True, text=True, env=env, timeout=600, cwd=REPO
    )


def test_prune_runs_without_datasets_and_lm_eval(tmp_path):
    out = tmp_path / "pruned"
    completed = casp_without_optional_packages(
        "prune", "--model", str(STORIES), "--ratio", "0.3", "--out", str(out), *SMALL, "--device", "cpu:0"
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads((out / "report.json").read_text())
    assert abs(report["achieved_ratio"] - 0.3) <= 0.01
    assert set(report["perplexity"]) == {"wikitext2", "ptb"}


def test_zero_shot_without_lm_eval_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process: only the refusal is checked here, and `import lm_eval` fails wherever sys.modules holds None.
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    out = tmp_path / "pruned"
    arguments = ["prune", "--model", str(STORIES), "--ratio", "0.3", "--out", str(out), *SMALL, "--zero-shot", "piqa"]
    assert main(arguments) == 2
    stderr = capsys.readouterr().err
    assert [line for line in stderr.splitlines() if "error" in line] == [
        "casp: error: invalid_config: zero-shot evaluation needs lm-evaluation-harness, which this machine lacks "
        "(pip install lm_eval)"
    ], stderr
    assert "casp: evaluation" not in stderr  # refused before any evaluation
    assert not out.exists()
