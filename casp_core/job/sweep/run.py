"""The sweep: a job with a target (a file size, a parameter count or a perplexity increase) instead of a ratio
tries several ratios in several formats, measures each, plots perplexity against size and hands back the best
candidate as a single-ratio job of that ratio and format would have written it.

`run_sweep`, step by step:

1. load the dense model; the candidates from the target before any statistics (`casp_core.job.plan.plan_sweep`), as
   units of work: one pruned model per ratio serves every variant (GGUF type or quantization scheme) whose widths
   round alike (a quantized GGUF type rounds the FFN widths to its block, as its single-ratio job would);
2. read the texts; evaluate the dense model in transformers (or reuse an earlier job's figures of it:
   casp_core.artifacts.dense_cache);
3. the dense reference points: the dense model written in each variant and measured;
4. each unit in turn (`shared_pass.prune_plans`: the work the units share computed once): the pruned model
   evaluated in transformers (perplexity, and the zero-shot tasks when asked), written to
   `candidates/ratio-0.30/`, each variant exported or quantized there and measured in its serving engine
   (llama.cpp for GGUF, transformers for safetensors); its points kept in the retry state, with the pruned model
   when it is the best so far, so that a retry resumes after the units already finished;
5. the Pareto front and the pick: the lowest perplexity within a bytes or parameters budget, or the smallest file
   whose perplexity rises by at most the target over the dense model's, among the pruned points and (with
   `target.candidates` "all", the default) the dense ones; `budget_unmet` when none qualifies once measured (the
   estimates that chose the candidates are close, not exact);
6. the pick's files written as its single-ratio job writes them (checkpoint, its one export, report, model card),
   with frontier.json and frontier.png; a dense pick is the dense model written alike, its report saying why in
   one sentence beside the best pruned point; the other candidates' folders removed unless keep is "all".

Perplexity, the front and the pick use the first evaluation text.
"""

import copy
import json
import math
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core.artifacts.compressed_tensors.quantize import (
    QuantizationInput,
    QuantizedCheckpoint,
    quantize,
    weight_bytes,
)
from casp_core.artifacts.dense_cache import evaluate_dense
from casp_core.artifacts.gguf.engine import (
    EngineFigures,
    artifact_table,
    engine_speed,
    gguf_perplexity,
    measure_exports,
)
from casp_core.artifacts.gguf.types import require_llama_cpp
from casp_core.artifacts.gguf.writer import GgufExport, export_gguf, gguf_file_name
from casp_core.artifacts.snapshot import PrunedSnapshot
from casp_core.errors import BudgetUnmet
from casp_core.eval.evaluate import EvaluationPlan, Figures, evaluate, side_by_side
from casp_core.job.plan import ArtifactsPlan, JobPlan, SweepPlan
from casp_core.job.stages import CANDIDATE_STAGES, DENSE_POINTS, SWEEP_STAGE
from casp_core.job.steps import (
    SWEEP_STATE_FILE,
    Inputs,
    Pruned,
    RetryState,
    check_gguf_tokenizer,
    checkpoint_perplexity,
    read_inputs,
    save_checkpoint,
    staged_output,
    warn_rounding,
    write_job_report,
)
from casp_core.job.sweep.candidates import within_target
from casp_core.job.sweep.shared_pass import prune_plans
from casp_core.method.placement import Placement, choose_placement
from casp_core.method.results import PruneResult
from casp_core.model import load_model, prunable_parameters, resolve_device
from casp_core.report.build import pruning_section, unpruned_section
from casp_core.report.publish import public_name
from casp_core.run import Run
from casp_core.settings import NO_QUANTIZATION, PruneConfig, TargetConfig

CANDIDATES_DIR = "candidates"
DENSE_DIR = "dense"
FRONTIER_FILE = "frontier.json"
GGUF = "gguf"


@dataclass(frozen=True)
class Point:
    """One measured candidate of the frontier (a pruned model in one variant) or a dense reference point."""

    ratio: float  # 0.0 for the dense points
    format: str  # "gguf" | "safetensors"
    variant: str  # the GGUF type, or the quantization scheme ("none": the checkpoint as saved)
    bytes: int  # the file(s) a user serves: the GGUF file, or the checkpoint's safetensors
    params: int  # every parameter the model holds (embedding and head included, tied ones once)
    perplexity: dict[str, float | None]  # by text name, in the variant's serving engine
    seconds: float  # its own work: its ratio's pruning (the shared statistics left out), evaluation, export, measure
    dense: bool
    within_target: bool
    on_front: bool = False  # no other point is both smaller and lower in perplexity on the first text
    path: str | None = None  # where its file is in the output: the pick's, and every candidate's with keep "all"
    zero_shot: dict[str, Any] | None = None  # the model's (unquantized) in transformers, when the job asks for it

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Point":
        return cls(**data)

    def name(self) -> str:
        variant = "unquantized" if self.variant == NO_QUANTIZATION else self.variant
        return f"ratio {self.ratio:g}, {variant}" if not self.dense else f"dense, {variant}"


@dataclass(frozen=True)
class Unit:
    """One pruned model of the sweep: a ratio and the variants that share its widths (`block`: the quantized GGUF
    block their FFN widths are rounded to, None for the default rounding)."""

    ratio: float
    variants: tuple[str, ...]
    block: int | None

    @property
    def key(self) -> str:
        """Its folder under candidates/ and its name in the retry state."""
        ratio = f"{self.ratio:.2f}" if round(self.ratio, 2) == self.ratio else f"{self.ratio:g}"
        return f"ratio-{ratio}" + (f"-block{self.block}" if self.block else "")

    def describe(self) -> str:
        return f"ratio {self.ratio:g} ({', '.join(self.variants)})"


def sweep_units(plan: SweepPlan) -> list[Unit]:
    """The candidates as units of work: grouped by the rounding their variant's single-ratio job would use, then by
    ratio (in dense calibration `prune_plans` finishes them in this order after its one pass over the layers)."""
    groups: dict[int | None, dict[float, list[str]]] = {}
    for candidate in plan.candidates:
        block = plan.prune_of(candidate.ratio, candidate.variant).allocation.block
        groups.setdefault(block, {}).setdefault(candidate.ratio, []).append(candidate.variant)
    return [
        Unit(ratio, tuple(variants), block)
        for block, ratios in groups.items()
        for ratio, variants in sorted(ratios.items())
    ]


@dataclass
class SweepProgress:
    """The sweep's progress: each unit an equal share of the "sweep" stage, every report while it is worked on
    named by it ("candidate 3 of 6: ratio 0.3 (f16, q8_0)")."""

    run: Run
    count: int
    done: int = 0
    name: str = ""
    started: float = 0.0  # when work on the current unit started (perf_counter)
    _within: float = 0.0

    def sharing(self, units: list["Unit"]) -> None:
        """The work the units share comes first, within the first unit's share."""
        ratios = sorted({unit.ratio for unit in units})
        self.name, self._within = f"statistics shared by ratios {', '.join(f'{ratio:g}' for ratio in ratios)}", 0.0

    def start(self, name: str) -> None:
        self.name, self._within, self.started = name, 0.0, time.perf_counter()
        self.run.check_cancelled()
        self.report(SWEEP_STAGE.name, 0.0, "")

    def report(self, stage: str, fraction: float, message: str = "") -> None:
        if stage in CANDIDATE_STAGES:  # any other keeps the share reached
            self._within = max(self._within, (CANDIDATE_STAGES.index(stage) + fraction) / len(CANDIDATE_STAGES))
        what = f"candidate {self.done + 1} of {self.count}: {self.name}"
        self.run.report(
            SWEEP_STAGE.name, (self.done + self._within) / self.count, f"{what}: {message}" if message else what
        )

    def finish(self) -> None:
        self.done += 1

    def unit_run(self) -> Run:
        """The job's run, reporting as this progress."""
        return replace(self.run, progress=self.report)


def reporting_as(run: Run, stage: str) -> Run:
    """`run`, with every report under `stage`."""
    return replace(run, progress=lambda _, fraction, message="": run.report(stage, fraction, message))


def whole_model_params(model: PreTrainedModel) -> int:
    """Every parameter, embedding and head included, tied ones once (as `parameters()` yields them)."""
    return sum(parameter.numel() for parameter in model.parameters())


@dataclass
class Measured:
    """A model of the sweep, saved as a checkpoint in `folder`, and what it measured in transformers."""

    model: PreTrainedModel
    folder: Path
    ratio: float
    figures: Figures
    seconds: float  # what its points share: pruning and the transformers evaluation


def measure_variant(
    measured: Measured,
    tokenizer: PreTrainedTokenizerBase,
    fmt: str,
    variant: str,
    plan: EvaluationPlan,
    run: Run,
) -> Point:
    """One variant of a saved model, written beside it and measured in its serving engine (`within_target` is set
    by the caller, who knows the target)."""
    started = time.perf_counter()
    run.check_cancelled()
    path = variant_path(measured.folder, fmt, variant)
    if fmt == GGUF:
        # Perplexity alone: the speed runs (several prompts per file) would cost a large model's sweep more than
        # its measurement; the pick's file gets them in its row of the table of files.
        export = export_gguf(measured.folder, path, variant)
        size, perplexity = export.bytes, gguf_perplexity(path, plan.texts, run)
    elif variant == NO_QUANTIZATION:
        size, perplexity = weight_bytes(path), dict(measured.figures.perplexity)
    else:  # a copy of the checkpoint, quantized in place
        shutil.copytree(measured.folder, path)
        quantized = quantize(QuantizationInput(copy.deepcopy(measured.model), tokenizer, path, variant, plan), run)
        size, perplexity = quantized.weight_bytes_after, dict(quantized.perplexity)
    zero_shot = measured.figures.zero_shot
    return Point(
        ratio=measured.ratio,
        format=fmt,
        variant=variant,
        bytes=size,
        params=whole_model_params(measured.model),
        perplexity=perplexity,
        seconds=measured.seconds + time.perf_counter() - started,
        dense=measured.ratio == 0.0,
        within_target=False,
        zero_shot={"average_acc": zero_shot["average_acc"], "tasks": zero_shot["tasks"]} if zero_shot else None,
    )


def variant_path(folder: Path, fmt: str, variant: str) -> Path:
    """Where a variant of the model saved in `folder` is written: a GGUF file in it, the checkpoint itself, or a
    quantized copy beside it."""
    if fmt == GGUF:
        return folder / gguf_file_name(variant)
    return folder if variant == NO_QUANTIZATION else folder.with_name(f"{folder.name}-{variant}")


def first_perplexity(point: Point) -> float:
    value = next(iter(point.perplexity.values()), None)
    return math.inf if value is None else value


@dataclass(frozen=True)
class Target:
    """The job's target as the sweep applies it to measured points."""

    config: PruneConfig
    dense_perplexity: float  # the dense model's, in transformers, on the first text

    def met_by(self, size: int, params: int, perplexity: float) -> bool:
        target = self.config.target
        if target.max_perplexity_increase is not None:
            return perplexity <= self.dense_perplexity * (1 + target.max_perplexity_increase)
        return within_target(size, params, target)

    def pick(self, points: list[Point]) -> Point | None:
        """The point the job hands back: the lowest perplexity within a bytes or parameters budget (ties to the
        smaller file); for a perplexity increase, the smallest file within it (ties to the lower perplexity). Among
        the pruned points, and the dense ones too with `target.candidates` "all"."""
        return self.best(points, dense=self.config.target.candidates == "all")

    def best(self, points: list[Point], *, dense: bool) -> Point | None:
        """`pick`'s rule among the pruned points, and the dense ones when `dense`."""
        qualified = [point for point in points if point.within_target and (dense or not point.dense)]
        if not qualified:
            return None
        if self.config.target.max_perplexity_increase is not None:
            return min(qualified, key=lambda point: (point.bytes, first_perplexity(point)))
        return min(qualified, key=lambda point: (first_perplexity(point), point.bytes))

    def unmet(self, points: list[Point]) -> BudgetUnmet:
        """The error of a sweep none of whose points qualified, naming the closest it came."""
        target = self.config.target
        pruned = [point for point in points if not point.dense]
        if target.max_perplexity_increase is not None:
            best = min(pruned, key=first_perplexity)
            return BudgetUnmet(
                f"target.max_perplexity_increase: no candidate's perplexity is within "
                f"{target.max_perplexity_increase:g} of the dense model's {self.dense_perplexity:.4g}: the lowest "
                f"measured is {first_perplexity(best):.4g} ({best.name()})"
            )
        if target.max_bytes is not None:
            smallest = min(pruned, key=lambda point: point.bytes)
            return BudgetUnmet(
                f"target.max_bytes: no candidate fits in {target.max_bytes:,} bytes once written: the smallest "
                f"produced is {smallest.bytes:,} bytes ({smallest.name()})"
            )
        smallest = min(pruned, key=lambda point: point.params)
        return BudgetUnmet(
            f"target.max_params: no candidate has at most {target.max_params:,} parameters once pruned: the "
            f"smallest produced has {smallest.params:,} ({smallest.name()})"
        )

    def better_dense(self, points: list[Point], pick: Point) -> str | None:
        """A warning when a dense point within the target beats the pick (lower perplexity within a budget; a
        smaller file within a perplexity increase): the user may prefer the dense model in that format."""
        dense = [point for point in points if point.dense and point.within_target]
        if self.config.target.max_perplexity_increase is not None:
            better, how = [point for point in dense if point.bytes < pick.bytes], "smaller"
            best = min(better, key=lambda point: point.bytes, default=None)
        else:
            better, how = [point for point in dense if first_perplexity(point) < first_perplexity(pick)], "better"
            best = min(better, key=first_perplexity, default=None)
        if best is None:
            return None
        return (
            f"the dense model ({best.name()}: {best.bytes:,} bytes, perplexity {first_perplexity(best):.4g}) is "
            f"within the target and {how} than the pick ({pick.name()}: {pick.bytes:,} bytes, perplexity "
            f"{first_perplexity(pick):.4g}); target.candidates all would hand it back; see frontier.json"
        )

    def dense_pick_reason(self, pick: Point, best_pruned: Point | None) -> str:
        """Why a dense point is the pick, in one sentence, beside the best pruned point within the target (the
        pick's rule among the pruned ones), or that none met it."""
        target = self.config.target
        variant = "unquantized" if pick.variant == NO_QUANTIZATION else f"in {pick.variant}"
        if target.max_perplexity_increase is not None:
            won, runner_up = f"is the smallest file within {self.describe()}", "the smallest pruned candidate"
        else:
            won, runner_up = f"beats every pruned candidate within {self.describe()}", "the best pruned candidate"
        beside = (
            f"{runner_up} within it is {best_pruned.name()}: {figures_of(best_pruned)}"
            if best_pruned is not None
            else "no pruned candidate is within it"
        )
        return f"the dense model {variant} {won}: {figures_of(pick)}; {beside}"

    def describe(self) -> str:
        """The target in a few words: `10,541,328 bytes of gguf`, `perplexity 121.3 (0.1 above ...)`."""
        target: TargetConfig = self.config.target
        if target.max_bytes is not None:
            return f"{target.max_bytes:,} bytes of {target.format}"
        if target.max_params is not None:
            return f"{target.max_params:,} parameters"
        limit = self.dense_perplexity * (1 + target.max_perplexity_increase)
        return (
            f"perplexity {limit:.4g} ({target.max_perplexity_increase:g} above the dense model's "
            f"{self.dense_perplexity:.4g})"
        )


def figures_of(point: Point) -> str:
    return f"perplexity {first_perplexity(point):.4g} at {point.bytes:,} bytes"


def on_front(points: list[Point]) -> list[Point]:
    """`points` with `on_front` set: no other point is at most as large and at most as high in perplexity on the
    first text, and better in one of them (the Pareto front over bytes and perplexity, dense points included)."""

    def dominated(point: Point) -> bool:
        size, perplexity = point.bytes, first_perplexity(point)
        return any(
            other.bytes <= size
            and first_perplexity(other) <= perplexity
            and (other.bytes < size or first_perplexity(other) < perplexity)
            for other in points
        )

    return [replace(point, on_front=not dominated(point)) for point in points]


@dataclass
class SweepState:
    """What a retry resumes from: the dense model's figures, every point measured, the units finished and the one
    whose model is the best so far (its model in a `pruned_snapshot` beside this file)."""

    dense_figures: Figures | None = None
    points: list[Point] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    best: str | None = None

    @classmethod
    def resume(cls, retry: RetryState) -> "SweepState":
        """The state kept in `retry`'s directory for this job, or an empty one."""
        path = retry.directory / SWEEP_STATE_FILE if retry.directory is not None else None
        if path is None or not path.is_file():
            return cls()
        kept = json.loads(path.read_text())
        if kept["fingerprint"] != json.loads(json.dumps(retry.fingerprint)):  # compared as read back from JSON
            return cls()
        return cls(
            dense_figures=Figures(**kept["dense_figures"]) if kept["dense_figures"] else None,
            # The files of an earlier attempt went with its staging folder.
            points=[replace(Point.from_dict(point), path=None) for point in kept["points"]],
            finished=kept["finished"],
            best=kept["best"],
        )

    def keep(self, retry: RetryState) -> None:
        """Writes the state whole into `retry`'s directory (nothing without one)."""
        if retry.directory is None:
            return
        retry.directory.mkdir(parents=True, exist_ok=True)
        kept = {
            "fingerprint": retry.fingerprint,
            "dense_figures": asdict(self.dense_figures) if self.dense_figures else None,
            "points": [point.to_dict() for point in self.points],
            "finished": self.finished,
            "best": self.best,
        }
        partial = retry.directory / f".{SWEEP_STATE_FILE}.partial"
        partial.write_text(json.dumps(kept))
        os.replace(partial, retry.directory / SWEEP_STATE_FILE)
        retry.saved(retry.directory / SWEEP_STATE_FILE)


def best_model_state(retry: RetryState, unit_key: str) -> RetryState:
    """Where the model of the best unit so far is kept: the job's snapshot, fingerprinted with the unit."""
    return replace(retry, fingerprint={**retry.fingerprint, "candidate": unit_key})


@dataclass
class Sweep:
    """What the steps share."""

    model: str
    revision: str | None
    cache_dir: Path
    config: PruneConfig
    tokenizer: PreTrainedTokenizerBase
    inputs: Inputs
    staging: Path
    retry: RetryState
    plan: SweepPlan
    dtype: str
    state: SweepState
    best: PrunedSnapshot | None  # the best unit's model so far, with its figures and pruning section

    @property
    def target(self) -> Target:
        """The job's target, once the dense model's figures are known."""
        assert self.state.dense_figures is not None, "the dense model is evaluated first"
        return Target(self.config, next(iter(self.state.dense_figures.perplexity.values())))

    def kept(self, path: Path) -> str | None:
        """`path` relative to the output when the candidates' files stay in it, else None."""
        return str(path.relative_to(self.staging)) if self.config.keep == "all" else None

    def finish_points(self, points: list[Point]) -> list[Point]:
        """`points` with `within_target` set from their measured figures."""
        return [
            replace(point, within_target=self.target.met_by(point.bytes, point.params, first_perplexity(point)))
            for point in points
        ]


def run_sweep(
    model: str,
    job_plan: JobPlan,
    out_dir: Path,
    run: Run,
    retry: RetryState,
    *,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: Path,
) -> dict[str, Any]:
    """The sweep job (the steps in the module docstring); returns the report written, the pick's, with the
    frontier in `report["frontier"]`. `cache_dir`: as run_job's."""
    config, plan = job_plan.settings, job_plan.sweep
    assert plan is not None, "a job with a target has a sweep"
    with staged_output(out_dir) as staging:
        device = resolve_device(config.device)
        run.time_on(device)
        with run.stage("load"):
            run.report("load", 0.0, f"loading {public_name(model)}")
            dense, tokenizer = load_model(
                model, revision=revision, dtype=config.dtype, token=token, device=device, cache_dir=cache_dir
            )
            units = sweep_units(plan)
            check_candidates(model, dense, tokenizer, plan, run)
            placement = choose_placement(dense, plan.placement, device)
            state, best = resume(retry, run)
        with run.stage("calibration_data"):
            inputs = read_inputs(tokenizer, plan.calibration, job_plan.evaluation, None, run)
        sweep = Sweep(
            model=model,
            revision=revision,
            cache_dir=cache_dir,
            config=config,
            tokenizer=tokenizer,
            inputs=inputs,
            staging=staging,
            retry=retry,
            plan=plan,
            dtype=str(dense.dtype).removeprefix("torch."),
            state=state,
            best=best,
        )
        if state.dense_figures is None:
            measure_dense(sweep, dense, run)
        with run.stage(SWEEP_STAGE.name):
            sweep_candidates_of(sweep, dense, units, placement, run)
        report = write_pick(sweep, dense, device, run)
    run.report("report", 1.0, "report.json, report.md, frontier.json and the model card written")
    return report


def unit_config(config: PruneConfig, unit: Unit, fmt: str) -> PruneConfig:
    """The single-ratio settings a unit is pruned with: those of its first variant (its others round alike)."""
    return config.candidate_config(unit.ratio, fmt, unit.variants[0])


def check_candidates(
    model: str, dense: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, plan: SweepPlan, run: Run
) -> None:
    """What the plan could not check without the weights, before any work: llama.cpp, which measures the GGUF
    candidates, must be there, and the GGUF files' tokenizer must be one it reproduces; each candidate's rounding
    warns as its single-ratio job's does."""
    if plan.format == GGUF:
        require_llama_cpp()
        check_gguf_tokenizer(model, dense, tokenizer)
    for candidate in plan.candidates:
        warn_rounding(dense, plan.prune_of(candidate.ratio, candidate.variant).allocation, run)


def resume(retry: RetryState, run: Run) -> tuple[SweepState, PrunedSnapshot | None]:
    """What an earlier attempt kept: the state, and the best unit's model so far from its snapshot. Without the
    snapshot (lost between two saves), the units are done again."""
    state = SweepState.resume(retry)
    best = None
    if state.best is not None:
        best = best_model_state(retry, state.best).pruned_snapshot()
        if best is None:
            state.points = [point for point in state.points if point.dense]
            state.finished, state.best = [], None
    if state.dense_figures is not None:
        done = f"{len(state.finished)} candidate{'s' if len(state.finished) != 1 else ''} already measured"
        run.report("load", 1.0, f"resumed after the dense model's evaluation, {done}")
    return state, best


def measure_dense(sweep: Sweep, dense: PreTrainedModel, run: Run) -> None:
    """The dense model's figures in transformers (an earlier job's, kept in the cache, when one matches), and the
    dense reference points: the dense model in each variant, measured as the candidates are."""
    state = sweep.state
    started = time.perf_counter()
    state.dense_figures = evaluate_dense(dense, sweep.tokenizer, sweep.inputs.plan, run, sweep.cache_dir)
    seconds = time.perf_counter() - started
    with run.stage(DENSE_POINTS.name):
        variants = sweep.plan.variants
        run.report(DENSE_POINTS.name, 0.0, f"the dense model in {', '.join(variants)}")
        folder = sweep.staging / CANDIDATES_DIR / DENSE_DIR
        within = reporting_as(run, DENSE_POINTS.name)
        # Saved as a dense pick is (its GGUF files named alike, so that the pick's file is the one measured).
        artifacts = ArtifactsPlan.of(sweep.config.model_copy(update={"export": []}))
        save_checkpoint(dense, sweep.tokenizer, sweep.model, sweep.revision, artifacts, within, folder)
        measured = Measured(dense, folder, 0.0, state.dense_figures, seconds)
        points = []
        for index, variant in enumerate(variants):
            point = measure_variant(measured, sweep.tokenizer, sweep.plan.format, variant, sweep.inputs.plan, within)
            points.append(replace(point, path=sweep.kept(variant_path(folder, sweep.plan.format, variant))))
            run.report(DENSE_POINTS.name, (index + 1) / len(variants), f"the dense model in {variant} measured")
        state.points = sweep.finish_points(points)
        drop_unless_kept(sweep, folder)
    state.keep(sweep.retry)


def drop_unless_kept(sweep: Sweep, folder: Path) -> None:
    """A candidate's folder (and its quantized siblings) once measured, unless keep is "all"."""
    if sweep.config.keep == "all":
        return
    for path in folder.parent.glob(f"{folder.name}*"):
        if path == folder or path.name.startswith(f"{folder.name}-"):
            shutil.rmtree(path)


def sweep_candidates_of(
    sweep: Sweep,
    dense: PreTrainedModel,
    units: list[Unit],
    placement: Placement,
    run: Run,
) -> None:
    """Every unit not yet finished: pruned (one `prune_plans` for them all: the work they share done once),
    measured, kept."""
    progress = SweepProgress(run, len(units))
    todo = [unit for unit in units if unit.key not in sweep.state.finished]
    progress.done = len(units) - len(todo)
    if progress.done:  # a retry
        run.report(SWEEP_STAGE.name, progress.done / len(units), f"{progress.done} of {len(units)} candidates measured")
    progress.sharing(todo)
    unit_run = progress.unit_run()

    def started(index: int) -> None:
        progress.start(todo[index].describe())

    pruned = prune_plans(
        dense,
        sweep.tokenizer,
        [sweep.plan.prune_of(unit.ratio, unit.variants[0]) for unit in todo],
        unit_run,
        windows=sweep.inputs.windows,
        placement=placement,
        on_start=started,
    )
    for unit, result in zip(todo, pruned, strict=True):
        measure_unit(sweep, unit, result, time.perf_counter() - progress.started, unit_run)
        progress.finish()


def measure_unit(sweep: Sweep, unit: Unit, result: PruneResult, prune_seconds: float, run: Run) -> None:
    """One unit's pruned model: evaluated in transformers, written to its folder, each variant measured; its
    points and, when it is the best so far, its model kept for a retry."""
    state = sweep.state
    started = time.perf_counter()
    figures = evaluate(result.model, sweep.tokenizer, sweep.inputs.plan, run)
    folder = sweep.staging / CANDIDATES_DIR / unit.key
    candidate = unit_config(sweep.config, unit, sweep.plan.format)
    save_checkpoint(
        result.model,
        sweep.tokenizer,
        sweep.model,
        sweep.revision,
        ArtifactsPlan.of(candidate.model_copy(update={"export": []})),
        run,
        folder,
    )
    measured = Measured(result.model, folder, unit.ratio, figures, prune_seconds + time.perf_counter() - started)
    points = []
    for variant in unit.variants:
        point = measure_variant(measured, sweep.tokenizer, sweep.plan.format, variant, sweep.inputs.plan, run)
        points.append(replace(point, path=sweep.kept(variant_path(folder, sweep.plan.format, variant))))
    drop_unless_kept(sweep, folder)
    state.points += sweep.finish_points(points)
    state.finished.append(unit.key)
    pick = sweep.target.pick(state.points)
    if pick is not None and pick.ratio == unit.ratio and pick.variant in unit.variants:
        assert state.dense_figures is not None
        sweep.best = PrunedSnapshot(
            result.model,
            sweep.tokenizer,
            state.dense_figures,
            figures,
            pruning_section(result),
            sweep.dtype,
            list(run.warnings),
        )
        best_model_state(sweep.retry, unit.key).keep_pruned(sweep.best)
        state.best = unit.key
    state.keep(sweep.retry)


def write_pick(sweep: Sweep, dense: PreTrainedModel, device: Any, run: Run) -> dict[str, Any]:
    """The front, the pick and its files, as the pick's single-ratio job writes them (a dense pick: the dense
    model, written alike in the pick's variant), with frontier.json and frontier.png; the report written."""
    state, target = sweep.state, sweep.target
    assert state.dense_figures is not None
    variants = [point.variant for point in state.points if point.dense]  # in the sweep's order
    points = on_front(sorted(state.points, key=lambda point: (point.ratio, variants.index(point.variant))))
    pick = target.pick(points)
    if pick is None:
        raise target.unmet(points)
    warning = target.better_dense(points, pick)
    if warning:
        run.warn(warning)
    if pick.dense:
        # Its settings are the job's (the target kept: nothing was pruned), written as the pick's variant.
        config = sweep.config.written_as(pick.format, pick.variant)
        kept = PrunedSnapshot(
            dense, sweep.tokenizer, state.dense_figures, state.dense_figures,
            unpruned_section(prunable_parameters(dense)), sweep.dtype, [],
        )  # fmt: skip
    else:
        assert sweep.best is not None, "the best unit's model is kept whenever a pruned point is the pick"
        config, kept = sweep.config.candidate_config(pick.ratio, pick.format, pick.variant), sweep.best
    # Everything the pick's files take reports as the checkpoint stage, the last before the report.
    files = write_pick_files(sweep, config, pick, kept, reporting_as(run, "checkpoint"))
    points = [replace(point, path=files.path) if point == pick else point for point in points]
    frontier = {
        "target": sweep.config.target.to_dict(),
        "format": sweep.plan.format,
        "ratios": sorted(sweep.config.ratios),
        "variants": variants,
        "keep": sweep.config.keep,
        "perplexity_text": next(iter(sweep.inputs.plan.texts)),
        "dense_perplexity": state.dense_figures.perplexity,
        "candidates": [point.to_dict() for point in points],
        "pick": replace(pick, path=files.path).to_dict(),
    }
    if pick.dense:
        best_pruned = target.best(points, dense=False)
        frontier["dense_pick"] = target.dense_pick_reason(pick, best_pruned)
        frontier["best_pruned"] = best_pruned.to_dict() if best_pruned is not None else None
    (sweep.staging / FRONTIER_FILE).write_text(json.dumps(frontier, indent=2) + "\n")
    if not any((sweep.staging / CANDIDATES_DIR).iterdir()):
        (sweep.staging / CANDIDATES_DIR).rmdir()
    run.report("report", 0.0, "writing the report")
    return write_job_report(
        sweep.model,
        config,
        Pruned(kept.model, kept.pruning, state.dense_figures, None),
        files.evaluation,
        None,
        files.exports,
        files.quantized,
        files.artifacts,
        run,
        device=str(device),
        dtype=sweep.dtype,
        out=sweep.staging,
        cache_dir=sweep.cache_dir,
        frontier=frontier,
    )


@dataclass
class PickFiles:
    """The pick's files in the output and what the report says of them."""

    evaluation: dict[str, Any]  # `side_by_side`: the dense model's figures and the pick's, in transformers
    exports: list[GgufExport]
    quantized: QuantizedCheckpoint | None
    artifacts: dict[str, Any]  # `artifact_table`
    path: str  # the pick's file: its GGUF, or the checkpoint's weights


def write_pick_files(sweep: Sweep, config: PruneConfig, pick: Point, kept: PrunedSnapshot, run: Run) -> PickFiles:
    """The pick's checkpoint and its export or quantization, from its model (`kept`: the best unit's, or the dense
    one), as its single-ratio job (`config`) writes them; its figures are those the sweep measured."""
    assert sweep.state.dense_figures is not None
    model, plan, artifacts = kept.model, sweep.inputs.plan, ArtifactsPlan.of(config)
    exports = save_checkpoint(model, sweep.tokenizer, sweep.model, sweep.revision, artifacts, run, sweep.staging)
    evaluation = side_by_side(sweep.state.dense_figures, kept.pruned_figures, plan.texts)
    quantized = None
    if artifacts.quantization is not None:
        with run.stage("quantization"):
            quantized = quantize(
                QuantizationInput(model, sweep.tokenizer, sweep.staging, artifacts.quantization, plan), run
            )
    if pick.format == GGUF:
        # The pick's GGUF (its only export) is the file measured in the sweep, written again alike: its perplexity
        # is the sweep's; its speed is measured now.
        with run.stage("evaluation_gguf"):
            engine_figures: list[EngineFigures | None] = [
                EngineFigures(pick.perplexity, *engine_speed(exports[0].path))
            ]
    else:  # the GGUF a safetensors sweep's job asked for beside its checkpoint, measured as a single-ratio job's
        with run.stage("evaluation_gguf") if exports else nullcontext():
            engine_figures = measure_exports(exports, plan.texts, run)
    artifacts = artifact_table(
        sweep.staging,
        checkpoint_perplexity(evaluation, "pruned", quantized),
        exports,
        engine_figures,
        list(plan.texts),
    )
    # The checkpoint's row names its weights file (or its count of shards).
    path = exports[0].path.name if pick.format == GGUF else artifacts["rows"][0]["file"]
    return PickFiles(evaluation, exports, quantized, artifacts, path)
