"""The `casp` command: `casp prune` runs the pipeline locally; other subcommands come from the service.

Errors print one line, `casp: error: <code>: <message>`, and exit with status 2 (bad input) or 1.
"""

import argparse
import copy
import json
import sys
import tomllib
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

from casp_core.cli.eval import add_eval_parser
from casp_core.cli.export import add_export_parser, warn_about
from casp_core.cli.progress import local_run
from casp_core.cli.recover import add_recover_parser
from casp_core.cli.setting_flags import add_machine_flags, add_setting_flags, settings_from_args
from casp_core.cli.upgrade import add_upgrade_parser
from casp_core.errors import CaspError
from casp_core.settings import PruneConfig

BAD_INPUT_CODES = {
    "invalid_config",
    "model_not_found",
    "unsupported_model",
    "unsupported_export",
    "dataset_not_found",
    "invalid_dataset",
    "device_unavailable",
}
DISTRIBUTION = "casp"


def add_prune_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("prune", help="prune a model locally and write checkpoint + report")
    parser.add_argument("--model", required=True, help="local model directory or Hugging Face id")
    parser.add_argument("--revision", help="Hugging Face revision")
    parser.add_argument("--out", required=True, type=Path, help="output directory (must be new or empty)")
    add_setting_flags(parser)
    add_machine_flags(parser)
    parser.set_defaults(run=run_prune)


def prune_config(args: argparse.Namespace) -> PruneConfig:
    """The settings given on the command line over the config's defaults, and this machine's own."""
    settings = settings_from_args(args)
    return PruneConfig.from_dict({**settings, "datasets_dir": args.datasets_dir, "device": args.device}).validate()


def run_prune(args: argparse.Namespace) -> int:
    # torch and transformers load only when needed
    from casp_core.job.run import run_job

    # run_job plans from the model's config before any weight loads or stage starts (casp_core.job.plan), so what
    # the job would refuse is refused here too, with the job's message and no progress bar drawn.
    config = prune_config(args)
    with local_run() as run:
        report = run_job(args.model, config, args.out, run, revision=args.revision)
    summary = {
        "out": str(args.out),
        "achieved_ratio": round(report["achieved_ratio"], 4),
        **({"rounding": rounding_summary(report["rounding"])} if report.get("rounding") else {}),
        "perplexity": {
            name: {
                "split": v["split"],
                **{k: round(v[k], 3) for k in ("dense", "pruned", "recovered", "quantized") if k in v},
            }
            for name, v in report["perplexity"].items()
        },
    }
    if "frontier" in report:
        pick = report["frontier"]["pick"]
        summary["frontier"] = {
            "pick": {key: pick[key] for key in ("ratio", "format", "variant", "bytes", "params", "perplexity")},
            "candidates": len(report["frontier"]["candidates"]),
            "file": "frontier.json",
        }
        if "dense_pick" in report["frontier"]:
            summary["frontier"]["dense_pick"] = report["frontier"]["dense_pick"]
    if "exports" in report:
        summary["exports"] = [with_engine_perplexity(export, report["artifacts"]) for export in report["exports"]]
        for export in report["exports"]:
            warn_about(export)
    print(json.dumps(summary))
    return 0


def with_engine_perplexity(export: dict[str, Any], artifacts: dict[str, Any]) -> dict[str, Any]:
    """An export of the report with its perplexity in llama.cpp from the table of files, where it was measured."""
    for row in artifacts["rows"]:
        if row["file"] == export["path"] and row["perplexity_in"] == "llama.cpp" and row["perplexity"]:
            figures = {name: round(value, 3) for name, value in row["perplexity"].items()}
            return {**export, "llama_cpp_perplexity": figures}
    return export


def rounding_summary(rounding: dict[str, Any]) -> dict[str, Any]:
    """What rounding did to the ratio, for the summary line: the report's `rounding` without the per-layer list."""
    return {
        "ffn_multiples": sorted(set(rounding["ffn_multiples"])),
        "head_multiple": rounding["head_multiple"],
        "achieved_minus_target": round(rounding["achieved_minus_target"], 4),
        "one_unit": round(rounding["one_unit"], 4),
    }


def package_version() -> str:
    """The installed distribution's version; from a source tree that was never installed, pyproject.toml's."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pass
    try:
        project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
        return f"{project['version']} (not installed)"
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown (not installed)"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` shows each option's default, options without help text included (argparse's own
    ArgumentDefaultsHelpFormatter skips those); not where there is none to show (None, empty) or it is a switch."""

    def _format_action(self, action: argparse.Action) -> str:
        default = action.default
        if action.option_strings and default not in (None, argparse.SUPPRESS) and not isinstance(default, bool):
            if isinstance(default, list | tuple):
                default = ",".join(map(str, default))  # as it would be typed: the list options take a,b,c
            if default != "":
                shown = f"default: {default}".replace("%", "%%")  # help text is a %-format string
                action = copy.copy(action)
                action.help = f"{action.help} ({shown})" if action.help else shown
        return super()._format_action(action)


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments get one line (`casp prune: error: argument --ratio: must be in (0, 1), got 1.5`), not usage.
    Every sub-command's parser is of this class too (argparse makes them so), and shows its defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


Register = Callable[[argparse._SubParsersAction], None]
LIBRARY_COMMANDS: list[Register] = [
    add_prune_parser,
    add_eval_parser,
    add_export_parser,
    add_recover_parser,
    add_upgrade_parser,
]


def build_parser(extensions: Sequence[Register] = ()) -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="casp", description="Correlation-Aware Structured Pruning for LLMs")
    parser.add_argument("--version", action="version", version=f"casp {package_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for register in [*LIBRARY_COMMANDS, *extensions]:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None, extensions: Sequence[Register] = ()) -> int:
    """`python -m casp_core` has the library's commands; the `casp` script (casp_cli) adds the service's."""
    parser = build_parser(extensions)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except CaspError as error:
        print(f"casp: error: {error.code}: {error.message}", file=sys.stderr)
        return 2 if error.code in BAD_INPUT_CODES else 1
    except KeyboardInterrupt:
        print("casp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
