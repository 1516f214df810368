"""The steps a job is made of, shared by the single-ratio job (casp_core.job.run) and the sweep
(casp_core.job.sweep.run): the staging directory, loading and checking the dense model, reading the texts, what a
retry keeps, writing the checkpoint with its exports, and the report with the model card."""

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core.artifacts.checkpoint import save_pruned
from casp_core.artifacts.compressed_tensors.quantize import QuantizedCheckpoint
from casp_core.artifacts.gguf.source import gguf_source_for, is_gguf_reference
from casp_core.artifacts.gguf.tokenizer import keep_source_vocabulary, vocabulary_of
from casp_core.artifacts.gguf.writer import GgufExport, export_checkpoint
from casp_core.artifacts.snapshot import SNAPSHOT_FILE, PrunedSnapshot, load_snapshot, save_snapshot
from casp_core.errors import InvalidConfig
from casp_core.eval.evaluate import EvaluationPlan, Figures
from casp_core.eval.kept_scores import copy_scores, restore_scores
from casp_core.families import projections
from casp_core.job.plan import ArtifactsPlan, JobPlan
from casp_core.method.budget import AllocationPlan
from casp_core.method.calibration import CalibrationPlan, calibration_windows
from casp_core.model import decoder_layers, load_model
from casp_core.recovery.data import RecoveryPlan, TrainingData
from casp_core.recovery.teacher import TEACHER_FILE
from casp_core.recovery.train import ADAPTER_DIR, STATE_FILE, RecoveryResult
from casp_core.report.build import build_report, write_report
from casp_core.report.model_card import write_model_card
from casp_core.report.plots import write_plots
from casp_core.report.publish import base_model_of, public_name, without_local_paths
from casp_core.rounding import fallback_warning, speed_warning
from casp_core.run import Run
from casp_core.settings import PruneConfig


@contextmanager
def staged_output(out_dir: Path) -> Iterator[Path]:
    """Work goes to a staging directory renamed to `out_dir` when the block ends without error: a crash never
    leaves a half checkpoint."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise InvalidConfig(f"out: {out_dir} exists and is not empty")
    staging = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@dataclass
class Inputs:
    """Every text the job reads, read before the long work starts so that a missing file fails the job at once."""

    windows: torch.Tensor | None  # the calibration tokens; None when resuming after pruning
    plan: EvaluationPlan
    training: TrainingData | None  # recovery's sequences, when the job recovers


@dataclass
class Pruned:
    """The pruned model and what the report needs from the stages that made it."""

    model: PreTrainedModel
    pruning: dict[str, Any]  # `pruning_section`
    dense_figures: Figures
    pruned_figures: Figures | None  # measured before recovery; without recovery, on the published model at the end


SWEEP_STATE_FILE = "sweep-state.json"  # a sweep's candidates measured so far (casp_core.job.sweep.run)
# The zero-shot log-likelihoods scored so far, a folder per model (casp_core.eval.kept_scores.copy_scores).
ZERO_SHOT_SCORES_FILE = "zero-shot-scores.tar"
# What a retry resumes from, in the retry state's folder: the pruned model's snapshot, recovery's training state, a
# sweep's state, the teacher's cache and the zero-shot scores. The worker stores each save and restores them for
# the next attempt.
RETRY_FILES = (SNAPSHOT_FILE, STATE_FILE, SWEEP_STATE_FILE, TEACHER_FILE, ZERO_SHOT_SCORES_FILE)


@dataclass
class RetryState:
    """Where a job keeps what a retry resumes from, and a retry finds it: with recovery, the pruned model (a
    `pruned_snapshot`, saved after the pruned model's evaluation) and recovery's training state; in a sweep, the
    candidates already measured and the best one's pruned model (casp_core.job.sweep.run); with zero-shot tasks,
    the log-likelihoods scored so far (`keep_scores`). `on_saved` is called with each saved path (the worker copies
    it to the job's storage)."""

    directory: Path | None  # None: the job keeps nothing (nothing to resume, or no place given)
    fingerprint: dict[str, Any]  # what a snapshot must match to be used
    on_saved: Callable[[Path], None] | None

    def pruned_snapshot(self) -> PrunedSnapshot | None:
        return load_snapshot(self.directory, self.fingerprint) if self.directory is not None else None

    def keep_pruned(self, snapshot: PrunedSnapshot) -> None:
        if self.directory is None:
            return
        self.saved(save_snapshot(self.directory, self.fingerprint, snapshot))

    def keep_scores(self, scores_dir: Path) -> None:
        """A copy of `scores_dir`, the zero-shot scores an evaluation keeps: a retry on another machine, pruning
        the same model again, scores only what no attempt had (hellaswag alone is an hour of a CPU)."""
        if self.directory is None:
            return
        archive = self.directory / ZERO_SHOT_SCORES_FILE
        copy_scores(scores_dir, archive)
        self.saved(archive)

    def restore_scores(self, scores_dir: Path) -> None:
        """The scores an earlier attempt copied of the model `scores_dir` is for, put there where they are more."""
        if self.directory is not None:
            restore_scores(self.directory / ZERO_SHOT_SCORES_FILE, scores_dir)

    def saved(self, path: Path) -> None:
        """`path`, in `directory`, was written whole."""
        if self.on_saved is not None:
            self.on_saved(path)


def load_dense(
    model: str,
    revision: str | None,
    plan: JobPlan,
    run: Run,
    token: str | None,
    device: torch.device,
    cache_dir: Path,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """The dense model, its tokenizer and its dtype's name, with what `plan` could not check without the weights:
    that llama.cpp reproduces the tokenizer of a GGUF export, and the rounding's warnings. A GGUF source is
    dequantized into `cache_dir` the first time (minutes for a large file: said in the events)."""
    run.report("load", 0.0, f"loading {public_name(model)}")
    if is_gguf_reference(model):
        run.report("load", 0.0, f"reading {public_name(model)} (dequantized once per file and dtype, then cached)")
    settings = plan.settings
    dense, tokenizer = load_model(
        model, revision=revision, dtype=settings.dtype, token=token, device=device, cache_dir=cache_dir
    )
    if settings.exports_gguf:
        check_gguf_tokenizer(model, dense, tokenizer)
    assert plan.prune is not None, "a single ratio's plan"
    warn_rounding(dense, plan.prune.allocation, run)
    return dense, tokenizer, str(dense.dtype).removeprefix("torch.")


def check_gguf_tokenizer(model: str, dense: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuses, before any work, a tokenizer llama.cpp cannot reproduce: the GGUF file's tokenizer is otherwise
    read at export, after the prune. A GGUF source passes: its file's own tokenizer keys are written unchanged."""
    if not is_gguf_reference(model):
        embedding_rows = dense.get_input_embeddings().weight.shape[0]
        vocabulary_of(tokenizer, embedding_rows, Path(tokenizer.name_or_path))


def warn_rounding(dense: PreTrainedModel, allocation: AllocationPlan, run: Run) -> None:
    """Warns of a rounding that forfeits the speedup or forces fallback types on the loaded model's widths (once per
    warning)."""
    widths = [projections(layer).down.in_features for layer in decoder_layers(dense)]
    for warning in (
        speed_warning(widths, allocation.round_to),
        fallback_warning(widths, allocation.round_to, allocation.gguf_type, allocation.block),
    ):
        if warning and warning not in run.warnings:
            run.warn(warning)


def read_inputs(
    tokenizer: PreTrainedTokenizerBase,
    calibration: CalibrationPlan | None,
    evaluation: EvaluationPlan,
    recovery: RecoveryPlan | None,
    run: Run,
) -> Inputs:
    """The calibration windows (none where `calibration` is None: resuming after pruning), the evaluation texts and
    recovery's data."""
    run.report("calibration", 0.0, "loading calibration and evaluation text")
    windows = None if calibration is None else calibration_windows(tokenizer, calibration)
    training = None if recovery is None else recovery.training_data(tokenizer)
    return Inputs(windows, evaluation.with_texts(tokenizer), training)


def save_checkpoint(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    source: str,
    revision: str | None,
    artifacts: ArtifactsPlan,
    run: Run,
    staging: Path,
) -> list[GgufExport]:
    """The checkpoint, with where it came from in its config, and the exports asked for."""
    with run.stage("checkpoint"):
        run.report("checkpoint", 0.0, "writing the checkpoint")
        model.config.casp = {
            "source_model": public_name(source),
            "base_model": base_model_of(source),
            "revision": revision,
            "settings": artifacts.recorded_settings,
        }
        save_pruned(model, tokenizer, staging)
        if is_gguf_reference(source):  # its GGUF exports keep the tokenizer llama.cpp served from the source
            keep_source_vocabulary(Path(source).expanduser(), staging)
    if not artifacts.export:
        return []
    with run.stage("export"):
        run.report("checkpoint", 1.0, f"exporting {', '.join(artifacts.export)}")
        return export_checkpoint(staging, list(artifacts.export), artifacts.gguf_type)


def checkpoint_perplexity(
    evaluation: dict[str, Any], published: str, quantized: QuantizedCheckpoint | None
) -> dict[str, float]:
    """The transformers perplexity of the checkpoint as written: the `published` side's, or that of the quantized
    checkpoint that replaced it."""
    if quantized is not None:
        return dict(quantized.perplexity)
    return {name: entry[published] for name, entry in evaluation["perplexity"].items()}


def write_job_report(
    model: str,
    config: PruneConfig,
    pruned: Pruned,
    evaluation: dict[str, Any],
    recovery: RecoveryResult | None,
    exports: list[GgufExport],
    quantized: QuantizedCheckpoint | None,
    artifacts: dict[str, Any],
    run: Run,
    *,
    device: str,
    dtype: str,
    out: Path,
    cache_dir: Path,
    frontier: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """report.json, report.md, the plots and the model card in `out`; returns the report written. A quantized
    checkpoint's perplexity goes beside the unquantized model's, as `quantized` in each perplexity entry. A sweep's
    model was picked from the candidates of `frontier` (casp_core.job.sweep.run), which the report and the card show."""
    report = build_report(
        model_name=public_name(model),
        config=config,
        # The stages this attempt ran, over those of the attempt that saved the snapshot it resumed from (if any).
        pruning={**pruned.pruning, "timings": {**pruned.pruning["timings"], **run.timer.stages}},
        perplexity=evaluation.pop("perplexity"),
        evaluation=evaluation,
        device=device,
        dtype=dtype,
        source=source.summary() if (source := gguf_source_for(model, dtype, cache_dir)) else None,
    )
    if recovery is not None:
        report["recovery"] = {
            **recovery.summary(),
            "adapter": ADAPTER_DIR if config.recovery.method == "lora" else None,
        }
    report["warnings"] = list(run.warnings)
    if exports:
        report["exports"] = [{**export.summary(), "path": export.path.name} for export in exports]
    if quantized is not None:
        report["quantization"] = quantized.summary()
        for name, entry in report["perplexity"].items():
            entry["quantized"] = quantized.perplexity[name]
    report["artifacts"] = artifacts
    if frontier is not None:
        report["frontier"] = frontier
    report["plots"] = [str(path.relative_to(out)) for path in write_plots(report, out)]
    report = without_local_paths(report)
    write_report(report, out)
    write_model_card(out, report, base_model=base_model_of(model), exported=[export.path.name for export in exports])
    return report
