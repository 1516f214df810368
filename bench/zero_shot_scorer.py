"""The zero-shot scorer against the harness's: the same requests, timed both ways, on the real model.

casp scores lm-evaluation-harness's log-likelihood requests with `SharedContextLM`
(casp_core/eval/shared_context.py: each context read once, logits only where a continuation token is predicted)
instead of the harness's `HFLM`. For each task this bench builds the requests of the first `--limit` documents as
the harness does, scores them with both in turn on SmolLM2-135M (as casp loads the GGUF), and records each one's
seconds, their ratio, the largest difference between their log-likelihoods and how many greedy flags and answers
(the choice of the highest log-likelihood, the `acc` metric's pick) differ.

Writes bench/results/zero_shot_scorer.{json,md}:

    PYTHONPATH=. python -m bench.zero_shot_scorer [--tasks hellaswag,boolq,...] [--limit 200]
"""

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from bench.common import (
    RESULTS_DIR,
    concurrency_note,
    default_datasets_dir,
    default_models_dir,
    finish_machine_info,
    machine_info,
    machine_line,
    write_json,
)
from casp_core.eval.shared_context import SHARED_WORTH_IT, SharedContextLM, shares_contexts
from casp_core.eval.zeroshot import datasets_offline, task_manager
from casp_core.model import load_model

MODEL = "smollm2-135m-instruct-gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
TASKS = ("hellaswag", "boolq", "arc_easy", "piqa", "winogrande")
RESULT = "zero_shot_scorer"


def task_requests(tasks: list[str], limit: int, datasets_dir: str) -> dict[str, list[Instance]]:
    """Each task's requests for its first `limit` documents, as the harness builds them."""
    with datasets_offline(), tempfile.TemporaryDirectory() as yaml_dir:
        manager: TaskManager = task_manager(tasks, datasets_dir, Path(yaml_dir))
        loaded = manager.load(tasks)["tasks"]
        for task in loaded.values():
            task.build_all_requests(limit=limit, rank=0, world_size=1)
        return {name: list(task.instances) for name, task in loaded.items()}


def picks(requests: list[Instance], answers: list[tuple[float, bool]]) -> list[int]:
    """Per document, the choice with the highest log-likelihood (what `acc` compares with the gold answer)."""
    by_document: dict[int, list[tuple[float, int]]] = {}
    for request, (log_likelihood, _) in zip(requests, answers, strict=True):
        by_document.setdefault(request.doc_id, []).append((log_likelihood, request.idx))
    return [max(choices)[1] for _, choices in sorted(by_document.items())]


def timed(scorer: HFLM, requests: list[Instance]) -> tuple[float, list[tuple[float, bool]]]:
    start = time.perf_counter()
    answers = scorer.loglikelihood(requests, disable_tqdm=True)
    return time.perf_counter() - start, answers


def task_row(model: Any, tokenizer: Any, task: str, requests: list[Instance], batch_size: int) -> dict[str, Any]:
    harness = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    ours = SharedContextLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    encoded = [(request.args, *ours._encode_pair(*request.args)) for request in requests]
    work_ratio = ours.work_ratio(encoded, ours.plan(encoded, list(range(len(encoded)))))
    harness_seconds, harness_answers = timed(harness, requests)
    ours_seconds, our_answers = timed(ours, requests)
    pairs = list(zip(harness_answers, our_answers, strict=True))
    return {
        "task": task,
        "documents": len({request.doc_id for request in requests}),
        "requests": len(requests),
        # Our estimate of the shared plan's work beside the harness's, and the plan it chose.
        "work_ratio": work_ratio,
        "plan": "contexts shared" if shares_contexts(work_ratio) else "the harness's",
        "harness_seconds": harness_seconds,
        "shared_context_seconds": ours_seconds,
        "ratio": ours_seconds / harness_seconds,
        "max_abs_log_likelihood_difference": max(abs(theirs[0] - mine[0]) for theirs, mine in pairs),
        "greedy_flags_differing": sum(theirs[1] != mine[1] for theirs, mine in pairs),
        "picks_differing": sum(
            a != b for a, b in zip(picks(requests, harness_answers), picks(requests, our_answers), strict=True)
        ),
    }


def markdown(payload: dict[str, Any]) -> list[str]:
    machine, settings = payload["machine"], payload["settings"]
    lines = [
        "# The zero-shot scorer against the harness's",
        "",
        f"`python -m bench.zero_shot_scorer`: {settings['model']}, the first {settings['limit']} documents of each "
        f"task, batch size {settings['batch_size']}; the harness's `HFLM`, then casp's `SharedContextLM`, on the "
        "same requests in one process. Work ratio: casp's estimate of the work with contexts shared beside the "
        f"harness's (tokens through the model, padding included, and the logits computed); at {SHARED_WORTH_IT} or "
        "under casp shares the contexts, else it hands the requests to the harness.",
        "",
        f"Machine: {machine_line(machine)}. {concurrency_note(machine)}",
        "",
        "| task | documents | requests | work ratio (estimated) | plan | harness s | casp s | time ratio | largest "
        "log-likelihood difference | greedy flags differing | answers differing |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in payload["rows"]:
        lines.append(
            f"| {row['task']} | {row['documents']} | {row['requests']} | {row['work_ratio']:.2f} | {row['plan']} | "
            f"{row['harness_seconds']:.1f} | "
            f"{row['shared_context_seconds']:.1f} | {row['ratio']:.2f} | "
            f"{row['max_abs_log_likelihood_difference']:.1e} | {row['greedy_flags_differing']} | "
            f"{row['picks_differing']} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated zero-shot tasks")
    parser.add_argument("--limit", type=int, default=200, help="documents per task")
    parser.add_argument("--batch-size", type=int, default=16, help="both scorers' (casp's zero-shot default)")
    parser.add_argument("--models-dir", default=default_models_dir())
    parser.add_argument("--datasets-dir", default=default_datasets_dir())
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",")
    machine = machine_info()
    model, tokenizer = load_model(str(Path(args.models_dir) / MODEL))
    requests = task_requests(tasks, args.limit, args.datasets_dir)
    rows = []
    for task in tasks:
        rows.append(task_row(model, tokenizer, task, requests[task], args.batch_size))
        print(rows[-1], flush=True)
    settings = {"model": MODEL, "limit": args.limit, "batch_size": args.batch_size, "tasks": tasks}
    payload = {"machine": finish_machine_info(machine), "settings": settings, "rows": rows}
    write_json(args.out / f"{RESULT}.json", payload)
    (args.out / f"{RESULT}.md").write_text("\n".join(markdown(payload)) + "\n")


if __name__ == "__main__":
    main()
