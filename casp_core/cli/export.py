"""`casp export CHECKPOINT --format gguf`; `casp prune` takes `--export`/`--gguf-type` from the config like its other
settings."""

import argparse
import json
import sys
from pathlib import Path

from casp_core.settings import EXPORT_FORMATS, GGUF_TYPES, PruneSettings


def add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help="write a checkpoint (pruned or dense) for another serving engine")
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory written by `casp prune`, or a dense one")
    parser.add_argument("--format", choices=EXPORT_FORMATS, required=True)
    parser.add_argument("--out", type=Path, required=True, help="file to write")
    parser.add_argument(
        "--gguf-type",
        choices=GGUF_TYPES,
        default=PruneSettings.model_fields["gguf_type"].default,  # the same default as a job's
        help="GGUF weight type, as llama.cpp spells it; the quantized ones are made by llama.cpp's quantizer "
        "(pip install 'casp[gguf]'), and weights whose rows do not fit the type's block get llama.cpp's fallback "
        "type (listed under fallbacks)",
    )
    parser.set_defaults(run=run_export)


def warn_about(export: dict) -> None:
    """`export` is a summary (`GgufExport.summary()`, or an entry of the report's `exports`)."""
    if export["tokenizer_caveat"]:
        print(f"casp: warning: {Path(export['path']).name}: {export['tokenizer_caveat']}", file=sys.stderr)


def run_export(args: argparse.Namespace) -> int:
    from casp_core.artifacts.gguf.writer import export_gguf  # torch and gguf load only when needed

    summary = export_gguf(args.checkpoint, args.out, args.gguf_type).summary()
    warn_about(summary)
    print(json.dumps(summary))
    return 0
