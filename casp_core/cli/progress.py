"""Progress of a local run on the command line (`casp prune`, `casp recover`, `casp eval`)."""

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TextIO

from casp_core.errors import InvalidConfig

if TYPE_CHECKING:
    from tqdm import tqdm

    from casp_core.run import Run

# How often a log (stderr that is not a terminal) gets a line while one stage goes on; the variable sets another,
# and 0 gives a line for every report (each of the service's progress events, and more).
LOG_INTERVAL_SECONDS = 10.0
LOG_INTERVAL_VARIABLE = "CASP_PROGRESS_INTERVAL"


def log_interval() -> float:
    """`CASP_PROGRESS_INTERVAL` seconds (0: every report), else `LOG_INTERVAL_SECONDS`."""
    value = os.environ.get(LOG_INTERVAL_VARIABLE)
    if value is None:
        return LOG_INTERVAL_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds < math.inf:
        raise InvalidConfig(f"{LOG_INTERVAL_VARIABLE}: a number of seconds, 0 or more, got {value!r}")
    return seconds


class StageBars:
    """One tqdm bar per pipeline stage on a terminal. In a log, a line when a stage starts and then one every
    `interval` seconds with the stage's latest message (the counts of the service's events: layers, windows,
    sequences, steps), its share done and the time spent in it. A thread writes that line when no report came in
    the interval (one batch of the allocation's gradients can take minutes), so a long stage is never silent."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = self.stream.isatty()
        self.interval = interval if interval is not None else log_interval()
        self.clock = clock
        self.stage: str | None = None
        self.bar: tqdm | None = None
        self.stage_started = 0.0
        self.last_line = 0.0
        self.fraction = 0.0
        self.message = ""
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.heartbeat: threading.Thread | None = None
        if not self.interactive and self.interval > 0:
            self.heartbeat = threading.Thread(target=self._beat, name="casp-progress", daemon=True)
            self.heartbeat.start()

    def __call__(self, stage: str, fraction: float, message: str = "") -> None:
        with self.lock:
            now = self.clock()
            self.fraction, self.message = fraction, message
            if stage != self.stage:
                self._close_bar()
                self.stage, self.stage_started, self.last_line = stage, now, now
                if not self.interactive:
                    self._line(f"casp: {stage}: {message}" if message else f"casp: {stage}")
                    return
                # Imported when drawn: a process may set TQDM_DISABLE, which tqdm reads at its import, after this one.
                from tqdm import tqdm

                self.bar = tqdm(total=100, desc=stage, unit="%", file=self.stream)
            if self.bar is not None:
                self.bar.n = round(100 * fraction)
                self.bar.set_postfix_str(message, refresh=True)
            else:
                self._line_if_due(now)

    def _beat(self) -> None:
        while not self.closed.wait(self.interval):
            with self.lock:
                if self.stage is not None:
                    self._line_if_due(self.clock())

    def _line_if_due(self, now: float) -> None:
        if now - self.last_line < self.interval:
            return
        self.last_line = now
        elapsed = _minutes_seconds(now - self.stage_started)
        message = f": {self.message}" if self.message else ""
        self._line(f"casp: {self.stage}{message} ({self.fraction:.0%}, {elapsed})")

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        """The run is over: the bar closed, the log's thread stopped."""
        self.closed.set()
        if self.heartbeat is not None:
            self.heartbeat.join()
        with self.lock:
            self._close_bar()


@contextmanager
def local_run() -> Iterator["Run"]:
    """The `Run` of a command: its stages' progress and its warnings on stderr, the bars closed however it ends."""
    from casp_core.run import Run  # torch: loaded only when a command needs it

    bars = StageBars()
    try:
        yield Run(progress=bars, on_warning=lambda message: print(f"casp: warning: {message}", file=sys.stderr))
    finally:
        bars.close()


def _minutes_seconds(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}:{seconds:02d} elapsed"
