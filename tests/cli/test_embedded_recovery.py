"""A job with recovery on Alpaca records in the single-machine mode (`casp serve`: SQLite, in-process worker)."""

import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from casp_core.artifacts.checkpoint import load_pruned
from casp_core.job.run import TEACHER_WORK
from tests.cli.test_embedded import casp_serve
from tests.conftest import PTBWIKI
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


@pytest.mark.slow
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


# `make test-slow`: 60-100 s of recovery on the toy fixtures; make test keeps distillation in
# tests/core/recovery/test_distillation.py and a recovery job through a worker in tests/worker/test_recovery_e2e.py.
@pytest.mark.slow
def test_embedded_distillation_jobs_on_both_fixtures(tmp_path: Path) -> None:
    """`{"method": "lora", "loss": "distill"}` through the API on stories260K and ptbwiki-7M: the dense model's
    top-k cache is computed before pruning, the report shows it, both loss terms and the three perplexities."""
    home = tmp_path / "home"
    home.mkdir()
    # Both under an allowed root: the home folder holds a copy of ptbwiki-7M and the training text.
    shutil.copytree(PTBWIKI, home / "ptbwiki-7M")
    lines = (FIXTURE_DATA / "ptb" / "ptb.train.txt").read_text(encoding="utf-8").splitlines()[:100]
    (home / "ptb-head.txt").write_text("\n".join(lines), encoding="utf-8")
    recovery = {
        "method": "lora",
        "loss": "distill",
        "dataset": str(home / "ptb-head.txt"),
        "max_steps": 3,
        "batch_size": 2,
        "grad_accum": 1,
        "max_seq_len": 64,
        "lr": 1e-3,
    }
    with casp_serve(home, free_port(), workers=1) as client:
        jobs = [
            client.submit({**SMALL_JOB, "model": model, "recovery": recovery})
            for model in (SMALL_JOB["model"], str(home / "ptbwiki-7M"))
        ]
        for job in jobs:
            done = client.wait(job["id"], timeout=300)
            assert done["status"] == "succeeded", done
            teacher = done["result"]["recovery"]["teacher"]
            assert teacher["top_k"] == 64 and teacher["bytes"] > teacher["tokens"] * teacher["bytes_per_token"]
            out = tmp_path / job["id"]
            client.download(job["id"], out)
            report = json.loads((out / "report.json").read_text())
            curve = report["recovery"]["curve"]
            assert len(curve) == 3 and all(
                point["loss"] == pytest.approx(point["kl"]) and point["ce"] > 0 for point in curve
            )
            perplexity = report["perplexity"]["wikitext2"]
            assert all(perplexity[side] > 1 for side in ("dense", "pruned", "recovered"))
            assert perplexity["recovered"] != perplexity["pruned"]
            # The dense model's pass is timed as a stage of its own, before pruning.
            stages = list(report["timings"])
            assert stages.index("teacher") < stages.index("evaluation_pruned")
            markdown = (out / "report.md").read_text()
            assert "- loss KL divergence from the dense model's top-64 (temperature 1.0)" in markdown
            assert f"teacher cache `teacher-topk.safetensors`: {teacher['tokens']:,} tokens x top 64" in markdown
            assert not (out / TEACHER_WORK).exists() and not list(out.rglob("*.safetensors.partial"))
            load_pruned(out)
