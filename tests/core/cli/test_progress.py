"""The command line's progress in a log: a long stage is never silent."""

import io

from casp_core.cli.progress import StageBars


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_the_stage_s_counts_and_elapsed_time_at_intervals() -> None:
    stream, clock = io.StringIO(), Clock()
    bars = StageBars(stream, interval=10.0, clock=clock)
    bars("allocation", 0.0, "layer sensitivities from the cross-entropy gradient")
    for done in range(1, 17):  # one report every 3 s: a line when 10 s have passed since the last one
        clock.now += 3.0
        bars("allocation", done / 16, f"gradients of {done} of 16 sequences")
    clock.now += 1.0
    bars("pruning", 0.0, "layer 1 of 8")
    assert stream.getvalue().splitlines() == [
        "casp: allocation: layer sensitivities from the cross-entropy gradient",
        "casp: allocation: gradients of 4 of 16 sequences (25%, 0:12 elapsed)",
        "casp: allocation: gradients of 8 of 16 sequences (50%, 0:24 elapsed)",
        "casp: allocation: gradients of 12 of 16 sequences (75%, 0:36 elapsed)",
        "casp: allocation: gradients of 16 of 16 sequences (100%, 0:48 elapsed)",
        "casp: pruning: layer 1 of 8",
    ]
