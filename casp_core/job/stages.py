"""The stages a job reports, declared once: each one's name (what `run.report` names it, the worker's progress bar
and the console show), its share of the job's progress, the timers its time is counted under (what `run.stage`
names, report.md's "Time and memory by stage") and when it runs.

A single-ratio job reports `SINGLE_RATIO` in order, less the stages its settings skip; a job with a target reports
`SWEEP`, and each of its candidates goes through `CANDIDATE_STAGES` within the sweep's share. "evaluation" comes up
to three times: the dense model (and the teacher's logits), the pruned model before recovery, and the model
published. A name reported that is no stage here ("placement", "temperature") stays within the current stage.
"""

from collections.abc import Callable
from dataclasses import dataclass

from casp_core.settings import NO_QUANTIZATION, PruneConfig


def always(settings: PruneConfig) -> bool:
    return True


def with_recovery(settings: PruneConfig) -> bool:
    return settings.recovery.enabled


def with_quantization(settings: PruneConfig) -> bool:
    return settings.quantization != NO_QUANTIZATION


@dataclass(frozen=True)
class Stage:
    name: str
    weight: int  # its share of the progress, against the other stages the job reports
    timers: tuple[str, ...] = ()
    runs: Callable[[PruneConfig], bool] = always


LOAD = Stage("load", 5, ("load",))
CALIBRATION = Stage("calibration", 5, ("calibration_data",))  # reading the texts: calibration, evaluation, recovery
DENSE_EVALUATION = Stage("evaluation", 10, ("evaluation_dense", "teacher"))
CHECKPOINT = Stage("checkpoint", 5, ("checkpoint", "export"))
REPORT = Stage("report", 2)

SINGLE_RATIO = (
    LOAD,
    CALIBRATION,
    DENSE_EVALUATION,
    Stage("allocation", 20, ("allocation",)),
    Stage("pruning", 35, ("calibration_forward", "statistics", "solver", "compensation")),
    Stage("verification", 3, ("surgery", "verification")),
    Stage("evaluation", 10, ("evaluation_pruned",), runs=with_recovery),
    Stage("recovery", 30, ("recovery",), runs=with_recovery),
    CHECKPOINT,
    Stage("evaluation", 10, ("evaluation_pruned", "evaluation_recovered", "evaluation_gguf")),
    Stage("quantization", 5, ("quantization",), runs=with_quantization),
    REPORT,
)

# "dense_points": the dense model written and measured in each candidate format; "sweep": every candidate in turn
# (pruned, written, measured); "checkpoint": the pick's files as a single-ratio job writes them.
DENSE_POINTS = Stage("dense_points", 5, ("dense_points",))
SWEEP_STAGE = Stage("sweep", 60, ("sweep",))
SWEEP = (LOAD, CALIBRATION, DENSE_EVALUATION, DENSE_POINTS, SWEEP_STAGE, CHECKPOINT, REPORT)

# How a candidate's work divides its share of the sweep's progress: the single-ratio stages it goes through, in
# order (recovery never runs in a sweep).
CANDIDATE_STAGES = ("allocation", "pruning", "verification", "checkpoint", "evaluation", "quantization")


def job_stages(settings: PruneConfig) -> tuple[Stage, ...]:
    """The stages a job of `settings` reports, in order."""
    if settings.is_sweep:
        return SWEEP
    return tuple(stage for stage in SINGLE_RATIO if stage.runs(settings))


def timer_names() -> set[str]:
    """Every timer a stage declares."""
    return {timer for stage in (*SINGLE_RATIO, *SWEEP) for timer in stage.timers}
