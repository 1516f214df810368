"""One model's figures: perplexity per text, and zero-shot accuracy and efficiency when asked for.

The job calls `evaluate` on the dense model (through casp_core.artifacts.dense_cache, which reuses an earlier job's
figures of the same model) and then on the pruned model (`EvaluationPlan.for_job`), `casp eval` on a saved
checkpoint; `side_by_side` lays the job's two sets of figures out for the report.
"""

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core.eval.efficiency import efficiency_ratios, measure_efficiency
from casp_core.eval.perplexity import EvaluationText, evaluation_text, windows_perplexity
from casp_core.eval.zeroshot import evaluate_zero_shot, harness
from casp_core.run import Run
from casp_core.settings import PruneConfig

# The version of what `evaluate` measures and how: part of the key of the dense models' evaluations kept for later
# jobs (casp_core.artifacts.dense_cache). Raise it with any change that moves a figure: the texts, their windows or
# tokens, the perplexity's arithmetic, the zero-shot tasks' settings.
EVALUATION_VERSION = 1


@dataclass(frozen=True)
class EvaluationPlan:
    """What one evaluation measures and how."""

    texts: dict[str, EvaluationText]  # read beforehand: a missing file fails before the long work
    zero_shot: list[str]
    limit: int | None  # examples per zero-shot task
    datasets_dir: str | None
    device: str
    perplexity_batch_size: int
    zero_shot_batch_size: int = 16
    efficiency: dict[str, int] | None = None  # measure_efficiency's settings; None skips it

    @classmethod
    def for_job(cls, tokenizer: PreTrainedTokenizerBase, config: PruneConfig, seq_len: int) -> "EvaluationPlan":
        """The job's plan from its settings; `seq_len` applies where `config.evaluation` names none."""
        evaluation = config.evaluation
        if evaluation.zero_shot:
            harness()  # a machine without lm_eval refuses the job here, before any work
        texts = {
            name: evaluation_text(
                tokenizer,
                name,
                evaluation.seq_len or seq_len,
                datasets_dir=config.datasets_dir,
                max_windows=evaluation.limit,
            )
            for name in evaluation.perplexity
        }
        return cls(
            texts=texts,
            zero_shot=list(evaluation.zero_shot),
            limit=evaluation.limit,
            datasets_dir=config.datasets_dir,
            device=config.device,
            perplexity_batch_size=config.calibration.batch_size,
            efficiency=config.efficiency.model_dump() if evaluation.efficiency else None,
        )


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
    run = run or Run()
    figures = Figures(perplexity={})
    for name, text in plan.texts.items():
        figures.perplexity[name] = windows_perplexity(
            model, text, device=plan.device, batch_size=plan.perplexity_batch_size, run=run
        )
    if plan.zero_shot:
        run.check_cancelled()
        run.report("evaluation", 0.0, f"zero-shot {', '.join(plan.zero_shot)}")
        figures.zero_shot = evaluate_zero_shot(
            model,
            tokenizer,
            plan.zero_shot,
            limit=plan.limit,
            datasets_dir=plan.datasets_dir,
            batch_size=plan.zero_shot_batch_size,
            device=plan.device,
        )
    if plan.efficiency is not None:
        run.check_cancelled()
        run.report("evaluation", 0.0, "parameters, MACs and latency")
        figures.efficiency = measure_efficiency(model, device=plan.device, **plan.efficiency)
    model.to("cpu")
    return figures


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
