"""Recovery bench: which recovery recipe to make the default. Both fixture models pruned by 30 % and 50 %, then
recovered by each recipe at the same number of steps and tokens (cross-entropy + LoRA, distillation + LoRA,
distillation and cross-entropy + LoRA, distillation + full fine-tuning); perplexity, a small zero-shot average,
seconds and the memory model's device estimate, next to the paper's LLaMA2-7B table (appendix, 50 %, LoRA on
cleaned Alpaca for 2 epochs).

Pruning as in the quality bench (greedy, gradient allocation, calibration on `ptb:train`, 16 x 128 tokens);
recovery on the first `--train-lines` lines of PTB train (the teacher's top-64 cache computed once per model from
the dense model); perplexity on the first `--eval-windows` windows of 128 tokens of `wikitext2` (raw test) and
`ptb` (test), held out from the training data. Writes bench/results/recovery.json and recovery.md.
"""

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any

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
from casp_core.eval.perplexity import evaluation_text, windows_perplexity
from casp_core.eval.zeroshot import evaluate_zero_shot
from casp_core.method.placement import ModelShape, estimate_recovery_memory
from casp_core.method.prune import prune
from casp_core.model import load_model
from casp_core.recovery.data import load_training_data
from casp_core.recovery.teacher import compute_teacher, teacher_fingerprint
from casp_core.recovery.train import recover
from casp_core.settings import CalibrationConfig, PruneConfig, RecoveryConfig

MODELS = ("stories260K", "ptbwiki-7M")
RATIOS = (0.3, 0.5)
EVALUATION = ("wikitext2", "ptb:test")
SEQ_LEN = 128
# name: (method, loss); every recipe trains the same steps on the same batches.
RECIPES = {
    "cross_entropy+lora": ("lora", "cross_entropy"),
    "distill+lora": ("lora", "distill"),
    "distill_ce+lora": ("lora", "distill_ce"),
    "distill+full": ("full", "distill"),
}
# The paper's Table (appendix "Performance Recovery with Fine-tuning"): LLaMA2-7B, 50 %, CASP.
PAPER = {"wikitext2": (18.1812, 12.52), "ptb": (67.9484, 42.45), "average zero-shot": (0.4492, 0.494)}


def recipe_config(recipe: str, args: argparse.Namespace) -> RecoveryConfig:
    method, loss = RECIPES[recipe]
    return RecoveryConfig(
        method=method,
        loss=loss,
        max_steps=args.steps,
        batch_size=args.batch_size,
        grad_accum=1,
        max_seq_len=SEQ_LEN,
        lr=args.full_lr if method == "full" else args.lr,
    )


def run_model(name: str, args: argparse.Namespace, training_file: Path, work: Path) -> list[dict[str, Any]]:
    dense, tokenizer = load_model(str(Path(args.models_dir) / name))
    texts = [
        evaluation_text(tokenizer, spec, SEQ_LEN, datasets_dir=args.datasets_dir, max_windows=args.eval_windows)
        for spec in EVALUATION
    ]

    def figures(candidate: Any) -> dict[str, Any]:
        perplexity = {text.dataset: windows_perplexity(candidate, text, device="cpu") for text in texts}
        if not args.zero_shot:
            return {"perplexity": perplexity}
        zero_shot = evaluate_zero_shot(
            candidate,
            tokenizer,
            args.zero_shot,
            limit=args.zero_shot_limit,
            datasets_dir=args.datasets_dir,
            device="cpu",
        )
        return {"perplexity": perplexity, "zero_shot_average": zero_shot["average_acc"]}

    dense_figures = figures(dense)
    data = load_training_data(str(training_file), tokenizer, max_seq_len=SEQ_LEN, context=512)
    distill = recipe_config("distill+lora", args)
    teacher = compute_teacher(
        dense, data, distill, work / name, teacher_fingerprint({"model": name}, data, distill), device="cpu"
    )
    shape = ModelShape.of(dense)
    rows = []
    for ratio in args.ratios:
        calibration = CalibrationConfig(dataset="ptb:train", n_samples=16, seq_len=SEQ_LEN)
        config = PruneConfig(ratio=ratio, calibration=calibration, datasets_dir=args.datasets_dir)
        pruned = prune(copy.deepcopy(dense), tokenizer, config)
        pruned_figures = figures(pruned.model)
        for recipe in args.recipes:
            settings = recipe_config(recipe, args)
            started = time.perf_counter()
            recovered, result = recover(
                copy.deepcopy(pruned.model),
                tokenizer,
                data,
                settings,
                device="cpu",
                teacher=teacher if settings.loss != "cross_entropy" else None,
            )
            seconds = time.perf_counter() - started
            estimate = estimate_recovery_memory(shape, settings, ratio, autocast=False)
            rows.append(
                {
                    "model": name,
                    "ratio": ratio,
                    "achieved_ratio": pruned.achieved_ratio,
                    "recipe": recipe,
                    "dense": dense_figures,
                    "pruned": pruned_figures,
                    "recovered": figures(recovered),
                    "recovery": {key: value for key, value in result.summary().items() if key != "curve"},
                    "loss_first_last": [result.curve[0]["loss"], result.curve[-1]["loss"]],
                    "ce_first_last": [result.curve[0]["ce"], result.curve[-1]["ce"]],
                    "seconds": seconds,
                    "estimated_memory_bytes": estimate.peak,
                    "settings": settings.to_dict(),
                    "train_lines": args.train_lines,
                    "eval_windows": args.eval_windows,
                }
            )
            print(f"{name} {ratio} {recipe}: {rows[-1]['recovered']} in {seconds:.0f} s", flush=True)
    return rows


def render_markdown(payload: dict[str, Any]) -> str:
    machine = payload["machine"]
    zero_shot = payload["zero_shot"]
    lines = [
        "# CASP recovery bench",
        "",
        f"Machine: {machine_line(machine)}. {concurrency_note(machine)}",
        "",
        f"Pruned by 30 % and 50 % (greedy, gradient allocation, calibration `ptb:train` 16 x {SEQ_LEN}); within "
        f"a model every recipe trains the same steps (the `steps x batch` column, {SEQ_LEN}-token sequences) on the "
        "same batches of the head of PTB train (the `train lines` column), lr "
        f"{payload['lr']} for LoRA rank 8 on all projections, {payload['full_lr']} for full; distillation from the "
        "dense model's top-64 at temperature 1, `distill_ce` with ce_weight 0.5. Perplexity on the first windows "
        f"(`eval windows`) of {SEQ_LEN} tokens of the held-out test splits"
        + (
            f"; zero-shot where run: the average accuracy over {', '.join(zero_shot)} (first "
            f"{payload['zero_shot_limit']} examples each; these models are near chance, so it is noise-level)."
            if zero_shot
            else "; zero-shot not run."
        ),
        "",
        "| model | ratio | recipe | steps x batch | train lines | eval windows | WikiText-2 (dense / pruned / "
        "recovered) | PTB (dense / pruned / recovered) | zero-shot avg (pruned / recovered) | seconds | "
        "est. memory (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in payload["rows"]:
        cells = []
        for dataset in ("wikitext2", "ptb"):
            values = (row[side]["perplexity"][dataset] for side in ("dense", "pruned", "recovered"))
            cells.append(" / ".join(f"{value:.2f}" for value in values))
        if "zero_shot_average" in row["recovered"]:
            cells.append(f"{row['pruned']['zero_shot_average']:.3f} / {row['recovered']['zero_shot_average']:.3f}")
        else:
            cells.append("-")
        settings = row["settings"]
        lines.append(
            f"| {row['model']} | {row['ratio']} | {row['recipe']} | {settings['max_steps']} x "
            f"{settings['batch_size']} | {row['train_lines']} | {row['eval_windows']} | {' | '.join(cells)} | "
            f"{row['seconds']:.0f} | {row['estimated_memory_bytes'] / 2**20:.0f} |"
        )
    lines += [
        "",
        "Memory: casp_core.method.placement's estimate of the device memory at these settings in float32 (the CPU has "
        "no per-run peak to measure); the teacher cache costs 388 bytes per training token at top-64.",
        "",
        "The paper (LLaMA2-7B, CASP at 50 %, LoRA on cleaned Alpaca, 2 epochs, lr 1e-4, batch 128):",
        "",
        "| figure | pruned 50 % | pruned + recovered | recovered / pruned |",
        "|---|---|---|---|",
        *(f"| {name} | {before} | {after} | {after / before:.3f} |" for name, (before, after) in PAPER.items()),
        "",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--full-lr", type=float, default=1e-4)
    parser.add_argument("--train-lines", type=int, default=1000)
    parser.add_argument("--eval-windows", type=int, default=20)
    parser.add_argument("--zero-shot", nargs="*", default=["arc_easy", "piqa", "winogrande"])
    parser.add_argument("--zero-shot-limit", type=int, default=50)
    parser.add_argument("--models-dir", default=default_models_dir())
    parser.add_argument("--datasets-dir", default=default_datasets_dir())
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--append",
        nargs="*",
        type=Path,
        default=[],
        help="earlier recovery.json files whose rows of other models are kept (a model benched apart, with its "
        "own settings, on a busy machine)",
    )
    args = parser.parse_args(argv)
    machine = machine_info()
    ptb_train = Path(args.datasets_dir) / "ptb" / "ptb.train.txt"
    payload: dict[str, Any] = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "full_lr": args.full_lr,
        "train_lines": args.train_lines,
        "eval_windows": args.eval_windows,
        "zero_shot": args.zero_shot,
        "zero_shot_limit": args.zero_shot_limit,
        "rows": [],
        "paper": PAPER,
    }
    with tempfile.TemporaryDirectory() as work:
        training_file = Path(work) / "ptb-train-head.txt"
        lines = ptb_train.read_text(encoding="utf-8").splitlines()[: args.train_lines]
        training_file.write_text("\n".join(lines), encoding="utf-8")
        earlier = [json.loads(path.read_text()) for path in args.append]
        payload["machine"] = earlier[0]["machine"] if earlier and not args.models else machine

        def write() -> None:
            kept = [
                {"train_lines": result["train_lines"], "eval_windows": result["eval_windows"], **row}
                for result in earlier
                for row in result["rows"]
                if row["model"] not in args.models
            ]
            payload["rows"] = kept + [row for row in payload["rows"] if row["model"] in args.models]
            write_json(args.out / "recovery.json", payload)
            (args.out / "recovery.md").write_text(render_markdown(payload))

        write()
        for name in args.models:
            payload["rows"] += run_model(name, args, training_file, Path(work))
            # Written after each model: a long run interrupted keeps what it finished.
            finish_machine_info(machine)
            write()
    return payload


if __name__ == "__main__":
    main()
