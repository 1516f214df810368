"""Zero-shot accuracy through lm-evaluation-harness, offline, on the real stories260K model and data."""

import copy
import fcntl
import os
import socket
import time
from dataclasses import replace
from pathlib import Path
from statistics import fmean

import datasets
import huggingface_hub.constants
import lm_eval
import pytest
import torch
import yaml
from lm_eval.tasks import TaskManager
from sqlitedict import SqliteDict
from transformers import AutoModelForCausalLM, AutoTokenizer

from casp_core.errors import Cancelled, DatasetNotFound, InvalidConfig
from casp_core.eval.evaluate import EvaluationPlan, evaluate, kept_scores
from casp_core.eval.kept_scores import ABANDONED_AFTER_SECONDS, SCORES_FOLDER
from casp_core.eval.zeroshot import (
    LOCAL_TASKS,
    SCORES_FILE,
    documents_scored,
    evaluate_zero_shot,
    kept_loglikelihoods,
)
from casp_core.run import Run
from casp_core.settings import ZERO_SHOT_TASKS
from tests.conftest import STORIES
from tests.core.eval.eval_helpers import (
    datasets_dir_or_skip,
    no_network,
    one_torch_thread,  # noqa: F401 (an autouse fixture)
)


@pytest.fixture(scope="module")
def stories_model():
    return AutoModelForCausalLM.from_pretrained(STORIES), AutoTokenizer.from_pretrained(STORIES)


def test_the_table_covers_exactly_the_configured_tasks():
    assert set(LOCAL_TASKS) == set(ZERO_SHOT_TASKS)


def test_seven_tasks_offline_without_touching_the_network(stories_model, monkeypatch):
    datasets_dir = datasets_dir_or_skip()
    model, tokenizer = stories_model
    # As if the environment allowed the network (the offline flags are read at import time, hence the
    # attributes): the evaluation itself must not try it.
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    with no_network(monkeypatch) as attempts:
        out = evaluate_zero_shot(
            model, tokenizer, list(ZERO_SHOT_TASKS), limit=10, datasets_dir=str(datasets_dir), device="cpu"
        )
    assert attempts == []
    assert (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_UPDATE_DOWNLOAD_COUNTS) == (False, True)
    assert out["source"] == "local"
    assert out["harness_version"] == lm_eval.__version__
    assert out["limit"] == 10 and out["num_fewshot"] == 0
    assert list(out["tasks"]) == list(ZERO_SHOT_TASKS)
    for task, figures in out["tasks"].items():
        assert 0.0 <= figures["acc"] <= 1.0, task
        assert figures["acc_stderr"] >= 0.0, task
        assert figures["n_samples"] == 10 and figures["n_documents"] > 10, task
        assert figures["num_fewshot"] == 0 and figures["version"] is not None, task
        # Accuracies over 10 documents are multiples of 1/10.
        assert round(figures["acc"] * 10, 9) == round(figures["acc"] * 10), task
    # The harness gives acc_norm only for tasks whose answers differ in length.
    has_norm = {t for t, f in out["tasks"].items() if "acc_norm" in f}
    assert has_norm == {"piqa", "hellaswag", "arc_easy", "arc_challenge", "openbookqa"}
    assert all(0.0 <= out["tasks"][t]["acc_norm"] <= 1.0 for t in has_norm)
    assert {out["tasks"][t]["split"] for t in ("arc_easy", "arc_challenge", "openbookqa")} == {"test"}
    assert out["tasks"]["boolq"]["split"] == "validation"
    assert out["average_acc"] == pytest.approx(fmean(f["acc"] for f in out["tasks"].values()))
    assert out["average_over"] == list(ZERO_SHOT_TASKS)


@pytest.mark.slow
def test_piqa_matches_the_harness_own_hf_model(stories_model, tmp_path, monkeypatch):
    """The harness loading the checkpoint itself (`model="hf"`) on the same file gives the same figures."""
    datasets_dir = datasets_dir_or_skip()
    model, tokenizer = stories_model
    limit = 200
    ours = evaluate_zero_shot(model, tokenizer, ["piqa"], limit=limit, datasets_dir=str(datasets_dir), device="cpu")[
        "tasks"
    ]["piqa"]

    # An independent task file, written as fixtures/PROVENANCE.md describes, under another name.
    harness_piqa = f"{lm_eval.__path__[0]}/tasks/piqa/piqa.yaml"
    task_file = {
        "include": harness_piqa,
        "task": "piqa_reference",
        "dataset_path": "json",
        "dataset_name": None,
        "training_split": None,
        "dataset_kwargs": {"data_files": {"validation": str(datasets_dir / "zeroshot/piqa/validation.jsonl")}},
    }
    (tmp_path / "piqa_reference.yaml").write_text(yaml.safe_dump(task_file))
    with no_network(monkeypatch) as attempts:
        reference = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={STORIES}",
            tasks=["piqa_reference"],
            limit=limit,
            device="cpu",
            batch_size=4,  # not ours (16): padding in other batches must not change a figure
            task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
            log_samples=False,
        )
    assert attempts == []
    theirs = reference["results"]["piqa_reference"]
    assert ours["n_samples"] == limit
    assert ours["acc"] == theirs["acc,none"]
    assert ours["acc_norm"] == theirs["acc_norm,none"]
    assert ours["acc_stderr"] == theirs["acc_stderr,none"]
    assert ours["version"] == reference["versions"]["piqa_reference"]


def test_the_network_guard_catches_connections(monkeypatch):
    with no_network(monkeypatch) as attempts, pytest.raises(OSError):
        socket.create_connection(("s3.amazonaws.com", 443), timeout=1)
    assert len(attempts) == 1


def test_missing_local_file_names_the_path(stories_model, tmp_path):
    model, tokenizer = stories_model
    (tmp_path / "zeroshot" / "arc_easy").mkdir(parents=True)
    (tmp_path / "zeroshot" / "arc_easy" / "validation.jsonl").write_text("")
    with pytest.raises(DatasetNotFound) as error:
        evaluate_zero_shot(model, tokenizer, ["arc_easy"], limit=1, datasets_dir=str(tmp_path), device="cpu")
    assert str(tmp_path / "zeroshot" / "arc_easy" / "test.jsonl") in error.value.message


def test_unknown_task_is_refused(stories_model):
    model, tokenizer = stories_model
    with pytest.raises(InvalidConfig, match="mmlu"):
        evaluate_zero_shot(model, tokenizer, ["piqa", "mmlu"], limit=1, datasets_dir=None, device="cpu")


def test_a_cancelled_evaluation_stops_between_batches_after_reporting_its_progress(stories_model, capfd):
    """Every document of the seven tasks is hours of a CPU: the evaluation reports its start (before the documents
    load), then the fraction scored after each batch (the harness's own bars of the scoring not drawn beside it),
    and a cancelled job stops at the next one."""
    datasets_dir = datasets_dir_or_skip()
    model, tokenizer = stories_model
    reports: list[tuple[str, float, str]] = []
    run = Run(progress=lambda stage, fraction, message="": reports.append((stage, fraction, message)))
    evaluate_zero_shot(model, tokenizer, ["arc_easy"], limit=40, datasets_dir=str(datasets_dir), device="cpu", run=run)
    assert len(reports) >= 3 and {stage for stage, _, _ in reports} == {"evaluation"}
    assert {message for _, _, message in reports} == {"zero-shot arc_easy"}
    fractions = [fraction for _, fraction, _ in reports]
    assert fractions[0] == 0.0 and fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0)
    drawn = capfd.readouterr().err
    assert "Tokenizing inputs" not in drawn and "Running loglikelihood requests" not in drawn

    reports.clear()
    run = Run(
        progress=lambda stage, fraction, message="": reports.append(fraction), should_cancel=lambda: len(reports) > 1
    )
    with pytest.raises(Cancelled):
        evaluate_zero_shot(
            model, tokenizer, ["arc_easy"], limit=40, datasets_dir=str(datasets_dir), device="cpu", run=run
        )
    assert len(reports) == 2 and reports[0] == 0.0 < reports[1] < 0.5  # the start, the first batch


# make test-slow: the next test holds the same through `evaluate`'s kept scores, which jobs and `casp eval` use.
@pytest.mark.slow
def test_an_evaluation_cut_short_resumes_from_its_kept_scores_and_scores_only_the_rest(stories_model, tmp_path):
    """hellaswag on every document is two hours of a CPU: with a folder to keep its scores in, an evaluation
    cancelled part-way and run again scores only the requests it had not, and gives the uncut run's accuracy."""
    datasets_dir = str(datasets_dir_or_skip())
    model, tokenizer = stories_model
    rows_read: list[int] = []

    def count_rows(module, args, kwargs, output):
        rows_read.append(len(args[0] if args else kwargs["input_ids"]))

    def evaluate(run: Run | None = None) -> dict:
        rows_read.clear()
        return evaluate_zero_shot(
            model, tokenizer, ["arc_easy"], limit=40, datasets_dir=datasets_dir, device="cpu", run=run,
            scores_dir=tmp_path / "scores",
        )  # fmt: skip

    hook = model.register_forward_hook(count_rows, with_kwargs=True)
    try:
        uncut = evaluate_zero_shot(model, tokenizer, ["arc_easy"], limit=40, datasets_dir=datasets_dir, device="cpu")
        uncut_rows = sum(rows_read)
        reports: list[float] = []
        run = Run(
            progress=lambda stage, fraction, message="": reports.append(fraction),
            should_cancel=lambda: len(reports) > 2,  # the start, the first batch, then cancelled after the second
        )
        with pytest.raises(Cancelled):
            evaluate(run)
        assert (tmp_path / "scores").is_dir()
        resumed = evaluate()
        resumed_rows = sum(rows_read)
        again = evaluate()
    finally:
        hook.remove()
    assert resumed["tasks"]["arc_easy"]["acc"] == uncut["tasks"]["arc_easy"]["acc"]
    assert resumed["tasks"]["arc_easy"]["acc_norm"] == uncut["tasks"]["arc_easy"]["acc_norm"]
    assert resumed["tasks"]["arc_easy"]["n_samples"] == 40
    # The resumed run read fewer rows than the whole evaluation, and a run with every score kept reads none.
    assert 0 < resumed_rows < uncut_rows
    assert again["tasks"]["arc_easy"] == resumed["tasks"]["arc_easy"] and rows_read == []


def arc_easy_keeping_scores(home: Path, datasets_dir: str | None) -> EvaluationPlan:
    """40 documents of arc_easy, their scores kept under `home` as a job's are."""
    return EvaluationPlan(
        perplexity=(), seq_len=128, max_windows=None, zero_shot=("arc_easy",), limit=40, datasets_dir=datasets_dir,
        device="cpu", perplexity_batch_size=8,
    ).keeping_scores(home)  # fmt: skip


def test_an_evaluation_keeps_its_scores_by_model_and_run_again_resumes_from_them(stories_model, tmp_path):
    """`evaluate` with a scores cache (a job's, `casp eval`'s): cut short, its log-likelihoods stay in a folder
    named by the model's weights and settings; run again, it says from how many it resumes, reads fewer rows than the
    whole evaluation and gives the uncut run's figures, then removes the folder. A run cancelled before its first
    batch leaves an empty SQLite file: the next does not say it resumes. Another model's weights get another
    folder, and a folder another evaluation holds is not shared with it."""
    datasets_dir = str(datasets_dir_or_skip())
    model, tokenizer = stories_model
    plan = arc_easy_keeping_scores(tmp_path, datasets_dir)
    scores = tmp_path / SCORES_FOLDER
    rows_read: list[int] = []
    hook = model.register_forward_hook(
        lambda module, args, kwargs, output: rows_read.append(len(args[0] if args else kwargs["input_ids"])),
        with_kwargs=True,
    )
    messages: list[str] = []
    try:
        with pytest.raises(Cancelled), kept_scores(model, plan) as before_the_first_batch:
            assert before_the_first_batch is not None
            SqliteDict(str(before_the_first_batch / f"{SCORES_FILE}_rank0.db"), autocommit=True).close()
            raise Cancelled("cancelled before the first batch")
        uncut = evaluate(
            model, tokenizer, plan, Run(progress=lambda stage, fraction, message="": messages.append(message))
        ).zero_shot
        uncut_rows = sum(rows_read)
        assert not any("resuming" in message for message in messages)
        assert not any(scores.iterdir())
        messages.clear()
        cut = Run(
            progress=lambda stage, fraction, message="": messages.append(message),
            should_cancel=lambda: len(messages) > 2,
        )
        with pytest.raises(Cancelled):
            evaluate(model, tokenizer, plan, cut)
        (kept,) = scores.iterdir()
        kept_before = kept_loglikelihoods(kept)
        assert kept_before > 0
        rows_read.clear()
        messages.clear()
        resumed = evaluate(
            model, tokenizer, plan, Run(progress=lambda stage, fraction, message="": messages.append(message))
        ).zero_shot
    finally:
        hook.remove()
    assert messages[0] == f"zero-shot: resuming from the {kept_before:,} log-likelihoods an earlier run kept"
    assert resumed is not None and uncut is not None and resumed["tasks"] == uncut["tasks"]
    assert 0 < sum(rows_read) < uncut_rows
    assert not any(scores.iterdir())

    with kept_scores(model, plan) as held:
        assert held is not None and held.name == kept.name
        with kept_scores(model, plan) as second:
            assert second is None  # held by the first: scored without kept scores
        retrained = copy.deepcopy(model)
        with torch.no_grad():
            next(retrained.parameters())[0, 0] += 1.0
        with kept_scores(retrained, plan) as other:
            assert other is not None and other.name != kept.name
    assert not any(scores.iterdir())  # each removed as its evaluation ended
    with kept_scores(model, replace(plan, scores_cache=None)) as none:
        assert none is None


def test_an_evaluation_removes_the_scores_that_evaluations_abandoned(stories_model, tmp_path):
    """The folders of scores untouched for `ABANDONED_AFTER_SECONDS` and held by no process go when an evaluation
    next keeps scores; one with a file written since, and an old one another evaluation holds, stay."""
    model, _ = stories_model
    plan = arc_easy_keeping_scores(tmp_path, None)
    scores = tmp_path / SCORES_FOLDER
    long_ago = time.time() - ABANDONED_AFTER_SECONDS - 60

    def left_long_ago(name: str) -> Path:
        folder = scores / name
        folder.mkdir(parents=True)
        (folder / f"{SCORES_FILE}_rank0.db").write_bytes(b"scores")
        for path in (folder / f"{SCORES_FILE}_rank0.db", folder):
            os.utime(path, (long_ago, long_ago))
        return folder

    left_long_ago("abandoned")
    os.utime(left_long_ago("written-since") / f"{SCORES_FILE}_rank0.db")
    holder = os.open(left_long_ago("held"), os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with kept_scores(model, plan) as own:
            assert own is not None
            assert sorted(folder.name for folder in scores.iterdir()) == sorted([own.name, "written-since", "held"])
    finally:
        os.close(holder)


def test_an_evaluation_in_parts_of_the_documents_adds_up_to_the_whole(stories_model):
    """Two ranges of documents, scored apart, give the accuracy of their union scored at once (the bench scores
    hellaswag in parts, each short enough for one sitting, `documents_scored` telling where the split ends); a limit
    and a range together are refused."""
    datasets_dir = str(datasets_dir_or_skip())
    model, tokenizer = stories_model

    def evaluate(**which) -> dict:
        out = evaluate_zero_shot(model, tokenizer, ["arc_easy"], datasets_dir=datasets_dir, device="cpu", **which)
        return out["tasks"]["arc_easy"] | {"documents": out["documents"]}

    whole = evaluate(limit=40)
    first, second = evaluate(limit=None, documents=range(0, 16)), evaluate(limit=None, documents=range(16, 40))
    assert (first["n_samples"], second["n_samples"], second["documents"]) == (16, 24, [16, 40])
    assert documents_scored("arc_easy", datasets_dir) == whole["n_documents"]  # the split the harness scores: test
    for metric in ("acc", "acc_norm"):
        assert 16 * first[metric] + 24 * second[metric] == pytest.approx(40 * whole[metric])
    assert first["acc"] != second["acc"]  # two parts that score alike would not tell the ranges apart
    with pytest.raises(InvalidConfig, match="not both"):
        evaluate(limit=10, documents=range(0, 10))
