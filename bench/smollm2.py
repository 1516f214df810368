"""SmolLM2-135M-Instruct: casp's claims, and the "prune, quantize or both?" answer, on a real pretrained model.

`python -m bench.smollm2` (#38) measures the model of `../shared/fixtures/models/smollm2-135m-instruct-gguf/`, loaded
from its Q4_1 GGUF file as `casp prune --model file.gguf` loads it on the CPU (dequantized to float32), in five
parts:

- `quality`: the defaults against each alternative the README claims they beat (`CONFIGS`) at `--ratios`.
  Perplexity on WikiText-2 test and PTB test (`ptb:test`; casp's plain `ptb` is the validation split) at
  128-token windows (LLM-Pruner's and FLAP's convention) and 2048-token ones (SliceGPT's and Wanda's), the first
  `--windows-128` and `--windows-2048` windows of each, the same windows for every row. The seven zero-shot tasks
  (`--zero-shot-limit` documents each; 0: every document) for the dense model and every row at
  `ZERO_SHOT_RATIOS`. The prune's wall time and peak host memory, in a fresh process per row.
- `zero-shot`: the seven tasks on every document of each, for the dense model and each configuration of
  `CONFIGS` at `ZERO_SHOT_RATIOS`, each pruned as its quality row is. One row per task (`zero-shot/<configuration>/
  <ratio>/<task>`, the cheapest tasks first; the first of a configuration's rows prunes and writes the model,
  the others load it, `pruned_once`), so that the part lands piece by piece: a model's seven cost about an hour and
  a half of 2 cores (hellaswag about an hour, boolq 10 minutes, openbookqa one), where the quality row's
  perplexities take minutes. hellaswag is measured in eighths of its documents, a row each (`ZERO_SHOT_PARTS`), and
  a row cut short resumes from the scores it kept (`SCORES_CACHE`). A model a row of the task has measured, bit for
  bit (`weights_digest`: alpha "auto" where it chooses the default's temperature), is not evaluated again: its row
  copies that accuracy and names the row (`same_weights_as`). The table gathers a configuration's tasks, the mean
  of its first five (`FIRST_FIVE_TASKS`) once they are in, and the mean of all seven once all are; below it, the
  accuracies that differ from the defaults' by over twice the standard error of the difference, and the rows
  measured and left, with the hours left at the minutes each task's rows took.
- `ladder`: every GGUF file, made by llama.cpp's quantizer (its fallbacks included), measured in llama.cpp on the
  same windows: the dense model down `DENSE_LADDER`, the source Q4_1 file itself, and the defaults' prune at each
  ratio in `PRUNED_TYPES` (`round_to: auto`, so pruned once per block family). Beside each, its bytes, bits per
  weight and llama.cpp's prefill and decode speed at `SPEED_THREADS` threads. The equal-bytes table puts each
  pruned file against the dense ladder interpolated at its size; smollm2.png draws the front.
- `recovery`: the defaults' prune at `RECOVERY_RATIO`, recovered by each recipe of `RECIPES` on PTB train
  (`ptb:train`, held out from both test texts) for `--recovery-steps` steps of the same batches, then its `q4_k_m`
  file in llama.cpp against the dense front.

Calibration is the same for every prune: `CALIBRATION` (the WikiText-2 validation file, 32 x 512 tokens, seed 0).
The gradient sensitivities S_l depend only on the dense model and those windows, not on the ratio, solver or
compensation: they are measured once (the row `allocation/sensitivities`, its time and peak beside it) and given
to every prune, as bench/quality.py does, so a row's prune time and peak exclude them.

Each row is measured in a child process (its peak RSS is the child's VmHWM) and written to
bench/results/smollm2.json as it finishes, with its machine, commit, load before and after and the settings it was
measured under. A rerun skips the rows already held under the same settings, so the bench can be stopped and
resumed; `--rerun KEY` measures one row again beside the held one (the reproducibility check). smollm2.md and
smollm2.png are rendered from the JSON after every row (`--render` alone renders).
"""

import argparse
import fnmatch
import hashlib
import json
import math
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from statistics import fmean, median
from typing import Any

from bench.common import (
    RESULTS_DIR,
    SMOLLM2_GGUF,
    default_datasets_dir,
    default_models_dir,
    finish_machine_info,
    git_commit,
    machine_info,
    machine_line,
    run_child,
    write_json,
)
from bench.memory import memory_status_mib
from bench.quantized import _dense_at

RATIOS = (0.2, 0.3, 0.1, 0.5)  # 0.2 first: the ratio the figures and the README's headline are at
# Name -> the settings that differ from casp prune's defaults.
CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "solver diagonal": {"solver": "diagonal"},
    "solver wanda_sp": {"solver": "wanda_sp"},
    "FLAP (UL-UM)": {"solver": "flap", "compensation": "bias", "allocation": "uniform"},
    "FLAP, gradient allocation": {"solver": "flap", "compensation": "bias"},
    "allocation uniform": {"allocation": "uniform"},
    "compensation none (the paper's CASP)": {"compensation": "none"},
    "alpha auto": {"alpha": "auto"},
    # The paper's temperature, casp's default until this bench measured 0.5 better.
    "alpha 1 (the paper's)": {"alpha": 1.0},
    "shape uniform (vLLM)": {"shape": "uniform"},
}
ZERO_SHOT_RATIOS = (0.2, 0.3)
ZERO_SHOT_TASKS = ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
# The dense model's minutes a task on every document, on 2 cores, extrapolated from its first 100 documents: what
# the progress table expects of a task no row has measured on every document yet. hellaswag's is measured: the
# dense model's eight eighths took 59 minutes, 4.3 to 9.1 each (the split's ActivityNet documents, then from the
# third on its WikiHow ones, 2.5 times as long).
EXTRAPOLATED_MINUTES = {
    "openbookqa": 1,
    "winogrande": 2,
    "piqa": 6,
    "arc_challenge": 7,
    "arc_easy": 10,
    "boolq": 37,
    "hellaswag": 60,
}
# The order the zero-shot part measures a model's tasks in, the cheapest on every document first.
ZERO_SHOT_TASKS_BY_COST = tuple(sorted(EXTRAPOLATED_MINUTES, key=EXTRAPOLATED_MINUTES.__getitem__))
# The five a configuration has first, a tenth of the part's hours: their mean ranks the configurations while boolq
# and hellaswag are still to come.
FIRST_FIVE_TASKS = ZERO_SHOT_TASKS_BY_COST[:5]
# The longest task, measured in this many parts of consecutive documents, a row each (`zero-shot/<configuration>/
# <ratio>/hellaswag (part 1 of 8)`, 4 to 9 minutes): a stop loses a part's work at most, a session's end none of
# the parts written, and the task's accuracy is its parts', weighted by their documents, once all are in
# (`whole_tasks`).
ZERO_SHOT_PARTS = {"hellaswag": 8}
PART = re.compile(r"(?P<task>\w+) \(part (?P<part>\d+) of (?P<parts>\d+)\)")
# Label -> the evaluation source: both test splits, held out from calibration and recovery text.
EVAL_SETS = {"wikitext2": "wikitext2", "ptb:test": "ptb:test"}
EVAL_SEQ_LENS = (128, 2048)
CALIBRATION = {"dataset": "wikitext-2/wiki.valid.tokens", "n_samples": 32, "seq_len": 512, "seed": 0}
DENSE_LADDER = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0", "iq4_nl", "q3_k_m", "q2_k")
# The type a checkpoint is pruned for (round_to auto fits its block) -> the pruned files written from it.
PRUNED_TYPES = {"q8_0": ("q8_0",), "q4_k_m": ("q5_k_m", "q4_k_m")}
SPEED_THREADS = (1, 2)
SPEED_REPEATS = 3
# How the ladder times a file: a pruned file against the dense file of the same type timed beside it (file_figures).
SPEED = {"threads": list(SPEED_THREADS), "repeats": SPEED_REPEATS, "against": "dense of the same type, timed beside"}
FRONT_AXIS = ("wikitext2", 2048)  # the plot's perplexity and the equal-bytes table's first column
RECOVERY_RATIO = 0.3
# The zero-shot rows' pruned model, under casp's cache folder (casp_core.artifacts.caches.default_cache_dir).
PRUNED_CACHE = "bench-smollm2-pruned"
# A zero-shot row's log-likelihoods as they are scored, by its model's weights_digest and its task (or part), beside
# PRUNED_CACHE: a row cut short (boolq's are 10 minutes, a part of hellaswag's 4 to 9) resumes where it stopped when run
# again on this machine.
SCORES_CACHE = "bench-smollm2-scores"
PRUNE_FIGURES = "prune-figures.json"
RECIPES = {"distill_ce+lora": ("lora", "distill_ce"), "distill+full": ("full", "distill")}
RECOVERY_SEQ_LEN = 256
# The settings a pruned model depends on: a row records them, casp's defaults resolved, and is measured again when
# they change (a new default, say). Evaluation and export settings are the bench's own.
PRUNE_FIELDS = (
    "ratio", "alpha", "solver", "allocation", "shape", "r_max", "round_to", "compensation", "compensation_damping",
    "dtype", "calibration", "moe", "gguf_type",
)  # fmt: skip
RESULT = "smollm2"
SENSITIVITIES_ROW = "allocation/sensitivities"


def eval_key(dataset: str, seq_len: int) -> str:
    return f"{dataset}@{seq_len}"


def measured_tasks(task: str) -> list[str]:
    """What a model's zero-shot rows of `task` measure: the task, or each of its `ZERO_SHOT_PARTS` parts."""
    parts = ZERO_SHOT_PARTS.get(task)
    return [task] if parts is None else [f"{task} (part {part} of {parts})" for part in range(1, parts + 1)]


def task_of(key: str) -> str:
    """The task a zero-shot row measures, whole or a part of it."""
    measured = key.rsplit("/", 1)[1]
    part = PART.fullmatch(measured)
    return part["task"] if part else measured


def part_documents(measured: str, datasets_dir: str) -> tuple[str, range | None]:
    """A zero-shot row's task and, for a part of it, the indices of the part's documents."""
    from casp_core.eval.zeroshot import documents_scored

    part = PART.fullmatch(measured)
    if part is None:
        return measured, None
    task, number, parts = part["task"], int(part["part"]), int(part["parts"])
    documents = documents_scored(task, datasets_dir)
    return task, range((number - 1) * documents // parts, number * documents // parts)


# ---------------------------------------------------------------- what a child process measures


def model_path(settings: dict[str, Any]) -> str:
    return str(Path(settings["models_dir"]) / SMOLLM2_GGUF)


def prune_config(settings: dict[str, Any], ratio: float, overrides: dict[str, Any]) -> Any:
    from casp_core.settings import CalibrationConfig, PruneConfig

    calibration = {**CALIBRATION, "dataset": str(Path(settings["datasets_dir"]) / CALIBRATION["dataset"])}
    return PruneConfig(
        ratio=ratio,
        calibration=CalibrationConfig(**calibration),
        datasets_dir=settings["datasets_dir"],
        device="cpu",
        **overrides,
    )


def planned_prune(key: str) -> tuple[float, dict[str, Any]] | None:
    """The ratio the row `key` prunes at and its settings other than casp prune's defaults; None: the dense model."""
    part, *rest = key.split("/")
    if part in ("quality", "zero-shot"):
        ratio, overrides = float(rest[1]), CONFIGS.get(rest[0], {})
    elif part == "ladder":
        ratio, overrides = float(rest[0]), {"export": ["gguf"], "gguf_type": rest[1]}
    elif part == "recovery":
        ratio, overrides = RECOVERY_RATIO, {}
    else:
        return None
    return (ratio, overrides) if ratio else None


def prune_record(settings: dict[str, Any], key: str) -> dict[str, Any] | None:
    """What the row's prune resolves to (`PRUNE_FIELDS`, casp's defaults included), without this machine's paths."""
    planned = planned_prune(key)
    if planned is None:
        return None
    from casp_core.method.budget import AllocationPlan

    config = prune_config(settings, *planned)
    record = {field: value for field, value in config.to_dict().items() if field in PRUNE_FIELDS}
    if not AllocationPlan.of(config).uses_sensitivities:  # a uniform allocation or shape has no temperature
        record["alpha"] = None
    return record | {"calibration": record["calibration"] | {"dataset": CALIBRATION["dataset"]}}


def evaluation_texts(tokenizer: Any, settings: dict[str, Any]) -> dict[str, Any]:
    from casp_core.eval.perplexity import evaluation_text

    return {
        eval_key(name, seq_len): evaluation_text(
            tokenizer,
            source,
            seq_len,
            datasets_dir=settings["datasets_dir"],
            max_windows=settings["windows"][str(seq_len)],
        )
        for seq_len in EVAL_SEQ_LENS
        for name, source in EVAL_SETS.items()
    }


def sensitivities_row(settings: dict[str, Any]) -> dict[str, Any]:
    """The gradient allocation's S_l on the calibration windows, as `prune` measures them, with their seconds."""
    import torch

    from casp_core.method.allocation import layer_sensitivities
    from casp_core.method.calibration import CalibrationPlan, calibration_windows
    from casp_core.model import load_model
    from casp_core.run import Run

    model, tokenizer = load_model(model_path(settings))
    config = prune_config(settings, RATIOS[0], {})
    windows = calibration_windows(tokenizer, CalibrationPlan.of(config, model.config))
    start = time.perf_counter()
    sensitivities = layer_sensitivities(
        model, windows, batch_size=config.calibration.batch_size, device=torch.device("cpu"), run=Run()
    )
    return {
        "sensitivities": sensitivities,
        "seconds": time.perf_counter() - start,
        "peak_rss_mib": memory_status_mib("VmHWM"),
    }


def pruned(
    settings: dict[str, Any], ratio: float, overrides: dict[str, Any], sensitivities: list[float] | None
) -> tuple[Any, Any, dict[str, Any]]:
    """The model pruned at `ratio` with `overrides` (ratio 0: dense), given the S_l (measured inside when None),
    with the prune's seconds and peak RSS."""
    from casp_core.method.prune import prune
    from casp_core.model import load_model

    model, tokenizer = load_model(model_path(settings))
    start = time.perf_counter()
    achieved, temperature = 0.0, None
    if ratio:
        result = prune(model, tokenizer, prune_config(settings, ratio, overrides), sensitivities=sensitivities)
        model, achieved = result.model, result.achieved_ratio
        temperature = result.temperature.summary() if result.temperature else None
    return (
        model,
        tokenizer,
        {
            "achieved_ratio": achieved,
            "params": sum(parameter.numel() for parameter in model.parameters()),
            "prune_seconds": time.perf_counter() - start,
            "sensitivities_given": sensitivities is not None,
            "alpha_auto": temperature,  # alpha "auto": the temperature chosen and each candidate's held-out loss
            # The process's peak so far: loading and pruning, before any evaluation.
            "prune_peak_rss_mib": memory_status_mib("VmHWM"),
        },
    )


def zero_shot(
    model: Any,
    tokenizer: Any,
    settings: dict[str, Any],
    limit: int | None,
    tasks: tuple[str, ...] = ZERO_SHOT_TASKS,
    scores_dir: Path | None = None,
    documents: range | None = None,
) -> dict[str, Any]:
    """The tasks' accuracies and their mean, on the first `limit` documents of each (None: all of them, or those of
    `documents`); the log-likelihoods kept in `scores_dir` as they come, where one is given (evaluate_zero_shot)."""
    from casp_core.eval.zeroshot import evaluate_zero_shot

    result = evaluate_zero_shot(
        model,
        tokenizer,
        list(tasks),
        limit=limit,
        datasets_dir=settings["datasets_dir"],
        device="cpu",
        scores_dir=scores_dir,
        documents=documents,
    )
    tasks_figures = result["tasks"].items()
    return {
        "acc": {task: figures["acc"] for task, figures in tasks_figures},
        "acc_stderr": {task: figures["acc_stderr"] for task, figures in tasks_figures},
        "n_samples": {task: figures["n_samples"] for task, figures in tasks_figures},
        "mean": result["average_acc"],
    }


def quality_row(
    settings: dict[str, Any], ratio: float, overrides: dict[str, Any], sensitivities: list[float] | None
) -> dict[str, Any]:
    from casp_core.eval.perplexity import windows_perplexity

    model, tokenizer, figures = pruned(settings, ratio, overrides, sensitivities)
    texts = evaluation_texts(tokenizer, settings)
    start = time.perf_counter()
    ppl = {key: windows_perplexity(model, text, device="cpu") for key, text in texts.items()}
    measured = settings["zero_shot_limit"] >= 0 and (ratio == 0 or ratio in ZERO_SHOT_RATIOS)
    return {
        **figures,
        "ppl": ppl,
        "zero_shot": zero_shot(model, tokenizer, settings, settings["zero_shot_limit"] or None) if measured else None,
        "evaluation_seconds": time.perf_counter() - start,
    }


def pruned_once(
    settings: dict[str, Any], ratio: float, overrides: dict[str, Any], sensitivities: list[float] | None
) -> tuple[Any, Any, dict[str, Any]]:
    """The model `pruned` gives, pruned by the first of a configuration's zero-shot rows and written to the cache,
    then loaded from there by every row (each row is a process of its own, and the prune is about 90 s of a cheap
    task's 2-4 minutes). An entry is the prune's settings, the S_l and the commit; the cache keeps the one in use
    alone (about 0.5 GB; the rows run a configuration's tasks one after another). Its figures are those of the
    prune that made it; `pruned_model_reused` says whether this row loaded it, made by an earlier row. The dense
    model (ratio 0) is `pruned`'s: loading it is all there is."""
    from casp_core.artifacts.caches import BoundedCache, default_cache_dir
    from casp_core.artifacts.checkpoint import load_pruned
    from casp_core.model import key_digest

    if not ratio:
        return pruned(settings, ratio, overrides, sensitivities)
    cache = BoundedCache(default_cache_dir() / PRUNED_CACHE, max_bytes=0)
    described = [prune_config(settings, ratio, overrides).to_dict(), sensitivities, git_commit()]
    entry = key_digest(described)[:24]
    reused = cache.has(entry)
    if not reused:
        model, tokenizer, figures = pruned(settings, ratio, overrides, sensitivities)
        with cache.partial() as partial:  # whole or not at all: a row cut short leaves no entry to load
            save_checkpoint(model, tokenizer, partial, settings)
            (partial / PRUNE_FIGURES).write_text(json.dumps(figures))
            cache.add(partial, entry)
        del model
    with cache.held(entry, evicted=f"the pruned model {entry} left the cache while it was being loaded") as folder:
        model, tokenizer = load_pruned(folder)
        figures = json.loads((folder / PRUNE_FIGURES).read_text())
    return model, tokenizer, figures | {"pruned_model_reused": reused}


def weights_digest(model: Any) -> str:
    """The model as it computes: its config less what names the settings asked for (casp's provenance, the
    source's path) and its tensors. Two configurations that prune to one model share it: alpha "auto" where it
    chooses the default's temperature, or 0 at a ratio where that is the uniform allocation."""
    import torch

    config = model.config.to_diff_dict()
    for named_elsewhere in ("casp", "_name_or_path", "transformers_version"):
        config.pop(named_elsewhere, None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def zero_shot_row(
    settings: dict[str, Any],
    ratio: float,
    overrides: dict[str, Any],
    measured: str,
    sensitivities: list[float] | None,
    measured_models: dict[str, str],
) -> dict[str, Any]:
    """Every document of one task, or of a part of it (`measured`, `ZERO_SHOT_PARTS`), on the model the quality row
    of the same settings measures; not measured again where `measured_models` (the rows of the same task or part
    measured, by their model's `weights_digest`) holds the same model: `same_weights_as` names that row, and the
    parent copies its accuracy. A row cut short resumes from the scores it kept (SCORES_CACHE); its
    `evaluation_seconds` are then this run's alone."""
    from casp_core.artifacts.caches import default_cache_dir

    model, tokenizer, figures = pruned_once(settings, ratio, overrides, sensitivities)
    digest = weights_digest(model)
    if digest in measured_models:
        return {**figures, "weights_digest": digest, "same_weights_as": measured_models[digest]}
    task, documents = part_documents(measured, settings["datasets_dir"])
    folder = re.sub(r"\W+", "-", measured).strip("-")  # "hellaswag-part-1-of-8"
    scores_dir = default_cache_dir() / SCORES_CACHE / f"{digest[:24]}-{folder}"
    start = time.perf_counter()
    figures |= {
        "weights_digest": digest,
        "zero_shot": zero_shot(model, tokenizer, settings, None, (task,), scores_dir, documents),
        "evaluation_seconds": time.perf_counter() - start,
    }
    shutil.rmtree(scores_dir)  # the row holds its accuracy now
    return figures


def gguf_rows(
    checkpoint: Path, gguf_types: tuple[str, ...], texts: dict[str, Any], dense: Path | None = None
) -> list[dict[str, Any]]:
    """Each type's file of `checkpoint`, measured; with `dense` (the dense checkpoint), the dense file of the same
    type is timed right after each of its speed runs, in the same process."""
    from casp_core.artifacts.gguf.writer import export_gguf

    rows = []
    for gguf_type in gguf_types:
        export = export_gguf(checkpoint, checkpoint / f"model-{gguf_type}.gguf", gguf_type)
        reference = export_gguf(dense, dense / f"model-{gguf_type}.gguf", gguf_type).path if dense else None
        rows.append(
            {
                "type": gguf_type,
                **file_figures(export.path, texts, reference),
                "tensor_types": dict(Counter(export.tensor_types.values()).most_common()),
                "fallbacks": [asdict(fallback) for fallback in export.fallbacks],
            }
        )
        export.path.unlink()
        if reference:
            reference.unlink()
    return rows


def file_figures(path: Path, texts: dict[str, Any], reference: Path | None = None) -> dict[str, Any]:
    """A GGUF file's bytes, bits per weight, perplexity on `texts` and speed, in llama.cpp; with `reference`, that
    file's speed too, each of its runs right after the file's at the same thread count. This machine's speed
    drifts between sessions by a third (the dense q8_0 decoded 153 tokens/s in one session and 102 in the next, on
    the same VM type), so a speed is set only against one timed beside it."""
    from casp_core.artifacts.gguf import engine

    start = time.perf_counter()
    ppl = engine.gguf_perplexity(path, texts)
    timed = {"tokens_per_s": path} | ({"dense_tokens_per_s": reference} if reference else {})
    speeds: dict[str, dict[str, dict[str, float]]] = {key: {} for key in timed}
    for threads in SPEED_THREADS:
        for key, file in timed.items():
            runs = engine.engine_speed(file, SPEED_REPEATS, threads)
            speeds[key][str(threads)] = dict(zip(("prefill", "decode"), runs, strict=True))
    figures = {"bytes": path.stat().st_size, "bits_per_weight": engine.gguf_bits_per_weight(path), "ppl": ppl}
    return figures | speeds | {"seconds": time.perf_counter() - start}


def ladder_row(
    settings: dict[str, Any],
    ratio: float,
    overrides: dict[str, Any],
    planned_for: str,
    sensitivities: list[float] | None,
) -> dict[str, Any]:
    """Ratio 0: the dense ladder ("dense") or the source file ("source"); else the defaults' prune for
    `planned_for`'s block and the files of its family."""
    if planned_for == "source":
        _, tokenizer, _ = pruned(settings, 0, {}, None)
        texts = evaluation_texts(tokenizer, settings)
        return {"files": [{"type": "q4_1 (source)", **file_figures(Path(model_path(settings)), texts)}]}
    gguf_types = DENSE_LADDER if ratio == 0 else PRUNED_TYPES[planned_for]
    model, tokenizer, figures = pruned(settings, ratio, overrides, sensitivities)
    texts = evaluation_texts(tokenizer, settings)
    with tempfile.TemporaryDirectory() as work:
        checkpoint = Path(work) / "checkpoint"
        save_checkpoint(model, tokenizer, checkpoint, settings)
        del model
        dense = None
        if ratio:  # the dense files of the same types, to time beside the pruned ones
            dense = Path(work) / "dense"
            save_checkpoint(*pruned(settings, 0, {}, None)[:2], dense, settings)
        return {**figures, "files": gguf_rows(checkpoint, gguf_types, texts, dense)}


def save_checkpoint(model: Any, tokenizer: Any, checkpoint: Path, settings: dict[str, Any]) -> None:
    """As a job writes it: the source file's own vocabulary kept."""
    from casp_core.artifacts.checkpoint import save_pruned
    from casp_core.artifacts.gguf.tokenizer import keep_source_vocabulary

    save_pruned(model, tokenizer, checkpoint)
    keep_source_vocabulary(Path(model_path(settings)), checkpoint)


def recovery_row(
    settings: dict[str, Any], ratio: float, recipe: str, sensitivities: list[float] | None
) -> dict[str, Any]:
    from casp_core.eval.perplexity import windows_perplexity
    from casp_core.model import load_model
    from casp_core.recovery.data import load_training_data
    from casp_core.recovery.teacher import compute_teacher, teacher_fingerprint
    from casp_core.recovery.train import recover
    from casp_core.settings import RecoveryConfig

    method, loss = RECIPES[recipe]
    recovery = RecoveryConfig(
        method=method,
        loss=loss,
        dataset="ptb:train",
        max_steps=settings["recovery_steps"],
        max_seq_len=RECOVERY_SEQ_LEN,
    )
    dense, tokenizer = load_model(model_path(settings))
    data = load_training_data(
        "ptb:train", tokenizer, max_seq_len=RECOVERY_SEQ_LEN, context=2048, datasets_dir=settings["datasets_dir"]
    )
    # The sequences the steps take, in order: the teacher's top-k is computed for those alone.
    used = settings["recovery_steps"] * recovery.batch_size * recovery.grad_accum
    data = replace(data, sequences=data.sequences[:used], labels=data.labels[:used])
    texts = evaluation_texts(tokenizer, settings)
    with tempfile.TemporaryDirectory() as work:
        start = time.perf_counter()
        fingerprint = teacher_fingerprint({"model": str(SMOLLM2_GGUF)}, data, recovery)
        teacher = compute_teacher(dense, data, recovery, Path(work) / "teacher", fingerprint, device="cpu")
        teacher_seconds = time.perf_counter() - start
        model, _, figures = pruned(settings, ratio, {}, sensitivities)
        save_checkpoint(dense, tokenizer, Path(work) / "dense", settings)  # its q4_k_m is timed beside
        del dense
        pruned_ppl = {key: windows_perplexity(model, text, device="cpu") for key, text in texts.items()}
        start = time.perf_counter()
        recovered, result = recover(model, tokenizer, data, recovery, device="cpu", teacher=teacher)
        recovery_seconds = time.perf_counter() - start
        checkpoint = Path(work) / "checkpoint"
        save_checkpoint(recovered, tokenizer, checkpoint, settings)
        return {
            **figures,
            "recovery": recovery.to_dict(),
            "train_sequences": len(data),
            "train_tokens": sum(len(sequence) for sequence in data.sequences),
            "pruned_ppl": pruned_ppl,
            "ppl": {key: windows_perplexity(recovered, text, device="cpu") for key, text in texts.items()},
            "zero_shot": (
                zero_shot(recovered, tokenizer, settings, settings["zero_shot_limit"] or None)
                if settings["zero_shot_limit"] >= 0
                else None
            ),
            "loss_first_last": [result.curve[0]["loss"], result.curve[-1]["loss"]],
            "teacher_seconds": teacher_seconds,
            "recovery_seconds": recovery_seconds,
            "files": gguf_rows(checkpoint, ("q4_k_m",), texts, Path(work) / "dense"),
        }


def measure_row(
    key: str, settings: dict[str, Any], sensitivities: list[float] | None, measured_models: dict[str, str]
) -> dict[str, Any]:
    part, *rest = key.split("/")
    if part == "allocation":
        return sensitivities_row(settings)
    ratio, overrides = planned_prune(key) or (0.0, {})
    if part == "quality":
        return quality_row(settings, ratio, overrides, sensitivities)
    if part == "zero-shot":
        return zero_shot_row(settings, ratio, overrides, rest[2], sensitivities, measured_models)
    if part == "ladder":
        return ladder_row(settings, ratio, overrides, rest[1], sensitivities)
    return recovery_row(settings, ratio, rest[0], sensitivities)


# ---------------------------------------------------------------- the plan and the parent process


def planned_rows(parts: list[str], ratios: list[float]) -> Iterator[str]:
    """Each row's key: its part and what it varies; first the S_l every prune is given."""
    yield SENSITIVITIES_ROW
    if "quality" in parts:
        yield "quality/dense/0"
        for ratio in ratios:
            for config in CONFIGS:
                yield f"quality/{config}/{ratio:g}"
    if "ladder" in parts:
        yield "ladder/0/dense"
        yield "ladder/0/source"
        for ratio in ratios:
            for planned_for in PRUNED_TYPES:
                yield f"ladder/{ratio:g}/{planned_for}"
    if "recovery" in parts:
        for recipe in RECIPES:
            yield f"recovery/{recipe}"
    if "zero-shot" in parts:
        models = ["dense/0"]
        models += [f"{config}/{ratio:g}" for ratio in ratios if ratio in ZERO_SHOT_RATIOS for config in CONFIGS]
        for model in models:
            for task in ZERO_SHOT_TASKS_BY_COST:
                for measured in measured_tasks(task):
                    yield f"zero-shot/{model}/{measured}"


def chosen(key: str, only: list[str] | None) -> bool:
    """Whether `--only`'s keys or shell-style patterns take the row (`zero-shot/*/hellaswag (part 1 of 8)`); the S_l
    row is always taken, since every prune is given them."""
    return not only or key == SENSITIVITIES_ROW or any(fnmatch.fnmatchcase(key, pattern) for pattern in only)


def measured_models(rows: list[dict[str, Any]], key: str) -> dict[str, str]:
    """For a zero-shot row, the rows of its task (or of its part of the task) that measured their model, by the
    model's `weights_digest`."""
    if not key.startswith("zero-shot/"):
        return {}
    task = key.rsplit("/", 1)[1]
    return {
        row["weights_digest"]: row["key"]
        for row in rows
        if row["key"].startswith("zero-shot/")
        and row["key"].endswith(f"/{task}")
        and "same_weights_as" not in row
        and "weights_digest" in row
    }


def measure_in_child(
    key: str, settings: dict[str, Any], sensitivities: list[float] | None, held_rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """One row in a fresh process: its peak RSS is its own, and nothing but the S_l is shared between rows (and,
    for a zero-shot row whose model a held row measured, that row's accuracy)."""
    machine = machine_info()
    measured = measured_models(held_rows, key)
    arguments = [
        *("--row", key, json.dumps(settings)),
        *("--sensitivities", json.dumps(sensitivities), "--measured-models", json.dumps(measured)),
    ]
    figures = run_child("bench.smollm2", arguments, key)
    if "same_weights_as" in figures:
        figures["zero_shot"] = next(row for row in held_rows if row["key"] == figures["same_weights_as"])["zero_shot"]
    record = prune_record(settings, key)
    return {"key": key, "settings": settings, "prune": record, "machine": finish_machine_info(machine), **figures}


def recorded_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What the rows' figures depend on (`PART_SETTINGS`: which of them each part's do)."""
    return {
        "models_dir": args.models_dir,
        "datasets_dir": args.datasets_dir,
        "calibration": CALIBRATION,
        "windows": {"128": args.windows_128, "2048": args.windows_2048},
        "zero_shot_limit": args.zero_shot_limit,
        "recovery_steps": args.recovery_steps,
        "speed": SPEED,
    }


# The settings a part's figures depend on; and `speed` where the row writes pruned GGUF files (their speed is
# set against the dense files timed beside them: the dense ladder and the source file are timed alone).
PART_SETTINGS = {
    "allocation": ("calibration",),
    "quality": ("calibration", "windows", "zero_shot_limit"),
    "zero-shot": ("calibration",),
    "ladder": ("calibration", "windows"),
    "recovery": ("calibration", "windows", "zero_shot_limit", "recovery_steps"),
}


def same_settings(row: dict[str, Any], settings: dict[str, Any]) -> bool:
    """Whether the held row was measured under the settings its figures depend on and prunes as its key would
    now: only then is it reused."""
    part = row["key"].split("/")[0]
    names = PART_SETTINGS[part] + (("speed",) if part in ("ladder", "recovery") and planned_prune(row["key"]) else ())
    held = all(row["settings"].get(name) == settings.get(name) for name in names)
    return held and row.get("prune") == prune_record(settings, row["key"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--row", nargs=2, metavar=("KEY", "SETTINGS"), help=argparse.SUPPRESS)
    parser.add_argument("--sensitivities", help=argparse.SUPPRESS)
    parser.add_argument("--measured-models", help=argparse.SUPPRESS)
    parser.add_argument(
        "--parts",
        default="quality,ladder,recovery,zero-shot",
        help="quality, ladder, recovery, zero-shot, comma-separated",
    )
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    parser.add_argument("--windows-128", type=int, default=128, help="128-token windows per test text")
    parser.add_argument("--windows-2048", type=int, default=8, help="2048-token windows per test text")
    parser.add_argument(
        "--zero-shot-limit", type=int, default=100, help="documents per zero-shot task (0: all of them, -1: none)"
    )
    parser.add_argument(
        "--recovery-steps",
        type=int,
        default=10,
        help="optimizer steps per recovery recipe, each 8 x 16 sequences of 256 tokens of PTB train (10: about an "
        "hour a recipe on 2 cores)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="KEY",
        help="measure only these rows of the plan: their keys, or patterns of them ('zero-shot/*/0.3/boolq')",
    )
    parser.add_argument("--rerun", help="measure this row again (its key), beside the one held")
    parser.add_argument("--render", action="store_true", help="only render smollm2.md and smollm2.png from the JSON")
    parser.add_argument("--models-dir", default=default_models_dir())
    parser.add_argument("--datasets-dir", default=default_datasets_dir())
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.row:
        key, settings = args.row
        sensitivities, measured = json.loads(args.sensitivities or "null"), json.loads(args.measured_models or "{}")
        print(json.dumps(measure_row(key, json.loads(settings), sensitivities, measured)))
        return
    path = args.out / f"{RESULT}.json"
    payload = json.loads(path.read_text()) if path.is_file() else {"rows": [], "reruns": []}
    if not args.render:
        settings = recorded_settings(args)
        keys = [args.rerun] if args.rerun else planned_rows(args.parts.split(","), args.ratios)
        for key in keys:
            if not chosen(key, args.only):
                continue
            held = [row for row in payload["rows"] if row["key"] == key]
            if held and same_settings(held[0], settings) and not args.rerun:
                continue
            held_sensitivities = next(
                (r["sensitivities"] for r in payload["rows"] if r["key"] == SENSITIVITIES_ROW), None
            )
            sensitivities = held_sensitivities if key != SENSITIVITIES_ROW else None
            row = measure_in_child(key, settings, sensitivities, [] if args.rerun else payload["rows"])
            if args.rerun:
                payload["reruns"].append(row)
            else:
                payload["rows"] = [*(r for r in payload["rows"] if r["key"] != key), row]
            figures = row.get("ppl") or row.get("files") or row.get("zero_shot") or row.get("sensitivities")
            print(f"{key}: {figures}", flush=True)
            write_json(path, payload)
            render(payload, args.out)
    render(payload, args.out)


# ---------------------------------------------------------------- the tables and the plot


def render(payload: dict[str, Any], out: Path) -> None:
    rows = {row["key"]: row for row in payload["rows"]}
    files = ladder_files(rows)
    if files:
        plot(files, out / f"{RESULT}.png")
    (out / f"{RESULT}.md").write_text("\n".join(markdown(rows, files, payload["reruns"])) + "\n")


def ladder_files(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every measured GGUF file, with the ratio and block family it came from."""
    files = []
    for key, row in rows.items():
        if key.startswith("ladder/"):
            _, ratio, planned_for = key.split("/")
            files += [{**file, "ratio": float(ratio), "planned_for": planned_for} for file in row["files"]]
        elif key.startswith("recovery/"):
            files += [{**file, "ratio": RECOVERY_RATIO, "planned_for": key} for file in row["files"]]
    return files


def on_front(files: list[dict[str, Any]]) -> set[int]:
    """Indices of the files no other file beats in both bytes and perplexity (the front's axis)."""
    axis = eval_key(*FRONT_AXIS)
    return {
        index
        for index, file in enumerate(files)
        if not any(
            (other["bytes"] <= file["bytes"] and other["ppl"][axis] < file["ppl"][axis])
            or (other["bytes"] < file["bytes"] and other["ppl"][axis] <= file["ppl"][axis])
            for other in files
        )
    }


def plot(files: list[dict[str, Any]], path: Path) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import FormatStrFormatter

    axis = eval_key(*FRONT_AXIS)
    figure = Figure(figsize=(7, 5))
    axes = figure.add_subplot()
    groups = dict.fromkeys((file["ratio"], file["planned_for"]) for file in files)
    for index, (ratio, planned_for) in enumerate(groups):
        points = sorted(
            (file["bytes"], file["ppl"][axis], file["type"])
            for file in files
            if (file["ratio"], file["planned_for"]) == (ratio, planned_for)
        )
        label = (
            f"pruned {ratio:g} ({planned_for})"
            if ratio
            else {"dense": "dense", "source": "the source file"}[planned_for]
        )
        axes.plot([p[0] / 1e6 for p in points], [p[1] for p in points], marker="o", color=f"C{index}", label=label)
        for size, value, gguf_type in points:
            axes.annotate(gguf_type, (size / 1e6, value), fontsize=6, xytext=(2, 2), textcoords="offset points")
    front = sorted((files[index]["bytes"] / 1e6, files[index]["ppl"][axis]) for index in on_front(files))
    axes.plot([p[0] for p in front], [p[1] for p in front], color="black", linewidth=0.8, label="front")
    axes.set_xscale("log")
    axes.set_yscale("log")
    for scale in (axes.xaxis, axes.yaxis):  # plain numbers on the log axes, not powers of ten
        scale.set_major_formatter(FormatStrFormatter("%g"))
        scale.set_minor_formatter(FormatStrFormatter("%g"))
    axes.set_xlabel("GGUF file MB")
    axes.set_ylabel(f"{FRONT_AXIS[0]} perplexity at {FRONT_AXIS[1]}-token windows (llama.cpp)")
    axes.set_title("SmolLM2-135M-Instruct: pruned and quantized")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=120)


def _ppl(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}"


def _lower(value: float, other: float) -> bool:
    """Lower as printed: the same model pruned by two code paths (alpha auto where it chose the default) differs in
    the last float bits, which is a tie, not a win."""
    return round(value, 2) < round(other, 2)


def _load(row: dict[str, Any]) -> str:
    machine = row["machine"]
    return f"{machine['loadavg_start'][0]:.1f}/{machine['loadavg_end'][0]:.1f}"


def stale_rows(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The held rows whose prune differs from what their key prunes now (casp's defaults changed since), each with
    the settings that differ: shown as measured until the bench measures them again."""
    stale = []
    for key, row in rows.items():
        if row.get("prune") is None:
            continue
        now = prune_record(row["settings"], key)
        if now is None or now == row["prune"]:
            continue
        changed = ", ".join(
            f"{field} {row['prune'][field]} (now {now[field]})" for field in now if row["prune"][field] != now[field]
        )
        stale.append(f"- `{key}`: {changed}")
    if not stale:
        return []
    return [
        "",
        "Held from before casp's defaults changed, and shown as measured until they are measured again:",
        "",
        *stale,
    ]


def markdown(rows: dict[str, dict[str, Any]], files: list[dict[str, Any]], reruns: list[dict[str, Any]]) -> list[str]:
    any_row = next(iter(rows.values()), None)
    lines = [
        "# SmolLM2-135M-Instruct: casp on a real pretrained model",
        "",
        "Produced by `python -m bench.smollm2` (bench/smollm2.py says what each part measures). The model: "
        f"`{SMOLLM2_GGUF}`, dequantized to float32 on the CPU. Calibration for every prune: the WikiText-2 "
        f"validation file (`{CALIBRATION['dataset']}`), {CALIBRATION['n_samples']} x {CALIBRATION['seq_len']} "
        f"tokens, seed {CALIBRATION['seed']}. Perplexity on WikiText-2 test and `ptb:test` (PTB's test split), "
        "both held out.",
    ]
    if any_row is not None:
        settings = any_row["settings"]
        windows = settings["windows"]
        lines += [
            "",
            f"Evaluation: the first {windows['128']} windows of 128 tokens and the first {windows['2048']} of 2048 "
            "tokens of each text, the same for every row; zero-shot on the first "
            f"{settings['zero_shot_limit'] or 'all'} documents of each task. Each row was measured in its own "
            "process; its machine, commit and load (1-minute load average before/after) are in smollm2.json, the "
            "load also below.",
            "",
            f"Machine of the first row: {machine_line(any_row['machine'])}.",
        ]
    sensitivities = rows.get(SENSITIVITIES_ROW)
    if sensitivities is not None:
        lines += [
            "",
            f"The gradient sensitivities S_l on the calibration windows took {sensitivities['seconds']:.0f} s (peak "
            f"RSS {sensitivities['peak_rss_mib']:.0f} MiB, load {_load(sensitivities)}), measured once and given to "
            "every prune: the prune seconds and peaks below exclude them (a `casp prune` measures them inside, "
            "once).",
        ]
    lines += stale_rows(rows)
    lines += quality_tables(rows, reruns)
    lines += ladder_tables(rows, files)
    lines += recovery_table(rows, files)
    lines += reruns_tables(rows, reruns)
    return lines


def reruns_tables(rows: dict[str, dict[str, Any]], reruns: list[dict[str, Any]]) -> list[str]:
    """Each rerun beside the row it measured again: a perplexity's relative change, an accuracy's in points, with
    both commits (a zero-shot row held from before the scorer read each context once, rerun since, checks the two
    scorers agree as well as the row's reproducibility)."""
    # A held row measured again under changed defaults is no longer what the rerun repeated.
    comparable = [
        (rerun, rows[rerun["key"]])
        for rerun in reruns
        if rerun["key"] in rows and rows[rerun["key"]].get("prune") == rerun.get("prune")
    ]
    perplexity = [
        f"| {rerun['key']} {name} | {_ppl(held['ppl'][name])} | {_ppl(value)} | {value / held['ppl'][name] - 1:+.2%} |"
        for rerun, held in comparable
        if "ppl" in held
        for name, value in rerun["ppl"].items()
    ]
    accuracy = [
        f"| {_task_row(rerun['key'], task)} | {before:.4f} ({_commit(held)}) | {value:.4f} ({_commit(rerun)}) "
        f"| {100 * (value - before):+.2f} |"
        for rerun, held in comparable
        if held.get("zero_shot") and rerun.get("zero_shot")
        for task, value in rerun["zero_shot"]["acc"].items()
        for before in [held["zero_shot"]["acc"][task]]
    ]
    lines = ["", "## Reruns from the recorded settings"] if perplexity or accuracy else []
    if perplexity:
        lines += ["", "| row | perplexity held | rerun | change |", "|---|---|---|---|", *perplexity]
    if accuracy:
        lines += ["", "| row | accuracy held (commit) | rerun (commit) | change (points) |", "|---|---|---|---|"]
        lines += accuracy
    return lines


def _task_row(key: str, task: str) -> str:
    """A zero-shot row's key names its task; a quality row's measures them all."""
    return key if key.endswith(f"/{task}") else f"{key} {task}"


def _commit(row: dict[str, Any]) -> str:
    return str(row["machine"].get("git_commit") or "?")[:7]


def quality_tables(rows: dict[str, dict[str, Any]], reruns: list[dict[str, Any]]) -> list[str]:
    dense = rows.get("quality/dense/0")
    quality = {key: row for key, row in rows.items() if key.startswith("quality/") and key != "quality/dense/0"}
    if dense is None:
        return []
    columns = [eval_key(name, seq_len) for seq_len in EVAL_SEQ_LENS for name in EVAL_SETS]
    lines = [
        "",
        "## 1. Quality: the defaults against each alternative",
        "",
        f"| ratio | configuration | {' | '.join(columns)} | prune s | peak RSS MiB | load |",
        f"|---|---|{'---|' * len(columns)}---|---|---|",
        f"| 0 | dense | {' | '.join(_ppl(dense['ppl'][c]) for c in columns)} | - | "
        f"{dense['prune_peak_rss_mib']:.0f} | {_load(dense)} |",
    ]
    ratios = sorted({float(key.split("/")[2]) for key in quality})
    # A row measured before the choice was recorded takes it from its rerun (the same settings choose the same).
    choices = {rerun["key"]: rerun["alpha_auto"] for rerun in reruns if rerun.get("alpha_auto")}
    for ratio in ratios:
        at_ratio = {key.split("/")[1]: row for key, row in quality.items() if float(key.split("/")[2]) == ratio}
        best = {c: min(row["ppl"][c] for row in at_ratio.values()) for c in columns}
        for config in CONFIGS:
            row, key = at_ratio.get(config), f"quality/{config}/{ratio:g}"
            if row is None:
                continue
            cells = [f"**{_ppl(row['ppl'][c])}**" if row["ppl"][c] == best[c] else _ppl(row["ppl"][c]) for c in columns]
            lines.append(
                f"| {ratio:g} | {_configuration(config, row.get('alpha_auto') or choices.get(key))} | "
                f"{' | '.join(cells)} | {row['prune_seconds']:.0f} | "
                f"{row['prune_peak_rss_mib']:.0f} | {_load(row)} |"
            )
    lines += ["", "Bold: the best of the ratio's measured rows in that column."]
    lines += against_defaults_table(quality, ratios, columns)
    lines += defaults_verdict(quality, columns)
    lines += zero_shot_table(
        f"Zero-shot accuracy, the first {dense['settings']['zero_shot_limit']} documents of each task",
        {key: row for key, row in rows.items() if key.startswith("quality/")},
    )
    zero_shot_rows = {key: row for key, row in rows.items() if key.startswith("zero-shot/")}
    every_document = whole_tasks(zero_shot_rows)
    lines += zero_shot_table("Zero-shot accuracy, every document", every_document)
    lines += same_weights_lines(every_document)
    lines += zero_shot_against_defaults(every_document)
    lines += zero_shot_progress(zero_shot_rows)
    return lines


def against_defaults_table(quality: dict[str, dict[str, Any]], ratios: list[float], columns: list[str]) -> list[str]:
    """Each alternative against the defaults at every ratio: the change on the 2048-token columns, and how many of
    all the columns the defaults win."""
    shown = [eval_key(name, 2048) for name in EVAL_SETS]
    lines = [
        "",
        "### Against the defaults",
        "",
        f"Each cell: {' / '.join(shown)} against the defaults' at the same ratio (the defaults' row: their own). "
        f"Defaults win: of the {len(columns)} columns at each ratio measured, those where the defaults' perplexity "
        "is lower to two decimals.",
        "",
        f"| configuration | {' | '.join(f'at {ratio:g}' for ratio in ratios)} | defaults win |",
        f"|---|{'---|' * len(ratios)}---|",
    ]
    for config in CONFIGS:
        cells, won, compared = [], 0, 0
        for ratio in ratios:
            row, defaults = quality.get(f"quality/{config}/{ratio:g}"), quality.get(f"quality/defaults/{ratio:g}")
            if row is None or defaults is None:
                cells.append("-")
                continue
            if config == "defaults":
                cells.append(" / ".join(_ppl(row["ppl"][column]) for column in shown))
                continue
            cells.append(" / ".join(f"{row['ppl'][column] / defaults['ppl'][column] - 1:+.1%}" for column in shown))
            won += sum(_lower(defaults["ppl"][column], row["ppl"][column]) for column in columns)
            compared += len(columns)
        lines.append(f"| {config} | {' | '.join(cells)} | {f'{won} of {compared}' if compared else ''} |")
    return lines


def _configuration(config: str, alpha_auto: dict[str, Any] | None) -> str:
    """The configuration's name, and for alpha "auto" the temperature it chose."""
    return f"{config} (chose {alpha_auto['chosen']:g})" if alpha_auto else config


def defaults_verdict(quality: dict[str, dict[str, Any]], columns: list[str]) -> list[str]:
    """Where the defaults lose: each alternative that beats them, by how much, in which column."""
    losses, compared = [], 0
    for key, row in quality.items():
        _, config, ratio = key.split("/")
        defaults = quality.get(f"quality/defaults/{ratio}")
        if config == "defaults" or defaults is None:
            continue
        compared += 1
        for column in columns:
            if _lower(row["ppl"][column], defaults["ppl"][column]):
                losses.append(
                    f"- at {ratio}, {config} beats the defaults on {column}: {_ppl(row['ppl'][column])} against "
                    f"{_ppl(defaults['ppl'][column])} ({row['ppl'][column] / defaults['ppl'][column] - 1:+.1%})"
                )
    if not compared:
        return ["", "No alternative is measured beside the defaults yet."]
    if not losses:
        return ["", f"The defaults win every column against the {compared} alternative rows measured."]
    return ["", "Where the defaults lose:", "", *losses]


def whole_tasks(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The zero-shot rows by the task they measure: a task measured in parts (`ZERO_SHOT_PARTS`) has a row once all
    its parts are in, its accuracy theirs weighted by their documents, its standard error lm-eval's over them all,
    and `same_weights_as` where every part copied one model's."""
    whole: dict[str, dict[str, Any]] = {}
    parts_of: dict[str, list[dict[str, Any]]] = {}
    for key, row in rows.items():
        model, measured = key.rsplit("/", 1)
        if part := PART.fullmatch(measured):
            parts_of.setdefault(f"{model}/{part['task']}", []).append(row)
        else:
            whole[key] = row
    for key, parts in parts_of.items():
        task = task_of(key)
        if len(parts) < ZERO_SHOT_PARTS[task]:
            continue
        documents = sum(part["zero_shot"]["n_samples"][task] for part in parts)
        accuracy = sum(part["zero_shot"]["acc"][task] * part["zero_shot"]["n_samples"][task] for part in parts)
        accuracy /= documents
        copied = {part.get("same_weights_as", "").rsplit("/", 1)[0] for part in parts}
        whole[key] = {
            "zero_shot": {
                "acc": {task: accuracy},
                "acc_stderr": {task: accuracy_standard_error(accuracy, documents)},
                "n_samples": {task: documents},
                "mean": accuracy,
            },
            "evaluation_seconds": sum(part.get("evaluation_seconds", 0.0) for part in parts),
            **({"same_weights_as": f"{copied.pop()}/{task}"} if len(copied) == 1 and "" not in copied else {}),
        }
    return whole


def zero_shot_accuracies(rows: dict[str, dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """The tasks' accuracies by (configuration, ratio), from the rows keyed `part/configuration/ratio[/task]` that
    measured them: a quality row all seven at once, a zero-shot row one."""
    gathered: dict[tuple[str, str], dict[str, float]] = {}
    for key, row in rows.items():
        if row.get("zero_shot"):
            config, ratio = key.split("/")[1:3]
            gathered.setdefault((config, ratio), {}).update(row["zero_shot"]["acc"])
    return gathered


def in_table_order(models: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """(configuration, ratio) pairs by ratio, then as the tables list configurations: the dense model, then
    `CONFIGS`."""
    order = ["dense", *CONFIGS]
    return sorted(models, key=lambda pair: (float(pair[1]), order.index(pair[0])))


def zero_shot_table(title: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    """The accuracies of the rows that measured the tasks, the dense model first; a task not measured yet is `-`,
    and so is a mean until all its tasks are: the seven's, and that of `FIRST_FIVE_TASKS`."""
    accuracies = zero_shot_accuracies(rows)
    if not accuracies:
        return []
    lines = [
        "",
        f"### {title}",
        "",
        f"| ratio | configuration | {' | '.join(ZERO_SHOT_TASKS)} | mean | mean of five |",
        f"|---|---|{'---|' * len(ZERO_SHOT_TASKS)}---|---|",
    ]
    for config, ratio in in_table_order(accuracies):
        acc = accuracies[config, ratio]
        cells = " | ".join(f"{acc[task]:.3f}" if task in acc else "-" for task in ZERO_SHOT_TASKS)
        means = " | ".join(
            f"{fmean(acc[task] for task in tasks):.3f}" if set(acc) >= set(tasks) else "-"
            for tasks in (ZERO_SHOT_TASKS, FIRST_FIVE_TASKS)
        )
        lines.append(f"| {ratio} | {config} | {cells} | {means} |")
    lines += [
        "",
        f"Mean of five: {', '.join(FIRST_FIVE_TASKS)}, the tasks each configuration has first. Every accuracy is"
        " lm-eval's `acc`, the choice of highest log-likelihood, on every task: not `acc_norm` (per character of the"
        " choice), which some papers quote for hellaswag, arc and openbookqa.",
    ]
    return lines


def accuracy_standard_error(accuracy: float, documents: int) -> float:
    """The standard error lm-eval gives an accuracy over `documents` (a mean of 0/1 scores): their sample standard
    deviation over the root of their count."""
    return math.sqrt(accuracy * (1 - accuracy) / (documents - 1))


def same_weights_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The rows whose pruned model a row of the same task had measured, bit for bit (`weights_digest`)."""

    def model(key: str) -> str:
        config, ratio = key.split("/")[1:3]
        return f"{config} at {ratio}"

    copied = [
        f"{model(key)} on {key.rsplit('/', 1)[1]}: {model(row['same_weights_as'])}'s"
        for key, row in rows.items()
        if "same_weights_as" in row
    ]
    if not copied:
        return []
    return [
        "",
        "Not measured again: the same weights and config as a model measured on the task, so the same accuracy "
        f"({'; '.join(copied)}).",
    ]


def zero_shot_against_defaults(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Each configuration's accuracy against the defaults' at the same ratio, task by task, where the two differ
    by over twice the standard error of their difference. Unpaired: the two standard errors combine as if the
    models were scored on independent documents, which overstates it for two models scored on the same ones; still,
    of many comparisons, a few may pass twice their standard error by chance. A task's document count comes from the
    rows that recorded it."""
    accuracies = zero_shot_accuracies(rows)
    documents: dict[str, int] = {}
    for row in rows.values():
        documents |= row["zero_shot"].get("n_samples", {}) if row.get("zero_shot") else {}
    compared, differences = 0, []
    for config, ratio in in_table_order(accuracies):
        acc, defaults = accuracies[config, ratio], accuracies.get(("defaults", ratio))
        if config in ("dense", "defaults") or defaults is None:
            continue
        for task in ZERO_SHOT_TASKS:
            if task not in acc or task not in defaults or task not in documents:
                continue
            compared += 1
            error = math.hypot(*(accuracy_standard_error(a[task], documents[task]) for a in (acc, defaults)))
            gap = acc[task] - defaults[task]
            if abs(gap) > 2 * error:
                differences.append(
                    f"- at {ratio}, {config} on {task}: {acc[task]:.3f} against {defaults[task]:.3f} "
                    f"({100 * gap:+.1f} points, {abs(gap) / error:.1f} standard errors)"
                )
    if not compared:
        return []
    lines = [
        "",
        "### Zero-shot: where a configuration differs from the defaults",
        "",
        f"Of the {compared} (configuration, ratio, task) accuracies measured on every document beside the defaults', "
        "those over twice the standard error of the difference from the defaults' (lm-eval's standard error of "
        "each, combined as if unpaired, so an overstatement for two models on the same documents). Where two models "
        "score alike, about one comparison in twenty would still pass by chance on independent documents:",
        "",
    ]
    return lines + (differences or ["- none"])


def zero_shot_progress(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The zero-shot part's rows measured and left, task by task, and the hours left: each row at the median of its
    task's rows measured so far (the extrapolated minutes of a task none has measured), and a prune for each model
    with rows left (a rerun from another commit prunes each model again)."""
    planned = [key for key in planned_rows(["zero-shot"], list(ZERO_SHOT_RATIOS)) if key.startswith("zero-shot/")]
    left = [key for key in planned if key not in rows]
    if not rows or not left:
        return []
    lines = [
        "",
        "### Zero-shot: measured and left",
        "",
        "| task | rows measured | rows left | minutes a row | hours left |",
        "|---|---|---|---|---|",
    ]
    hours_left = 0.0
    for task in ZERO_SHOT_TASKS_BY_COST:
        parts = ZERO_SHOT_PARTS.get(task, 1)
        done = [row for key, row in rows.items() if task_of(key) == task]
        measured = [row["evaluation_seconds"] / 60 for row in done if "same_weights_as" not in row]
        minutes = median(measured) if measured else EXTRAPOLATED_MINUTES[task] / parts
        task_left = sum(task_of(key) == task for key in left)
        hours_left += task_left * minutes / 60
        shown = f"{minutes:.1f}" if measured else f"{minutes:.1f} (extrapolated)"
        name = task if parts == 1 else f"{task} ({parts} parts a model, a row each)"
        lines.append(f"| {name} | {len(done)} | {task_left} | {shown} | {task_left * minutes / 60:.1f} |")
    models_left = {key.rsplit("/", 1)[0] for key in left} - {"zero-shot/dense/0"}
    prunes = [row["prune_seconds"] for row in rows.values() if row.get("pruned_model_reused") is False]
    prune_minutes = median(prunes) / 60 if prunes else 0.0
    hours_left += len(models_left) * prune_minutes / 60
    return [
        *lines,
        "",
        f"{len(planned) - len(left)} of {len(planned)} rows measured; {len(left)} left, about {hours_left:.0f} hours "
        f"of this machine, with a prune of {prune_minutes:.1f} minutes (the median) for each of the "
        f"{len(models_left)} pruned models with rows left. Minutes a row: the median of the task's rows measured.",
    ]


def ladder_tables(rows: dict[str, dict[str, Any]], files: list[dict[str, Any]]) -> list[str]:
    ladder = [file for file in files if not file["planned_for"].startswith("recovery/")]
    if not ladder:
        return []
    columns = [eval_key(name, seq_len) for seq_len in EVAL_SEQ_LENS for name in EVAL_SETS]
    front = on_front(ladder)
    lines = [
        "",
        "## 2. Prune x quantize in llama.cpp, and 3. its speed",
        "",
        f"Every file made by llama.cpp's quantizer and measured in llama.cpp. Front: no other file is both smaller "
        f"and better on {eval_key(*FRONT_AXIS)} (the plot's axis). Speed: tokens per second of a 128-token prefill "
        f"and of 64 tokens decoded one at a time, the median of {SPEED_REPEATS} runs, at 1 and 2 threads, as each "
        "row's session measured them: this machine's speed drifts between sessions by up to a third, so compare "
        "speeds across rows only through the speed table below (each pruned file against dense timed beside it).",
        "",
        f"| file | bytes | bpw | {' | '.join(columns)} | front | prefill 1t | decode 1t | prefill 2t | decode 2t |",
        f"|---|---|---|{'---|' * len(columns)}---|---|---|---|---|",
    ]
    for index, file in sorted(enumerate(ladder), key=lambda pair: pair[1]["bytes"]):
        name = "dense" if file["ratio"] == 0 else f"pruned {file['ratio']:g}"
        speed = file["tokens_per_s"]
        lines.append(
            f"| {name} {file['type']} | {file['bytes']:,} | {file['bits_per_weight']:.2f} | "
            f"{' | '.join(_ppl(file['ppl'][c]) for c in columns)} | {'yes' if index in front else ''} | "
            f"{speed['1']['prefill']:.0f} | {speed['1']['decode']:.1f} | {speed['2']['prefill']:.0f} | "
            f"{speed['2']['decode']:.1f} |"
        )
    dense = [file for file in ladder if file["ratio"] == 0 and "source" not in file["type"]]
    lines += [
        "",
        "### At equal bytes",
        "",
        "Each pruned file against the dense ladder interpolated (linear in log bytes) at its size.",
        "",
        f"| file | bytes | {' | '.join(f'{c}: pruned / dense at its bytes' for c in columns)} |",
        f"|---|---|{'---|' * len(columns)}",
    ]
    for file in sorted((f for f in ladder if f["ratio"] > 0), key=lambda f: f["bytes"]):
        cells = []
        for column in columns:
            at = _dense_at([{"bytes": d["bytes"], "ppl": d["ppl"]} for d in dense], file["bytes"], column)
            cells.append(
                "outside the dense range"
                if at is None
                else f"{_ppl(file['ppl'][column])} / {_ppl(at)} ({file['ppl'][column] / at - 1:+.1%})"
            )
        lines.append(f"| pruned {file['ratio']:g} {file['type']} | {file['bytes']:,} | {' | '.join(cells)} |")
    lines += speed_table(ladder)
    lines += ["", f"![perplexity against bytes]({RESULT}.png)"]
    return lines


def speed_table(ladder: list[dict[str, Any]]) -> list[str]:
    """Each pruned file's llama.cpp speed over the dense file of the same type timed beside it, at each thread
    count. A file measured before the rows timed the dense one beside it is left out: the machine's speed drifts
    between sessions (file_figures)."""
    pruned = sorted((f for f in ladder if "dense_tokens_per_s" in f), key=lambda f: (f["type"], f["ratio"]))
    if not pruned:
        return []
    header = " | ".join(f"{stage} {threads}t" for threads in SPEED_THREADS for stage in ("prefill", "decode"))
    lines = [
        "",
        "### Speed against dense at the same type",
        "",
        "Tokens per second of the pruned file over the dense file's of the same type, on the same prompt and lengths,",
        "the dense file timed in the same process right after the pruned one at each thread count.",
        "",
        f"| file | {header} |",
        f"|---|{'---|' * 2 * len(SPEED_THREADS)}",
    ]
    for file in pruned:
        base = file["dense_tokens_per_s"]
        cells = [
            f"{file['tokens_per_s'][str(threads)][stage] / base[str(threads)][stage]:.2f}x"
            for threads in SPEED_THREADS
            for stage in ("prefill", "decode")
        ]
        lines.append(f"| pruned {file['ratio']:g} {file['type']} | {' | '.join(cells)} |")
    return lines


def recovery_table(rows: dict[str, dict[str, Any]], files: list[dict[str, Any]]) -> list[str]:
    recovered = {key.split("/")[1]: row for key, row in rows.items() if key.startswith("recovery/")}
    dense = rows.get("quality/dense/0")
    if not recovered or dense is None:
        return []
    columns = [eval_key(name, seq_len) for seq_len in EVAL_SEQ_LENS for name in EVAL_SETS]
    lines = [
        "",
        f"## 4. Recovery at {RECOVERY_RATIO:g} on `ptb:train`",
        "",
        "Share of the pruning's perplexity loss recovered: (pruned - recovered) / (pruned - dense).",
        "",
        f"| recipe | steps | tokens | {' | '.join(f'{c}: pruned -> recovered (share)' for c in columns)} | "
        "zero-shot mean | seconds |",
        f"|---|---|---|{'---|' * len(columns)}---|---|",
    ]
    for recipe, row in recovered.items():
        cells = []
        for column in columns:
            before, after, base = row["pruned_ppl"][column], row["ppl"][column], dense["ppl"][column]
            cells.append(f"{_ppl(before)} -> {_ppl(after)} ({(before - after) / (before - base):.0%})")
        zero = row["zero_shot"]["mean"] if row.get("zero_shot") else None
        lines.append(
            f"| {recipe} | {row['recovery']['max_steps']} | {row['train_tokens']:,} | {' | '.join(cells)} | "
            f"{'-' if zero is None else f'{zero:.3f}'} | {row['recovery_seconds']:.0f} |"
        )
    return lines


if __name__ == "__main__":
    main()
