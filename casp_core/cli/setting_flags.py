"""Command-line flags made from the settings (casp_core.settings): `casp prune` and `casp submit` take the same flag,
help text, default and range for each setting.

A flag is the setting's name in kebab case (`calibration.n_samples` is `--n-samples`), prefixed with its part where
the bare name would be ambiguous (`FLAGS`). A flag that is left out is not in the result, so the defaults stay
where they are defined: the config's for `casp prune`, the server's for `casp submit`.
"""

import argparse
import json
import os
from collections.abc import Callable
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from casp_core.cli.arguments import names
from casp_core.settings import (
    PruneConfig,
    PruneSettings,
    choices_of,
    describe_range,
    reason,
    setting_fields,
    without_none,
)

FLAGS = {
    "calibration.dataset": "--calibration-dataset",
    "calibration.mode": "--calibration-mode",
    "evaluation.seq_len": "--eval-seq-len",
    "evaluation.limit": "--eval-limit",
    "efficiency.macs_seq_len": "--efficiency-macs-seq-len",
    "efficiency.batch_size": "--efficiency-batch-size",
    "efficiency.seq_len": "--efficiency-seq-len",
    "efficiency.new_tokens": "--efficiency-new-tokens",
    "efficiency.repeats": "--efficiency-repeats",
    "efficiency.warmup": "--efficiency-warmup",
    "recovery.method": "--recovery",
    "recovery.loss": "--recovery-loss",
    "recovery.temperature": "--distill-temperature",
    "recovery.dataset": "--recovery-dataset",
    "recovery.lr": "--recovery-lr",
    "recovery.batch_size": "--recovery-batch-size",
    "recovery.max_seq_len": "--recovery-seq-len",
    "recovery.rank": "--lora-rank",
    "recovery.alpha": "--lora-alpha",
    "recovery.dropout": "--lora-dropout",
    "recovery.target_modules": "--lora-targets",
    "recovery.seed": "--recovery-seed",
    "target.max_bytes": "--target-bytes",
    "target.format": "--target-format",
    "target.max_params": "--target-params",
    "target.candidates": "--target-candidates",
    "moe.prune_unreached": "--moe-prune-unreached",
    "moe.prune_experts": "--moe-prune-experts",
}
# Earlier spellings (`casp prune` said --calibration-data / --eval-data, `casp submit` said --limit): still read,
# no longer shown.
ALIASES = {
    "calibration.dataset": ("--calibration-data",),
    "evaluation.perplexity": ("--eval-data",),
    "evaluation.limit": ("--limit",),
}


def flag_of(name: str) -> str:
    return FLAGS.get(name, "--" + name.rpartition(".")[2].replace("_", "-"))


def _members(annotation: Any) -> tuple[Any, ...]:
    """The types of a union but None (`int | None`: int; `float | Literal["auto"]`: both); () for the others."""
    if get_origin(annotation) in (Union, UnionType):
        return tuple(arg for arg in get_args(annotation) if arg is not NoneType)
    return ()


def value_parser(info: FieldInfo) -> Callable[[str], Any]:
    """Text to the setting's value, checked by the setting's own rules; a bad value names the rule it broke."""
    annotation = without_none(info.annotation)
    adapter: TypeAdapter[Any] = TypeAdapter(Annotated[(annotation, *info.metadata)] if info.metadata else annotation)
    is_list = get_origin(annotation) is list
    scalar = annotation if annotation in (int, float) else str

    def parse(text: str) -> Any:
        value = names(text) if is_list else scalar(text)
        try:
            return adapter.validate_python(value)
        except ValidationError as error:
            first = error.errors()[0]
            raise argparse.ArgumentTypeError(reason(info, first["type"], first.get("input"), first["msg"])) from None

    parse.__name__ = scalar.__name__ if not is_list else "list"  # argparse's "invalid int value: 'x'"
    return parse


def _shown(default: Any) -> str:
    return ",".join(map(str, default)) if isinstance(default, list) else str(default)


def bare_flag(name: str) -> str:
    """The flag of a setting of one part on its own (`casp recover`'s `max_steps` is `--max-steps`)."""
    return "--" + name.replace("_", "-")


def add_setting_flags(
    parser: argparse.ArgumentParser,
    *,
    required: tuple[str, ...] = (),
    model: type[BaseModel] = PruneSettings,
    flag: Callable[[str], str] = flag_of,
    skip: tuple[str, ...] = (),
) -> None:
    """One flag per setting of `model` (PruneSettings, or one part for a command of its own) but those in `skip`;
    `required` names the settings the command cannot do without."""
    for name, info in setting_fields(model):
        if name in skip:
            continue
        default = info.get_default(call_default_factory=True)
        is_list = get_origin(without_none(info.annotation)) is list
        help_text = (info.description or "") + (", comma-separated" if is_list else "")
        if default is not PydanticUndefined and default is not None and not isinstance(default, bool):
            help_text += f" (default: {_shown(default) or 'none'})"
        options: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
        if info.annotation is bool:
            parser.add_argument(flag(name), action=argparse.BooleanOptionalAction, **options)
            continue
        choices = choices_of(info.annotation)
        value = value_parser(info)
        if choices and not is_list:
            options["choices"] = choices
        metavar = flag(name).removeprefix("--").replace("-", "_").upper()
        parser.add_argument(
            flag(name),
            type=value,
            required=name in required,
            metavar=None if "choices" in options else metavar,
            **options,
        )
        for alias in ALIASES.get(name, ()):
            parser.add_argument(alias, type=value, dest=name, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_machine_flags(parser: argparse.ArgumentParser) -> None:
    """The machine's own settings, which on the service are the server's (casp_core.settings.SERVER_SIDE)."""
    parser.add_argument(
        "--datasets-dir",
        default=os.environ.get("CASP_DATASETS_DIR"),
        help="local copies of the named data sets (env CASP_DATASETS_DIR)",
    )
    parser.add_argument(
        "--device", default=PruneConfig.model_fields["device"].default, help="auto, cpu, cuda, cuda:1, ..."
    )


def settings_from_args(args: argparse.Namespace, model: type[BaseModel] = PruneSettings) -> dict[str, Any]:
    """The settings given on the command line, nested as `model` takes them (`{"calibration": {...}}`)."""
    settings: dict[str, Any] = {}
    for name, _ in setting_fields(model):
        if hasattr(args, name):
            *parts, leaf = name.split(".")
            target = settings
            for part in parts:
                target = target.setdefault(part, {})
            target[leaf] = getattr(args, name)
    return settings


def allowed(info: FieldInfo) -> str:
    """What a setting takes, in the words of the README's table."""
    is_list = get_origin(without_none(info.annotation)) is list
    choices = choices_of(info.annotation)
    if choices:
        return ("a list of " if is_list else "") + ", ".join(f"`{choice}`" for choice in choices)
    words = next((member for member in _members(info.annotation) if get_origin(member) is Literal), None)
    if words is not None:  # a number or a word (alpha: `auto`)
        number = next(member for member in _members(info.annotation) if member is not words)
        span = describe_range(FieldInfo.from_annotation(number))
        return f"{span} or " + ", ".join(f"`{word}`" for word in get_args(words))
    if info.annotation is bool:
        return "true, false"
    span = describe_range(info)
    if span and is_list:
        return f"a list of numbers {span}"
    if span:
        return span + (" or null" if get_origin(info.annotation) in (Union, UnionType) else "")
    # The free-text settings are data sets: `name[:split]` or a file.
    longest = next((rule.max_length for rule in info.metadata if isinstance(rule, annotated_types.MaxLen)), None)
    return f"at most {longest} data sets" if is_list else "a data set"


def settings_table() -> str:
    """The README's table of settings: one row per setting, from casp_core.settings (tests/test_settings_table.py
    keeps the README equal to it)."""
    rows = ["| setting | flag | default | allowed | meaning |", "|---|---|---|---|---|"]
    for name, info in setting_fields(PruneSettings):
        default = info.get_default(call_default_factory=True)
        shown = "required" if default is PydanticUndefined else f"`{json.dumps(default)}`"
        description = (info.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | `{flag_of(name)}` | {shown} | {allowed(info)} | {description} |")
    return "\n".join(rows)
