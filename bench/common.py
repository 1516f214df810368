"""What every bench shares: where the fixtures are, what machine a number came from, how results are written."""

import datetime
import json
import math
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"
# The real pretrained model (#37, #38), under the models folder.
SMOLLM2_GGUF = Path("smollm2-135m-instruct-gguf") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_datasets_dir() -> str:
    return os.environ.get("CASP_DATASETS_DIR") or str(REPO_ROOT.parent / "shared" / "fixtures" / "data")


def default_models_dir() -> str:
    return os.environ.get("CASP_MODELS_DIR") or str(REPO_ROOT.parent / "shared" / "fixtures" / "models")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_info() -> dict[str, Any]:
    """Recorded with every result: timings from a shared 2-core box and from a workstation do not compare."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "cpu_model": _cpu_model(),
        "nproc": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": metadata.version("transformers"),
        "python": platform.python_version(),
        "cuda_available": torch.cuda.is_available(),
        # Other work on the machine inflates every timing; the load average says how much there was.
        "loadavg_start": list(os.getloadavg()),
        "git_commit": git_commit(),
    }


def finish_machine_info(machine: dict[str, Any]) -> dict[str, Any]:
    machine["loadavg_end"] = list(os.getloadavg())
    return machine


def concurrency_note(machine: dict[str, Any]) -> str:
    loads = machine.get("loadavg_start", [0.0]) + machine.get("loadavg_end", [0.0])
    busiest = max(loads[0], loads[-3] if len(loads) > 3 else 0.0)
    if busiest > 0.5 * (machine.get("nproc") or 1):
        return (
            f"Other work ran on this machine at the same time (1-minute load average up to {busiest:.1f} on "
            f"{machine.get('nproc')} cores): timings are inflated and noisy."
        )
    return "The machine was otherwise idle (load average below half the core count)."


def machine_line(machine: dict[str, Any]) -> str:
    return (
        f"{machine['date']}, {machine['cpu_model']}, nproc {machine['nproc']}, torch {machine['torch']} "
        f"({machine['torch_threads']} threads), transformers {machine['transformers']}, commit "
        f"{(machine.get('git_commit') or 'unknown')[:10]}"
    )


def all_finite(value: Any) -> bool:
    """Every number in a nested structure is finite (None and strings are skipped)."""
    if isinstance(value, dict):
        return all(all_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(all_finite(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return True


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")


def run_child(module: str, args: list[str], what: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`python -m <module> <args>` in a fresh process from the repository root (its peak memory is its own): the
    JSON of the last line it prints; a failure raises, naming `what`, with the end of its stderr."""
    completed = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False, env=env
    )
    if completed.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{completed.stderr[-4000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])
