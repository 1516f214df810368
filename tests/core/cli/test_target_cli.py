"""`casp prune` and `casp submit` with a budget instead of a ratio (issue 23): the flags, and a one-line error with
exit status 2 for each bad input, before any work."""

from pathlib import Path

import pytest

from casp_cli.main import register, submit_request
from casp_core.cli import main as cli
from casp_core.job.plan import plan_sweep
from casp_core.model import load_config
from casp_core.settings import DEFAULT_SWEEP_RATIOS, PruneConfig
from tests.conftest import STORIES

FLAGS = ["--target-bytes", "--target-format", "--target-params", "--max-perplexity-increase", "--ratios"]
FLAGS += ["--gguf-types", "--quantizations", "--keep"]


def help_text(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.build_parser([register]).parse_args([command, "--help"])
    assert exited.value.code == 0
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", ["prune", "submit"])
def test_help_shows_the_target_flags(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = help_text(command, capsys)
    for flag in FLAGS:
        assert flag in text, flag
    assert "--target-format {gguf,safetensors}" in text and "--keep {best,all}" in text
    assert f"(default: {','.join(map(str, DEFAULT_SWEEP_RATIOS))})" in text


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (
            ["--ratio", "0.3", "--target-bytes", "1MB"],
            "casp: error: invalid_config: ratio: give ratio or target, not both",
        ),
        ([], "casp: error: invalid_config: ratio: give ratio or target"),
        (
            ["--target-bytes", "1MB", "--target-params", "100"],
            "casp: error: invalid_config: target: give exactly one of max_bytes, max_params, max_perplexity_increase, "
            "got max_bytes, max_params",
        ),
        (
            ["--target-params", "100000", "--target-format", "gguf"],
            "casp: error: invalid_config: target.format: only goes with max_bytes",
        ),
        (
            ["--target-bytes", "6 parsecs"],
            "casp prune: error: argument --target-bytes: must be a number of bytes > 0, or one with a unit such as "
            "24GiB or 500MB, got 6 parsecs",
        ),
        (["--target-params", "0"], "casp prune: error: argument --target-params: must be >= 1, got 0"),
        (
            ["--max-perplexity-increase", "0"],
            "casp prune: error: argument --max-perplexity-increase: must be in (0, 100], got 0.0",
        ),
        (["--target-params", "100000", "--ratios", ","], "casp prune: error: argument --ratios: must not be empty"),
        (
            ["--target-params", "100000", "--ratios", "0.2,1.5"],
            "casp prune: error: argument --ratios: must be in (0, 1), got 1.5",
        ),
        (["--target-params", "100000", "--ratios", "0.2,0.2"], "casp: error: invalid_config: ratios: names 0.2 twice"),
        (
            ["--target-params", "100000", "--ratios", "0.2,0.95"],
            "casp: error: invalid_config: ratios: must be at most r_max (0.9), got 0.95",
        ),
        (
            ["--target-bytes", "1MB", "--gguf-types", "f16,q9"],
            "casp prune: error: argument --gguf-types: must be one of f32, f16, bf16, q8_0, q6_k, q5_k_m, q5_k_s, "
            "q4_k_m, q4_k_s, q3_k_m, q2_k, q4_0, q5_0, iq4_nl, got 'q9'",
        ),
        (
            ["--target-bytes", "1MB", "--keep", "some"],
            "casp prune: error: argument --keep: must be one of best, all, got 'some'",
        ),
    ],
)
def test_bad_input_gets_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], expected: str
) -> None:
    out = tmp_path / "out"
    try:
        status = cli.main(["prune", "--model", str(STORIES), "--out", str(out), *arguments])
    except SystemExit as exited:  # argparse's own refusals
        status = exited.code
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    assert not out.exists()


@pytest.mark.parametrize(
    ("flag", "measure", "unit"),
    [("--target-bytes", "estimated_bytes", "bytes"), ("--target-params", "estimated_params", "parameters")],
)
def test_an_impossible_budget_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, measure: str, unit: str
) -> None:
    budget = "max_bytes" if flag == "--target-bytes" else "max_params"
    roomy = PruneConfig(target={budget: 10**9}, export=["gguf"])
    everything = plan_sweep(load_config(str(STORIES)), roomy).candidates
    smallest = min(everything, key=lambda c: getattr(c, measure))
    size = getattr(smallest, measure)
    out = tmp_path / "out"
    arguments = ["prune", "--model", str(STORIES), "--out", str(out), "--export", "gguf", flag, str(size - 1)]
    assert cli.main(arguments) == 2
    assert capsys.readouterr().err.strip() == (
        f"casp: error: invalid_config: target.{budget}: no candidate fits in {size - 1} {unit}: the smallest "
        f"reachable is {size} {unit} (ratio {smallest.ratio}, {smallest.variant})"
    )
    assert not out.exists()


def test_casp_submit_sends_the_target_nested_as_the_api_takes_it() -> None:
    parser = cli.build_parser([register])
    arguments = ["submit", "--model", "org/model", "--target-bytes", "6GB", "--target-format", "safetensors"]
    args = parser.parse_args([*arguments, "--ratios", "0.2,0.4", "--quantizations", "none,w8a8_int8", "--keep", "all"])
    request = submit_request(args)
    assert request["target"] == {"max_bytes": 6 * 10**9, "format": "safetensors"}
    assert (request["ratios"], request["quantizations"], request["keep"]) == ([0.2, 0.4], ["none", "w8a8_int8"], "all")
    assert "ratio" not in request
    args = parser.parse_args(["submit", "--model", "org/model", "--max-perplexity-increase", "0.1"])
    assert submit_request(args)["target"] == {"max_perplexity_increase": 0.1}


def test_casp_submit_needs_a_ratio_or_a_target() -> None:
    args = cli.build_parser([register]).parse_args(["submit", "--model", "org/model"])
    with pytest.raises(SystemExit) as exited:
        submit_request(args)
    assert (
        "needs --model and --ratio (or a target: --target-bytes, --target-params or --max-perplexity-increase)"
        in str(exited.value)
    )
