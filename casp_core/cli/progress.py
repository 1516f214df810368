"""Progress of a local run on the command line (`casp prune`, `casp recover`)."""

import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

# How often a log (stderr that is not a terminal) gets a line while one stage goes on.
LOG_INTERVAL_SECONDS = 10.0


class StageBars:
    """One tqdm bar per pipeline stage on a terminal. In a log, a line when a stage starts and then one every
    `interval` seconds with the stage's latest message (its counts: layers, windows, steps), its share done and the
    time spent in it, so that a long stage is never silent."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        interval: float = LOG_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = self.stream.isatty()
        self.interval = interval
        self.clock = clock
        self.stage: str | None = None
        self.bar: tqdm | None = None
        self.stage_started = 0.0
        self.last_line = 0.0

    def __call__(self, stage: str, fraction: float, message: str = "") -> None:
        now = self.clock()
        if stage != self.stage:
            self.close()
            self.stage, self.stage_started, self.last_line = stage, now, now
            if not self.interactive:
                self._line(f"casp: {stage}: {message}" if message else f"casp: {stage}")
                return
            self.bar = tqdm(total=100, desc=stage, unit="%", file=self.stream)
        if self.bar is not None:
            self.bar.n = round(100 * fraction)
            self.bar.set_postfix_str(message, refresh=True)
        elif now - self.last_line >= self.interval:
            self.last_line = now
            elapsed = _minutes_seconds(now - self.stage_started)
            self._line(f"casp: {stage}" + (f": {message}" if message else "") + f" ({fraction:.0%}, {elapsed})")

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _minutes_seconds(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}:{seconds:02d} elapsed"
