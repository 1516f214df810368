"""How long-running stages report progress and learn that they should stop."""

import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from casp_core.errors import Cancelled


class ProgressFn(Protocol):
    def __call__(self, stage: str, fraction: float, message: str = "") -> None:
        """`stage` names the pipeline stage, `fraction` is its completion in [0, 1]."""


CancelCheck = Callable[[], bool]


def no_progress(stage: str, fraction: float, message: str = "") -> None:
    """The default: report nowhere."""


def never_cancelled() -> bool:
    return False


def check_cancelled(should_cancel: CancelCheck) -> None:
    """Called at every layer boundary: the work done so far is dropped, nothing half-written is kept."""
    if should_cancel():
        raise Cancelled("the job was cancelled")


class StageTimer:
    """Wall time and peak memory of each named stage, for the report."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stages: dict[str, dict[str, float]] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            record = self.stages.setdefault(name, {"seconds": 0.0})
            record["seconds"] += time.perf_counter() - start
            # ru_maxrss is the process's peak so far (KiB on Linux): an upper bound for the stage on the CPU.
            record["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            if self.device.type == "cuda":
                record["peak_gpu_mb"] = max(
                    record.get("peak_gpu_mb", 0.0), torch.cuda.max_memory_allocated(self.device) / 2**20
                )
