"""The whole job: load, evaluate the dense model, prune, [evaluate, recover,] save, evaluate the result, [quantize,]
report; or, for a job with a target instead of a ratio, the sweep (casp_core.job.sweep.run).

The command line and the service call `run_job`; what it reports, in order, is casp_core.job.stages' (the worker's
progress bar is built from it). The steps both kinds of job share are in casp_core.job.steps.
"""

import json
import shutil
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core.artifacts.caches import default_cache_dir
from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.artifacts.compressed_tensors.quantize import QuantizationInput, quantize
from casp_core.artifacts.dense_cache import evaluate_dense
from casp_core.artifacts.gguf.engine import artifact_table, measure_exports
from casp_core.artifacts.gguf.types import require_llama_cpp
from casp_core.artifacts.snapshot import PrunedSnapshot, snapshot_fingerprint
from casp_core.eval.evaluate import EvaluationPlan, evaluate, side_by_side
from casp_core.job.plan import JobPlan, plan_job
from casp_core.job.steps import (
    Inputs,
    Pruned,
    RetryState,
    checkpoint_perplexity,
    load_dense,
    read_inputs,
    save_checkpoint,
    staged_output,
    write_job_report,
)
from casp_core.job.sweep.run import run_sweep
from casp_core.method.placement import Placement, check_recovery_fits, choose_placement
from casp_core.method.prune import PrunePlan, prune_as_planned
from casp_core.model import load_config, resolve_device
from casp_core.recovery.data import RecoveryPlan, TrainingData, load_training_data
from casp_core.recovery.teacher import TeacherCache, compute_teacher, load_teacher, needs_teacher, teacher_fingerprint
from casp_core.recovery.train import ADAPTER_DIR, RecoveryResult, recover
from casp_core.report.build import pruning_section
from casp_core.report.plots import RECOVERY_CURVE, plot_recovery_curve
from casp_core.report.publish import public_name
from casp_core.rounding import quantizer_block
from casp_core.run import Run
from casp_core.settings import PruneConfig, RecoveryConfig

# Where the teacher cache goes when the job keeps no retry state (the command line): inside the staging folder,
# removed once recovery has used it.
TEACHER_WORK = ".teacher"


def run_job(
    model: str,
    config: PruneConfig,
    out_dir: Path,
    run: Run | None = None,
    *,
    revision: str | None = None,
    retry_state: Path | None = None,
    on_retry_state_saved: Callable[[Path], None] | None = None,
    token: str | None = None,
    cache_dir: Path | None = None,
) -> dict[str, Any]:
    """The whole job; `out_dir` ends up holding the checkpoint with its model card (README.md), report.json and
    report.md, or nothing. Nothing written there names a local path other than by its last part, and the
    report returned is the one written. `retry_state` is where a job keeps what a retry resumes from, and where a
    retry finds it: with recovery, its pruned model (a `pruned_snapshot`, after the pruned model's evaluation) and
    the recovery stage's training state; in a sweep, the candidates measured so far and the best one's model; with
    zero-shot tasks, the log-likelihoods scored so far.
    `on_retry_state_saved` is called with the path of each save (see `recover`). `token`: a Hugging Face token for
    a private repository; it reaches the loader alone, nothing written or reported. `cache_dir` keeps what is
    worked out once per model (casp_core.artifacts.caches; default `$CASP_CACHE_DIR`, else ~/.cache/casp): a GGUF
    source's dequantized folder, the dense model's evaluation."""
    config.validate()
    cache_dir = cache_dir or default_cache_dir()
    # The settings checked against the model's config before any weight loads, as the API and the command line
    # check them; a retry plans again, so that one resuming after pruning has its plan too.
    plan = plan_job(config, load_config(model, revision=revision, token=token))
    if quantizer_block(config):
        require_llama_cpp()
    run = run or Run()
    out_dir = Path(out_dir)
    retry = RetryState(
        retry_state if config.keeps_retry_state else None,
        snapshot_fingerprint(model, revision, config),
        on_retry_state_saved,
    )
    # A retry, or the same job again, on this machine scores only the zero-shot requests an earlier attempt had not;
    # on another machine, those the retry state's copies do not hold.
    plan = replace(plan, evaluation=plan.evaluation.keeping_scores(cache_dir, retry if retry.directory else None))
    if config.is_sweep:
        return run_sweep(model, plan, out_dir, run, retry, revision=revision, token=token, cache_dir=cache_dir)
    assert plan.prune is not None, "a single ratio's plan"
    prune_plan = plan.prune
    with staged_output(out_dir) as staging:
        device = resolve_device(config.device)
        run.time_on(device)
        recovery_memory = None
        with run.stage("load"):
            snapshot = retry.pruned_snapshot()
            if snapshot is None:
                dense, tokenizer, dtype = load_dense(model, revision, plan, run, token, device, cache_dir)
                # Refused here when even one layer cannot fit on the device, or recovery would not, before hours
                # of evaluation and pruning.
                placement = choose_placement(dense, prune_plan.placement, device)
                if plan.recovery is not None:
                    recovery_memory = check_recovery_fits(
                        dense, plan.recovery.settings, prune_plan.allocation.ratio, prune_plan.placement, device
                    )
            else:
                run.report("load", 1.0, f"resumed after pruning (snapshot saved {snapshot.saved_at})")
                for warning in snapshot.warnings:
                    run.warn(warning)
                tokenizer, dtype = snapshot.tokenizer, snapshot.dtype
        with run.stage("calibration_data"):
            calibration = prune_plan.calibration if snapshot is None else None
            inputs = read_inputs(tokenizer, calibration, plan.evaluation, plan.recovery, run)
        teacher = None
        if plan.recovery is not None and needs_teacher(plan.recovery.settings):
            # Before pruning frees the dense model; a retry after pruning finds the cache, or loads the dense one.
            teacher = teacher_for(
                model,
                revision,
                plan,
                inputs.training,
                dense if snapshot is None else None,
                run,
                retry,
                staging,
                token,
                device,
                cache_dir,
            )
        if snapshot is None:
            pruned = prune_dense(dense, tokenizer, inputs, prune_plan, run, placement, cache_dir)
            del dense  # its decoder layers were released while pruning; the rest goes now
        else:
            pruned = Pruned(snapshot.model, snapshot.pruning, snapshot.dense_figures, snapshot.pruned_figures)
            del snapshot
        recovery = None
        if plan.recovery is not None:
            assert inputs.training is not None, "read with the recovery's plan"
            recovery = recover_pruned(
                pruned, tokenizer, inputs.training, inputs.plan, plan.recovery, run, retry, dtype, staging, teacher
            )
            shutil.rmtree(staging / TEACHER_WORK, ignore_errors=True)
            if recovery_memory is not None:
                recovery.memory_estimate = recovery_memory.summary()
        exports = save_checkpoint(pruned.model, tokenizer, model, revision, plan.artifacts, run, staging)
        evaluation = evaluate_published(pruned, tokenizer, inputs.plan, run)
        with run.stage("evaluation_gguf") if exports else nullcontext():  # timed only when there is work
            engine_figures = measure_exports(exports, inputs.plan.texts, run)
        quantized = None
        if plan.artifacts.quantization is not None:
            with run.stage("quantization"):
                quantized = quantize(
                    QuantizationInput(pruned.model, tokenizer, staging, plan.artifacts.quantization, inputs.plan), run
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
            cache_dir=cache_dir,
        )
    run.report("report", 1.0, "report.json, report.md and the model card written")
    return report


def teacher_for(
    model: str,
    revision: str | None,
    plan: JobPlan,
    training: TrainingData,
    dense: PreTrainedModel | None,
    run: Run,
    retry: RetryState,
    staging: Path,
    token: str | None,
    device: torch.device,
    cache_dir: Path,
) -> TeacherCache:
    """The distillation teacher's cache over the recovery data: the one a previous attempt kept, else computed
    with `dense` (or, on a retry that resumed after pruning without it, with the dense model loaded again)."""
    assert plan.recovery is not None, "only a job that recovers has a teacher"
    recovery = plan.recovery.settings
    directory = retry.directory or staging / TEACHER_WORK
    source = {"model": model, "revision": revision, "dtype": plan.settings.dtype}
    fingerprint = teacher_fingerprint(source, training, recovery)
    cached = load_teacher(directory, fingerprint)
    if cached is not None:
        run.report("evaluation", 1.0, f"teacher: the cache {cached.path.name} kept by an earlier attempt")
        return cached
    with run.stage("teacher"):
        if dense is None:
            dense = load_dense(model, revision, plan, run, token, device, cache_dir)[0]
        cache = compute_teacher(dense, training, recovery, directory, fingerprint, run, device=plan.recovery.device)
    retry.saved(cache.path)
    return cache


def prune_dense(
    dense: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    inputs: Inputs,
    plan: PrunePlan,
    run: Run,
    placement: Placement,
    cache_dir: Path,
) -> Pruned:
    """The dense model's evaluation (an earlier job's, kept in `cache_dir`, when one matches), then pruning as
    `plan` says; `dense` loses its decoder layers' weights on the way."""
    dense_figures = evaluate_dense(dense, tokenizer, inputs.plan, run, cache_dir)
    result = prune_as_planned(
        dense, tokenizer, plan, run, windows=inputs.windows, release_dense=True, placement=placement
    )
    return Pruned(result.model, pruning_section(result), dense_figures, None)


def recover_pruned(
    pruned: Pruned,
    tokenizer: PreTrainedTokenizerBase,
    training: TrainingData,
    plan: EvaluationPlan,
    recovery_plan: RecoveryPlan,
    run: Run,
    retry: RetryState,
    dtype: str,
    staging: Path,
    teacher: TeacherCache | None,
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
        settings = recovery_plan.settings
        what = f"{settings.method}, {settings.loss}"
        run.report("recovery", 0.0, f"{what} on {settings.dataset}: {len(training):,} sequences")
        pruned.model, recovery = recover(
            pruned.model,
            tokenizer,
            training,
            settings,
            run,
            device=recovery_plan.device,
            state_dir=retry.directory,
            on_state_saved=retry.on_saved,
            adapter_dir=staging / ADAPTER_DIR if settings.method == "lora" else None,
            teacher=teacher,
        )
    return recovery


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


def recover_checkpoint(
    checkpoint: Path,
    config: RecoveryConfig,
    out_dir: Path,
    run: Run | None = None,
    *,
    datasets_dir: str | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """`casp recover`: a saved checkpoint recovered into a new one in `out_dir` (the trained weights, `adapter/`
    with LoRA, recovery.json, the loss curve), or nothing."""
    lora = config.method == "lora"
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
                model,
                tokenizer,
                training,
                config,
                run,
                device=device,
                adapter_dir=staging / ADAPTER_DIR if lora else None,
            )
        with run.stage("checkpoint"):
            run.report("checkpoint", 0.0, "writing the checkpoint")
            model.config.casp = {**(getattr(model.config, "casp", None) or {}), "recovery": config.to_dict()}
            save_pruned(model, tokenizer, staging)
        summary = {"checkpoint": str(checkpoint), **recovery.summary(), "adapter": ADAPTER_DIR if lora else None}
        summary["plots"] = [str(plot_recovery_curve(recovery.curve, staging / RECOVERY_CURVE).relative_to(staging))]
        summary["timings"] = run.timer.stages
        (staging / "recovery.json").write_text(json.dumps(summary, indent=2) + "\n")
    run.report("checkpoint", 1.0, "the recovered checkpoint written")
    return summary
