"""The dense model is evaluated once per model: a second job reuses the first's figures, and says so, only while
the model, the dtype, the texts, the settings and the evaluation code are the same (casp_core.artifacts.dense_cache)."""

import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from casp_core.artifacts import dense_cache
from casp_core.artifacts.dense_cache import CACHE_FOLDER, FILE_DIGESTS, evaluate_dense, source_identity
from casp_core.artifacts.gguf.source import SOURCE_RECORD
from casp_core.eval.evaluate import EvaluationPlan
from casp_core.job.run import run_job
from casp_core.model import load_config, load_model
from casp_core.run import Run
from casp_core.settings import EvaluationConfig, PruneConfig
from tests.conftest import DATASETS_DIR, STORIES, tiny_config
from tests.core.test_model_source import COMMIT, hub_cache  # noqa: F401 (the fixture)

PERPLEXITY = "perplexity wikitext2"  # the message of each batch of the perplexity's windows


def evaluated_config(ratio: float):
    """A job in seconds that measures perplexity: 4 windows of 64 tokens of WikiText-2 test."""
    return tiny_config(ratio, evaluation=EvaluationConfig(perplexity=["wikitext2"], seq_len=64, limit=4))


def recorded(messages: list[tuple[str, str]]) -> Run:
    return Run(progress=lambda stage, fraction, message="": messages.append((stage, message)))


def test_a_second_job_on_the_same_model_reuses_the_dense_evaluation_and_says_when_it_was_measured(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    first_messages: list[tuple[str, str]] = []
    started = datetime.now().astimezone()
    first = run_job(str(STORIES), evaluated_config(0.3), tmp_path / "first", recorded(first_messages), cache_dir=cache)
    ended = datetime.now().astimezone()
    assert "evaluation_dense" in first["timings"] and "dense_reused" not in first["evaluation"]
    assert "reused" not in (tmp_path / "first" / "report.md").read_text()
    (entry,) = (cache / CACHE_FOLDER).glob("*.json")
    measured_at = json.loads(entry.read_text())["measured_at"]
    assert started.replace(microsecond=0) <= datetime.fromisoformat(measured_at) <= ended

    # Another ratio of the same model: the dense figures are the first job's, not measured again.
    second_messages: list[tuple[str, str]] = []
    second = run_job(
        str(STORIES), evaluated_config(0.5), tmp_path / "second", recorded(second_messages), cache_dir=cache
    )
    assert second["perplexity"]["wikitext2"]["dense"] == first["perplexity"]["wikitext2"]["dense"]
    assert second["perplexity"]["wikitext2"]["pruned"] != first["perplexity"]["wikitext2"]["pruned"]
    assert second["evaluation"]["dense_reused"] == {"measured_at": measured_at}
    assert "evaluation_dense" not in second["timings"]
    # Each evaluation reports each batch of its windows: the first job's dense and pruned, the second's pruned only.
    batches = [message for _, message in first_messages].count(PERPLEXITY)
    assert batches == 2 * [message for _, message in second_messages].count(PERPLEXITY) > 0
    reused = ("evaluation", f"dense model: figures reused from its evaluation of {measured_at}")
    assert reused in second_messages and reused not in first_messages
    for written in ("report.md", "README.md"):  # the report and the model card
        text = (tmp_path / "second" / written).read_text()
        assert f"reused from its evaluation of {measured_at}" in text, written
    assert json.loads((tmp_path / "second" / "report.json").read_text())["evaluation"]["dense_reused"] == {
        "measured_at": measured_at
    }
    assert list((cache / CACHE_FOLDER).glob("*.json")) == [entry]


@pytest.mark.slow  # 12 s: the job's reuse above is make test's, the sweep reads the same cache through the same call
def test_a_sweep_reuses_the_dense_evaluation_of_a_single_ratio_job(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    job = run_job(str(STORIES), evaluated_config(0.3), tmp_path / "job", cache_dir=cache)
    (entry,) = (cache / CACHE_FOLDER).glob("*.json")
    sweep = evaluated_config(0.3).model_dump() | {
        "ratio": None,
        "target": {"max_bytes": "100MB", "format": "safetensors"},
        "ratios": [0.3],
        "quantizations": ["none"],
        "calibration": {"dataset": "wikitext2:validation", "n_samples": 4, "seq_len": 32, "batch_size": 4},
    }
    report = run_job(str(STORIES), PruneConfig(**sweep), tmp_path / "sweep", cache_dir=cache)
    assert report["frontier"]["dense_perplexity"] == {"wikitext2": job["perplexity"]["wikitext2"]["dense"]}
    assert report["evaluation"]["dense_reused"] == {"measured_at": json.loads(entry.read_text())["measured_at"]}
    assert "evaluation_dense" not in report["timings"]


def evaluated(model: torch.nn.Module, tokenizer, plan: EvaluationPlan, cache: Path) -> tuple[float, str | None]:
    """The dense perplexity on the plan's one text, and when it was measured if it was reused."""
    figures = evaluate_dense(model, tokenizer, plan, Run(), cache)
    return next(iter(figures.perplexity.values())), figures.reused_from


def text_plan(tokenizer, text: Path, limit: int = 2) -> EvaluationPlan:
    config = tiny_config(0.3, evaluation=EvaluationConfig(perplexity=[str(text)], seq_len=64, limit=limit))
    return EvaluationPlan.of(config, load_config(str(STORIES))).with_texts(tokenizer)


def test_the_figures_are_reused_only_while_the_key_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    text = tmp_path / "text.txt"
    lines = (DATASETS_DIR / "wikitext-2-raw" / "wiki.test.raw").read_text().splitlines()[:200]
    text.write_text("\n".join(lines))
    model, tokenizer = load_model(str(STORIES))
    plan = text_plan(tokenizer, text)

    measured, when = evaluated(model, tokenizer, plan, cache)
    assert when is None
    again, when = evaluated(model, tokenizer, plan, cache)
    assert again == measured and when is not None

    # Another dtype, fewer windows: measured again.
    bfloat16, _ = load_model(str(STORIES), dtype="bfloat16")
    assert evaluated(bfloat16, tokenizer, plan, cache)[1] is None
    assert evaluated(model, tokenizer, text_plan(tokenizer, text, limit=1), cache)[1] is None

    # The data file changed, with as many windows as before: measured again, and the new figure is kept.
    text.write_text("\n".join(lines).replace(" the ", " a "))
    changed = text_plan(tokenizer, text)
    assert changed.texts[str(text)].convention == plan.texts[str(text)].convention
    assert evaluated(model, tokenizer, changed, cache)[1] is None
    assert evaluated(model, tokenizer, changed, cache)[1] is not None

    # Another version of the evaluation code: measured again.
    monkeypatch.setattr(dense_cache, "EVALUATION_VERSION", dense_cache.EVALUATION_VERSION + 1)
    assert evaluated(model, tokenizer, changed, cache)[1] is None
    monkeypatch.undo()

    # An entry cut short is ignored and written over.
    entries = list((cache / CACHE_FOLDER).glob("*.json"))
    for entry in entries:
        entry.write_text(entry.read_text()[:40])
    assert evaluated(model, tokenizer, changed, cache)[1] is None
    assert evaluated(model, tokenizer, changed, cache)[1] is not None


def test_a_model_is_known_by_its_commit_its_gguf_file_or_its_files(
    tmp_path: Path,
    hub_cache: Path,  # noqa: F811 (the fixture)
) -> None:
    digests = tmp_path / "cache"
    hub, _ = load_model("org/tiny")
    assert source_identity(Path(hub.config.name_or_path), digests) == {"hub": "org/tiny", "commit": COMMIT}

    converted = tmp_path / "converted"
    shutil.copytree(STORIES, converted)
    record = {"file": "m.gguf", "sha256": "ab" * 32, "architecture": "llama", "model_type": "llama"}
    (converted / SOURCE_RECORD).write_text(json.dumps({**record, "tensor_types": {"Q4_1": 1}}))
    assert source_identity(converted, digests) == {"gguf_sha256": "ab" * 32}

    # A local folder: by its files, wherever it lies; each file's digest read once per size and modification time.
    local = tmp_path / "local"
    shutil.copytree(STORIES, local)
    identity = source_identity(local, digests)
    assert source_identity(STORIES, digests) == identity
    weights = load_file(local / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    save_file(weights, local / "model.safetensors", metadata={"format": "pt"})
    changed = source_identity(local, digests)
    assert changed != identity
    for memo in (digests / FILE_DIGESTS).iterdir():
        memo.write_text("0" * 64)
    assert source_identity(local, digests) not in (identity, changed)  # the remembered digests, no file read
