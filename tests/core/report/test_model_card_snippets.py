"""The model card's Python runs as written, as a user of the uploaded checkpoint runs it: in a fresh process with
no stdin, where casp_core cannot be imported, only the model name (the card's placeholder for the folder or the
repository) replaced by the checkpoint's path. For both shapes: per layer (remote code) and uniform (plain llama)."""

import json
import re
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from casp_core.job import run_job
from tests.conftest import STORIES, tiny_config
from tests.core.fresh_process import run_python

PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
# What transformers prints before its stdin question about remote code (with no stdin it then goes on quietly).
REMOTE_CODE_QUESTION = "Do you wish to run the custom code?"


@pytest.fixture(scope="module", params=["per_layer", "uniform"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(request.param) / "checkpoint"
    run_job(str(STORIES), tiny_config(0.3, shape=request.param), out)
    return out


def test_python_snippets_run_as_written_without_casp_core(checkpoint: Path, tmp_path: Path) -> None:
    card = (checkpoint / "README.md").read_text(encoding="utf-8")
    name = ModelCard(card).data.model_name
    snippets = PYTHON_BLOCK.findall(card)
    assert len(snippets) == 1 and f'"{name}"' in snippets[0]
    unimportable = run_python("import casp_core", cwd=tmp_path)
    assert unimportable.returncode != 0 and "No module named 'casp_core'" in unimportable.stderr

    completed = run_python(snippets[0].replace(f'"{name}"', json.dumps(str(checkpoint))), cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert REMOTE_CODE_QUESTION not in completed.stdout + completed.stderr
    # The snippet prints the prompt and its greedy continuation: 32 tokens more than the prompt's own.
    text = completed.stdout.strip().splitlines()[-1]
    assert text.startswith("<s> Once upon a time") and len(text) > len("<s> Once upon a time") + 32
