"""Zero-shot accuracy with lm-evaluation-harness, on a model already in memory.

Online (no data set directory) the harness's own task definitions fetch their data from the Hugging
Face hub. With a data set directory (argument or env `CASP_DATASETS_DIR`, layout of
shared/fixtures/data: `zeroshot/<task>/<split>.jsonl`) the *same* task definitions run on the local
files: for each task a YAML is generated into a temporary directory that `include:`s the harness's own
YAML and overrides only where the data comes from (see fixtures/PROVENANCE.md). Nothing else changes,
so prompts, choices, metrics and versions are the harness's. So are the log-likelihoods, computed with each
context read once for all its choices (casp_core.eval.shared_context).

Output of `evaluate_zero_shot`:

    {
      "harness": "lm-evaluation-harness", "harness_version": "0.4.13",
      "num_fewshot": 0, "limit": int | None, "documents": [start, stop] | None, "batch_size": int, "device": str,
      "source": "local" | "hub", "datasets_dir": str | None,
      "tasks": {task: {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr" (those the harness gives),
                       "n_samples": documents scored, "n_documents": documents in the split,
                       "version": task version, "split": the split scored, "num_fewshot": 0}},
      "average_acc": mean of the tasks' acc (the paper's "Average" column), "average_over": [tasks],
    }

`lm_eval` and `datasets` are imported where they are used: the job imports this module whether or not it
evaluates zero-shot, and the pruning path must run on machines without them (the GPU workers).
"""

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from types import ModuleType
from typing import TYPE_CHECKING, Any

import yaml
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core.data import POINT_ELSEWHERE
from casp_core.errors import DatasetNotFound, InvalidConfig
from casp_core.model import resolve_device
from casp_core.run import Run
from casp_core.settings import ZERO_SHOT_TASKS

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

DATASETS_DIR_ENV = "CASP_DATASETS_DIR"
METRICS = ("acc", "acc_norm")
SCORES_FILE = "loglikelihoods"


@dataclass(frozen=True)
class LocalTask:
    """Where a harness task is defined and which split files it reads (the training split is never used
    at zero shots, and the local copies do not have it)."""

    harness_yaml: str  # relative to the installed lm_eval/tasks
    splits: tuple[str, ...]


# Configuration as data: the harness YAML each task comes from and the splits it names (it evaluates on
# `test` where it defines one, else on `validation`).
LOCAL_TASKS: dict[str, LocalTask] = {
    "boolq": LocalTask("super_glue/boolq/default.yaml", ("validation",)),
    "piqa": LocalTask("piqa/piqa.yaml", ("validation",)),
    "hellaswag": LocalTask("hellaswag/hellaswag.yaml", ("validation",)),
    "winogrande": LocalTask("winogrande/default.yaml", ("validation",)),
    "arc_easy": LocalTask("arc/arc_easy.yaml", ("validation", "test")),
    "arc_challenge": LocalTask("arc/arc_challenge.yaml", ("validation", "test")),
    "openbookqa": LocalTask("openbookqa/openbookqa.yaml", ("validation", "test")),
}


def harness() -> ModuleType:
    """lm_eval, or a one-line error naming what to install where it is missing."""
    try:
        import lm_eval
    except ImportError as error:
        raise InvalidConfig(
            "zero-shot evaluation needs lm-evaluation-harness, which this machine lacks (pip install lm_eval)"
        ) from error
    return lm_eval


def resolve_datasets_dir(datasets_dir: str | None) -> str | None:
    """The explicit directory, else `CASP_DATASETS_DIR`, else None (online)."""
    return datasets_dir or os.environ.get(DATASETS_DIR_ENV) or None


def split_file(task: str, split: str, datasets_dir: str | Path) -> Path:
    """The local copy of a split of `task` under `datasets_dir`, one document a line."""
    path = (Path(datasets_dir) / "zeroshot" / task / f"{split}.jsonl").resolve()
    if not path.is_file():
        raise DatasetNotFound(f"zero-shot task {task}: {path} does not exist; {POINT_ELSEWHERE}")
    return path


def documents_scored(task: str, datasets_dir: str | Path) -> int:
    """How many documents `task` scores: those of its test split where it has one, else of its validation split."""
    scored = "test" if "test" in LOCAL_TASKS[task].splits else "validation"
    with split_file(task, scored, datasets_dir).open() as documents:
        return sum(1 for _ in documents)


def local_task_config(task: str, datasets_dir: str | Path) -> dict[str, Any]:
    """The YAML content that runs harness task `task` on the local copies under `datasets_dir`."""
    spec = LOCAL_TASKS[task]
    data_files = {split: str(split_file(task, split, datasets_dir)) for split in spec.splits}
    harness_tasks = Path(harness().__file__).parent / "tasks"
    return {
        # Absolute paths: the harness resolves relative ones against the working directory.
        "include": str(harness_tasks / spec.harness_yaml),
        "task": task,
        "dataset_path": "json",
        "dataset_name": None,
        "training_split": None,
        "dataset_kwargs": {"data_files": data_files},
    }


@contextmanager
def datasets_offline() -> Iterator[None]:
    """Local files need no network, but `datasets` pings the hub to count every load of its `json` builder
    unless it believes it is offline: make it believe so, for this evaluation only."""
    import datasets  # lm_eval's own dependency: there when it is

    saved = datasets.config.HF_HUB_OFFLINE, datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.config.HF_HUB_OFFLINE, datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = True, False
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = saved


def task_manager(tasks: list[str], datasets_dir: str | None, yaml_dir: Path) -> "TaskManager":
    """The harness's task manager for `tasks`: from `datasets_dir`'s files (`local_task_config`, written to
    `yaml_dir`), or the harness's own definitions where no folder is given."""
    from lm_eval.tasks import TaskManager

    if datasets_dir is None:
        return TaskManager()
    for task in tasks:
        config = local_task_config(task, datasets_dir)
        (yaml_dir / f"{task}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    # Without the defaults, the local definitions are the only ones under these names.
    return TaskManager(include_path=str(yaml_dir), include_defaults=False)


def _check_tasks(tasks: list[str]) -> None:
    if not tasks:
        raise InvalidConfig("zero-shot: no tasks given")
    unknown = [t for t in tasks if t not in LOCAL_TASKS]
    if unknown:
        raise InvalidConfig(
            f"zero-shot: unknown task(s) {', '.join(unknown)}; choose among {', '.join(ZERO_SHOT_TASKS)}"
        )


def task_figures(results: dict[str, Any], task: str) -> dict[str, Any]:
    """One task's entry of the output, from a `simple_evaluate` result."""
    raw = results["results"][task]
    figures: dict[str, Any] = {}
    for metric in METRICS:
        if f"{metric},none" in raw:
            figures[metric] = raw[f"{metric},none"]
            figures[f"{metric}_stderr"] = raw.get(f"{metric}_stderr,none")
    counts = results["n-samples"][task]
    figures["n_samples"] = counts["effective"]
    figures["n_documents"] = counts["original"]
    figures["version"] = results["versions"][task]
    config = results["configs"][task]
    figures["split"] = config.get("test_split") or config.get("validation_split")
    figures["num_fewshot"] = results["n-shot"][task]
    return figures


def evaluate_zero_shot(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: list[str],
    *,
    limit: int | None,
    datasets_dir: str | None,
    batch_size: int = 16,
    device: str,
    run: Run | None = None,
    scores_dir: Path | None = None,
    documents: range | None = None,
) -> dict[str, Any]:
    """Zero-shot acc / acc_norm of `model` on `tasks` (any of ZERO_SHOT_TASKS), as the harness computes them.

    `limit` caps the documents per task (the first ones of the split), for quick runs; `documents` takes these
    of each task's split instead (an evaluation too long for one sitting, in parts). The model is moved
    to `device` ("auto": cuda when available) in place, and put in eval mode. `run` hears the start and the
    fraction scored after each batch, and its cancellation stops the scoring there.

    `scores_dir` keeps each log-likelihood as it is scored (the harness's own cache, a SQLite file committed
    request by request): an evaluation cut short, then run again with the same folder, scores only the requests
    it had not. The requests key the scores, not the model: one folder per model.
    """
    run = run or Run()

    def scored(fraction: float) -> None:
        run.check_cancelled()  # every document of the seven tasks is hours of a CPU
        run.report("evaluation", fraction, f"zero-shot {', '.join(tasks)}")

    _check_tasks(tasks)
    if limit is not None and documents is not None:
        raise InvalidConfig("zero-shot: a limit or a range of documents, not both")
    scored(0.0)  # the tasks' documents load and become requests before the first batch: minutes for hellaswag
    lm_eval = harness()
    from casp_core.eval.shared_context import SharedContextLM

    datasets_dir = resolve_datasets_dir(datasets_dir)
    target = resolve_device(device)
    model.to(target)
    offline = nullcontext() if datasets_dir is None else datasets_offline()
    with tempfile.TemporaryDirectory(prefix="casp-zeroshot-") as yaml_dir, offline:
        manager = task_manager(tasks, datasets_dir, Path(yaml_dir))
        lm = SharedContextLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, on_progress=scored)
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            num_fewshot=0,
            limit=limit,
            samples=None if documents is None else {task: list(documents) for task in tasks},
            task_manager=manager,
            log_samples=False,
            # The harness appends its process rank and ".db" to this path.
            use_cache=None if scores_dir is None else str(Path(scores_dir) / SCORES_FILE),
        )
    assert results is not None  # None only on non-zero ranks of a distributed run
    per_task = {task: task_figures(results, task) for task in tasks}
    return {
        "harness": "lm-evaluation-harness",
        "harness_version": results["lm_eval_version"],
        "num_fewshot": 0,
        "limit": limit,
        "documents": None if documents is None else [documents.start, documents.stop],
        "batch_size": batch_size,
        "device": str(target),
        "source": "hub" if datasets_dir is None else "local",
        "datasets_dir": None if datasets_dir is None else str(Path(datasets_dir).resolve()),
        "tasks": per_task,
        # The paper's "Average" column is the plain mean of acc over the tasks evaluated.
        "average_acc": fmean(per_task[t]["acc"] for t in tasks),
        "average_over": list(tasks),
    }


def kept_loglikelihoods(scores_dir: Path) -> int:
    """How many log-likelihoods `scores_dir` (evaluate_zero_shot's) holds: none after a run cut short before its
    first batch, which leaves the harness's SQLite file made and empty."""
    from sqlitedict import SqliteDict  # lm_eval's, imported with it

    kept = 0
    for file in Path(scores_dir).glob(f"{SCORES_FILE}_rank*.db"):
        with SqliteDict(str(file), flag="r") as scores:
            kept += len(scores)
    return kept
