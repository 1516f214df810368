"""The checkpoint's model card, README.md: Hugging Face front matter (base model, tags, a model-index of the
pruned model's measured figures, each exported GGUF's perplexity in llama.cpp among them) and a short body (what
was pruned, the settings, dense against pruned, the files as deployed, how to load it). Written by run_job after
the evaluation, from the report; the directory is then ready for `huggingface-cli upload` as it is.

With recovery, the model-index holds the recovered model's figures, and the card shows the recovery (dense,
pruned and recovered side by side) with its training curve.
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from casp_core.data import HUB_SOURCES, evaluation_source
from casp_core.errors import UnsupportedExport
from casp_core.families import check_export, config_from_dict, is_pruned_model_type
from casp_core.report.build import quantization_section, recovery_section, rounding_line, source_line
from casp_core.report.evaluation_section import render_evaluation_section
from casp_core.report.frontier_section import dense_pick_reason, render_frontier_section
from casp_core.report.gguf_section import render_gguf_section
from casp_core.report.plots import RECOVERY_CURVE
from casp_core.report.publish import public_name

CARD_FILE = "README.md"
TAGS = ["pruned", "structured-pruning", "casp"]
PIPELINE_TAG = "text-generation"
ZERO_SHOT_METRICS = ("acc", "acc_norm")


def card_model_name(source_name: str, target_ratio: float | None) -> str:
    """`stories260K` pruned by 30 % -> `stories260K-casp-30`; a sweep's dense pick (no ratio) ->
    `stories260K-casp-dense`."""
    return f"{source_name}-casp-{'dense' if target_ratio is None else round(target_ratio * 100)}"


def published_side(report: dict[str, Any]) -> str:
    """Whose figures the model-index holds: the model in this folder, pruned and, when the job ran them, recovered
    and quantized."""
    if report.get("quantization"):
        return "quantized"
    return "recovered" if report.get("recovery") else "pruned"


def _perplexity_result(name: str, entry: dict[str, Any], value: float, metric_name: str) -> EvalResult:
    """One perplexity figure on data set `name`, measured under `entry`'s convention (the report's perplexity)."""
    source = evaluation_source(name)
    hub = None if source.is_file else HUB_SOURCES[source.name]
    return EvalResult(
        task_type=PIPELINE_TAG,
        task_name="Language modelling",
        dataset_type=hub.path if hub else name,
        dataset_name=name,
        dataset_config=hub.name if hub else None,
        dataset_split=entry.get("split"),
        metric_type="perplexity",
        metric_value=value,
        metric_name=metric_name,
    )


def _perplexity_results(perplexity: dict[str, dict[str, Any]], side: str) -> list[EvalResult]:
    return [
        _perplexity_result(name, entry, entry[side], f"perplexity ({entry.get('seq_len', '?')}-token windows)")
        for name, entry in perplexity.items()
        if entry.get(side) is not None
    ]


def _gguf_results(perplexity: dict[str, dict[str, Any]], artifacts: dict[str, Any]) -> list[EvalResult]:
    """Each GGUF's perplexity in llama.cpp, on the same windows as the transformers figures."""
    return [
        _perplexity_result(
            name,
            perplexity[name],
            value,
            f"perplexity in llama.cpp, {row['file']} ({row['type']}, {perplexity[name].get('seq_len', '?')}-token "
            "windows)",
        )
        for row in artifacts.get("rows", [])
        if row["perplexity_in"] == "llama.cpp"
        for name, value in row["perplexity"].items()
        if value is not None
    ]


def _zero_shot_results(zero_shot: dict[str, Any], side: str) -> list[EvalResult]:
    published = zero_shot.get(side) or {}
    results = []
    for task, figures in published.get("tasks", {}).items():
        for metric in ZERO_SHOT_METRICS:
            if figures.get(metric) is None:
                continue
            results.append(
                EvalResult(
                    task_type=PIPELINE_TAG,
                    task_name="Zero-shot multiple choice (lm-evaluation-harness)",
                    dataset_type=task,
                    dataset_name=task,
                    dataset_split=figures.get("split"),
                    metric_type=metric,
                    metric_value=figures[metric],
                    metric_name=f"{metric}, {published.get('num_fewshot', 0)}-shot",
                )
            )
    return results


def card_data(report: dict[str, Any], *, base_model: str | None, exported: Sequence[str]) -> ModelCardData:
    """The front matter: the model-index holds the published model's figures as report.json has them."""
    evaluation = report.get("evaluation", {})
    side = published_side(report)
    results = _perplexity_results(report["perplexity"], side)
    results += _gguf_results(report["perplexity"], report.get("artifacts") or {})
    results += _zero_shot_results(evaluation.get("zero_shot") or {}, side)
    return ModelCardData(
        base_model=base_model,
        library_name="transformers",
        pipeline_tag=PIPELINE_TAG,
        tags=TAGS
        + (["gguf"] if any(name.endswith(".gguf") for name in exported) else [])
        + (["compressed-tensors", report["quantization"]["scheme"]] if report.get("quantization") else []),
        model_name=card_model_name(public_name(report["model"]), report["target_ratio"]),
        eval_results=results or None,
    )


def _what_was_pruned(report: dict[str, Any], base: str) -> list[str]:
    params = report["params"]
    layers = report["layers"]
    lines = [
        f"{base}, pruned with CASP (Correlation-Aware Structured Pruning): whole attention heads and MLP "
        "channels are removed, chosen per layer from the correlations of their outputs on calibration text, "
        "and the kept weights are refitted to make up for them. The layers stay dense matrices, smaller.",
        "",
        f"- ratio {'picked by the sweep' if report.get('frontier') else 'asked'} {report['target_ratio']:.3f}, "
        f"achieved {report['achieved_ratio']:.4f}: "
        f"{params['dense']:,} -> {params['pruned']:,} parameters ({params['counted']})",
        *([f"- rounding: {rounding_line(report['rounding'])}"] if report.get("rounding") else []),
        *source_line(report.get("source")),
    ]
    efficiency = report.get("evaluation", {}).get("efficiency") or {}
    if efficiency.get("dense") and efficiency.get("pruned"):
        lines.append(
            f"- whole model: {efficiency['dense']['params']:,} -> {efficiency['pruned']['params']:,} parameters"
        )
    lines += [
        "",
        "| layer | ratio | attention heads kept | MLP channels kept |",
        "|---|---|---|---|",
    ]
    for layer in layers:
        heads, channels = layer["attn"]["units"], layer["mlp"]["units"]
        lines.append(
            f"| {layer['index']} | {layer['ratio']:.3f} | {heads - len(layer['pruned_heads'])}/{heads} | "
            f"{channels - len(layer['pruned_channels'])}/{channels} |"
        )
    return lines


def _settings(report: dict[str, Any]) -> list[str]:
    settings = report["settings"]
    calibration = settings["calibration"]
    return [
        f"- solver `{settings['solver']}`, allocation `{settings['allocation']}` (alpha {settings['alpha']}, "
        f"r_max {settings['r_max']}), compensation `{settings['compensation']}`, FFN widths rounded to "
        f"{settings['round_to']}",
        f"- calibration: {calibration['n_samples']} windows of {calibration['seq_len']} tokens of "
        f"`{calibration['dataset']}`, seed {calibration['seed']}, {calibration['mode']} statistics",
        f"- weights {report['dtype']}, pruned on {report['device']}; "
        + ", ".join(f"{name} {version}" for name, version in report["versions"].items() if version),
    ]


def gguf_refusal(config: dict[str, Any]) -> str | None:
    """Why casp cannot write a GGUF of the checkpoint whose config.json is `config`, or None when it can."""
    try:
        check_export(config_from_dict(config), ["gguf"])
    except UnsupportedExport as refusal:
        return refusal.message
    return None


def _usage(model_type: str, name: str, exported: Sequence[str], no_gguf: str | None) -> list[str]:
    per_layer = is_pruned_model_type(model_type)
    gguf = next((file for file in exported if file.endswith(".gguf")), None)
    # AutoTokenizer reads config.json too, whose model type transformers knows only from the modeling file here:
    # without the flag it asks on stdin whether to run that file.
    remote_code = ", trust_remote_code=True" if per_layer else ""
    lines = [
        f"`{name}` below is this folder, or the repository it was uploaded to.",
        "",
        "**transformers**"
        + (
            f" (the layers have different shapes: the modeling file shipped here, `modeling_{model_type}.py`, "
            "builds them, hence `trust_remote_code=True`)"
            if per_layer
            else f" (a plain `{model_type}` checkpoint)"
        ),
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{name}"{remote_code})',
        f'model = AutoModelForCausalLM.from_pretrained("{name}"{remote_code})',
        'inputs = tokenizer("Once upon a time", return_tensors="pt")',
        "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=32, do_sample=False)[0]))",
        "```",
        "",
        "**llama.cpp**",
        "",
    ]
    # Every command shown runs as written: none where casp's GGUF export would refuse the checkpoint.
    if gguf:
        lines += ["```bash", f'llama-cli -m {gguf} -p "Once upon a time" -n 64', "```"]
    elif no_gguf:
        lines.append(f"casp's GGUF export refuses this checkpoint ({no_gguf}).")
    else:
        lines += [
            "```bash",
            f"casp export {name} --format gguf --out {name}.gguf   # casp's GGUF export",
            f'llama-cli -m {name}.gguf -p "Once upon a time" -n 64',
            "```",
        ]
    lines += ["", "**vLLM**", ""]
    if per_layer:
        lines.append(
            "vLLM does not load layers of different shapes; prune with `shape: uniform` for a checkpoint it serves."
        )
    else:
        lines += ["```bash", f"vllm serve {name}", "```"]
    return lines


def render_model_card(
    report: dict[str, Any],
    *,
    model_type: str,
    base_model: str | None,
    exported: Sequence[str] = (),
    no_gguf: str | None = None,
) -> ModelCard:
    """The card for a checkpoint of `model_type` (config.json's), from its path-free report (see
    `casp_core.report.publish`); `exported` names the files written beside it (model-f16.gguf, ...); `no_gguf`
    says why casp's GGUF export refuses the checkpoint, if it does."""
    data = card_data(report, base_model=base_model, exported=exported)
    source = public_name(report["model"])
    base = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else f"A local model, `{source}`"
    evaluation = {
        "perplexity": report["perplexity"],
        **report.get("evaluation", {}),
        "artifacts": report.get("artifacts"),
    }
    dense_pick = dense_pick_reason(report.get("frontier"))
    body = [
        f"# {data.model_name}",
        "",
        *(
            ["## Not pruned", "", f"{base}, not pruned: {dense_pick}."]
            if dense_pick
            else ["## What was pruned", "", *_what_was_pruned(report, base)]
        ),
        "",
        "## Settings",
        "",
        *_settings(report),
        "",
        render_evaluation_section(evaluation, title="Dense against pruned"),
        *render_gguf_section(report.get("exports", [])),
        *render_frontier_section(report.get("frontier")),
        "## How to load it",
        "",
        *_usage(model_type, data.model_name, exported, no_gguf),
        "",
    ]
    recovery = recovery_section(report)
    if recovery:
        body += [*recovery, f"![training loss]({RECOVERY_CURVE})", ""]
    body += quantization_section(report)
    body += [
        "## More",
        "",
        "`report.md` and `report.json` beside this card hold every figure of the run: the objective per layer, "
        "the verification of the pruned model against the masked one, time and memory per stage.",
        "",
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))


def write_model_card(
    directory: Path,
    report: dict[str, Any],
    *,
    base_model: str | None,
    exported: Sequence[str] = (),
) -> Path:
    """README.md in the checkpoint `directory`, for the model type its config.json holds."""
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    card = render_model_card(
        report, model_type=config["model_type"], base_model=base_model, exported=exported, no_gguf=gguf_refusal(config)
    )
    path = directory / CARD_FILE
    card.save(path)
    return path
