"""The stages a job reports, declared once (casp_core.job.stages): which a job's settings run, and the timers they
declare against every timer the code starts (`run.stage(...)`, read from the source)."""

import ast
from pathlib import Path

from casp_core.job import stages
from casp_core.job.stages import job_stages, timer_names
from casp_core.settings import PruneConfig, RecoveryConfig, TargetConfig

CASP_CORE = Path(stages.__file__).resolve().parents[1]


def names(settings: PruneConfig) -> list[str]:
    return [stage.name for stage in job_stages(settings)]


def test_a_job_reports_the_stages_its_settings_run_in_order() -> None:
    plain = ["load", "calibration", "evaluation", "allocation", "pruning", "verification", "checkpoint"]
    assert names(PruneConfig(ratio=0.3)) == [*plain, "evaluation", "report"]
    assert names(PruneConfig(ratio=0.3, quantization="w4a16")) == [*plain, "evaluation", "quantization", "report"]
    recovered = names(PruneConfig(ratio=0.3, recovery=RecoveryConfig(method="lora")))
    assert recovered == [*plain[:6], "evaluation", "recovery", "checkpoint", "evaluation", "report"]
    sweep = PruneConfig(ratio=None, target=TargetConfig(max_bytes=10**6))
    assert names(sweep) == ["load", "calibration", "evaluation", "dense_points", "sweep", "checkpoint", "report"]


def literal_names(node: ast.expr, constants: dict[str, str]) -> set[str]:
    """The timer names an argument of `run.stage` can take: string literals (both arms of a conditional), a
    module constant, or a stage of casp_core.job.stages by its `.name`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return literal_names(node.body, constants) | literal_names(node.orelse, constants)
    if isinstance(node, ast.Name) and node.id in constants:
        return {constants[node.id]}
    if isinstance(node, ast.Attribute) and node.attr == "name" and isinstance(node.value, ast.Name):
        return {getattr(stages, node.value.id).name}
    return set()


def timers_started_in_code() -> set[str]:
    found: set[str] = set()
    for path in CASP_CORE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        constants = {
            target.id: node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            if isinstance(node.value.value, str)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "stage":
                found |= literal_names(node.args[0], constants) if node.args else set()
    return found


def test_every_timer_the_code_starts_belongs_to_a_stage() -> None:
    started = timers_started_in_code()
    assert {"load", "statistics", "evaluation_dense", "sweep", "evaluation_recovered"} <= started  # the reader works
    assert started == timer_names()
