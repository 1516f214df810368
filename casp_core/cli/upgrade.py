"""`casp upgrade CHECKPOINT`: a checkpoint written by an earlier casp gets the current modeling file and config, in
place, verified, with a backup of the old files (casp_core.artifacts.upgrade)."""

import argparse
import json
from pathlib import Path


def add_upgrade_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "upgrade",
        help="give a checkpoint written by an earlier casp the current modeling file and config, in place",
    )
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory written by `casp prune`")
    parser.set_defaults(run=run_upgrade)


def run_upgrade(args: argparse.Namespace) -> int:
    from casp_core.artifacts.upgrade import upgrade_checkpoint  # torch and transformers load only when needed

    print(json.dumps(upgrade_checkpoint(args.checkpoint)))
    return 0
