"""The pruning report: report.json (everything, machine-readable) and report.md (for people)."""

import json
import platform
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from casp_core.config import PruneConfig
from casp_core.evaluation_card import render_card

if TYPE_CHECKING:  # the pipeline imports this module to write its report
    from casp_core.pipeline import PruneResult

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
    result: "PruneResult",
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
        "perplexity": perplexity,
        "evaluation": evaluation or {},
        "layers": layers,
        "verification": {"max_abs_logit_diff": result.verification_max_abs_diff},
        "timings": result.timings,
        "settings": config.to_dict(),
        "device": device,
        "dtype": dtype,
        "versions": library_versions(),
    }


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def render_markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    calibration = settings["calibration"]
    lines = [
        f"# CASP pruning report: {report['model']}",
        "",
        f"- target ratio {report['target_ratio']:.3f}, achieved {report['achieved_ratio']:.4f} "
        f"({report['params']['dense']:,} -> {report['params']['pruned']:,} {report['params']['counted']} parameters)",
        f"- solver `{settings['solver']}`, allocation `{settings['allocation']}`, alpha {settings['alpha']}, "
        f"r_max {settings['r_max']}",
        f"- calibration: {calibration['n_samples']} x {calibration['seq_len']} tokens of `{calibration['dataset']}`, "
        f"seed {calibration['seed']}, {calibration['mode']} statistics",
        f"- pruned vs masked model, max |logit difference|: {report['verification']['max_abs_logit_diff']:.3g}",
        f"- device {report['device']}, dtype {report['dtype']}; "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v),
        "",
        render_card({"perplexity": report["perplexity"], **report["evaluation"]}),
        "## Objective z'Qz (sum over layers)",
        "",
        "| sub-layer | chosen solver | independent (diagonal) |",
        "|---|---|---|",
    ]
    for sub, values in report["objective"].items():
        lines.append(f"| {sub} | {_number(values['solver'], 6)} | {_number(values['diagonal'], 6)} |")
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
