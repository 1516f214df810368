"""Python run as a user of a checkpoint runs it: a fresh process in another folder, stdin closed, transformers'
modules cache of its own, and nothing of this repository importable. site-packages go on the path without their
.pth files (`-S`), so the editable install of casp (`pip install -e .`, the Makefile's) does not reach casp_core."""

import os
import site
import subprocess
import sys
from pathlib import Path


def run_python(code: str, *args: str, cwd: Path, first_on_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`first_on_path`: a folder searched before site-packages (another transformers version installed apart)."""
    paths = [*([str(first_on_path)] if first_on_path else []), *site.getsitepackages()]
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": os.pathsep.join(paths),
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(cwd / "modules"),
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-S", "-c", code, *args],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
