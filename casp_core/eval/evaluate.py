"""One model's figures: perplexity per text, and zero-shot accuracy and efficiency when asked for.

The job calls `evaluate` on the dense model (through casp_core.artifacts.dense_cache, which reuses an earlier job's
figures of the same model) and then on the pruned model (`EvaluationPlan.of`), `casp eval` on a saved
checkpoint; `side_by_side` lays the job's two sets of figures out for the report.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from casp_core.eval.efficiency import efficiency_ratios, measure_efficiency
from casp_core.eval.kept_scores import SCORES_FOLDER, ScoresCopy, copying_now_and_then, held_scores
from casp_core.eval.perplexity import EvaluationText, default_seq_len, evaluation_text, windows_perplexity
from casp_core.eval.zeroshot import evaluate_zero_shot, harness, kept_loglikelihoods
from casp_core.model import key_digest, resolve_device, weights_digest
from casp_core.run import Run
from casp_core.settings import PruneSettings

# The version of what `evaluate` measures and how: part of the key of the dense models' evaluations kept for later
# jobs (casp_core.artifacts.dense_cache). Raise it with any change that moves a figure: the texts, their windows or
# tokens, the perplexity's arithmetic, the zero-shot tasks' settings. 2: the zero-shot log-likelihoods read each
# context once (casp_core.eval.shared_context; the same to float rounding, which could still break a tie).
EVALUATION_VERSION = 2


@dataclass(frozen=True)
class EvaluationPlan:
    """What one evaluation measures and how. A job plans it from its settings and the model's config before the
    weights load (`of`) and reads its texts once the tokenizer has loaded (`with_texts`), before the long work: a
    missing file fails the job at once."""

    perplexity: tuple[str, ...]  # the texts' names (casp_core.data)
    seq_len: int  # tokens per perplexity window
    max_windows: int | None  # the first windows of each text only; None: all of them
    zero_shot: tuple[str, ...]
    limit: int | None  # examples per zero-shot task
    datasets_dir: str | None
    device: str
    perplexity_batch_size: int
    zero_shot_batch_size: int = 16
    efficiency: dict[str, int] | None = None  # measure_efficiency's settings; None skips it
    texts: dict[str, EvaluationText] = field(default_factory=dict)  # by name, once read
    # Where the zero-shot log-likelihoods are kept as they are scored (`kept_scores`); None keeps none.
    scores_cache: Path | None = None
    # Where the kept scores are copied every SCORES_COPIED_EVERY_SECONDS while they are scored and once they all
    # are, and restored from before scoring (`kept_scores`); None copies none.
    scores_copy: ScoresCopy | None = None

    @classmethod
    def of(cls, settings: PruneSettings, model_config: PretrainedConfig) -> "EvaluationPlan":
        """A job's evaluation: windows of the settings' length, else of the model's context up to 2048 tokens."""
        evaluation = settings.evaluation
        return cls(
            perplexity=tuple(evaluation.perplexity),
            seq_len=evaluation.seq_len or default_seq_len(model_config),
            max_windows=evaluation.limit,
            zero_shot=tuple(evaluation.zero_shot),
            limit=evaluation.limit,
            datasets_dir=settings.datasets_dir,
            device=settings.device,
            perplexity_batch_size=settings.calibration.batch_size,
            efficiency=settings.efficiency.model_dump() if evaluation.efficiency else None,
        )

    def with_texts(self, tokenizer: PreTrainedTokenizerBase) -> "EvaluationPlan":
        """The plan with its texts read and tokenized; a machine without lm_eval refuses zero-shot tasks here."""
        if self.zero_shot:
            harness()
        texts = {
            name: evaluation_text(
                tokenizer, name, self.seq_len, datasets_dir=self.datasets_dir, max_windows=self.max_windows
            )
            for name in self.perplexity
        }
        return replace(self, texts=texts)

    def keeping_scores(self, cache_dir: Path, scores_copy: ScoresCopy | None = None) -> "EvaluationPlan":
        """The plan with its zero-shot scores kept in `cache_dir` (casp_core.artifacts.caches) as they come, and
        copied to `scores_copy` now and then."""
        return replace(self, scores_cache=cache_dir / SCORES_FOLDER, scores_copy=scores_copy)


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
    assert set(plan.texts) == set(plan.perplexity), "the plan's texts are read (with_texts) before it evaluates"
    run = run or Run()
    figures = Figures(perplexity={})
    for name, text in plan.texts.items():
        figures.perplexity[name] = windows_perplexity(
            model, text, device=plan.device, batch_size=plan.perplexity_batch_size, run=run
        )
    if plan.zero_shot:
        # Where it is scored, before its weights are summed for its scores' folder: a GPU sums a 7B model's at once,
        # a CPU in about a minute.
        model.to(resolve_device(plan.device))
        with kept_scores(model, plan) as scores_dir:
            kept = 0 if scores_dir is None else kept_loglikelihoods(scores_dir)
            if kept:
                resuming = f"zero-shot: resuming from the {kept:,} log-likelihoods an earlier run kept"
                run.report("evaluation", 0.0, resuming)
            copy = None if scores_dir is None else plan.scores_copy
            try:
                figures.zero_shot = evaluate_zero_shot(
                    model,
                    tokenizer,
                    list(plan.zero_shot),
                    limit=plan.limit,
                    datasets_dir=plan.datasets_dir,
                    batch_size=plan.zero_shot_batch_size,
                    device=plan.device,
                    run=run if copy is None else copying_now_and_then(run, scores_dir, copy),
                    scores_dir=scores_dir,
                )
            finally:
                # Whole, or as far as the scoring came before a cancel or an error (a worker stopping hands the
                # job back to the queue, and another machine may take it).
                if copy is not None:
                    copy.keep_scores(scores_dir)
    if plan.efficiency is not None:
        run.check_cancelled()
        run.report("evaluation", 0.0, "parameters, MACs and latency")
        figures.efficiency = measure_efficiency(model, device=plan.device, **plan.efficiency)
    model.to("cpu")
    return figures


@contextmanager
def kept_scores(model: PreTrainedModel, plan: EvaluationPlan) -> Iterator[Path | None]:
    """The folder under the plan's `scores_cache` for `model`'s zero-shot log-likelihoods, kept as they are scored
    (evaluate_zero_shot's `scores_dir`; casp_core.eval.kept_scores). The harness keys its scores by request, so the
    folder is named by what else they depend on: the weights (`weights_digest`: a retry prunes again, and must find
    the same model), dtype, device kind, batch size and versions. None when the plan keeps no scores, or as
    `held_scores` says."""
    if plan.scores_cache is None:
        yield None
        return
    key = {
        "weights": weights_digest(model),
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": resolve_device(plan.device).type,
        "batch_size": plan.zero_shot_batch_size,
        "evaluation_version": EVALUATION_VERSION,
        "lm_eval": version("lm_eval"),
    }
    with held_scores(plan.scores_cache, key_digest(key)[:32], plan.scores_copy) as folder:
        yield folder


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
