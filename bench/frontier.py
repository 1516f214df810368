"""The frontier of issue 23 (item 4): perplexity against file size of each fixture model's sweep, the dense model
in each GGUF type beside the pruned ones, and which points are on the Pareto front.

Each model is swept as a job with a target does it (`casp_core.job.run.run_job`, casp_core.job.sweep.run): the default
ratios (0.1 to 0.6) times the default GGUF types (f16, q8_0, q5_k_m, q4_k_m; the results were measured when a
K-quant was only taken where the hidden size fits its block), each pruned model written in each type and measured
in llama.cpp. The target is a perplexity increase no candidate reaches (every candidate is tried and measured);
the budget of the issue's "Done when", 70 % of the dense f16 GGUF, is then applied to the measured points: what a
job with that budget picks, and the best dense file within it. Calibration `ptb:train`, 16 x 128 tokens;
perplexity on the first 20 windows of 128 tokens of WikiText-2 (test) and PTB (test), as bench/quality.py and
bench/quantized.py measure.

    PYTHONPATH=. .venv/bin/python -m bench.frontier    # bench/results/frontier.{json,md}, frontier-<model>.png
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    RESULTS_DIR,
    all_finite,
    concurrency_note,
    default_datasets_dir,
    default_models_dir,
    finish_machine_info,
    machine_info,
    machine_line,
    write_json,
)
from casp_core.job.run import run_job
from casp_core.job.sweep.candidates import DEFAULT_GGUF_TYPES
from casp_core.job.sweep.run import FRONTIER_FILE
from casp_core.run import Run
from casp_core.settings import PruneConfig

MODELS = ("ptbwiki-7M", "stories260K")
RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
CALIBRATION_SET = "ptb:train"
EVAL_SETS = ("wikitext2", "ptb:test")
BUDGET_SHARE = 0.7  # of the dense f16 GGUF, as in the "Done when"
EVERY_CANDIDATE = 100.0  # a perplexity increase (x 101) no candidate reaches: every one is tried


def sweep_settings(args: argparse.Namespace) -> PruneConfig:
    return PruneConfig(
        target={"max_perplexity_increase": EVERY_CANDIDATE},
        ratios=list(args.ratios),
        gguf_types=args.gguf_types,
        export=["gguf"],
        calibration={"dataset": CALIBRATION_SET, "n_samples": args.n_samples, "seq_len": args.seq_len},
        evaluation={"perplexity": list(EVAL_SETS), "seq_len": args.eval_seq_len, "limit": args.eval_windows},
        datasets_dir=args.datasets_dir,
        device="cpu",
    )


def sweep_model(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One model's sweep: its frontier (report.json's) and how long the job took."""
    out = work / name
    started = time.perf_counter()
    report = run_job(str(Path(args.models_dir) / name), sweep_settings(args), out, Run())
    seconds = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out / "frontier.png", args.out / f"frontier-{name}.png")
    frontier = json.loads((out / FRONTIER_FILE).read_text())
    assert frontier == report["frontier"]
    return {"model": name, "seconds": seconds, "frontier": frontier, "budget": at_budget(frontier)}


def first_perplexity(point: dict[str, Any]) -> float:
    return next(iter(point["perplexity"].values()))


def at_budget(frontier: dict[str, Any]) -> dict[str, Any]:
    """The issue's budget (70 % of the dense f16 file) applied to the measured points: what a job with it picks
    (`target.candidates: all`, the default: the lowest perplexity within, the dense files included, ties to the
    smaller), and the best pruned file within it (what `candidates: pruned` picks)."""
    points = frontier["candidates"]
    dense_f16 = next(point for point in points if point["dense"] and point["variant"] == "f16")
    budget = int(BUDGET_SHARE * dense_f16["bytes"])
    within = [point for point in points if point["bytes"] <= budget]
    pruned = [point for point in within if not point["dense"]]
    return {
        "max_bytes": budget,
        "pick": min(within, key=lambda point: (first_perplexity(point), point["bytes"])) if within else None,
        "best_pruned": min(pruned, key=lambda point: (first_perplexity(point), point["bytes"])) if pruned else None,
    }


def dense_beats(points: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pruned point, the dense point that beats it: at most as large and lower in perplexity on the first text)."""
    dense = [point for point in points if point["dense"]]
    beaten = []
    for point in points:
        if point["dense"]:
            continue
        better = [d for d in dense if d["bytes"] <= point["bytes"] and first_perplexity(d) < first_perplexity(point)]
        if better:
            beaten.append((point, min(better, key=lambda d: d["bytes"])))
    return beaten


def _name(point: dict[str, Any]) -> str:
    return f"dense {point['variant']}" if point["dense"] else f"{point['ratio']:g} {point['variant']}"


def _pruned_within(best_pruned: dict[str, Any] | None, pick: dict[str, Any]) -> str:
    if best_pruned is None:
        return "no pruned file fits in it."
    if best_pruned is pick:
        return "a pruned file."
    return (
        f"the best pruned file within it is {_name(best_pruned)} ({best_pruned['bytes']:,} bytes, "
        f"{first_perplexity(best_pruned):.3f}), which `target.candidates: pruned` would pick."
    )


def render(payload: dict[str, Any]) -> str:
    settings = payload["settings"]
    lines = [
        "# The frontier: perplexity against file size (issue 23, item 4)",
        "",
        f"`python -m bench.frontier` ({payload['total_seconds']:.0f} s). {machine_line(payload['machine'])}. "
        + concurrency_note(payload["machine"]),
        "",
        f"Each model swept as a job with a target sweeps it (casp_core.job.sweep.run): ratios "
        f"{', '.join(f'{r:g}' for r in settings['ratios'])} times the GGUF types asked for, each file "
        f"measured in llama.cpp (one thread); calibration `{settings['calibration_set']}`, {settings['n_samples']} "
        f"x {settings['seq_len']} tokens; perplexity on the first {settings['eval_windows']} windows of "
        f"{settings['eval_seq_len']} tokens of {' and '.join(settings['eval_sets'])}; the front and the pick use "
        "the first. On the front: no other point, dense ones included, is both smaller and lower in perplexity.",
        "",
    ]
    for run in payload["models"]:
        frontier = run["frontier"]
        texts = list(frontier["dense_perplexity"])
        front = [point for point in frontier["candidates"] if point["on_front"]]
        beaten = dense_beats(frontier["candidates"])
        pruned = [point for point in frontier["candidates"] if not point["dense"]]
        lines += [
            f"## {run['model']} ({run['seconds']:.0f} s for the sweep)",
            "",
            f"![frontier of {run['model']}](frontier-{run['model']}.png)",
            "",
            f"| ratio | type | bytes | parameters | {' | '.join(f'perplexity {text}' for text in texts)} | on front |",
            "|---|---|---|---|" + "---|" * len(texts) + "---|",
        ]
        for point in frontier["candidates"]:
            ratio = "dense" if point["dense"] else f"{point['ratio']:g}"
            figures = " | ".join(f"{point['perplexity'][text]:.3f}" for text in texts)
            lines.append(
                f"| {ratio} | {point['variant']} | {point['bytes']:,} | {point['params']:,} | {figures} | "
                f"{'yes' if point['on_front'] else ''} |"
            )
        lines += [
            "",
            f"- On the front ({len(front)} of {len(frontier['candidates'])} points), smallest first: "
            + ", ".join(_name(point) for point in sorted(front, key=lambda point: point["bytes"]))
            + ".",
            f"- A dense file beats {len(beaten)} of the {len(pruned)} pruned points (at most as large, lower "
            f"in perplexity on {texts[0]})"
            + (
                ": " + "; ".join(f"{_name(point)} by {_name(dense)}" for point, dense in beaten) + "."
                if beaten
                else "."
            ),
        ]
        budget = run["budget"]
        pick = budget["pick"]
        if pick is not None:
            lines.append(
                f"- Within {BUDGET_SHARE:.0%} of the dense f16 file ({budget['max_bytes']:,} bytes) a job picks "
                f"{_name(pick)} ({pick['bytes']:,} bytes, perplexity {first_perplexity(pick):.3f}); "
                + _pruned_within(budget["best_pruned"], pick)
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    parser.add_argument("--gguf-types", nargs="+", default=None, help=f"default: {', '.join(DEFAULT_GGUF_TYPES)}")
    parser.add_argument("--n-samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--eval-windows", type=int, default=20)
    parser.add_argument("--eval-seq-len", type=int, default=128)
    parser.add_argument("--models-dir", default=default_models_dir())
    parser.add_argument("--datasets-dir", default=default_datasets_dir())
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--render",
        action="store_true",
        help="no sweep: the budget applied again to the points in frontier.json (the pick's rule changed), rewritten",
    )
    args = parser.parse_args(argv)
    if args.render:
        payload = json.loads((args.out / "frontier.json").read_text())
        for run in payload["models"]:
            run["budget"] = at_budget(run["frontier"])
        write_json(args.out / "frontier.json", payload)
        (args.out / "frontier.md").write_text(render(payload))
        return payload
    start = time.perf_counter()
    machine = machine_info()
    with tempfile.TemporaryDirectory() as work:
        models = [sweep_model(name, args, Path(work)) for name in args.models]
    payload = {
        "machine": finish_machine_info(machine),
        "settings": {
            "ratios": args.ratios,
            "gguf_types": args.gguf_types,
            "calibration_set": CALIBRATION_SET,
            "n_samples": args.n_samples,
            "seq_len": args.seq_len,
            "eval_sets": list(EVAL_SETS),
            "eval_windows": args.eval_windows,
            "eval_seq_len": args.eval_seq_len,
            "budget_share": BUDGET_SHARE,
        },
        "models": models,
        "total_seconds": time.perf_counter() - start,
    }
    assert all_finite(payload)
    write_json(args.out / "frontier.json", payload)
    (args.out / "frontier.md").write_text(render(payload))
    return payload


if __name__ == "__main__":
    main()
