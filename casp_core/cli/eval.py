"""`casp eval`: zero-shot accuracy, perplexity and efficiency of one checkpoint, dense or pruned.

    casp eval --model PATH [--tasks a,b] [--limit N] [--perplexity wikitext2,ptb] [--datasets-dir DIR]
              [--device D] [--out FILE.json]

The JSON it writes (and prints when no --out is given):

    {
      "model": PATH,
      "zero_shot": {task: {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "n_samples", ...}},
      "zero_shot_summary": the rest of evaluate_zero_shot's output (harness version, limit, average_acc, ...),
      "perplexity": {data set: casp_core.eval.perplexity.perplexity's output},
      "efficiency": casp_core.eval.efficiency.measure_efficiency's output,
    }

A section that was not asked for is absent. Wire it into the command with
`add_eval_parser(subparsers)`; the work itself is `evaluate_checkpoint`, callable without argparse.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from casp_core.cli.arguments import names, non_negative_int, positive_int
from casp_core.cli.progress import local_run
from casp_core.errors import InvalidConfig, ModelNotFound
from casp_core.settings import ZERO_SHOT_TASKS, EfficiencyConfig

if TYPE_CHECKING:
    from casp_core.run import Run


def add_eval_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval", help="evaluate a checkpoint (dense or pruned): zero-shot accuracy, perplexity, efficiency"
    )
    parser.add_argument(
        "--model",
        required=True,
        help="local checkpoint directory (dense or pruned), or a GGUF file: evaluated dequantized in transformers, "
        "and its perplexity measured in llama.cpp itself on the same windows",
    )
    parser.add_argument(
        "--tasks",
        type=names,
        default=list(ZERO_SHOT_TASKS),
        help=f"comma-separated zero-shot tasks among {','.join(ZERO_SHOT_TASKS)} (default all; '' for none)",
    )
    parser.add_argument("--limit", type=positive_int, help="quick runs: at most N documents per zero-shot task")
    parser.add_argument(
        "--perplexity",
        type=names,
        default=["wikitext2", "ptb"],
        help="comma-separated perplexity data sets ('' for none)",
    )
    parser.add_argument("--seq-len", type=positive_int, help="perplexity window (default min(2048, context))")
    parser.add_argument(
        "--max-windows", type=positive_int, help="quick runs: at most N perplexity windows per data set"
    )
    parser.add_argument(
        "--datasets-dir",
        default=os.environ.get("CASP_DATASETS_DIR"),
        help="local copies of the data sets, layout of shared/fixtures/data (env CASP_DATASETS_DIR); "
        "without it the data come from the Hugging Face hub",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="zero-shot and perplexity batch")
    parser.add_argument("--no-efficiency", dest="efficiency", action="store_false", help="skip efficiency")
    sizes = EfficiencyConfig()  # the paper's, as a job's `efficiency` settings default to
    parser.add_argument("--latency-batch-size", type=positive_int, default=sizes.batch_size)
    parser.add_argument("--latency-seq-len", type=positive_int, default=sizes.seq_len)
    parser.add_argument("--new-tokens", type=positive_int, default=sizes.new_tokens, help="tokens per decode run")
    parser.add_argument("--repeats", type=positive_int, default=sizes.repeats, help="timed runs per latency figure")
    parser.add_argument("--warmup", type=non_negative_int, default=sizes.warmup, help="untimed runs before them")
    parser.add_argument("--out", type=Path, help="write the JSON here (default: print it)")
    parser.set_defaults(run=run_eval)


def evaluate_checkpoint(
    model_path: str,
    *,
    tasks: list[str],
    limit: int | None = None,
    perplexity_sets: list[str],
    seq_len: int | None = None,
    max_windows: int | None = None,
    datasets_dir: str | None = None,
    device: str = "auto",
    batch_size: int = 16,
    efficiency: dict[str, int] | None = None,
    cache_dir: Path | None = None,
    run: "Run | None" = None,
) -> dict[str, Any]:
    """Loads `model_path` and evaluates it; `efficiency` holds measure_efficiency's settings, None skips it. A GGUF
    file is evaluated dequantized (casp_core.artifacts.gguf.source, converted once into `cache_dir`), and its
    perplexity is also measured in llama.cpp on the same windows: the figure of the file the user serves, their
    baseline."""
    # torch, transformers and the harness load only when a command needs them.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from casp_core.artifacts.caches import default_cache_dir
    from casp_core.artifacts.gguf.source import is_gguf_reference
    from casp_core.artifacts.gguf.types import require_llama_cpp
    from casp_core.eval.evaluate import EvaluationPlan, evaluate
    from casp_core.eval.perplexity import default_seq_len
    from casp_core.eval.zeroshot import resolve_datasets_dir
    from casp_core.model import load_model, resolve_device

    unknown = [task for task in tasks if task not in ZERO_SHOT_TASKS]
    if unknown:
        raise InvalidConfig(f"tasks: unknown {', '.join(unknown)}; choose among {', '.join(ZERO_SHOT_TASKS)}")
    gguf_file = Path(model_path).expanduser() if is_gguf_reference(model_path) else None
    if gguf_file is None and not Path(model_path).is_dir():
        raise ModelNotFound(f"model path {model_path!r} does not exist or is not a directory")
    if gguf_file is not None and perplexity_sets:
        require_llama_cpp()
    target = resolve_device(device)
    # One place for the env fallback, so that zero-shot and perplexity read the same copies.
    datasets_dir = resolve_datasets_dir(datasets_dir)
    if gguf_file is not None:
        model, tokenizer = load_model(str(gguf_file), device=target, cache_dir=cache_dir)
    else:
        # trust_remote_code: a pruned checkpoint carries its own modeling file (named in config.json's auto_map).
        model = AutoModelForCausalLM.from_pretrained(model_path, trust_remote_code=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    plan = EvaluationPlan(
        perplexity=tuple(perplexity_sets),
        seq_len=seq_len or default_seq_len(model.config),
        max_windows=max_windows,
        zero_shot=tuple(tasks),
        limit=limit,
        datasets_dir=datasets_dir,
        device=str(target),
        perplexity_batch_size=batch_size,
        zero_shot_batch_size=batch_size,
        efficiency=efficiency,
    ).with_texts(tokenizer)
    # Run again after a cut (Ctrl-C, a crash), it scores only the zero-shot requests it had not.
    plan = plan.keeping_scores(cache_dir or default_cache_dir())
    texts = plan.texts
    figures = evaluate(model, tokenizer, plan, run)
    out: dict[str, Any] = {"model": model_path}
    if figures.zero_shot is not None:
        zero_shot = dict(figures.zero_shot)
        out["zero_shot"] = zero_shot.pop("tasks")
        out["zero_shot_summary"] = zero_shot
    if perplexity_sets:
        out["perplexity"] = {name: {"ppl": figures.perplexity[name], **text.convention} for name, text in texts.items()}
    if figures.efficiency is not None:
        out["efficiency"] = figures.efficiency
    if gguf_file is not None:
        out["gguf"] = gguf_file_figures(gguf_file, texts)
    return out


def gguf_file_figures(path: Path, texts: dict[str, Any]) -> dict[str, Any]:
    """The GGUF file as llama.cpp serves it: its source record (name, sha256, tensor types), size, bits per weight
    and, on the evaluation's windows, its perplexity in llama.cpp."""
    from casp_core.artifacts.gguf.engine import engine_convention, gguf_bits_per_weight, gguf_perplexity
    from casp_core.artifacts.gguf.source import check_gguf_file

    return {
        **check_gguf_file(path).summary(),
        "bytes": path.stat().st_size,
        "bits_per_weight": gguf_bits_per_weight(path),
        "perplexity": gguf_perplexity(path, texts) if texts else {},
        "engine": engine_convention(),
    }


def run_eval(args: argparse.Namespace) -> int:
    efficiency = (
        {
            "batch_size": args.latency_batch_size,
            "seq_len": args.latency_seq_len,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "warmup": args.warmup,
        }
        if args.efficiency
        else None
    )
    with local_run() as run:
        out = evaluate_checkpoint(
            args.model,
            tasks=args.tasks,
            limit=args.limit,
            perplexity_sets=args.perplexity,
            seq_len=args.seq_len,
            max_windows=args.max_windows,
            datasets_dir=args.datasets_dir,
            device=args.device,
            batch_size=args.batch_size,
            efficiency=efficiency,
            run=run,
        )
    text = json.dumps(out, indent=2) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0
