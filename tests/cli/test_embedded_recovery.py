"""A job with recovery on Alpaca records in the single-machine mode (`casp serve`: SQLite, in-process worker)."""

import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from casp_core.checkpoint import load_pruned
from tests.cli.test_embedded import casp_serve
from tests.service_fixtures import FIXTURE_DATA, SMALL_JOB, free_port

pytestmark = pytest.mark.service


def alpaca_file(path: Path, records: int) -> Path:
    """Instruction records made of PTB train lines: continue the first half of a line with its second half."""
    lines = (FIXTURE_DATA / "ptb" / "ptb.train.txt").read_text(encoding="utf-8").splitlines()[:records]
    with path.open("w", encoding="utf-8") as out:
        for line in lines:
            words = line.split()
            half = len(words) // 2
            record = {
                "instruction": "Continue the sentence.",
                "input": " ".join(words[:half]),
                "output": " ".join(words[half:]),
            }
            out.write(json.dumps(record) + "\n")
    return path


def test_embedded_job_with_alpaca_recovery(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    data = alpaca_file(home / "alpaca.jsonl", 64)  # the home folder is an allowed root in these tests
    recovery = {"method": "lora", "dataset": str(data), "max_steps": 3, "batch_size": 2, "grad_accum": 1}
    with casp_serve(home, free_port(), workers=1) as client:
        job = client.submit({**SMALL_JOB, "recovery": {**recovery, "max_seq_len": 256}})
        done = client.wait(job["id"], timeout=300)
        assert done["status"] == "succeeded", done
        assert done["result"]["recovery"]["steps"] == 3 and done["result"]["recovery"]["resumed_from_step"] is None
        assert {"dense", "pruned", "recovered"} <= set(done["result"]["perplexity"]["wikitext2"])
        paths = client.download(job["id"], tmp_path / "out")
    names = {str(path.relative_to(tmp_path / "out")) for path in paths}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "plots/recovery_loss.png"} <= names
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["recovery"]["data"]["layout"] == "alpaca" and report["recovery"]["data"]["sequences"] == 64
    load_pruned(tmp_path / "out")
    # The checkpoint's row of the table of files is the recovered model's (the adapter is not a row of its own).
    (checkpoint_row,) = report["artifacts"]["rows"]
    assert checkpoint_row["file"] == "model.safetensors"
    assert checkpoint_row["perplexity"]["wikitext2"] == report["perplexity"]["wikitext2"]["recovered"]
    # The card publishes the recovered model's figures, and shows the recovery with its curve.
    card = ModelCard.load(tmp_path / "out" / "README.md")
    (result,) = [r for r in card.data.eval_results if r.dataset_name == "wikitext2"]
    assert result.metric_value == report["perplexity"]["wikitext2"]["recovered"]
    assert result.metric_value != report["perplexity"]["wikitext2"]["pruned"]
    assert "## Recovery" in card.text and "![training loss](plots/recovery_loss.png)" in card.text
