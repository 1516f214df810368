"""The whole job: load, evaluate the dense model, prune, save, evaluate the pruned model, report.

The command line and the service call `run_job`; `STAGES` is what it reports, in order, and the worker's
progress bar is built from it.
"""

import shutil
from pathlib import Path
from typing import Any

from casp_core.budget import check_reachable
from casp_core.calibration import calibration_windows
from casp_core.checkpoint import save_pruned
from casp_core.config import PruneConfig
from casp_core.errors import InvalidConfig
from casp_core.eval.evaluate import EvaluationPlan, evaluate, side_by_side
from casp_core.eval.perplexity import default_seq_len
from casp_core.export.gguf import export_checkpoint
from casp_core.model import check_model_reference, load_model, resolve_device
from casp_core.prune import prune
from casp_core.report.build import build_report, write_report
from casp_core.report.model_card import write_model_card
from casp_core.report.plots import write_plots
from casp_core.report.publish import base_model_of, public_name, without_local_paths
from casp_core.run import Run

# The stages run_job reports progress under, in order. "calibration" is reading the texts (calibration and
# evaluation); "evaluation" comes twice, for the dense and then the pruned model.
STAGES = (
    "load",
    "calibration",
    "evaluation",
    "allocation",
    "pruning",
    "verification",
    "checkpoint",
    "evaluation",
    "report",
)


def _prepare_output(out_dir: Path) -> Path:
    """Work goes to a staging directory renamed into place at the end: a crash never leaves a half checkpoint."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise InvalidConfig(f"out: {out_dir} exists and is not empty")
    staging = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def run_job(
    model: str, config: PruneConfig, out_dir: Path, run: Run | None = None, *, revision: str | None = None
) -> dict[str, Any]:
    """The whole job; `out_dir` ends up holding the checkpoint with its model card (README.md), report.json and
    report.md, or nothing. Nothing written there names a local path other than by its last part, and the
    report returned is the one written."""
    config.validate()
    check_model_reference(model)
    run = run or Run()
    out_dir = Path(out_dir)
    staging = _prepare_output(out_dir)
    try:
        device = resolve_device(config.device)
        run.time_on(device)
        with run.stage("load"):
            run.report("load", 0.0, f"loading {model}")
            dense, tokenizer = load_model(model, revision=revision, dtype=config.dtype)
            check_reachable(dense, config)
            dtype = str(dense.dtype).removeprefix("torch.")
        with run.stage("calibration_data"):
            # Every input is read before the long work starts, so a missing file fails the job at once.
            run.report("calibration", 0.0, "loading calibration and evaluation text")
            windows = calibration_windows(dense, tokenizer, config)
            plan = EvaluationPlan.for_job(tokenizer, config, default_seq_len(dense))
        with run.stage("evaluation_dense"):
            dense_figures = evaluate(dense, tokenizer, plan, run)
        result = prune(dense, tokenizer, config, run, windows=windows, release_dense=True)
        del dense
        with run.stage("checkpoint"):
            run.report("checkpoint", 0.0, "writing the checkpoint")
            base_model = base_model_of(model)
            result.model.config.casp = {
                "source_model": public_name(model),
                "base_model": base_model,
                "revision": revision,
                "settings": without_local_paths(config.to_dict()),
            }
            save_pruned(result.model, tokenizer, staging)
        exports = []
        if config.export:
            with run.stage("export"):
                run.report("checkpoint", 1.0, f"exporting {', '.join(config.export)}")
                exports = export_checkpoint(staging, config.export, config.gguf_type)
        with run.stage("evaluation_pruned"):
            pruned_figures = evaluate(result.model, tokenizer, plan, run)
        run.report("report", 0.0, "writing the report")
        evaluation = side_by_side(dense_figures, pruned_figures, plan.texts)
        report = build_report(
            model_name=public_name(model),
            config=config,
            result=result,
            perplexity=evaluation.pop("perplexity"),
            evaluation=evaluation,
            device=str(device),
            dtype=dtype,
        )
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
