"""Pruned and quantized: what each GGUF type and compressed-tensors scheme costs in bytes and perplexity, dense
and pruned, measured in the engine that serves the file, and what pruning buys in llama.cpp's speed.

Quality: ptbwiki-7M and stories260K, dense and pruned at `--ratios` (the job's defaults: per_layer shape, gradient
allocation, greedy, least-squares compensation; calibration as bench/quality.py: ptb:train, 16 x 128 tokens, seed 0,
shared by all ratios of a model). A job that exports a quantized GGUF rounds its widths to the type's block (`round_to:
auto`), so ptbwiki-7M is pruned once per block family and ratio: with `gguf_type: q8_0` (FFN widths in multiples of 32)
for f16, q8_0 and q4_0, and with `gguf_type: q4_k_m` (multiples of 256, heads in multiples of 8 where one head's move
allows it) for f16, q6_k, q5_k_m and q4_k_m. stories260K (hidden 64, below the K-quants' block of 256, which casp
refuses) gets the 32 family only. Each file is written by casp_core.artifacts.gguf.writer.export_gguf and measured by
casp_core.artifacts.gguf.engine.measure_gguf: llama.cpp perplexity at one thread on the first `--eval-windows` windows
of `--eval-seq-len` tokens of WikiText-2 test and PTB test, the same windows for every row of a model; the checkpoint's
own transformers perplexity on them is beside it.
The compressed-tensors rows are read from bench/results/compressed_tensors.json (its own settings, recorded).

Speed: llama.cpp prefill and decode tokens/s at one thread (casp_core.artifacts.gguf.engine.engine_speed,
`--speed-repeats` timed runs after one untimed) on a random-initialised LLaMA of Llama-3.2-1B's shape. Speed depends
only on the shapes, so instead of pruning a random model the bench builds, for each ratio, the uniform-shape checkpoint
whose heads and FFN width are those casp's uniform shape keeps at that ratio for a K-quant GGUF (whole blocks of 256 FFN
channels, o_proj rows a multiple of 256): `casp_core.method.budget.plan_uniform_shape`.

Writes bench/results/quantized.json, quantized.md and quantized.png.
"""

import argparse
import itertools
import json
import math
import re
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from transformers import LlamaConfig, LlamaForCausalLM

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
from bench.quality import CALIBRATION_SET, EVAL_SETS
from casp_core.artifacts.checkpoint import save_pruned
from casp_core.artifacts.gguf import engine
from casp_core.artifacts.gguf.writer import export_gguf
from casp_core.eval.perplexity import evaluation_text, windows_perplexity
from casp_core.method.allocation import layer_sensitivities
from casp_core.method.budget import AllocationPlan, plan_uniform_shape
from casp_core.method.calibration import CalibrationPlan, calibration_windows
from casp_core.method.prune import prune
from casp_core.model import decoder_layers, load_model
from casp_core.rounding import block_of
from casp_core.run import Run
from casp_core.settings import CalibrationConfig, PruneConfig

MODELS = ("ptbwiki-7M", "stories260K")
RATIOS = (0.0, 0.2, 0.3, 0.5)
# The type a pruned checkpoint is planned for (its block decides the widths) -> the types written from it.
FAMILIES = {"q8_0": ("f16", "q8_0", "q4_0"), "q4_k_m": ("f16", "q6_k", "q5_k_m", "q4_k_m")}
SPEED_RATIOS = (0.0, 0.3, 0.5)
SPEED_TYPES = ("f16", "q8_0", "q4_k_m")
SPEED_PLANNED_FOR = "q4_k_m"
# Llama-3.2-1B's shape (its RoPE without the llama3 scaling, which the export refuses and speed does not need).
LLAMA_1B = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
}
SPEED_TOKENIZER_FROM = "ptbwiki-7M"  # any tokenizer will do: speed is measured on random token ids
CT_RESULT = RESULTS_DIR / "compressed_tensors.json"


def _texts(tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    return {
        name: evaluation_text(
            tokenizer, source, args.eval_seq_len, datasets_dir=args.datasets_dir, max_windows=args.eval_windows
        )
        for name, source in EVAL_SETS.items()
    }


def _prune_config(ratio: float, planned_for: str, args: argparse.Namespace) -> PruneConfig:
    return PruneConfig(
        ratio=ratio,
        export=["gguf"],
        gguf_type=planned_for,  # round_to auto fits this type's block
        calibration=CalibrationConfig(
            dataset=CALIBRATION_SET, n_samples=args.n_samples, seq_len=args.seq_len, seed=args.seed
        ),
        datasets_dir=args.datasets_dir,
        device="cpu",
    )


def _shape(model: Any) -> dict[str, Any]:
    head_dim = model.config.head_dim
    layers = decoder_layers(model)
    return {
        "heads": [
            layer.self_attn.o_proj.in_features // head_dim if hasattr(layer, "self_attn") else 0 for layer in layers
        ],
        "ffn_widths": [layer.mlp.down_proj.in_features for layer in layers],
    }


def _file_rows(
    checkpoint: Path, gguf_types: tuple[str, ...], texts: dict[str, Any], common: dict[str, Any]
) -> list[dict[str, Any]]:
    rows = []
    for gguf_type in gguf_types:
        start = time.perf_counter()
        export = export_gguf(checkpoint, checkpoint / f"model-{gguf_type}.gguf", gguf_type)
        figures = engine.measure_gguf(export.path, texts)
        rows.append(
            {
                **common,
                "format": "gguf",
                "type": gguf_type,
                "bytes": export.bytes,
                "bits_per_weight": export.bits_per_weight,
                "tensor_types": dict(Counter(export.tensor_types.values()).most_common()),
                "fallbacks": [asdict(fallback) for fallback in export.fallbacks],
                "ppl": figures.perplexity,
                "ppl_in": "llama.cpp",
                "seconds": time.perf_counter() - start,
            }
        )
        export.path.unlink()
    return rows


def quality_rows(model_name: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Every ratio and type of one model, on one set of evaluation windows."""
    model_path = str(Path(args.models_dir) / model_name)
    model, tokenizer = load_model(model_path)
    texts = _texts(tokenizer, args)
    config = _prune_config(max(args.ratios), "q8_0", args)
    windows = calibration_windows(tokenizer, CalibrationPlan.of(config, model.config))
    sensitivities = layer_sensitivities(model, windows, batch_size=8, device=torch.device("cpu"), run=Run())
    # Below a family's block, a hidden size leaves its types mostly fallbacks (stories260K's 64 and the K-quants).
    families = {
        planned: types for planned, types in FAMILIES.items() if model.config.hidden_size % block_of(planned) == 0
    }
    rows: list[dict[str, Any]] = []
    for ratio in args.ratios:
        # The dense model is one checkpoint for every type; a pruned one is pruned per block family.
        plans = (
            {"dense": tuple(dict.fromkeys(t for types in families.values() for t in types))} if ratio == 0 else families
        )
        for planned_for, gguf_types in plans.items():
            model, tokenizer = load_model(model_path)
            start = time.perf_counter()
            achieved = 0.0
            if ratio > 0:
                result = prune(
                    model, tokenizer, _prune_config(ratio, planned_for, args), Run(), windows=windows,
                    sensitivities=sensitivities,
                )  # fmt: skip
                model, achieved = result.model, 1 - result.params_pruned / result.params_dense
            prune_seconds = time.perf_counter() - start
            checkpoint = work / f"{model_name}-{ratio}-{planned_for}"
            save_pruned(model, tokenizer, checkpoint)
            common = {
                "model": model_name,
                "ratio": ratio,
                "planned_for": planned_for,
                "achieved_ratio": achieved,
                **_shape(model),
                "prune_seconds": prune_seconds,
                "ppl_transformers": {
                    name: windows_perplexity(model, text, device="cpu") for name, text in texts.items()
                },
            }
            rows += _file_rows(checkpoint, gguf_types, texts, common)
            shutil.rmtree(checkpoint)
    return rows


def speed_shape(ratio: float, dense: dict[str, int]) -> dict[str, int]:
    """The heads and FFN width casp's uniform shape keeps at `ratio` on a model of `dense`'s shape, planned for a
    K-quant GGUF (no weights needed: the plan counts parameters)."""
    if ratio == 0:
        return dict(dense)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**dense))
    config = PruneConfig(ratio=ratio, shape="uniform", export=["gguf"], gguf_type=SPEED_PLANNED_FOR)
    shape = plan_uniform_shape(model, AllocationPlan.of(config))
    return {
        **dense,
        "num_attention_heads": shape.kv_heads * shape.heads_per_kv,
        "num_key_value_heads": shape.kv_heads,
        "intermediate_size": dense["intermediate_size"] - shape.pruned_channels,
    }


def speed_model(args: argparse.Namespace) -> dict[str, int]:
    """Llama-3.2-1B's shape, with what the command line sets instead."""
    return {**LLAMA_1B, **{key: getattr(args, f"speed_{key}") for key in LLAMA_1B if getattr(args, f"speed_{key}")}}


def speed_rows(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    dense = speed_model(args)
    rows = []
    for ratio in args.speed_ratios:
        shape = speed_shape(ratio, dense)
        checkpoint = work / f"speed-{ratio}"
        torch.manual_seed(0)
        with torch.device("cpu"):
            model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True, max_position_embeddings=2048))
        model.to(torch.bfloat16).save_pretrained(checkpoint)
        params = sum(parameter.numel() for parameter in model.parameters())
        del model
        tokenizer_dir = Path(args.models_dir) / SPEED_TOKENIZER_FROM
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, checkpoint / name)
        for gguf_type in args.speed_types:
            start = time.perf_counter()
            export = export_gguf(checkpoint, checkpoint / f"model-{gguf_type}.gguf", gguf_type)
            exported = time.perf_counter()
            prefill, decode = engine.engine_speed(export.path, args.speed_repeats)
            rows.append(
                {
                    "ratio": ratio,
                    "type": gguf_type,
                    "heads": shape["num_attention_heads"],
                    "kv_heads": shape["num_key_value_heads"],
                    "ffn_width": shape["intermediate_size"],
                    "params": params,
                    "bytes": export.bytes,
                    "bits_per_weight": export.bits_per_weight,
                    "fallbacks": [asdict(fallback) for fallback in export.fallbacks],
                    "prefill_tokens_per_s": prefill,
                    "decode_tokens_per_s": decode,
                    "export_seconds": exported - start,
                    "speed_seconds": time.perf_counter() - exported,
                }
            )
            export.path.unlink()
        shutil.rmtree(checkpoint)
    return rows


def compressed_tensors_rows() -> dict[str, Any] | None:
    """bench/results/compressed_tensors.json's rows and settings, as that bench wrote them (None if absent)."""
    if not CT_RESULT.is_file():
        return None
    result = json.loads(CT_RESULT.read_text())
    return {"settings": result["settings"], "machine": result["machine"], "rows": result["rows"]}


def _fallback_summary(fallbacks: list[dict[str, Any]]) -> str:
    """'4 x attn_output: Q5_0 for Q4_K (rows of 224)', one entry per kind of weight, type and row length."""
    if not fallbacks:
        return "none"
    kinds = Counter(
        (re.sub(r"^blk\.\d+\.", "", f["tensor"]).removesuffix(".weight"), f["type"], f["wanted"], f["row_length"])
        for f in fallbacks
    )
    return "; ".join(
        f"{count} x {kind}: {got} for {wanted} (rows of {length})"
        for (kind, got, wanted, length), count in sorted(kinds.items())
    )


def _dense_at(rows: list[dict[str, Any]], size: int, dataset: str) -> float | None:
    """The dense model's perplexity at `size` bytes: between the two dense files around it, linear in
    log(bytes); None outside the dense files' range."""
    points = sorted((row["bytes"], row["ppl"][dataset]) for row in rows)
    for (small, low), (large, high) in itertools.pairwise(points):
        if small <= size <= large:
            share = (math.log(size) - math.log(small)) / (math.log(large) - math.log(small))
            return low + share * (high - low)
    return None


def equal_bytes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pruned GGUF against the dense model quantized to the same bytes (interpolated between dense files)."""
    comparisons = []
    for model in dict.fromkeys(row["model"] for row in rows):
        dense = [row for row in rows if row["model"] == model and row["ratio"] == 0]
        for row in rows:
            if row["model"] != model or row["ratio"] == 0:
                continue
            at = {name: _dense_at(dense, row["bytes"], name) for name in EVAL_SETS}
            comparisons.append(
                {
                    "model": model,
                    "ratio": row["ratio"],
                    "type": row["type"],
                    "planned_for": row["planned_for"],
                    "bytes": row["bytes"],
                    "ppl": row["ppl"],
                    "dense_ppl_at_bytes": at,
                    "change": {name: (row["ppl"][name] / value - 1 if value else None) for name, value in at.items()},
                }
            )
    return comparisons


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Perplexity against file bytes, one line per ratio (dashed: the checkpoint pruned for the K-quants' block), a
    column per model and a row per test set."""
    models = list(dict.fromkeys(row["model"] for row in rows))
    figure = Figure(figsize=(5.5 * len(models), 8))
    for column, model in enumerate(models):
        for line, dataset in enumerate(EVAL_SETS):
            axes = figure.add_subplot(len(EVAL_SETS), len(models), line * len(models) + column + 1)
            lines = dict.fromkeys((row["ratio"], row["planned_for"]) for row in rows if row["model"] == model)
            colors = {ratio: f"C{index}" for index, ratio in enumerate(dict.fromkeys(r for r, _ in lines))}
            for ratio, planned_for in lines:
                points = sorted(
                    (row["bytes"], row["ppl"][dataset], row["type"])
                    for row in rows
                    if row["model"] == model and (row["ratio"], row["planned_for"]) == (ratio, planned_for)
                )
                axes.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    marker="o",
                    color=colors[ratio],
                    linestyle="--" if planned_for == "q4_k_m" else "-",  # the 256-block widths
                    label=f"ratio {ratio:g}" + (f", widths for {planned_for}" if ratio else ""),
                )
                for size, value, gguf_type in points:
                    axes.annotate(gguf_type, (size, value), fontsize=6, xytext=(2, 2), textcoords="offset points")
            axes.set_xscale("log")
            axes.set_xlabel("GGUF file bytes")
            axes.set_ylabel(f"{dataset} perplexity (llama.cpp)")
            axes.set_title(f"{model}: {dataset}")
            axes.grid(alpha=0.3)
            axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=120)
    return path


def _ppl(figures: dict[str, float]) -> str:
    return " | ".join(f"{figures[name]:.3f}" for name in EVAL_SETS)


def _verdict(comparisons: list[dict[str, Any]], model: str) -> tuple[int, int, int]:
    """(pruned files within the dense files' bytes, of them worse than dense at equal bytes on both sets, better
    on both)."""
    inside = [c for c in comparisons if c["model"] == model and all(v is not None for v in c["change"].values())]
    worse = sum(all(v > 0 for v in c["change"].values()) for c in inside)
    better = sum(all(v < 0 for v in c["change"].values()) for c in inside)
    return len(inside), worse, better


def render(payload: dict[str, Any]) -> str:
    settings = payload["settings"]
    names = list(EVAL_SETS)
    lines = [
        "# Pruned and quantized: bytes, perplexity in the serving engine, and llama.cpp speed",
        "",
        f"Machine: {machine_line(payload['machine'])}; load average {payload['machine']['loadavg_start'][0]:.1f} "
        f"at the start, {payload['machine']['loadavg_end'][0]:.1f} at the end; {payload['total_seconds']:.0f} s in "
        f"all. {concurrency_note(payload['machine'])}",
        "",
        "Written by `python -m bench.quantized` (bench/quantized.py says how; bench/README.md).",
        "",
        *(
            [
                f"The quality rows are kept from an earlier run (`--quality-from`): "
                f"{machine_line(payload['quality_machine'])}; load average "
                f"{payload['quality_machine']['loadavg_start'][0]:.1f} at its start, "
                f"{payload['quality_machine']['loadavg_end'][0]:.1f} at its end. The speed rows are this run's.",
                "",
            ]
            if payload.get("quality_machine")
            else []
        ),
        "## Quality",
        "",
        f"Pruned with the job's defaults (per_layer shape, gradient allocation, greedy, least-squares compensation), "
        f"calibrated on {CALIBRATION_SET} {settings['n_samples']} x {settings['seq_len']} tokens, seed "
        f"{settings['seed']} (bench/quality.py's calibration), the same windows for every ratio. `round_to: auto` "
        "fits the block of the type a checkpoint is planned for (`widths for`): q8_0 keeps FFN widths in multiples "
        "of 32, q4_k_m in multiples of 256 (and heads in multiples of 8 at ptbwiki-7M's head_dim 32 where one "
        "head's move allows it, else o_proj falls back). So ptbwiki-7M is pruned twice per ratio: f16, q8_0 and "
        "q4_0 come from the 32-block checkpoint, f16 again, q6_k, q5_k_m and q4_k_m from the 256-block one. "
        "stories260K has the 32 family only: its hidden size 64 is below the K-quants' block of 256 (casp refuses "
        "them). Each GGUF written by casp's export (the quantized ones by llama.cpp's quantizer, its default mix) "
        f"and measured in llama.cpp at one thread on the first {settings['eval_windows']} windows of "
        f"{settings['eval_seq_len']} tokens of WikiText-2 test and PTB test, the same windows for every row; "
        "`transformers` is the checkpoint's own perplexity (float32) on those windows. Bytes: the whole file "
        "(vocabulary and metadata included); bits per weight: llama.cpp's (tensor data only; the embedding and "
        "norms count).",
        "",
    ]
    for model in dict.fromkeys(row["model"] for row in payload["rows"]):
        lines += [
            f"### {model}",
            "",
            "| ratio | achieved | widths for | FFN widths | heads | type | bytes | bits/weight | "
            + " | ".join(f"{n} ppl" for n in names)
            + " | transformers "
            + " / ".join(names)
            + " | fallbacks |",
            "|---|---|---|---|---|---|---|---|" + "---|" * len(names) + "---|---|",
        ]
        for row in (r for r in payload["rows"] if r["model"] == model):
            widths = ", ".join(f"{w}" for w in sorted(set(row["ffn_widths"])))
            heads = ", ".join(f"{h}" for h in sorted(set(row["heads"])))
            reference = " / ".join(f"{row['ppl_transformers'][n]:.3f}" for n in names)
            lines.append(
                f"| {row['ratio']:g} | {row['achieved_ratio']:.3f} | {row['planned_for']} | {widths} | {heads} | "
                f"{row['type']} | {row['bytes']:,} | {row['bits_per_weight']:.2f} | {_ppl(row['ppl'])} | {reference} "
                f"| {_fallback_summary(row['fallbacks'])} |"
            )
        lines.append("")

    lines += [
        "### At equal bytes: pruned and quantized against the dense model quantized harder",
        "",
        "Each pruned file against the dense model at the same bytes: the dense files' perplexity interpolated "
        "between the two dense files around that size (linear in log bytes). `change`: pruned / dense at equal "
        "bytes - 1 (positive: the pruned file is worse). Blank where the pruned file is smaller than every dense "
        "file (no dense type that small was measured).",
        "",
        "| model | ratio | type | bytes | " + " | ".join(f"{n} ppl | dense at bytes | change" for n in names) + " |",
        "|---|---|---|---|" + "---|---|---|" * len(names),
    ]
    for c in payload["equal_bytes"]:
        cells = []
        for n in names:
            dense = c["dense_ppl_at_bytes"][n]
            cells.append(
                f"{c['ppl'][n]:.3f} | "
                + (f"{dense:.3f} | {100 * c['change'][n]:+.1f} %" if dense is not None else " | ")
            )
        lines.append(f"| {c['model']} | {c['ratio']:g} | {c['type']} | {c['bytes']:,} | " + " | ".join(cells) + " |")
    lines += ["", "![perplexity against file bytes](quantized.png)", ""]

    ct = payload["compressed_tensors"]
    if ct:
        cs = ct["settings"]
        lines += [
            "## compressed-tensors (vLLM)",
            "",
            f"From bench/results/compressed_tensors.json ({ct['machine']['date']}, commit "
            f"{(ct['machine'].get('git_commit') or 'unknown')[:10]}), not rerun: its own settings, so its "
            "perplexities do not compare with the GGUF rows above, only its ratios to the unquantized checkpoint "
            f"do. ptbwiki-7M pruned with shape uniform, round_to 32, calibrated on WikiText-2 validation "
            f"{cs['n_samples']} x {cs['seq_len']} tokens; perplexity in transformers (the checkpoint loaded back "
            f"with from_pretrained) on the first {cs['eval_windows']} windows of {cs['eval_seq_len']} tokens. "
            "Bytes: the safetensors files.",
            "",
            "| ratio | scheme | bytes | " + " | ".join(f"{n} ppl | / unquantized" for n in names) + " |",
            "|---|---|---|" + "---|---|" * len(names),
        ]
        for row in ct["rows"]:
            cells = " | ".join(f"{row['ppl'][n]:.3f} | {row['ppl_over_unquantized'][n]:.4f}" for n in names)
            lines.append(f"| {row['ratio']:g} | {row['scheme']} | {row['weight_bytes']:,} | {cells} |")
        lines.append("")

    speed = payload["speed"]
    if speed:
        dense = {row["type"]: row for row in speed if row["ratio"] == 0}
        shape = settings["speed_model"]
        lines += [
            "## Speed: llama.cpp at one thread on a 1B-class LLaMA",
            "",
            f"A random-initialised LLaMA of Llama-3.2-1B's shape (hidden {shape['hidden_size']}, "
            f"{shape['num_hidden_layers']} layers, FFN {shape['intermediate_size']}, {shape['num_attention_heads']} "
            f"heads / {shape['num_key_value_heads']} key/value heads of {shape['head_dim']}, vocabulary "
            f"{shape['vocab_size']}, tied embeddings, bf16 safetensors). Speed depends only on the shapes, so the "
            "pruned rows are not a pruned random model: each is a uniform-shape checkpoint built with the heads "
            "and FFN width casp's uniform shape keeps at that ratio when planned for a K-quant "
            "(`budget.plan_uniform_shape` with gguf_type q4_k_m: whole blocks of 256 FFN channels, heads x 64 a "
            "multiple of 256), the same shape for every type. Per-layer shapes of a real pruned model differ layer "
            f"by layer. llama.cpp (casp_core.artifacts.gguf.engine.engine_speed): a prefill of {engine.PREFILL_TOKENS} "
            f"tokens, then {engine.DECODE_TOKENS} tokens decoded one at a time, median of "
            f"{settings['speed_repeats']} timed run(s) after 1 untimed run (fewer than the engine's default "
            f"{engine.SPEED_REPEATS}, for time), one thread. `x dense`: against the dense file of the same type.",
            "",
            "| ratio | heads / kv | FFN | parameters | type | bytes | bits/weight | prefill tok/s | x dense | "
            "decode tok/s | x dense | fallbacks |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in speed:
            base = dense.get(row["type"])
            lines.append(
                f"| {row['ratio']:g} | {row['heads']} / {row['kv_heads']} | {row['ffn_width']} | {row['params']:,} | "
                f"{row['type']} | {row['bytes']:,} | {row['bits_per_weight']:.2f} | "
                f"{row['prefill_tokens_per_s']:.1f} | "
                + (f"{row['prefill_tokens_per_s'] / base['prefill_tokens_per_s']:.2f}" if base else "")
                + f" | {row['decode_tokens_per_s']:.2f} | "
                + (f"{row['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}" if base else "")
                + f" | {_fallback_summary(row['fallbacks'])} |"
            )
        lines.append("")

    lines += ["## The answer: at equal bytes, prune and quantize, or quantize the dense model harder?", ""]
    for model in dict.fromkeys(row["model"] for row in payload["rows"]):
        inside, worse, better = _verdict(payload["equal_bytes"], model)
        lines.append(
            f"- {model}: of the {inside} pruned files whose size lies within the dense files' range, {worse} are "
            f"worse than the dense model at the same bytes on both test sets, {better} better on both."
        )
    lines += ["", *answer(payload), ""]
    return "\n".join(lines)


def _row(rows: list[dict[str, Any]], model: str, ratio: float, gguf_type: str, planned_for: str) -> dict[str, Any]:
    return next(
        r
        for r in rows
        if (r["model"], r["ratio"], r["type"], r["planned_for"]) == (model, ratio, gguf_type, planned_for)
    )


def _speed_clause(payload: dict[str, Any]) -> str:
    """': on the 1B-class LLaMA, ...' from the speed rows of f16 and q4_k_m, dense and at 0.3; '.' without them."""
    speed = {(row["ratio"], row["type"]): row for row in payload["speed"]}
    keys = [(0.0, "f16"), (0.0, "q4_k_m"), (0.3, "q4_k_m")]
    if not all(key in speed for key in keys):
        return "."
    base, quantized, both = (speed[key] for key in keys)

    def times(row: dict[str, Any], stage: str) -> str:
        return f"{row[f'{stage}_tokens_per_s'] / base[f'{stage}_tokens_per_s']:.1f}x"

    return (
        f": on the 1B-class LLaMA, q4_k_m alone decodes {times(quantized, 'decode')} as fast as f16 and prefills "
        f"{times(quantized, 'prefill')}, pruned at 0.3 and q4_k_m {times(both, 'decode')} and {times(both, 'prefill')} "
        "(one thread)."
    )


def _stories_line(payload: dict[str, Any]) -> list[str]:
    """stories260K's comparisons within the dense range, which the ptbwiki-7M paragraph does not cover."""
    inside = [
        c
        for c in payload["equal_bytes"]
        if c["model"] == "stories260K" and all(v is not None for v in c["change"].values())
    ]
    if not inside:
        return []
    pairs = "; ".join(
        f"{c['ratio']:g} {c['type']}: "
        + ", ".join(f"{name} {100 * change:+.1f} %" for name, change in c["change"].items())
        for c in inside
    )
    return [
        "stories260K (hidden 64: f16, q8_0 and q4_0 only; its dense ffn_down rows of 172 stay F16 in every "
        "quantized type, so its dense files shrink less) has few pruned files within the dense range; "
        f"against the dense line: {pairs}. Pruned files calibrated on PTB train can gain on PTB while losing on "
        "WikiText-2; q4_0 costs this model more than it costs ptbwiki-7M (see its rows).",
        "",
    ]


def answer(payload: dict[str, Any]) -> list[str]:
    """The written answer, its figures read from the rows (ptbwiki-7M, whose every type was measured)."""
    rows = payload["rows"]
    if not any(r["model"] == "ptbwiki-7M" and r["ratio"] == 0.3 for r in rows):
        return []
    inside, worse, _ = _verdict(payload["equal_bytes"], "ptbwiki-7M")

    def cell(r: dict[str, Any]) -> str:
        figures = " / ".join(f"{r['ppl'][n]:.1f}" for n in EVAL_SETS)
        return f"{r['bytes'] / 1e6:.2f} MB, {figures}"

    def worse_by(r: dict[str, Any], than: dict[str, Any], name: str = "wikitext2") -> str:
        return f"{100 * (r['ppl'][name] / than['ppl'][name] - 1):.0f} %"

    dense = {t: _row(rows, "ptbwiki-7M", 0.0, t, "dense") for t in ("f16", "q6_k", "q5_k_m", "q4_k_m", "q4_0")}
    pruned_f16 = {ratio: _row(rows, "ptbwiki-7M", ratio, "f16", "q8_0") for ratio in (0.2, 0.5)}
    pruned_q8 = _row(rows, "ptbwiki-7M", 0.3, "q8_0", "q8_0")
    pruned_q4 = _row(rows, "ptbwiki-7M", 0.2, "q4_0", "q8_0")
    k_family = _row(rows, "ptbwiki-7M", 0.3, "q4_k_m", "q4_k_m")
    verdict = "worse" if worse == inside else "not uniformly worse"
    return [
        f"**At equal bytes, pruned and quantized is {verdict} than the dense model quantized harder, on these "
        f"models.** On ptbwiki-7M {worse} of the {inside} pruned files within the dense files' range of sizes lie "
        "above the dense line on both test sets (figures: MB, perplexity WikiText-2 / PTB). Pruned at 0.3 and "
        f"q8_0 ({cell(pruned_q8)}) against the dense model at q6_k ({cell(dense['q6_k'])}) and q5_k_m "
        f"({cell(dense['q5_k_m'])}): the dense q5_k_m file is smaller and {worse_by(pruned_q8, dense['q5_k_m'])} "
        "better on WikiText-2. The reason is in the dense rows: quantizing this model costs almost nothing down "
        f"to 4-5 bits (f16 {cell(dense['f16'])}, q4_k_m {cell(dense['q4_k_m'])}, q4_0 {cell(dense['q4_0'])}), "
        f"while pruning 20 % costs {worse_by(pruned_f16[0.2], dense['f16'])} on WikiText-2 and 50 % costs "
        f"{worse_by(pruned_f16[0.5], dense['f16'])} (f16 against f16), so bytes spent on more weights at fewer bits "
        "buy more than bytes spent on fewer weights at more bits.",
        "",
        "Where pruning adds something: below the smallest dense file measured (q4_0, "
        f"{dense['q4_0']['bytes'] / 1e6:.2f} MB) only pruning goes further among these types; pruned at 0.2 and "
        f"q4_0 ({cell(pruned_q4)}) is {100 * (1 - pruned_q4['bytes'] / dense['q4_0']['bytes']):.0f} % smaller than "
        f"dense q4_0 for {worse_by(pruned_q4, dense['q4_0'])} more WikiText-2 perplexity "
        f"({worse_by(pruned_q4, dense['q4_0'], 'ptb')} PTB). llama.cpp's 2-3 bit types (q3_k, q2_k, the i-quants) "
        "were not measured and may do better there. Pruning for the K-quants costs extra on a model this small: "
        "ptbwiki-7M's 704 FFN channels can keep only 256 or 512 in whole blocks of 256, so at 0.3 the K-quant "
        f"checkpoint is worse than the 32-block one before any quantization (its q4_k_m: {cell(k_family)}). "
        "Pruning's other gain is speed (the table above), which it adds to quantization's" + _speed_clause(payload),
        "",
        *_stories_line(payload),
        "Caveats: these are a 7M- and a 260K-parameter model; at 7B the costs of pruning and of quantization both "
        "differ, so this ranking may not transfer. Perplexity on 20 windows of 128 tokens of each test set.",
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    parser.add_argument("--n-samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-windows", type=int, default=20)
    parser.add_argument("--eval-seq-len", type=int, default=128)
    parser.add_argument("--speed-ratios", nargs="*", type=float, default=list(SPEED_RATIOS), help="none: no speed")
    parser.add_argument("--speed-types", nargs="+", default=list(SPEED_TYPES))
    parser.add_argument("--speed-repeats", type=int, default=1)
    for key in LLAMA_1B:  # a smaller speed model, for the tests
        parser.add_argument(f"--speed-{key.replace('_', '-')}", type=int, dest=f"speed_{key}")
    parser.add_argument(
        "--quality-from", type=Path, help="an earlier quantized.json whose quality rows (and settings) to keep"
    )
    parser.add_argument("--models-dir", default=default_models_dir())
    parser.add_argument("--datasets-dir", default=default_datasets_dir())
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    machine = machine_info()
    earlier = json.loads(args.quality_from.read_text()) if args.quality_from else None
    with tempfile.TemporaryDirectory() as work:
        if earlier:
            rows = earlier["rows"]
        else:
            rows = [row for model in args.models for row in quality_rows(model, args, Path(work))]
        speed = speed_rows(args, Path(work))
    quality_settings = ("n_samples", "seq_len", "seed", "eval_windows", "eval_seq_len")
    settings = {
        **{key: earlier["settings"][key] if earlier else getattr(args, key) for key in quality_settings},
        "calibration_set": CALIBRATION_SET,
        "eval_sets": EVAL_SETS,
        "families": FAMILIES,
        "engine": engine.engine_convention(),
        "speed_ratios": args.speed_ratios,
        "speed_types": args.speed_types,
        "speed_repeats": args.speed_repeats,
        "speed_model": speed_model(args),
        "speed_planned_for": SPEED_PLANNED_FOR,
    }
    payload = {
        "machine": finish_machine_info(machine),
        "settings": settings,
        "rows": rows,
        "equal_bytes": equal_bytes(rows),
        "compressed_tensors": compressed_tensors_rows(),
        "speed": speed,
        # The run the quality rows came from, when they were kept from an earlier one (--quality-from).
        "quality_machine": earlier["machine"] if earlier else None,
        "total_seconds": time.perf_counter() - start,
    }
    assert all_finite(payload)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "quantized.json", payload)
    (args.out / "quantized.md").write_text(render(payload))
    plot(rows, args.out / "quantized.png")
    return payload


if __name__ == "__main__":
    main()
