"""The pruning report: report.json (everything, machine-readable) and report.md (for people)."""

import json
import platform
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from casp_core.compensation import DENSE_MODEL, SAME_INPUTS
from casp_core.config import PruneConfig
from casp_core.report.card import render_card
from casp_core.results import PruneResult
from casp_core.verification import VERIFY_RELATIVE_TOLERANCE, VERIFY_RULE

LIBRARIES = ("casp", "torch", "transformers", "safetensors", "lm_eval")


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def build_report(
    *,
    model_name: str,
    config: PruneConfig,
    result: PruneResult,
    perplexity: dict[str, dict[str, Any]],
    device: str,
    dtype: str,
    evaluation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    layers = [asdict(layer) for layer in result.layers]
    return {
        "model": model_name,
        "target_ratio": config.ratio,
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
        "perplexity": perplexity,
        "evaluation": evaluation or {},
        "layers": layers,
        "verification": {
            "rule": VERIFY_RULE,
            "relative_tolerance": VERIFY_RELATIVE_TOLERANCE,
            "max_abs_diff": result.verification_max_abs_diff,
            "max_relative_diff": result.verification_max_relative_diff,
        },
        "timings": result.timings,
        "settings": config.to_dict(),
        "device": device,
        "dtype": dtype,
        "versions": library_versions(),
    }


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


def render_markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    calibration = settings["calibration"]
    verification = report["verification"]
    lines = [
        f"# CASP pruning report: {report['model']}",
        "",
        f"- target ratio {report['target_ratio']:.3f}, achieved {report['achieved_ratio']:.4f} "
        f"({report['params']['dense']:,} -> {report['params']['pruned']:,} {report['params']['counted']} parameters)",
        f"- solver `{settings['solver']}`, allocation `{settings['allocation']}`, alpha {settings['alpha']}, "
        f"r_max {settings['r_max']}, compensation `{settings['compensation']}`",
        f"- calibration: {calibration['n_samples']} x {calibration['seq_len']} tokens of `{calibration['dataset']}`, "
        f"seed {calibration['seed']}, {calibration['mode']} statistics",
        f"- pruned vs masked model: largest difference {verification['max_relative_diff']:.3g} of a stage's output "
        f"({verification['max_abs_diff']:.3g} absolute); rule: {verification['rule']}",
        f"- device {report['device']}, dtype {report['dtype']}; "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v),
        *(f"- warning: {warning}" for warning in report.get("warnings", [])),
        "",
        render_card({"perplexity": report["perplexity"], **report["evaluation"]}),
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
    if report.get("plots"):
        lines += ["", "## Plots", "", *(f"![{Path(path).stem}]({path})" for path in report["plots"])]
    lines += ["", "## Time and memory by stage", "", "| stage | seconds | peak memory (MB) |", "|---|---|---|"]
    for name, record in report["timings"].items():
        memory = record.get("peak_gpu_mb", record.get("peak_rss_mb"))
        lines.append(f"| {name} | {record['seconds']:.2f} | {_number(memory, 6)} |")
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], directory: Path) -> None:
    (directory / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (directory / "report.md").write_text(render_markdown(report))
