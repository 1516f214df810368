"""`make demo` on a fresh clone installs what the demo runs and nothing more: the runtime requirements and casp,
not the development requirements (llama-cpp-python builds from source: 27 minutes cold on a loaded 2-core machine)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

DEVELOPMENT_ONLY = ("requirements-dev.txt", "requirements-gguf.txt", "requirements-lowest.txt", "llama-cpp-python")


def requirement_lines(requirements: Path) -> list[str]:
    """The lines of the file and of every file it includes with `-r`, without comments."""
    lines = []
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.match(r"-r\s+(\S+)", line)
        lines += requirement_lines(requirements.parent / match.group(1)) if match else [line] if line else []
    return lines


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_installs_the_runtime_alone(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # -n: the commands a fresh clone would run (-B: as if nothing were built yet), none of them run.
    completed = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", "demo", f"VENV={venv}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    commands = completed.stdout.splitlines()
    installs = [command for command in commands if " pip install " in command]
    assert installs == [
        f"{venv}/bin/python -m pip install -q -c constraints.txt pip",
        f"{venv}/bin/python -m pip install -q -r requirements.txt -c constraints.txt",
        f"{venv}/bin/python -m pip install -q --no-deps --no-build-isolation -e .",
    ]
    assert commands[-1].endswith(f"{venv}/bin/casp demo")
    runtime = "\n".join(requirement_lines(REPO / "requirements.txt"))
    assert [name for name in DEVELOPMENT_ONLY if name in runtime or name in completed.stdout] == []
