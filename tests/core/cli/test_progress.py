"""The command line's progress in a log: a long stage is never silent."""

import io
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from casp_core.cli import main as cli
from casp_core.cli.progress import LOG_INTERVAL_SECONDS, LOG_INTERVAL_VARIABLE, StageBars, local_run, log_interval
from casp_core.errors import InvalidConfig
from tests.conftest import DATASETS_DIR, REPO, STORIES


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
    bars.close()
    assert stream.getvalue().splitlines() == [
        "casp: allocation: layer sensitivities from the cross-entropy gradient",
        "casp: allocation: gradients of 4 of 16 sequences (25%, 0:12 elapsed)",
        "casp: allocation: gradients of 8 of 16 sequences (50%, 0:24 elapsed)",
        "casp: allocation: gradients of 12 of 16 sequences (75%, 0:36 elapsed)",
        "casp: allocation: gradients of 16 of 16 sequences (100%, 0:48 elapsed)",
        "casp: pruning: layer 1 of 8",
    ]


def test_a_log_gets_a_line_at_intervals_while_no_report_comes() -> None:
    """One batch of the allocation's gradients can take minutes: the thread writes the latest counts meanwhile."""
    stream = io.StringIO()
    bars = StageBars(stream, interval=0.05)
    bars("allocation", 0.25, "gradients of 2 of 8 sequences")
    deadline = time.monotonic() + 10
    while len(stream.getvalue().splitlines()) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    bars.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "casp: allocation: gradients of 2 of 8 sequences"
    assert len(lines) >= 4 and set(lines[1:]) == {"casp: allocation: gradients of 2 of 8 sequences (25%, 0:00 elapsed)"}
    time.sleep(0.2)
    assert stream.getvalue().splitlines() == lines  # closed: the thread has stopped


def test_a_command_s_run_prints_its_progress_and_warnings_and_stops_its_thread_however_it_ends(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`casp prune`, `casp recover` and `casp eval` all run through `local_run` (recover's warnings, the LoRA
    dropout of experts, were once dropped)."""
    monkeypatch.setenv(LOG_INTERVAL_VARIABLE, "60")  # the log's thread runs, and writes no line of its own here
    with pytest.raises(RuntimeError, match="the stage failed"), local_run() as run:
        run.report("recovery", 0.5, "step 2 of 4")
        run.warn("recovery: LoRA dropout 0 instead of 0.05")
        assert any(thread.name == "casp-progress" for thread in threading.enumerate())
        raise RuntimeError("the stage failed")
    assert not any(thread.name == "casp-progress" for thread in threading.enumerate())
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == ["casp: recovery: step 2 of 4", "casp: warning: recovery: LoRA dropout 0 instead of 0.05"]
    assert run.warnings == ["recovery: LoRA dropout 0 instead of 0.05"]


def test_the_interval_is_set_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert log_interval() == LOG_INTERVAL_SECONDS == 10.0
    monkeypatch.setenv(LOG_INTERVAL_VARIABLE, "2.5")
    bars = StageBars(io.StringIO())
    bars.close()
    assert bars.interval == 2.5
    for wrong in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv(LOG_INTERVAL_VARIABLE, wrong)
        with pytest.raises(
            InvalidConfig, match=f"{LOG_INTERVAL_VARIABLE}: a number of seconds, 0 or more, got '{wrong}'"
        ):
            log_interval()


def casp_prune_in_a_log(out: Path, interval: str) -> subprocess.CompletedProcess[str]:
    """`casp prune` of stories260K with stderr a pipe, as under nohup, cron or CI."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", LOG_INTERVAL_VARIABLE: interval}
    # 8 windows in batches of 2: the allocation reports each layer of each chunk of windows, the pruning each layer.
    settings = ["--n-samples", "8", "--seq-len", "32", "--batch-size", "2", "--eval-seq-len", "32", "--eval-limit", "2"]
    return subprocess.run(
        [
            *(sys.executable, "-m", "casp_core", "prune", "--model", str(STORIES), "--ratio", "0.3", "--out", str(out)),
            *("--datasets-dir", str(DATASETS_DIR), "--calibration-dataset", "wikitext2:validation", "--device", "cpu"),
            *settings,
            *("--perplexity", "wikitext2"),
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_casp_prune_in_a_log_prints_the_counts_of_the_service_s_events(tmp_path: Path) -> None:
    completed = casp_prune_in_a_log(tmp_path / "out", "0")
    assert completed.returncode == 0, completed.stderr[-2000:]
    lines = [line for line in completed.stderr.splitlines() if line.startswith("casp: ")]
    counted = re.compile(r"casp: (\w+): (.+) \((\d+)%, (\d+):(\d\d) elapsed\)")
    progress = [match.groups()[:3] for match in map(counted.fullmatch, lines) if match]
    # The allocation goes a chunk of windows at a time, each forward through the 5 layers, then back from the head.
    allocation = [(message, int(percent)) for stage, message, percent in progress if stage == "allocation"]
    chunks = sorted({message.split(":")[0] for message, _ in allocation}, key=lambda c: int(c.split()[1].split("-")[0]))
    steps = [f"forward through layer {layer} of 5" for layer in range(1, 6)]
    steps += [f"gradient at the output of layer {layer}" for layer in range(5, 0, -1)]
    assert [message for message, _ in allocation] == [f"{chunk}: {step}" for chunk in chunks for step in steps]
    covered = [range(int(first), int(last) + 1) for first, last in (c.split()[1].split("-") for c in chunks)]
    assert [window for windows in covered for window in windows] == list(range(8))
    percents = [percent for _, percent in allocation]
    assert percents == sorted(percents) and percents[-1] == 100
    assert [row for row in progress if row[0] == "pruning"] == [
        *(("pruning", f"layer {layer} of 5", str(20 * (layer - 1))) for layer in range(2, 6)),
        ("pruning", "all layers pruned", "100"),
    ]
    assert ("report", "report.json, report.md and the model card written", "100") in progress
    # Every stage starts with a line of its own, and no message repeats its stage ("casp: placement: placement:").
    started = [line.split(":")[1].strip() for line in lines if not counted.fullmatch(line)]
    assert {"load", "calibration", "evaluation", "placement", "allocation", "pruning", "verification"} <= set(started)
    assert not [line for line in lines if re.match(r"casp: (\w+): \1: ", line)], lines


def test_a_wrong_interval_is_one_line_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(LOG_INTERVAL_VARIABLE, "soon")
    out = tmp_path / "out"
    assert cli.main(["prune", "--model", str(STORIES), "--ratio", "0.3", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        "casp: error: invalid_config: CASP_PROGRESS_INTERVAL: a number of seconds, 0 or more, got 'soon'\n"
    )
    assert not out.exists()
