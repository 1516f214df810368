"""The whole job: load, evaluate the dense model, prune, [evaluate, recover,] save, evaluate the result, report.

The command line and the service call `run_job`; `STAGES` is what it reports, in order, and the worker's
progress bar is built from it; `job_stages` is the part of it one job reports.
"""

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from casp_core.budget import check_reachable
from casp_core.calibration import calibration_windows
from casp_core.checkpoint import load_pruned, save_pruned
from casp_core.config import PruneConfig, RecoveryConfig
from casp_core.errors import InvalidConfig
from casp_core.eval.evaluate import EvaluationPlan, evaluate, side_by_side
from casp_core.eval.perplexity import default_seq_len
from casp_core.export.gguf import export_checkpoint
from casp_core.model import check_model_reference, decoder_layers, load_model, resolve_device
from casp_core.placement import choose_placement
from casp_core.prune import prune
from casp_core.pruned_snapshot import PrunedSnapshot, load_snapshot, save_snapshot, snapshot_fingerprint
from casp_core.recovery import ADAPTER_DIR, recover
from casp_core.recovery_data import load_training_data
from casp_core.report.build import build_report, pruning_section, write_report
from casp_core.report.model_card import write_model_card
from casp_core.report.plots import RECOVERY_CURVE, plot_recovery_curve, write_plots
from casp_core.report.publish import base_model_of, public_name, without_local_paths
from casp_core.rounding import speed_warning
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
    "report",
)
RECOVERY_STAGES = (6, 7)  # the indices in STAGES of the stages only a job with recovery reports


def job_stages(config: PruneConfig) -> tuple[str, ...]:
    """The stages run_job reports for `config`, in order."""
    if config.recovery.method != "none":
        return STAGES
    return tuple(stage for index, stage in enumerate(STAGES) if index not in RECOVERY_STAGES)


def _prepare_output(out_dir: Path) -> Path:
    """Work goes to a staging directory renamed into place at the end: a crash never leaves a half checkpoint."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise InvalidConfig(f"out: {out_dir} exists and is not empty")
    staging = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def run_job(
    model: str,
    config: PruneConfig,
    out_dir: Path,
    run: Run | None = None,
    *,
    revision: str | None = None,
    recovery_state: Path | None = None,
    on_recovery_state_saved: Callable[[Path], None] | None = None,
) -> dict[str, Any]:
    """The whole job; `out_dir` ends up holding the checkpoint with its model card (README.md), report.json and
    report.md, or nothing. Nothing written there names a local path other than by its last part, and the
    report returned is the one written. `recovery_state` is where a job with recovery saves its pruned model (a
    `pruned_snapshot`, after the pruned model's evaluation) and the recovery stage its training state, and where a
    retry resumes from both; `on_recovery_state_saved` is called with the path of each save (see `recover`)."""
    config.validate()
    check_model_reference(model)
    run = run or Run()
    out_dir = Path(out_dir)
    staging = _prepare_output(out_dir)
    try:
        device = resolve_device(config.device)
        run.time_on(device)
        # A job with recovery saves its pruned model before recovering it, and a retry resumes from that.
        snapshot_dir = recovery_state if config.recovery.method != "none" else None
        fingerprint = snapshot_fingerprint(model, revision, config)
        with run.stage("load"):
            snapshot = load_snapshot(snapshot_dir, fingerprint) if snapshot_dir is not None else None
            if snapshot is None:
                run.report("load", 0.0, f"loading {model}")
                dense, tokenizer = load_model(model, revision=revision, dtype=config.dtype)
                check_reachable(dense, config)
                # Refused here when even one layer cannot fit on the device, before hours of evaluation.
                placement = choose_placement(dense, config, device)
                warning = speed_warning(
                    [layer.mlp.down_proj.in_features for layer in decoder_layers(dense)], config.round_to
                )
                if warning:
                    run.warn(warning)
                dtype = str(dense.dtype).removeprefix("torch.")
                loaded = dense
            else:
                run.report("load", 1.0, f"resumed after pruning (snapshot saved {snapshot.saved_at})")
                for warning in snapshot.warnings:
                    run.warn(warning)
                loaded, tokenizer, dtype = snapshot.model, snapshot.tokenizer, snapshot.dtype
        with run.stage("calibration_data"):
            # Every input is read before the long work starts, so a missing file fails the job at once.
            run.report("calibration", 0.0, "loading calibration and evaluation text")
            if snapshot is None:
                windows = calibration_windows(dense, tokenizer, config)
            plan = EvaluationPlan.for_job(tokenizer, config, default_seq_len(loaded))
            training = None
            if config.recovery.method == "lora":
                training = load_training_data(
                    config.recovery.dataset,
                    tokenizer,
                    max_seq_len=config.recovery.max_seq_len,
                    context=loaded.config.max_position_embeddings,
                    datasets_dir=config.datasets_dir,
                )
        del loaded
        if snapshot is None:
            with run.stage("evaluation_dense"):
                dense_figures = evaluate(dense, tokenizer, plan, run)
            result = prune(dense, tokenizer, config, run, windows=windows, release_dense=True, placement=placement)
            del dense
            pruned, pruning, pruned_figures = result.model, pruning_section(result), None
            del result
        else:
            pruned, pruning = snapshot.model, snapshot.pruning
            dense_figures, pruned_figures = snapshot.dense_figures, snapshot.pruned_figures
            del snapshot
        recovery = None
        if training is not None:
            if pruned_figures is None:
                with run.stage("evaluation_pruned"):
                    pruned_figures = evaluate(pruned, tokenizer, plan, run)
                if snapshot_dir is not None:
                    saved = PrunedSnapshot(
                        pruned, tokenizer, dense_figures, pruned_figures, pruning, dtype, list(run.warnings)
                    )
                    path = save_snapshot(snapshot_dir, fingerprint, saved)
                    if on_recovery_state_saved is not None:
                        on_recovery_state_saved(path)
            with run.stage("recovery"):
                run.report("recovery", 0.0, f"LoRA on {config.recovery.dataset}: {len(training):,} sequences")
                pruned, recovery = recover(
                    pruned,
                    tokenizer,
                    training,
                    config.recovery,
                    run,
                    device=config.device,
                    state_dir=recovery_state,
                    on_state_saved=on_recovery_state_saved,
                    adapter_dir=staging / ADAPTER_DIR,
                )
        with run.stage("checkpoint"):
            run.report("checkpoint", 0.0, "writing the checkpoint")
            base_model = base_model_of(model)
            pruned.config.casp = {
                "source_model": public_name(model),
                "base_model": base_model,
                "revision": revision,
                "settings": without_local_paths(config.to_dict()),
            }
            save_pruned(pruned, tokenizer, staging)
        exports = []
        if config.export:
            with run.stage("export"):
                run.report("checkpoint", 1.0, f"exporting {', '.join(config.export)}")
                exports = export_checkpoint(staging, config.export, config.gguf_type)
        if recovery is None:
            with run.stage("evaluation_pruned"):
                pruned_figures = evaluate(pruned, tokenizer, plan, run)
        else:
            with run.stage("evaluation_recovered"):
                recovered_figures = evaluate(pruned, tokenizer, plan, run)
        run.report("report", 0.0, "writing the report")
        evaluation = side_by_side(dense_figures, pruned_figures, plan.texts)
        if recovery is not None:
            for name, entry in evaluation["perplexity"].items():
                entry["recovered"] = recovered_figures.perplexity[name]
            if "zero_shot" in evaluation:
                evaluation["zero_shot"]["recovered"] = recovered_figures.zero_shot
        report = build_report(
            model_name=public_name(model),
            config=config,
            # The stages this attempt ran, over those of the attempt that saved the snapshot it resumed from (if any).
            pruning={**pruning, "timings": {**pruning["timings"], **run.timer.stages}},
            perplexity=evaluation.pop("perplexity"),
            evaluation=evaluation,
            device=str(device),
            dtype=dtype,
        )
        if recovery is not None:
            report["recovery"] = {**recovery.summary(), "adapter": ADAPTER_DIR}
        report["warnings"] = list(run.warnings)
        if exports:
            report["exports"] = [{**export.summary(), "path": export.path.name} for export in exports]
        report["plots"] = [str(path.relative_to(staging)) for path in write_plots(report, staging)]
        report = without_local_paths(report)
        write_report(report, staging)
        write_model_card(staging, report, base_model=base_model, exported=[export.path.name for export in exports])
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
        run.report("report", 1.0, f"written to {out_dir}")
        return report
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
    staging = _prepare_output(out_dir)
    try:
        run.time_on(resolve_device(device))
        with run.stage("load"):
            run.report("load", 0.0, f"loading {checkpoint}")
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
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
        run.report("checkpoint", 1.0, f"written to {out_dir}")
        return summary
    finally:
        shutil.rmtree(staging, ignore_errors=True)
