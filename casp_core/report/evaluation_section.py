"""The evaluation section of report.md and of the model card: every figure with the convention it was
measured under, the dense model's figure beside the pruned model's (measured in the same run, or reused from an
earlier job's evaluation of the same dense model, which the section then says).

The evaluation dict it renders (each section optional; a side missing from a section shows as "-"):

    {
      "perplexity": {dataset: {"dense": float, "pruned": float, **EvaluationText.convention}}, i.e. also
                    "dataset", "split" (None for a file), "seq_len", "n_windows", "n_tokens", "bos"
      "zero_shot": {"dense": evaluate_zero_shot(...), "pruned": evaluate_zero_shot(...)},
      "dense_reused": {"measured_at": ISO 8601 time}, when the dense perplexity and zero-shot figures were reused
                    from an earlier job's evaluation (casp_core.artifacts.dense_cache) rather than measured in this run,
      "efficiency": compare_efficiency(...), i.e. {"dense": measure_efficiency(...),
                    "pruned": measure_efficiency(...), "pruned_over_dense": {...} (optional)},
      "artifacts": casp_core.artifacts.gguf.engine.artifact_table(...), i.e. {"rows": [one per file written:
                    format, type, bytes, bits per weight, perplexity by data set, tokens/s in llama.cpp],
                    "engine", "note"},
    }

`EvaluationText` is in casp_core.eval.perplexity, `evaluate_zero_shot` in casp_core.eval.zeroshot,
`measure_efficiency` / `compare_efficiency` in casp_core.eval.efficiency; their docstrings describe their own dicts.
"""

from collections.abc import Callable
from typing import Any

SIDES = ("dense", "pruned")
DASH = "-"


def _fixed(value: float | None, digits: int = 4) -> str:
    return DASH if value is None else f"{value:.{digits}f}"


def _si(value: float | None, unit: str = "") -> str:
    """845710000000 -> '845.71 G'."""
    if value is None:
        return DASH
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:g} {unit}".rstrip()


def _ratio(pruned: float | None, dense: float | None) -> str:
    return DASH if pruned is None or not dense else f"{pruned / dense:.3f}"


def _with_stderr(figures: dict[str, Any] | None, metric: str) -> str:
    if not figures or figures.get(metric) is None:
        return DASH
    stderr = figures.get(f"{metric}_stderr")
    return _fixed(figures[metric]) + ("" if stderr is None else f" ± {stderr:.4f}")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def perplexity_section(perplexity: dict[str, dict[str, Any]]) -> list[str]:
    rows = []
    for name, entry in perplexity.items():
        rows.append(
            [
                name,
                str(entry.get("split") or DASH),
                str(entry.get("seq_len", DASH)),
                str(entry.get("n_windows", DASH)),
                str(entry.get("bos", "not recorded")),
                _fixed(entry.get("dense"), 3),
                _fixed(entry.get("pruned"), 3),
                _ratio(entry.get("pruned"), entry.get("dense")),
            ]
        )
    return [
        "### Perplexity",
        "",
        *_table(["data set", "split", "seq_len", "windows", "BOS", "dense", "pruned", "pruned / dense"], rows),
        "",
        "Convention (LLM-Pruner's, from GPTQ): the split's rows as the Hugging Face loader gives them "
        '(WikiText-2 raw lines as they are, PTB lines stripped) joined with "\\n\\n" and tokenized once, BOS as '
        "given in the table, cut into non-overlapping windows of seq_len tokens (remainder dropped); "
        "exp(mean next-token NLL). Dense and pruned measured with the same settings on the same windows.",
    ]


def _zero_shot_conventions(side: dict[str, Any]) -> str:
    limit = side.get("limit")
    return (
        f"{side.get('harness', 'lm-evaluation-harness')} {side.get('harness_version', '?')}, "
        f"{side.get('num_fewshot', 0)}-shot, limit "
        + ("none (full splits)" if limit is None else f"{limit} documents per task")
        + f", data from {side.get('source', '?')}"
        + (f" ({side['datasets_dir']})" if side.get("datasets_dir") else "")
    )


def zero_shot_section(zero_shot: dict[str, Any]) -> list[str]:
    sides = {side: zero_shot[side] for side in SIDES if zero_shot.get(side)}
    tasks = list(dict.fromkeys(task for out in sides.values() for task in out["tasks"]))
    rows = []
    for task in tasks:
        per_side = {side: out["tasks"].get(task) for side, out in sides.items()}
        known = next(f for f in per_side.values() if f)
        rows.append(
            [
                task,
                str(known.get("version", DASH)),
                str(known.get("split", DASH)),
                str(known.get("n_samples", DASH)),
                *(_with_stderr(per_side.get(side), "acc") for side in SIDES),
                *(_with_stderr(per_side.get(side), "acc_norm") for side in SIDES),
            ]
        )
    averages = {side: sides[side].get("average_acc") if side in sides else None for side in SIDES}
    rows.append(["**average acc**", "", "", "", *(_fixed(averages[side]) for side in SIDES), DASH, DASH])
    header = ["task", "version", "split", "n", "dense acc", "pruned acc", "dense acc_norm", "pruned acc_norm"]
    conventions = {side: _zero_shot_conventions(out) for side, out in sides.items()}
    lines = ["### Zero-shot accuracy", "", *_table(header, rows), ""]
    if len(set(conventions.values())) == 1:
        lines += [f"Convention: {next(iter(conventions.values()))}; dense and pruned evaluated alike.", ""]
    else:
        lines.append(
            "Convention, **different for dense and pruned**: "
            + "; ".join(f"{side}: {text}" for side, text in conventions.items())
            + "."
        )
    lines.append(
        "acc and acc_norm (length-normalised) as the harness computes them, ± its standard error; "
        "acc_norm only where the harness defines it. The average is the plain mean of acc over the tasks, "
        "as in the paper."
    )
    return lines


def _latency_conventions(latency: dict[str, Any]) -> tuple[str, str]:
    runs = f"median of {latency.get('repeats', '?')} runs after {latency.get('warmup', '?')} warm-up"
    shape = f"{latency.get('batch_size', '?')} x {latency.get('seq_len', '?')} tokens"
    return (
        f"prefill of {shape}, {runs}",
        f"greedy generation of {latency.get('new_tokens', '?')} tokens with KV cache after a prompt of "
        f"{shape} (includes its prefill), {runs}",
    )


def efficiency_section(efficiency: dict[str, Any]) -> list[str]:
    sides = {side: efficiency.get(side) or {} for side in SIDES}
    known = sides["pruned"] or sides["dense"]
    latency = known.get("latency", {})
    prefill_text, decode_text = _latency_conventions(latency)

    def row(label: str, get: Callable[[dict[str, Any]], float | None], fmt: Callable[[float | None], str]) -> list[str]:
        values = {side: get(figures) if figures else None for side, figures in sides.items()}
        return [label, fmt(values["dense"]), fmt(values["pruned"]), _ratio(values["pruned"], values["dense"])]

    rows = [
        row("parameters", lambda f: f.get("params"), lambda v: DASH if v is None else f"{v:,}"),
        row(f"MACs, prefill of 1 x {known.get('macs_seq_len', '?')} tokens", lambda f: f.get("macs"), _si),
        row("of which linear layers", lambda f: f.get("macs_linear"), _si),
        row("of which attention QKᵀ and AV", lambda f: f.get("macs_attention"), _si),
        row(f"prefill latency (s): {prefill_text}", lambda f: f["latency"]["prefill_s"], _fixed),
        row(f"decoding latency (s): {decode_text}", lambda f: f["latency"]["decode_s"], _fixed),
    ]
    where = {
        side: f"{f.get('device', '?')} ({f.get('device_name', '?')}), {f.get('dtype', '?')}, "
        f"torch {f.get('torch_version', '?')}"
        for side, f in sides.items()
        if f
    }
    lines = ["### Efficiency", "", *_table(["figure", "dense", "pruned", "pruned / dense"], rows), ""]
    if len(set(where.values())) == 1:
        lines.append(f"Measured on {next(iter(where.values()))}, dense and pruned one after the other.")
    else:
        lines.append("Measured on **different setups**: " + "; ".join(f"{s}: {w}" for s, w in where.items()) + ".")
    lines.append(
        "Parameters: every parameter the model holds (tied embedding and LM head once). MACs counted from "
        "the module shapes: every linear layer at every position, plus the attention products over full "
        "T x T matrices; element-wise work not counted (1 MAC = 2 FLOPs)."
    )
    return lines


def artifact_section(artifacts: dict[str, Any]) -> list[str]:
    """One row per file as it would be deployed: the checkpoint (transformers) and each GGUF (llama.cpp)."""
    rows = artifacts["rows"]
    datasets = list(dict.fromkeys(name for row in rows for name in row["perplexity"]))
    header = [
        "file",
        "format",
        "type",
        "bytes",
        "bits per weight",
        *(f"{name} perplexity" for name in datasets),
        "measured in",
        "prefill tokens/s",
        "decode tokens/s",
    ]
    table = [
        [
            f"`{row['file']}`",
            row["format"],
            row["type"],
            f"{row['bytes']:,}",
            f"{row['bits_per_weight']:.2f}",
            *(_fixed(row["perplexity"].get(name), 3) for name in datasets),
            row["perplexity_in"] or DASH,
            _fixed(row["prefill_tokens_per_s"], 1),
            _fixed(row["decode_tokens_per_s"], 1),
        ]
        for row in rows
    ]
    lines = ["### Files as deployed", "", *_table(header, table), ""]
    engine = artifacts.get("engine")
    if engine:
        lines.append(
            f"GGUF rows measured in {engine['engine']} (llama-cpp-python {engine['llama_cpp_python']}), KV cache "
            f"{engine['kv_cache']}: perplexity on the same windows of the same token ids as the transformers "
            f"figures above, each window from an empty cache, {engine['perplexity_threads']} thread(s); speed at "
            f"{engine['threads']} thread(s): a prefill of {engine['prefill_tokens']} tokens, then "
            f"{engine['decode_tokens']} tokens decoded one at a time, {engine['speed']}."
        )
        lines.append("")
    if artifacts.get("note"):
        lines += [f"**{artifacts['note']}.**", ""]
    lines.append(
        "Bits per weight: 8 x the bytes of the tensor data / the number of weights, as llama.cpp counts it "
        "(metadata and vocabulary left out)."
    )
    return lines


def reuse_note(reused: dict[str, Any] | None) -> list[str]:
    """Where the dense figures were not measured in this run: from when they are."""
    if not reused:
        return []
    return [
        f"**The dense model's perplexity and zero-shot figures were reused from its evaluation of "
        f"{reused['measured_at']}**, by an earlier job on the same model, dtype, texts and evaluation settings, "
        "not measured again in this run; efficiency is measured in every run.",
        "",
    ]


def render_evaluation_section(evaluation: dict[str, Any], title: str = "Evaluation") -> str:
    """Markdown for report.md and the model card; the sections present in `evaluation`, in the order
    perplexity, zero-shot, efficiency, artifacts, after the note on reused dense figures."""
    lines = [f"## {title}", "", *reuse_note(evaluation.get("dense_reused"))]
    sections = (
        ("perplexity", perplexity_section),
        ("zero_shot", zero_shot_section),
        ("efficiency", efficiency_section),
        ("artifacts", artifact_section),
    )
    for key, section in sections:
        if evaluation.get(key):
            lines += [*section(evaluation[key]), ""]
    if not any(evaluation.get(key) for key, _ in sections):
        lines += ["No evaluation was run.", ""]
    return "\n".join(lines)
