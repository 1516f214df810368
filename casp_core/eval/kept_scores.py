"""The zero-shot log-likelihoods kept as they are scored, a folder a model under the cache folder's
`zero-shot-scores/` (casp_core.artifacts.caches).

hellaswag on every document is an hour of a CPU. An evaluation cut short (a crash, a cancel, a lost worker) and run
again on the machine scores only the requests it had not: the harness keeps each log-likelihood in its SQLite file
in the folder `held_scores` gives, named by what the scores depend on besides the requests
(casp_core.eval.evaluate.kept_scores). A job also copies the folder into its retry state as it goes
(`copying_now_and_then`, `copy_scores`), and a retry on another machine restores the copy into the folder before
it scores (`restore_scores`).
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
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from casp_core.eval.zeroshot import SCORES_FILE, kept_loglikelihoods
from casp_core.run import Run

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


@contextmanager
def held_scores(scores_cache: Path, name: str, copy: ScoresCopy | None) -> Iterator[Path | None]:
    """The folder `name` of `scores_cache`, held by this process while the evaluation scores into it, with what
    `copy` holds of it restored first; removed once the evaluation has ended. None when the folder cannot be made
    or another process holds it (the same model scored at once: the first to end would remove it). Other models'
    folders untouched for `ABANDONED_AFTER_SECONDS` and held by no process are removed first."""
    remove_abandoned_scores(scores_cache)
    folder = scores_cache / name
    handle = _locked(folder)
    if handle is None:
        yield None
        return
    try:
        if copy is not None:  # a retry on another machine: the scores an earlier attempt copied
            copy.restore_scores(folder)
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
