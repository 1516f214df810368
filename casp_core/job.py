"""The whole job: load, evaluate the dense model, prune, [evaluate, recover,] save, evaluate the result, [quantize,]
report.

The command line and the service call `run_job`; `STAGES` is what it reports, in order, and the worker's
progress bar is built from it; `job_stages` is the part of it one job reports.
"""

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core.budget import check_reachable
from casp_core.calibration import calibration_windows
from casp_core.checkpoint import load_pruned, save_pruned
from casp_core.config import PruneConfig, RecoveryConfig
from casp_core.errors import InvalidConfig
from casp_core.eval.engine import artifact_table, measure_exports
from casp_core.eval.evaluate import EvaluationPlan, Figures, evaluate, side_by_side
from casp_core.eval.perplexity import default_seq_len
from casp_core.export.gguf import GgufExport, export_checkpoint
from casp_core.export.gguf_types import check_gguf_type, quantizer_block, require_llama_cpp
from casp_core.model import check_model_reference, decoder_layers, load_model, resolve_device
from casp_core.placement import Placement, choose_placement
from casp_core.prune import prune
from casp_core.pruned_snapshot import PrunedSnapshot, load_snapshot, save_snapshot, snapshot_fingerprint
from casp_core.quantization import NO_QUANTIZATION, QuantizationInput, QuantizedCheckpoint, check_quantization, quantize
from casp_core.recovery import ADAPTER_DIR, RecoveryResult, recover
from casp_core.recovery_data import TrainingData, load_training_data
from casp_core.report.build import build_report, pruning_section, write_report
from casp_core.report.model_card import write_model_card
from casp_core.report.plots import RECOVERY_CURVE, plot_recovery_curve, write_plots
from casp_core.report.publish import base_model_of, public_name, without_local_paths
from casp_core.rounding import fallback_warning, speed_warning
from casp_core.run import Run

# The stages run_job reports progress under, in order. "calibration" is reading the texts (calibration,
# evaluation and recovery data); "evaluation" comes for the dense model, then (with recovery) for the pruned model
# before it is recovered, then for the model that is published.
STAGES = (
    "load",
    "calibration",
    "evaluation",
    "allocation",
    "pruning",
    "verification",
    "evaluation",
    "recovery",
    "checkpoint",
    "evaluation",
    "quantization",
    "report",
)
RECOVERY_STAGES = (6, 7)  # the indices in STAGES of the stages only a job with recovery reports
QUANTIZATION_STAGE = 10  # the index in STAGES of the stage only a job with quantization reports


def job_stages(config: PruneConfig) -> tuple[str, ...]:
    """The stages run_job reports for `config`, in order."""
    skipped = set() if config.recovery.method != "none" else set(RECOVERY_STAGES)
    if config.quantization == NO_QUANTIZATION:
        skipped.add(QUANTIZATION_STAGE)
    return tuple(stage for index, stage in enumerate(STAGES) if index not in skipped)


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


@dataclass
class RetryState:
    """Where a job with recovery keeps what a retry resumes from: the pruned model (a `pruned_snapshot`, saved
    after the pruned model's evaluation) and recovery's training state. `on_saved` is called with each saved path."""

    directory: Path | None  # None: the job keeps nothing (no recovery, or no place given)
    fingerprint: dict[str, Any]  # what a snapshot must match to be used
    on_saved: Callable[[Path], None] | None

    def pruned_snapshot(self) -> PrunedSnapshot | None:
        return load_snapshot(self.directory, self.fingerprint) if self.directory is not None else None

    def keep_pruned(self, snapshot: PrunedSnapshot) -> None:
        if self.directory is None:
            return
        path = save_snapshot(self.directory, self.fingerprint, snapshot)
        if self.on_saved is not None:
            self.on_saved(path)


def run_job(
    model: str,
    config: PruneConfig,
    out_dir: Path,
    run: Run | None = None,
    *,
    revision: str | None = None,
    recovery_state: Path | None = None,
    on_recovery_state_saved: Callable[[Path], None] | None = None,
    token: str | None = None,
) -> dict[str, Any]:
    """The whole job; `out_dir` ends up holding the checkpoint with its model card (README.md), report.json and
    report.md, or nothing. Nothing written there names a local path other than by its last part, and the
    report returned is the one written. `recovery_state` is where a job with recovery saves its pruned model (a
    `pruned_snapshot`, after the pruned model's evaluation) and the recovery stage its training state, and where a
    retry resumes from both; `on_recovery_state_saved` is called with the path of each save (see `recover`).
    `token`: a Hugging Face token for a private repository; it reaches the loader alone, nothing written or reported."""
    config.validate()
    check_model_reference(model)
    if quantizer_block(config):
        require_llama_cpp()
    run = run or Run()
    out_dir = Path(out_dir)
    retry = RetryState(
        recovery_state if config.recovery.method != "none" else None,
        snapshot_fingerprint(model, revision, config),
        on_recovery_state_saved,
    )
    with staged_output(out_dir) as staging:
        device = resolve_device(config.device)
        run.time_on(device)
        with run.stage("load"):
            snapshot = retry.pruned_snapshot()
            if snapshot is None:
                dense, tokenizer, dtype = load_dense(model, revision, config, run, token)
                # Refused here when even one layer cannot fit on the device, before hours of evaluation.
                placement = choose_placement(dense, config, device)
            else:
                run.report("load", 1.0, f"resumed after pruning (snapshot saved {snapshot.saved_at})")
                for warning in snapshot.warnings:
                    run.warn(warning)
                tokenizer, dtype = snapshot.tokenizer, snapshot.dtype
        with run.stage("calibration_data"):
            inputs = read_inputs(dense if snapshot is None else snapshot.model, tokenizer, config, run, snapshot)
        if snapshot is None:
            pruned = prune_dense(dense, tokenizer, inputs, config, run, placement)
            del dense  # its decoder layers were released while pruning; the rest goes now
        else:
            pruned = Pruned(snapshot.model, snapshot.pruning, snapshot.dense_figures, snapshot.pruned_figures)
            del snapshot
        recovery = None
        if inputs.training is not None:
            recovery = recover_pruned(
                pruned, tokenizer, inputs.training, inputs.plan, config, run, retry, dtype, staging
            )
        exports = save_checkpoint(pruned.model, tokenizer, model, revision, config, run, staging)
        evaluation = evaluate_published(pruned, tokenizer, inputs.plan, run)
        with run.stage("evaluation_gguf") if exports else nullcontext():  # timed only when there is work
            engine_figures = measure_exports(exports, inputs.plan.texts, run)
        quantized = None
        if config.quantization != NO_QUANTIZATION:
            with run.stage("quantization"):
                quantized = quantize(
                    QuantizationInput(pruned.model, tokenizer, staging, config.quantization, inputs.plan), run
                )
        published = "recovered" if recovery is not None else "pruned"
        artifacts = artifact_table(
            staging,
            checkpoint_perplexity(evaluation, published, quantized),
            exports,
            engine_figures,
            list(inputs.plan.texts),
        )
        run.report("report", 0.0, "writing the report")
        report = write_job_report(
            model,
            config,
            pruned,
            evaluation,
            recovery,
            exports,
            quantized,
            artifacts,
            run,
            device=str(device),
            dtype=dtype,
            out=staging,
        )
    run.report("report", 1.0, "report.json, report.md and the model card written")
    return report


def load_dense(
    model: str, revision: str | None, config: PruneConfig, run: Run, token: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """The dense model, its tokenizer and its dtype's name; the ratio and the GGUF type are checked before any work."""
    run.report("load", 0.0, f"loading {public_name(model)}")
    dense, tokenizer = load_model(model, revision=revision, dtype=config.dtype, token=token)
    if "gguf" in config.export:
        check_gguf_type(dense.config.hidden_size, config.gguf_type)
    check_reachable(dense, config)
    check_quantization(dense.config, config)
    widths = [layer.mlp.down_proj.in_features for layer in decoder_layers(dense)]
    for warning in (
        speed_warning(widths, config.round_to),
        fallback_warning(widths, config.round_to, config.gguf_type, quantizer_block(config)),
    ):
        if warning:
            run.warn(warning)
    return dense, tokenizer, str(dense.dtype).removeprefix("torch.")


def read_inputs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config: PruneConfig,
    run: Run,
    snapshot: PrunedSnapshot | None,
) -> Inputs:
    """The calibration windows (unless resuming from `snapshot`), the evaluation texts and recovery's data."""
    run.report("calibration", 0.0, "loading calibration and evaluation text")
    windows = calibration_windows(model, tokenizer, config) if snapshot is None else None
    plan = EvaluationPlan.for_job(tokenizer, config, default_seq_len(model))
    training = None
    if config.recovery.method == "lora":
        training = load_training_data(
            config.recovery.dataset,
            tokenizer,
            max_seq_len=config.recovery.max_seq_len,
            context=model.config.max_position_embeddings,
            datasets_dir=config.datasets_dir,
        )
    return Inputs(windows, plan, training)


def prune_dense(
    dense: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    inputs: Inputs,
    config: PruneConfig,
    run: Run,
    placement: Placement,
) -> Pruned:
    """The dense model's evaluation, then pruning; `dense` loses its decoder layers' weights on the way."""
    with run.stage("evaluation_dense"):
        dense_figures = evaluate(dense, tokenizer, inputs.plan, run)
    result = prune(dense, tokenizer, config, run, windows=inputs.windows, release_dense=True, placement=placement)
    return Pruned(result.model, pruning_section(result), dense_figures, None)


def recover_pruned(
    pruned: Pruned,
    tokenizer: PreTrainedTokenizerBase,
    training: TrainingData,
    plan: EvaluationPlan,
    config: PruneConfig,
    run: Run,
    retry: RetryState,
    dtype: str,
    staging: Path,
) -> RecoveryResult:
    """The pruned model's figures (unless a snapshot brought them) and the snapshot a retry resumes from, then
    recovery: `pruned.model` becomes the recovered model."""
    if pruned.pruned_figures is None:
        with run.stage("evaluation_pruned"):
            pruned.pruned_figures = evaluate(pruned.model, tokenizer, plan, run)
        retry.keep_pruned(
            PrunedSnapshot(
                pruned.model,
                tokenizer,
                pruned.dense_figures,
                pruned.pruned_figures,
                pruned.pruning,
                dtype,
                list(run.warnings),
            )
        )
    with run.stage("recovery"):
        run.report("recovery", 0.0, f"LoRA on {config.recovery.dataset}: {len(training):,} sequences")
        pruned.model, recovery = recover(
            pruned.model,
            tokenizer,
            training,
            config.recovery,
            run,
            device=config.device,
            state_dir=retry.directory,
            on_state_saved=retry.on_saved,
            adapter_dir=staging / ADAPTER_DIR,
        )
    return recovery


def save_checkpoint(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    source: str,
    revision: str | None,
    config: PruneConfig,
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
            "settings": without_local_paths(config.to_dict()),
        }
        save_pruned(model, tokenizer, staging)
    if not config.export:
        return []
    with run.stage("export"):
        run.report("checkpoint", 1.0, f"exporting {', '.join(config.export)}")
        return export_checkpoint(staging, config.export, config.gguf_type)


def evaluate_published(
    pruned: Pruned, tokenizer: PreTrainedTokenizerBase, plan: EvaluationPlan, run: Run
) -> dict[str, Any]:
    """The published model's figures beside the dense model's and, when it was recovered, the pruned model's
    (measured before recovery: `pruned.pruned_figures` is set exactly then)."""
    recovered = pruned.pruned_figures is not None
    with run.stage("evaluation_recovered" if recovered else "evaluation_pruned"):
        published = evaluate(pruned.model, tokenizer, plan, run)
    if pruned.pruned_figures is None:
        return side_by_side(pruned.dense_figures, published, plan.texts)
    evaluation = side_by_side(pruned.dense_figures, pruned.pruned_figures, plan.texts)
    for name, entry in evaluation["perplexity"].items():
        entry["recovered"] = published.perplexity[name]
    if "zero_shot" in evaluation:
        evaluation["zero_shot"]["recovered"] = published.zero_shot
    return evaluation


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
) -> dict[str, Any]:
    """report.json, report.md, the plots and the model card in `out`; returns the report written. A quantized
    checkpoint's perplexity goes beside the unquantized model's, as `quantized` in each perplexity entry."""
    report = build_report(
        model_name=public_name(model),
        config=config,
        # The stages this attempt ran, over those of the attempt that saved the snapshot it resumed from (if any).
        pruning={**pruned.pruning, "timings": {**pruned.pruning["timings"], **run.timer.stages}},
        perplexity=evaluation.pop("perplexity"),
        evaluation=evaluation,
        device=device,
        dtype=dtype,
    )
    if recovery is not None:
        report["recovery"] = {**recovery.summary(), "adapter": ADAPTER_DIR}
    report["warnings"] = list(run.warnings)
    if exports:
        report["exports"] = [{**export.summary(), "path": export.path.name} for export in exports]
    if quantized is not None:
        report["quantization"] = quantized.summary()
        for name, entry in report["perplexity"].items():
            entry["quantized"] = quantized.perplexity[name]
    report["artifacts"] = artifacts
    report["plots"] = [str(path.relative_to(out)) for path in write_plots(report, out)]
    report = without_local_paths(report)
    write_report(report, out)
    write_model_card(out, report, base_model=base_model_of(model), exported=[export.path.name for export in exports])
    return report


def recover_checkpoint(
    checkpoint: Path,
    config: RecoveryConfig,
    out_dir: Path,
    run: Run | None = None,
    *,
    datasets_dir: str | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """`casp recover`: a saved checkpoint recovered into a new one in `out_dir` (merged weights, `adapter/`,
    recovery.json, the loss curve), or nothing."""
    run = run or Run()
    out_dir = Path(out_dir)
    with staged_output(out_dir) as staging:
        run.time_on(resolve_device(device))
        with run.stage("load"):
            run.report("load", 0.0, f"loading {public_name(str(checkpoint))}")
            model, tokenizer = load_pruned(checkpoint)
        with run.stage("calibration_data"):
            run.report("calibration", 0.0, f"reading {config.dataset}")
            training = load_training_data(
                config.dataset,
                tokenizer,
                max_seq_len=config.max_seq_len,
                context=model.config.max_position_embeddings,
                datasets_dir=datasets_dir,
            )
        with run.stage("recovery"):
            model, recovery = recover(
                model, tokenizer, training, config, run, device=device, adapter_dir=staging / ADAPTER_DIR
            )
        with run.stage("checkpoint"):
            run.report("checkpoint", 0.0, "writing the checkpoint")
            model.config.casp = {**(getattr(model.config, "casp", None) or {}), "recovery": config.to_dict()}
            save_pruned(model, tokenizer, staging)
        summary = {"checkpoint": str(checkpoint), **recovery.summary(), "adapter": ADAPTER_DIR}
        summary["plots"] = [str(plot_recovery_curve(recovery.curve, staging / RECOVERY_CURVE).relative_to(staging))]
        summary["timings"] = run.timer.stages
        (staging / "recovery.json").write_text(json.dumps(summary, indent=2) + "\n")
    run.report("checkpoint", 1.0, "the recovered checkpoint written")
    return summary
