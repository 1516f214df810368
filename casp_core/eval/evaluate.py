"""One model's figures: perplexity per text, and zero-shot accuracy and efficiency when asked for.

The job calls `evaluate` on the dense model (through casp_core.artifacts.dense_cache, which reuses an earlier job's
figures of the same model) and then on the pruned model (`EvaluationPlan.of`), `casp eval` on a saved
checkpoint; `side_by_side` lays the job's two sets of figures out for the report.
"""

import fcntl
import os
import re
import shutil
import sqlite3
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any, Protocol

from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from casp_core.eval.efficiency import efficiency_ratios, measure_efficiency
from casp_core.eval.perplexity import EvaluationText, default_seq_len, evaluation_text, windows_perplexity
from casp_core.eval.zeroshot import SCORES_FILE, evaluate_zero_shot, harness, kept_loglikelihoods
from casp_core.model import key_digest, resolve_device, weights_digest
from casp_core.run import Run
from casp_core.settings import PruneSettings

# The version of what `evaluate` measures and how: part of the key of the dense models' evaluations kept for later
# jobs (casp_core.artifacts.dense_cache). Raise it with any change that moves a figure: the texts, their windows or
# tokens, the perplexity's arithmetic, the zero-shot tasks' settings. 2: the zero-shot log-likelihoods read each
# context once (casp_core.eval.shared_context; the same to float rounding, which could still break a tie).
EVALUATION_VERSION = 2
SCORES_FOLDER = "zero-shot-scores"  # under the cache directory casp_core is given (casp_core.artifacts.caches)
# A model's scores untouched this long were left by an evaluation nobody ran again (a job cancelled and not
# resubmitted, a checkpoint deleted): the next evaluation that keeps scores removes them.
ABANDONED_AFTER_SECONDS = 7 * 24 * 3600
# How often scores being kept are also copied to the plan's `scores_copy` (a job's retry state, which the worker
# uploads): a retry on another machine loses at most this much scoring. A copy of hellaswag's 7 MB takes 0.04 s
# (bench/results/kept_scores.md).
SCORES_COPIED_EVERY_SECONDS = 300
# A scores folder's file in a copy (`copy_scores`): "<the folder's key>/<the harness's SQLite file>".
COPIED_SCORES = re.compile(rf"(?P<folder>[0-9a-f]{{32}})/{SCORES_FILE}_rank\d+\.db")


class ScoresCopy(Protocol):
    """Where an evaluation's kept scores are copied as they come, and found again by an evaluation on another
    machine (a job's retry state: casp_core.job.steps.RetryState)."""

    def keep_scores(self, scores_dir: Path) -> None:
        """Copy `scores_dir` (a folder `kept_scores` gave) now."""

    def restore_scores(self, scores_dir: Path) -> None:
        """Put the copy of `scores_dir`'s scores (the caller holds the folder) there, where it holds more."""


@dataclass(frozen=True)
class EvaluationPlan:
    """What one evaluation measures and how. A job plans it from its settings and the model's config before the
    weights load (`of`) and reads its texts once the tokenizer has loaded (`with_texts`), before the long work: a
    missing file fails the job at once."""

    perplexity: tuple[str, ...]  # the texts' names (casp_core.data)
    seq_len: int  # tokens per perplexity window
    max_windows: int | None  # the first windows of each text only; None: all of them
    zero_shot: tuple[str, ...]
    limit: int | None  # examples per zero-shot task
    datasets_dir: str | None
    device: str
    perplexity_batch_size: int
    zero_shot_batch_size: int = 16
    efficiency: dict[str, int] | None = None  # measure_efficiency's settings; None skips it
    texts: dict[str, EvaluationText] = field(default_factory=dict)  # by name, once read
    # Where the zero-shot log-likelihoods are kept as they are scored (`kept_scores`); None keeps none.
    scores_cache: Path | None = None
    # Where the kept scores are copied every SCORES_COPIED_EVERY_SECONDS while they are scored and once they all
    # are, and restored from before scoring (`kept_scores`); None copies none.
    scores_copy: ScoresCopy | None = None

    @classmethod
    def of(cls, settings: PruneSettings, model_config: PretrainedConfig) -> "EvaluationPlan":
        """A job's evaluation: windows of the settings' length, else of the model's context up to 2048 tokens."""
        evaluation = settings.evaluation
        return cls(
            perplexity=tuple(evaluation.perplexity),
            seq_len=evaluation.seq_len or default_seq_len(model_config),
            max_windows=evaluation.limit,
            zero_shot=tuple(evaluation.zero_shot),
            limit=evaluation.limit,
            datasets_dir=settings.datasets_dir,
            device=settings.device,
            perplexity_batch_size=settings.calibration.batch_size,
            efficiency=settings.efficiency.model_dump() if evaluation.efficiency else None,
        )

    def with_texts(self, tokenizer: PreTrainedTokenizerBase) -> "EvaluationPlan":
        """The plan with its texts read and tokenized; a machine without lm_eval refuses zero-shot tasks here."""
        if self.zero_shot:
            harness()
        texts = {
            name: evaluation_text(
                tokenizer, name, self.seq_len, datasets_dir=self.datasets_dir, max_windows=self.max_windows
            )
            for name in self.perplexity
        }
        return replace(self, texts=texts)

    def keeping_scores(self, cache_dir: Path, scores_copy: ScoresCopy | None = None) -> "EvaluationPlan":
        """The plan with its zero-shot scores kept in `cache_dir` (casp_core.artifacts.caches) as they come, and
        copied to `scores_copy` now and then."""
        return replace(self, scores_cache=cache_dir / SCORES_FOLDER, scores_copy=scores_copy)


@dataclass
class Figures:
    perplexity: dict[str, float]  # by text name; the conventions are the plan's texts'
    zero_shot: dict[str, Any] | None = None
    efficiency: dict[str, Any] | None = None
    # Set when the perplexity and zero-shot figures were not measured in this run but reused from an earlier one's
    # (casp_core.artifacts.dense_cache): when they were measured, ISO 8601 in UTC.
    reused_from: str | None = None


def evaluate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, plan: EvaluationPlan, run: Run | None = None
) -> Figures:
    assert set(plan.texts) == set(plan.perplexity), "the plan's texts are read (with_texts) before it evaluates"
    run = run or Run()
    figures = Figures(perplexity={})
    for name, text in plan.texts.items():
        figures.perplexity[name] = windows_perplexity(
            model, text, device=plan.device, batch_size=plan.perplexity_batch_size, run=run
        )
    if plan.zero_shot:
        # Where it is scored, before its weights are summed for its scores' folder: a GPU sums a 7B model's at once,
        # a CPU in about a minute.
        model.to(resolve_device(plan.device))
        with kept_scores(model, plan) as scores_dir:
            kept = 0 if scores_dir is None else kept_loglikelihoods(scores_dir)
            if kept:
                resuming = f"zero-shot: resuming from the {kept:,} log-likelihoods an earlier run kept"
                run.report("evaluation", 0.0, resuming)
            copy = None if scores_dir is None else plan.scores_copy
            try:
                figures.zero_shot = evaluate_zero_shot(
                    model,
                    tokenizer,
                    list(plan.zero_shot),
                    limit=plan.limit,
                    datasets_dir=plan.datasets_dir,
                    batch_size=plan.zero_shot_batch_size,
                    device=plan.device,
                    run=run if copy is None else copying_now_and_then(run, scores_dir, copy),
                    scores_dir=scores_dir,
                )
            finally:
                # Whole, or as far as the scoring came before a cancel or an error (a worker stopping hands the
                # job back to the queue, and another machine may take it).
                if copy is not None:
                    copy.keep_scores(scores_dir)
    if plan.efficiency is not None:
        run.check_cancelled()
        run.report("evaluation", 0.0, "parameters, MACs and latency")
        figures.efficiency = measure_efficiency(model, device=plan.device, **plan.efficiency)
    model.to("cpu")
    return figures


@contextmanager
def kept_scores(model: PreTrainedModel, plan: EvaluationPlan) -> Iterator[Path | None]:
    """The folder under the plan's `scores_cache` for `model`'s zero-shot log-likelihoods, kept as they are scored
    (evaluate_zero_shot's `scores_dir`): an evaluation cut short (a crash, a cancel, a lost worker) and run again
    on the same machine scores only the requests it had not. hellaswag on every document is an hour of a CPU.

    The harness keys its scores by request, so the folder is named by what else they depend on: the weights
    (`weights_digest`: a retry prunes again, and must find the same model), dtype, device kind, batch size and
    versions. It is removed once the evaluation has ended; None when the plan keeps no scores, the folder cannot
    be made, or another process holds it (the same model scored at once: the first to end would remove it).
    Other models' folders untouched for `ABANDONED_AFTER_SECONDS` and held by no process are removed first."""
    if plan.scores_cache is None:
        yield None
        return
    remove_abandoned_scores(plan.scores_cache)
    key = {
        "weights": weights_digest(model),
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": resolve_device(plan.device).type,
        "batch_size": plan.zero_shot_batch_size,
        "evaluation_version": EVALUATION_VERSION,
        "lm_eval": version("lm_eval"),
    }
    folder = plan.scores_cache / key_digest(key)[:32]
    handle = _locked(folder)
    if handle is None:
        yield None
        return
    try:
        if plan.scores_copy is not None:  # a retry on another machine: the scores an earlier attempt copied
            plan.scores_copy.restore_scores(folder)
        yield folder
        shutil.rmtree(folder, ignore_errors=True)  # the figures hold what the scores gave
    finally:
        os.close(handle)


def copying_now_and_then(run: Run, scores_dir: Path, copy: ScoresCopy) -> Run:
    """`run`, whose progress reports also copy `scores_dir` to `copy` once SCORES_COPIED_EVERY_SECONDS have passed
    since the last time (the zero-shot scoring reports after each batch)."""
    copied_at = time.monotonic()

    def progress(stage: str, fraction: float, message: str = "") -> None:
        nonlocal copied_at
        run.report(stage, fraction, message)
        if time.monotonic() - copied_at >= SCORES_COPIED_EVERY_SECONDS:
            copy.keep_scores(scores_dir)
            copied_at = time.monotonic()

    return replace(run, progress=progress)


def copy_scores(scores_dir: Path, archive: Path) -> None:
    """Puts a copy of `scores_dir` (a folder `kept_scores` gave) in the tar file `archive`, in place of an earlier
    copy of it and beside other folders' copies (a job's dense and pruned models). The copy is SQLite's backup,
    consistent while the harness goes on writing; the archive is replaced whole."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=archive.parent) as work:
        partial = Path(work) / archive.name
        with tarfile.open(partial, "w") as copied:
            if archive.is_file():
                with tarfile.open(archive) as earlier:
                    for member in earlier.getmembers():
                        if not member.name.startswith(f"{scores_dir.name}/"):
                            copied.addfile(member, earlier.extractfile(member))
            for scores in sorted(scores_dir.glob(f"{SCORES_FILE}_rank*.db")):
                backup = Path(work) / scores.name
                with (
                    closing(sqlite3.connect(scores)) as source,
                    closing(sqlite3.connect(backup)) as target,
                ):
                    source.backup(target)
                copied.add(backup, f"{scores_dir.name}/{scores.name}")
        partial.replace(archive)


def restore_scores(archive: Path, scores_dir: Path) -> int:
    """Replaces the scores in `scores_dir` (a folder `kept_scores` holds) with their copy in `archive`
    (`copy_scores`), where the copy holds more. How many log-likelihoods it restored: none where it did not."""
    if not archive.is_file():
        return 0
    scores_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as copied, tempfile.TemporaryDirectory(dir=scores_dir.parent) as work:
        files = [
            member
            for member in copied.getmembers()
            if member.isfile()
            and (match := COPIED_SCORES.fullmatch(member.name)) is not None
            and match["folder"] == scores_dir.name
        ]
        copied.extractall(work, members=files, filter="data")
        copy = Path(work) / scores_dir.name
        restored = kept_loglikelihoods(copy) if files else 0
        if restored <= kept_loglikelihoods(scores_dir):
            return 0
        for stale in scores_dir.glob(f"{SCORES_FILE}_rank*.db"):
            stale.unlink()
        for scores in copy.iterdir():
            scores.replace(scores_dir / scores.name)
            os.utime(scores_dir / scores.name)  # restored now: not abandoned (`remove_abandoned_scores`)
        return restored


def remove_abandoned_scores(scores_cache: Path) -> None:
    """Remove the folders of `scores_cache` whose newest file is older than `ABANDONED_AFTER_SECONDS`, unless a
    process holds one (an evaluation scoring it now)."""
    cutoff = time.time() - ABANDONED_AFTER_SECONDS
    folders = [folder for folder in scores_cache.iterdir() if folder.is_dir()] if scores_cache.is_dir() else []
    for folder in folders:
        try:
            touched = max([folder.stat().st_mtime, *(file.stat().st_mtime for file in folder.iterdir())])
        except FileNotFoundError:  # removed meanwhile by another process's evaluation
            continue
        if touched >= cutoff:
            continue
        handle = _locked(folder)
        if handle is None:
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(handle)


def _locked(folder: Path) -> int | None:
    """A descriptor of `folder`, made if need be, holding its exclusive lock; None when the folder cannot be made
    (a cache that cannot be written costs a rerun the scores, not this evaluation) or another process holds it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(handle)
        return None
    return handle


def side_by_side(dense: Figures, pruned: Figures, texts: dict[str, EvaluationText]) -> dict[str, Any]:
    """The evaluation card's layout: each figure's dense and pruned values side by side."""
    combined: dict[str, Any] = {
        "perplexity": {
            name: {"dense": dense.perplexity[name], "pruned": pruned.perplexity[name], **text.convention}
            for name, text in texts.items()
        }
    }
    if dense.zero_shot is not None and pruned.zero_shot is not None:
        combined["zero_shot"] = {"dense": dense.zero_shot, "pruned": pruned.zero_shot}
    if dense.reused_from is not None:
        combined["dense_reused"] = {"measured_at": dense.reused_from}
    if dense.efficiency is not None and pruned.efficiency is not None:
        combined["efficiency"] = {
            "dense": dense.efficiency,
            "pruned": pruned.efficiency,
            "pruned_over_dense": efficiency_ratios(dense.efficiency, pruned.efficiency),
        }
    return combined
