"""Command-line flags made from the settings (casp_core.config): `casp prune` and `casp submit` take the same flag,
help text, default and range for each setting.

A flag is the setting's name in kebab case (`calibration.n_samples` is `--n-samples`), prefixed with its part where
the bare name would be ambiguous (`FLAGS`). A flag that is left out is not in the result, so the defaults stay
where they are defined: the config's for `casp prune`, the server's for `casp submit`.
"""

import argparse
import json
from collections.abc import Callable
from types import NoneType, UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import annotated_types
from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from casp_core.cli.arguments import names
from casp_core.config import PruneSettings, choices_of, describe_range, reason, setting_fields

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


def _without_none(annotation: Any) -> Any:
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else ()
    if NoneType in members:
        return next(arg for arg in members if arg is not NoneType)
    return annotation  # `int | "auto"` stays a union: the flag takes either


def value_parser(info: FieldInfo) -> Callable[[str], Any]:
    """Text to the setting's value, checked by the setting's own rules; a bad value names the rule it broke."""
    annotation = _without_none(info.annotation)
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


def add_setting_flags(parser: argparse.ArgumentParser, *, required: tuple[str, ...] = ()) -> None:
    """One flag per setting of PruneSettings; `required` names the settings the command cannot do without."""
    for name, info in setting_fields(PruneSettings):
        default = info.get_default(call_default_factory=True)
        help_text = (info.description or "") + (", comma-separated" if get_origin(info.annotation) is list else "")
        if default is not PydanticUndefined and default is not None and not isinstance(default, bool):
            help_text += f" (default: {_shown(default) or 'none'})"
        options: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
        if info.annotation is bool:
            parser.add_argument(flag_of(name), action=argparse.BooleanOptionalAction, **options)
            continue
        choices = choices_of(info.annotation)
        value = value_parser(info)
        if choices and get_origin(info.annotation) is not list:
            options["choices"] = choices
        metavar = flag_of(name).removeprefix("--").replace("-", "_").upper()
        parser.add_argument(
            flag_of(name),
            type=value,
            required=name in required,
            metavar=None if "choices" in options else metavar,
            **options,
        )
        for alias in ALIASES.get(name, ()):
            parser.add_argument(alias, type=value, dest=name, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line, nested as PruneSettings takes them (`{"calibration": {...}}`)."""
    settings: dict[str, Any] = {}
    for name, _ in setting_fields(PruneSettings):
        if hasattr(args, name):
            *parts, leaf = name.split(".")
            target = settings
            for part in parts:
                target = target.setdefault(part, {})
            target[leaf] = getattr(args, name)
    return settings


def allowed(info: FieldInfo) -> str:
    """What a setting takes, in the words of the README's table."""
    is_list = get_origin(info.annotation) is list
    choices = choices_of(info.annotation)
    if choices:
        return ("a list of " if is_list else "") + ", ".join(f"`{choice}`" for choice in choices)
    if info.annotation is bool:
        return "true, false"
    span = describe_range(info)
    members = get_args(info.annotation) if get_origin(info.annotation) in (Union, UnionType) else ()
    keywords = [f"`{word}`" for member in members for word in choices_of(member) or ()]
    if span:
        return " or ".join([*keywords, span]) + (" or null" if NoneType in members else "")
    # The free-text settings are data sets: `name[:split]` or a file.
    longest = next((rule.max_length for rule in info.metadata if isinstance(rule, annotated_types.MaxLen)), None)
    return f"at most {longest} data sets" if is_list else "a data set"


def settings_table() -> str:
    """The README's table of settings: one row per setting, from casp_core.config (tests/test_settings_table.py
    keeps the README equal to it)."""
    rows = ["| setting | flag | default | allowed | meaning |", "|---|---|---|---|---|"]
    for name, info in setting_fields(PruneSettings):
        default = info.get_default(call_default_factory=True)
        shown = "required" if default is PydanticUndefined else f"`{json.dumps(default)}`"
        description = (info.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | `{flag_of(name)}` | {shown} | {allowed(info)} | {description} |")
    return "\n".join(rows)
