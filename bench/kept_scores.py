"""What keeping a job's zero-shot scores for a retry on another machine costs.

A job with zero-shot tasks copies each model's kept log-likelihoods (the harness's SQLite file,
casp_core.eval.kept_scores) into its retry state every `SCORES_COPIED_EVERY_SECONDS` while it scores and
once the model's evaluation ends (`copy_scores`: SQLite's backup, into one tar file per job, which the worker
uploads), and a retry restores a model's into its own cache before it scores it (`restore_scores`). This bench fills a
scores folder as the harness does (its `hash_args` keys, its `SqliteDict`, one entry a request) with as many
log-likelihoods as hellaswag's whole validation split asks (`--requests`, 40,168: 10,042 documents, four endings
each), and times the three steps on it, `--repeats` times each, median kept:

- the first copy, into a retry state holding nothing yet (the dense model's scores);
- a copy beside another model's whole copy (the pruned model's, every 5 minutes while it is scored);
- the restore of both into an empty cache (a retry on another machine).

The log-likelihoods are random: the file's size and the work depend on the count of entries, not on their values.
What a retry on another machine saves is the scoring it does not do again: bench/results/smollm2.md has each
model's seconds on hellaswag.

Writes bench/results/kept_scores.{json,md}:

    PYTHONPATH=. python -m bench.kept_scores [--requests 40168] [--repeats 5]
"""

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lm_eval.api.model import hash_args
from sqlitedict import SqliteDict

from bench.common import RESULTS_DIR, concurrency_note, finish_machine_info, machine_info, machine_line, write_json
from casp_core.eval.kept_scores import SCORES_COPIED_EVERY_SECONDS, copy_scores, restore_scores
from casp_core.eval.zeroshot import SCORES_FILE, kept_loglikelihoods

RESULT = "kept_scores"
HELLASWAG_REQUESTS = 10_042 * 4


def scores_folder(folder: Path, requests: int, seed: int) -> Path:
    """A folder holding `requests` log-likelihoods as the harness keeps them (lm_eval.api.model.CachingLM)."""
    folder.mkdir(parents=True)
    generator = random.Random(seed)
    with SqliteDict(str(folder / f"{SCORES_FILE}_rank0.db"), autocommit=False) as scores:
        for request in range(requests):
            context, ending = f"passage {seed}-{request}", f" ending {generator.random()}"
            scores[hash_args("loglikelihood", (context, ending))] = (-40 * generator.random(), generator.random() < 0.1)
        scores.commit()
    return folder


def median_seconds(step: Callable[[int], None], repeats: int) -> float:
    """The median wall time of `step(repeat)` over `repeats` runs."""
    seconds = []
    for repeat in range(repeats):
        start = time.perf_counter()
        step(repeat)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def measure(requests: int, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="casp-kept-scores-") as work:
        root = Path(work)
        dense = scores_folder(root / "cache" / f"{'d' * 32}", requests, seed=0)
        pruned = scores_folder(root / "cache" / f"{'e' * 32}", requests, seed=1)
        archives = root / "retry-states"

        def first_copy(repeat: int) -> None:
            copy_scores(dense, archives / f"first-{repeat}" / "zero-shot-scores.tar")

        def copy_beside_another(repeat: int) -> None:
            copy_scores(pruned, archives / f"first-{repeat}" / "zero-shot-scores.tar")

        def restore(repeat: int) -> None:
            for folder in (dense, pruned):
                archive = archives / f"first-{repeat}" / "zero-shot-scores.tar"
                restored = restore_scores(archive, root / f"cache-{repeat}" / folder.name)
                assert restored == requests, (folder, restored)

        row = {
            "requests": requests,
            "folder_bytes": sum(file.stat().st_size for file in dense.iterdir()),
            "first_copy_seconds": median_seconds(first_copy, repeats),
            "copy_beside_another_seconds": median_seconds(copy_beside_another, repeats),
            "archive_bytes": (archives / "first-0" / "zero-shot-scores.tar").stat().st_size,
            "restore_seconds": median_seconds(restore, repeats),
        }
        row["restored_loglikelihoods"] = kept_loglikelihoods(root / "cache-0" / dense.name)
        return row


def markdown(payload: dict[str, Any]) -> list[str]:
    machine, row = payload["machine"], payload["row"]
    mib = 1024 * 1024
    return [
        "# The zero-shot scores a job keeps for a retry on another machine",
        "",
        f"`python -m bench.kept_scores`: a scores folder of {row['requests']:,} log-likelihoods, as the harness "
        "keeps them (hellaswag's whole validation split asks 40,168), copied into a job's retry state and restored "
        f"from it (casp_core.eval.evaluate: `copy_scores`, `restore_scores`); median of {payload['repeats']} runs. "
        f"A job copies every {SCORES_COPIED_EVERY_SECONDS} s while it scores and once a model's evaluation ends; "
        "the worker uploads the archive after each copy.",
        "",
        f"Machine: {machine_line(machine)}. {concurrency_note(machine)}",
        "",
        "| log-likelihoods | folder MiB | archive MiB (two models) | first copy s | copy beside another model s "
        "| restore of both s |",
        "|---|---|---|---|---|---|",
        f"| {row['requests']:,} | {row['folder_bytes'] / mib:.1f} | {row['archive_bytes'] / mib:.1f} | "
        f"{row['first_copy_seconds']:.2f} | {row['copy_beside_another_seconds']:.2f} | "
        f"{row['restore_seconds']:.2f} |",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=HELLASWAG_REQUESTS, help="log-likelihoods in the folder")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    machine = machine_info()
    row = measure(args.requests, args.repeats)
    print(row, flush=True)
    payload = {"machine": finish_machine_info(machine), "repeats": args.repeats, "row": row}
    write_json(args.out / f"{RESULT}.json", payload)
    (args.out / f"{RESULT}.md").write_text("\n".join(markdown(payload)) + "\n")


if __name__ == "__main__":
    main()
