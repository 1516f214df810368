"""The pruning report: report.json (everything, machine-readable) and report.md (for people)."""

import json
import platform
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from casp_core.method.compensation import DENSE_MODEL, SAME_INPUTS
from casp_core.method.placement import byte_size
from casp_core.method.results import PruneResult
from casp_core.method.verification import VERIFY_RELATIVE_TOLERANCE, VERIFY_RULE
from casp_core.report.evaluation_section import render_evaluation_section
from casp_core.report.frontier_section import dense_pick_reason, render_frontier_section
from casp_core.report.gguf_section import render_gguf_section
from casp_core.settings import PruneConfig

LIBRARIES = ("casp", "torch", "transformers", "safetensors", "lm_eval")


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def pruning_section(result: PruneResult) -> dict[str, Any]:
    """The part of the report that comes from pruning, as plain JSON: what a retry resumed after pruning reads back
    instead of pruning again (see `casp_core.artifacts.snapshot`)."""
    layers = [asdict(layer) for layer in result.layers]
    return {
        "achieved_ratio": result.achieved_ratio,
        "params": {"dense": result.params_dense, "pruned": result.params_pruned, "counted": "decoder attention + MLP"},
        "objective": {
            sub: {
                "solver": sum(layer[sub]["objective"] for layer in layers),
                "diagonal": sum(layer[sub]["diagonal_objective"] for layer in layers),
            }
            for sub in ("attn", "mlp")
        },
        "compensation": compensation_summary(layers),
        "alpha_auto": result.temperature.summary() if result.temperature else None,
        "placement": result.placement.summary() if result.placement else None,
        "rounding": result.rounding,
        "layers": layers,
        "verification": {
            "rule": VERIFY_RULE,
            "relative_tolerance": VERIFY_RELATIVE_TOLERANCE,
            "max_abs_diff": result.verification_max_abs_diff,
            "max_relative_diff": result.verification_max_relative_diff,
        },
        "timings": result.timings,
    }


def unpruned_section(params: int) -> dict[str, Any]:
    """`pruning_section`'s shape for a model handed back unpruned (a sweep's dense pick, casp_core.job.sweep.run):
    nothing removed, no layer pruned, nothing to verify."""
    return {
        "achieved_ratio": 0.0,
        "params": {"dense": params, "pruned": params, "counted": "decoder attention + MLP"},
        "objective": None,
        "compensation": None,
        "alpha_auto": None,
        "placement": None,
        "rounding": None,
        "layers": [],
        "verification": None,
        "timings": {},
    }


def build_report(
    *,
    model_name: str,
    config: PruneConfig,
    pruning: dict[str, Any],
    perplexity: dict[str, dict[str, Any]],
    device: str,
    dtype: str,
    evaluation: dict[str, Any] | None = None,
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`pruning` is `pruning_section`'s; `source` is a GGUF source's summary (casp_core.artifacts.gguf.source), None
    for a model folder or hub id."""
    return {
        "model": model_name,
        **({"source": source} if source is not None else {}),
        "target_ratio": config.ratio,
        **{key: pruning[key] for key in ("achieved_ratio", "params", "objective", "compensation", "alpha_auto")},
        "rounding": rounding_effect(pruning.get("rounding"), config.ratio, pruning["achieved_ratio"]),
        "perplexity": perplexity,
        "evaluation": evaluation or {},
        **{key: pruning[key] for key in ("layers", "verification", "timings")},
        "settings": config.to_dict(),
        "device": device,
        "placement": pruning.get("placement"),  # a snapshot saved before placement was recorded has none
        "dtype": dtype,
        "versions": library_versions(),
    }


def rounding_effect(units: dict[str, Any] | None, target: float, achieved: float) -> dict[str, Any] | None:
    """The units the layers were pruned in (`budget.rounding_units`) and what they did to the ratio: achieved minus
    target, within one rounding unit. None for a snapshot saved before the units were recorded."""
    if units is None:
        return None
    return {**units, "achieved_minus_target": achieved - target}


def rounding_line(rounding: dict[str, Any] | None) -> str:
    """For report.md and the model card: the widths' units and what they did to the ratio."""
    if rounding is None:
        return ""
    multiples = sorted(set(rounding["ffn_multiples"]))
    units = f"FFN widths in multiples of {', '.join(map(str, multiples))}"
    if rounding["block"]:
        units = (
            f"{units} and {rounding['head_multiple']}-head multiples where one head's move allows it "
            f"(the {rounding['block']}-weight block of {rounding['gguf_type']})"
        )
    return (
        f"{units}: achieved - target {rounding['achieved_minus_target']:+.4f}, "
        f"one rounding unit {rounding['one_unit']:.4f}"
    )


def compensation_summary(layers: list[dict[str, Any]]) -> dict[str, dict[str, float]] | None:
    """Expected squared output error, summed over layers, without and with the compensation.

    What it is measured against is each layer's `compensation.reference`: the layer unpruned on the same inputs
    (`least_squares`, `bias`), or the dense model's layer on the dense model's inputs (`least_squares_dense_target`).
    """
    if not layers or layers[0]["attn"]["compensation"] is None:
        return None
    return {
        sub: {
            "error_before": sum(layer[sub]["compensation"]["error_before"] for layer in layers),
            "error_after": sum(layer[sub]["compensation"]["error_after"] for layer in layers),
        }
        for sub in ("attn", "mlp")
    }


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _budget(report: dict[str, Any]) -> str:
    """How the layers' shares were set: the uniform shape gives every layer the same one, with no allocation;
    alpha `auto` says which temperature it chose, and the held-out loss of each it tried."""
    settings = report["settings"]
    if settings.get("shape") == "uniform":
        return "shape `uniform` (every layer pruned alike; allocation and alpha do not apply)"
    choice = report.get("alpha_auto")
    if not choice:
        return f"allocation `{settings['allocation']}`, alpha {settings['alpha']}"
    losses = ", ".join(f"{row['alpha']:g}: {row['held_out_loss']:.4f}" for row in choice["grid"])
    alpha = f"auto = {choice['chosen']:g} (held-out loss of {choice['held_out_windows']} windows: {losses})"
    return f"allocation `{settings['allocation']}`, alpha {alpha}"


def _placement(placement: dict[str, Any] | None) -> str:
    """How pruning placed the weights on the device, with the memory model's estimate (casp_core.method.placement)."""
    if not placement or placement["device"] == "cpu":
        return ""
    limit = placement["limit_bytes"]
    return (
        f" ({placement['mode']}: estimated peak {byte_size(placement['resident_peak'])} resident, "
        f"{byte_size(placement['offload_peak'])} offloaded; "
        f"{byte_size(limit) + ' allowed' if limit else 'no limit known'})"
    )


def source_line(source: dict[str, Any] | None) -> list[str]:
    """For report.md and the model card: the GGUF file the weights came from, and what that means for them."""
    if source is None:
        return []
    types = ", ".join(f"{count} {kind}" for kind, count in sorted(source["tensor_types"].items()))
    return [
        f"- source: the GGUF file `{source['file']}` (sha256 `{source['sha256']}`; tensors {types}); {source['note']}"
    ]


def render_markdown(report: dict[str, Any]) -> str:
    dense_pick = dense_pick_reason(report.get("frontier"))
    lines = [
        f"# CASP pruning report: {report['model']}",
        "",
        *source_line(report.get("source")),
        *([f"- not pruned: {dense_pick}"] if dense_pick else pruning_lines(report)),
        f"- device {report['device']}{_placement(report.get('placement'))}, dtype {report['dtype']}; "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v),
        *(f"- warning: {warning}" for warning in report.get("warnings", [])),
        "",
        render_evaluation_section(
            {"perplexity": report["perplexity"], **report["evaluation"], "artifacts": report.get("artifacts")}
        ),
        *render_gguf_section(report.get("exports", [])),
        *render_frontier_section(report.get("frontier")),
        *recovery_section(report),
        *quantization_section(report),
        *([] if dense_pick else pruning_tables(report)),
    ]
    if report.get("plots"):
        lines += ["", "## Plots", "", *(f"![{Path(path).stem}]({path})" for path in report["plots"])]
    lines += ["", "## Time and memory by stage", "", "| stage | seconds | peak memory (MB) |", "|---|---|---|"]
    for name, record in report["timings"].items():
        memory = record.get("peak_gpu_mb", record.get("peak_rss_mb"))
        lines.append(f"| {name} | {record['seconds']:.2f} | {_number(memory, 6)} |")
    return "\n".join(lines) + "\n"


def pruning_lines(report: dict[str, Any]) -> list[str]:
    """report.md's lines on how the model was pruned: the ratio, the rounding, the solver, the calibration, the
    verification."""
    settings = report["settings"]
    calibration = settings["calibration"]
    verification = report["verification"]
    return [
        f"- {'ratio picked by the sweep' if report.get('frontier') else 'target ratio'} {report['target_ratio']:.3f}, "
        f"achieved {report['achieved_ratio']:.4f} "
        f"({report['params']['dense']:,} -> {report['params']['pruned']:,} {report['params']['counted']} parameters)",
        *([f"- rounding: {rounding_line(report['rounding'])}"] if report.get("rounding") else []),
        f"- solver `{settings['solver']}`, {_budget(report)}, "
        f"r_max {settings['r_max']}, compensation `{settings['compensation']}`",
        f"- calibration: {calibration['n_samples']} x {calibration['seq_len']} tokens of `{calibration['dataset']}`, "
        f"seed {calibration['seed']}, {calibration['mode']} statistics",
        f"- pruned vs masked model: largest difference {verification['max_relative_diff']:.3g} of a stage's output "
        f"({verification['max_abs_diff']:.3g} absolute); rule: {verification['rule']}",
    ]


def pruning_tables(report: dict[str, Any]) -> list[str]:
    """report.md's tables of the pruning: the objective, the compensation's error, the layers."""
    settings = report["settings"]
    lines = [
        "## Objective z'Qz (sum over layers)",
        "",
        "| sub-layer | chosen solver | independent (diagonal) |",
        "|---|---|---|",
    ]
    for sub, values in report["objective"].items():
        lines.append(f"| {sub} | {_number(values['solver'], 6)} | {_number(values['diagonal'], 6)} |")
    if report.get("compensation"):
        against = {
            SAME_INPUTS: "against each layer unpruned on the inputs it sees",
            DENSE_MODEL: "against the dense model's layer on the dense model's inputs",
        }[report["layers"][0]["attn"]["compensation"]["reference"]]
        lines += [
            "",
            f"## Compensation `{settings['compensation']}`: sub-layer output error {against} (sum over layers)",
            "",
            "| sub-layer | without compensation | with compensation |",
            "|---|---|---|",
        ]
        for sub, values in report["compensation"].items():
            lines.append(f"| {sub} | {_number(values['error_before'], 6)} | {_number(values['error_after'], 6)} |")
    lines += [
        "",
        "## Layers",
        "",
        "| layer | r_l | S_l | heads pruned | channels pruned | rho attn | rho mlp | params after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layer in report["layers"]:
        lines.append(
            f"| {layer['index']} | {layer['ratio']:.3f} | {_number(layer['sensitivity'])} | "
            f"{len(layer['pruned_heads'])}/{layer['attn']['units']} | "
            f"{len(layer['pruned_channels'])}/{layer['mlp']['units']} | {layer['attn']['offdiag_ratio']:.3f} | "
            f"{layer['mlp']['offdiag_ratio']:.3f} | {layer['params_after']:,}/{layer['params_before']:,} |"
        )
    return lines


def loss_words(settings: dict[str, Any]) -> str:
    """The recovery loss as the report names it, with its weights and temperature."""
    if settings["loss"] == "cross_entropy":
        return "next-token cross-entropy"
    distill = (
        f"KL divergence from the dense model's top-{settings['teacher_top_k']} (temperature {settings['temperature']})"
    )
    if settings["loss"] == "distill":
        return distill
    return f"{settings['ce_weight']} x cross-entropy + {1 - settings['ce_weight']:g} x {distill}"


def teacher_line(teacher: dict[str, Any] | None) -> list[str]:
    if not teacher:
        return []
    return [
        f"- teacher cache `{teacher['file']}`: {teacher['tokens']:,} tokens x top {teacher['top_k']}, "
        f"{teacher['bytes'] / 2**20:,.1f} MiB ({teacher['bytes_per_token']} bytes per token), computed in "
        f"{teacher['seconds']:.1f} s from the dense model before pruning"
    ]


def memory_line(estimate: dict[str, int] | None, timing: dict[str, float]) -> list[str]:
    """Recovery's device memory as estimated before pruning, beside the peak measured on a GPU."""
    if not estimate:
        return []
    measured = f", measured peak {timing['peak_gpu_mb']:,.0f} MB" if "peak_gpu_mb" in timing else ""
    return [f"- device memory: estimated peak {estimate['peak'] / 2**20:,.0f} MB before pruning{measured}"]


def recovery_section(report: dict[str, Any]) -> list[str]:
    """Dense, pruned and pruned + recovered side by side, and how the recovery ran; nothing without recovery."""
    recovery = report.get("recovery")
    if not recovery:
        return []
    settings = report["settings"]["recovery"]
    data = recovery["data"]
    if settings["method"] == "full":
        trained = "every weight of the decoder layers (AdamW, gradient checkpointing)"
    else:
        # What peft adapted, in the family's own names (fused projections; a mixture's expert weights, adapted as
        # parameters, without dropout).
        lora = recovery["lora"]
        targets = [", ".join(lora["modules"])] if lora["modules"] else []
        if lora["parameters"]:
            targets.append(f"the parameters {', '.join(lora['parameters'])}")
        trained = (
            f"LoRA rank {settings['rank']}, alpha {settings['alpha']}, dropout {lora['dropout']:g} on "
            f"{' and '.join(targets)}; merged into the weights, the adapter kept in `adapter/`"
        )
    lines = [
        "## Recovery",
        "",
        f"- {trained}",
        f"- loss {loss_words(settings)}",
        *teacher_line(recovery.get("teacher")),
        *memory_line(recovery.get("memory_estimate"), report["timings"].get("recovery", {})),
        f"- data `{settings['dataset']}` ({data['layout']}): {data['sequences']:,} sequences of at most "
        f"{settings['max_seq_len']} tokens, {data['loss_tokens']:,} with loss"
        + (f", {data['skipped']} left out (prompt longer than a sequence)" if data["skipped"] else ""),
        f"- {recovery['steps']} steps of {settings['batch_size']} x {settings['grad_accum']} sequences, lr "
        f"{settings['lr']}, {recovery['precision']}; {recovery['tokens']:,} tokens in {recovery['seconds']:.1f} s "
        f"({recovery['tokens_per_second']:,.0f} tokens/s)"
        + (f"; resumed from step {recovery['resumed_from_step']}" if recovery["resumed_from_step"] else ""),
        "",
        "| perplexity | dense | pruned | pruned + recovered |",
        "|---|---|---|---|",
    ]
    for name, entry in report["perplexity"].items():
        values = (entry.get(side) for side in ("dense", "pruned", "recovered"))
        lines.append(f"| {name} | " + " | ".join(_number(value) for value in values) + " |")
    averages = {side: figures.get("average_acc") for side, figures in report["evaluation"].get("zero_shot", {}).items()}
    if averages:
        values = (averages.get(side) for side in ("dense", "pruned", "recovered"))
        lines.append("| zero-shot average acc | " + " | ".join(_number(value) for value in values) + " |")
    lines += ["", "Measured in the same run with the same evaluation settings.", ""]
    return lines


def quantization_section(report: dict[str, Any]) -> list[str]:
    """The compressed-tensors checkpoint's scheme, bytes and perplexity beside the unquantized model's; nothing
    without quantization."""
    quantization = report.get("quantization")
    if not quantization:
        return []
    unquantized = "recovered" if report.get("recovery") else "pruned"
    weight_bytes = quantization["weight_bytes"]
    groups = ", ".join(f"{count} in groups of {size}" for size, count in quantization["group_sizes"].items())
    lines = [
        f"## Quantized checkpoint: {quantization['scheme']}",
        "",
        f"- compressed-tensors preset `{quantization['preset']}`, format `{quantization['format']}`, weights rounded "
        f"to nearest: {quantization['quantized_weights']} linear layers"
        + (f" ({groups})" if groups else "")
        + "; embeddings, norms and lm_head unquantized",
        f"- safetensors {weight_bytes['unquantized']:,} -> {weight_bytes['quantized']:,} bytes "
        f"({weight_bytes['quantized'] / weight_bytes['unquantized']:.3f})",
        "",
        f"| perplexity | {unquantized} | quantized | quantized / {unquantized} |",
        "|---|---|---|---|",
    ]
    for name, entry in report["perplexity"].items():
        before, after = entry.get(unquantized), entry.get("quantized")
        ratio = _number(after / before) if before and after is not None else "-"
        lines.append(f"| {name} | {_number(before)} | {_number(after)} | {ratio} |")
    lines += ["", "The quantized checkpoint is the one in this folder, loaded back with `from_pretrained`.", ""]
    return lines


def write_report(report: dict[str, Any], directory: Path) -> None:
    (directory / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (directory / "report.md").write_text(render_markdown(report))
