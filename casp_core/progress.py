"""How long-running stages report progress and learn that they should stop."""

from collections.abc import Callable
from typing import Protocol

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
