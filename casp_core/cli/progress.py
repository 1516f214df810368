"""Progress of a local run on the command line (`casp prune`, `casp recover`)."""

import sys

from tqdm import tqdm


class StageBars:
    """One tqdm bar per pipeline stage on a terminal; one line per stage in logs."""

    def __init__(self) -> None:
        self.stage: str | None = None
        self.bar: tqdm | None = None
        self.interactive = sys.stderr.isatty()

    def __call__(self, stage: str, fraction: float, message: str = "") -> None:
        if stage != self.stage:
            self.close()
            self.stage = stage
            if not self.interactive:
                print(f"casp: {stage}: {message}", file=sys.stderr)
                return
            self.bar = tqdm(total=100, desc=stage, unit="%", file=sys.stderr)
        if self.bar is not None:
            self.bar.n = round(100 * fraction)
            self.bar.set_postfix_str(message, refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
