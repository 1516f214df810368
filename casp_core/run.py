"""One run of the pipeline: where its stages report progress, how they learn they should stop, their timings.

A `Run` is made once by the caller (the command line, the worker, a test) and passed down to every stage.
"""

import resource
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from casp_core.errors import Cancelled


class ProgressFn(Protocol):
    def __call__(self, stage: str, fraction: float, message: str = "") -> None:
        """`stage` names the pipeline stage, `fraction` is its completion in [0, 1]."""


CancelCheck = Callable[[], bool]
WarningFn = Callable[[str], None]


def no_progress(stage: str, fraction: float, message: str = "") -> None:
    """The default: report nowhere."""


def no_warning(message: str) -> None:
    """The default: the warning is only kept in `Run.warnings`."""


def never_cancelled() -> bool:
    return False


def check_cancelled(should_cancel: CancelCheck) -> None:
    """Called at every layer boundary: the work done so far is dropped, nothing half-written is kept."""
    if should_cancel():
        raise Cancelled("the job was cancelled")


CPU = torch.device("cpu")


class StageTimer:
    """Wall time and peak memory of each named stage, for the report; `device` is the one whose memory counts."""

    def __init__(self, device: torch.device = CPU) -> None:
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


@dataclass
class Run:
    """Progress, cancellation and stage timing of one pipeline run, handed once to every stage."""

    progress: ProgressFn = no_progress
    should_cancel: CancelCheck = never_cancelled
    timer: StageTimer = field(default_factory=StageTimer)
    on_warning: WarningFn = no_warning  # the command line prints it, the worker adds a job event
    warnings: list[str] = field(default_factory=list)  # for the report

    def report(self, stage: str, fraction: float, message: str = "") -> None:
        self.progress(stage, fraction, message)

    def warn(self, message: str) -> None:
        """Settings that run, but forfeit something the user likely wants (the speedup of the pruned model)."""
        self.warnings.append(message)
        self.on_warning(message)

    def check_cancelled(self) -> None:
        check_cancelled(self.should_cancel)

    def stage(self, name: str) -> AbstractContextManager[None]:
        return self.timer.stage(name)

    def time_on(self, device: torch.device) -> None:
        """Stages from now on count the peak memory of `device` (the one the work runs on)."""
        self.timer.device = device
