"""`casp prune` end to end on the real model, and its one-line errors."""

import json
import os
import subprocess
import sys
import tomllib
from importlib import metadata

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from casp_cli.main import register
from casp_core.artifacts.checkpoint import load_pruned
from casp_core.cli import main as cli
from casp_core.errors import InvalidConfig
from casp_core.eval.perplexity import BOS_POLICY
from casp_core.families import SUPPORTED_MODEL_TYPES
from casp_core.method.temperature import ALPHA_GRID
from casp_core.model import resolve_device
from casp_core.rounding import speed_warning
from tests.conftest import DATASETS_DIR, PTBWIKI, REPO, STORIES

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA GPU")

SMALL = [
    "--datasets-dir",
    str(DATASETS_DIR),
    "--calibration-dataset",
    "wikitext2:validation",
    "--n-samples",
    "8",
    "--seq-len",
    "128",
    "--perplexity",
    "wikitext2,ptb",
    "--eval-seq-len",
    "128",
    "--eval-limit",
    "10",
]


def casp(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "casp_core", *args], capture_output=True, text=True, env=env, timeout=600, cwd=REPO
    )


def test_prune_end_to_end(tmp_path, capsys):
    out = tmp_path / "pruned"
    assert (
        cli.main(["prune", "--model", str(STORIES), "--ratio", "0.3", "--alpha", "auto", "--out", str(out), *SMALL])
        == 0
    )
    completed = capsys.readouterr()
    summary = json.loads(completed.out)
    assert abs(summary["achieved_ratio"] - 0.3) <= 0.01
    assert set(summary["perplexity"]) == {"wikitext2", "ptb"}
    assert summary["perplexity"]["ptb"]["split"] == "validation"  # LLM-Pruner's PTB split, named in the result
    assert "casp: pruning:" in completed.err  # stage progress, one line per stage in a log
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["alpha"] == "auto" and report["settings"]["calibration"]["n_samples"] == 8
    chosen = report["alpha_auto"]["chosen"]
    assert [row["alpha"] for row in report["alpha_auto"]["grid"]] == list(ALPHA_GRID) and chosen in ALPHA_GRID
    assert f"casp: temperature: alpha auto: {chosen:g}, the lowest held-out loss of 0: " in completed.err
    assert report["perplexity"]["ptb"]["n_windows"] == 10
    assert {key: report["perplexity"]["ptb"][key] for key in ("split", "seq_len", "bos")} == {
        "split": "validation",
        "seq_len": 128,
        "bos": BOS_POLICY,
    }
    model, tokenizer = load_pruned(out)
    generated = model.generate(**tokenizer("Once upon a time", return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > 5


def test_a_round_to_that_forfeits_the_speedup_is_one_warning_line_and_in_the_report(tmp_path, capsys):
    """ptbwiki-7M's 704 FFN channels: auto rounds to 8, an explicit 1 leaves widths the kernels run slowly."""
    out = tmp_path / "pruned"
    tiny = ["--datasets-dir", str(DATASETS_DIR), "--calibration-dataset", "wikitext2:validation", "--n-samples", "2",
            "--seq-len", "32", "--perplexity", "", "--solver", "diagonal", "--allocation", "uniform"]  # fmt: skip
    assert (
        cli.main(["prune", "--model", str(PTBWIKI), "--ratio", "0.3", "--round-to", "1", "--out", str(out), *tiny]) == 0
    )
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("casp: warning:")]
    assert warnings == [f"casp: warning: {speed_warning([704], 1)}"]
    assert json.loads((out / "report.json").read_text())["warnings"] == [speed_warning([704], 1)]
    assert f"- warning: {speed_warning([704], 1)}" in (out / "report.md").read_text()
    # The default (auto) keeps the speedup: nothing to warn about.
    assert cli.main(["prune", "--model", str(PTBWIKI), "--ratio", "0.3", "--out", str(tmp_path / "auto"), *tiny]) == 0
    assert "casp: warning:" not in capsys.readouterr().err
    assert json.loads((tmp_path / "auto" / "report.json").read_text())["warnings"] == []


def test_bad_input_in_a_process_of_its_own_is_one_line_and_exit_2(tmp_path):
    """What the user's terminal shows: nothing else reaches stderr (no warning of a library, no progress bar)."""
    completed = casp("prune", "--model", "/no/such/model", "--ratio", "0.3", "--out", str(tmp_path / "out"), *SMALL)
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines() == [
        "casp: error: model_not_found: model path '/no/such/model' does not exist or is not a directory"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (
            ["--model", "/no/such/model", "--ratio", "0.3"],
            "model_not_found: model path '/no/such/model' does not exist",
        ),
        (["--model", str(STORIES), "--ratio", "1.5"], "argument --ratio: must be in (0, 1), got 1.5"),
        (["--model", str(STORIES), "--ratio", "0"], "argument --ratio: must be in (0, 1), got 0.0"),
        (
            ["--model", str(STORIES), "--ratio", "0.3", "--alpha", "-1"],
            'argument --alpha: must be a number in [0, 100] or "auto", got -1',
        ),
        (
            ["--model", str(STORIES), "--ratio", "0.3", "--alpha", "hot"],
            'argument --alpha: must be a number in [0, 100] or "auto", got hot',
        ),
        pytest.param(
            ["--model", str(STORIES), "--ratio", "0.3", "--device", "cuda"],
            "device_unavailable: device 'cuda': ",
            marks=NO_CUDA,
        ),
        (
            ["--model", str(STORIES), "--ratio", "0.3", "--round-to", "0"],
            "argument --round-to: must be auto or an integer in [1, 65536], got 0",
        ),
        (
            ["--model", str(STORIES), "--ratio", "0.3", "--device", "gpu0"],
            "invalid_config: device: 'gpu0' is not a device name",
        ),
        (
            ["--model", str(STORIES), "--ratio", "0.3", "--recovery", "full", "--lora-rank", "16"],
            "invalid_config: recovery.rank: a LoRA setting, unused by recovery.method full",
        ),
    ],
)
def test_bad_input_gets_one_line_and_exit_2(tmp_path, capsys, arguments, expected):
    try:
        code = cli.main(["prune", *arguments, "--out", str(tmp_path / "out"), *SMALL])
    except SystemExit as exit_:  # argparse's refusals leave through parser.exit
        code = exit_.code
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_unsupported_architecture(tmp_path):
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)).save_pretrained(gpt2)
    completed = casp("prune", "--model", str(gpt2), "--ratio", "0.3", "--out", str(tmp_path / "out"), *SMALL)
    assert completed.returncode == 2
    assert "unsupported_model: model type 'gpt2' is not supported" in completed.stderr
    assert f"CASP prunes {', '.join(SUPPORTED_MODEL_TYPES)} models" in completed.stderr  # every family's types


@pytest.mark.slow
def test_missing_local_split_names_the_file(tmp_path):
    completed = casp(
        "prune",
        "--model",
        str(STORIES),
        "--ratio",
        "0.3",
        "--out",
        str(tmp_path / "out"),
        *SMALL[:2],
        "--calibration-dataset",
        "wikitext2",  # the train split is not among the fixtures
    )
    assert completed.returncode == 2
    assert f"wikitext2 train: looked for {DATASETS_DIR}/wikitext-2-raw/wiki.train.raw" in completed.stderr
    assert completed.stderr.strip().endswith("point --datasets-dir or CASP_DATASETS_DIR at a folder that has it")


@NO_CUDA
@pytest.mark.slow
def test_eval_on_a_missing_device_gets_one_line() -> None:
    completed = casp("eval", "--model", str(STORIES), "--device", "cuda:1", "--tasks", "", "--perplexity", "")
    assert completed.returncode == 2
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("casp: error: device_unavailable: device 'cuda:1': "), lines


def test_resolve_device_refuses_what_is_not_a_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(InvalidConfig, match="'cuda:x' is not a device name"):
        resolve_device("cuda:x")


def test_version() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "casp_cli.main", "--version"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert completed.returncode == 0
    assert completed.stdout == f"casp {metadata.version('casp')}\n"


def test_version_of_a_source_tree_that_was_never_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert cli.package_version() == f"{project['version']} (not installed)"


def help_of(command: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.build_parser([register]).parse_args([*command, "--help"])
    assert exited.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines where it likes


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        (
            ["prune"],
            [
                "--solver {greedy,",
                "default: greedy",
                "--n-samples N_SAMPLES calibration windows (default: 128)",
                "(default: auto)",
            ],
        ),
        (["eval"], ["--latency-seq-len LATENCY_SEQ_LEN default: 128", "(default: wikitext2,ptb)"]),
        (["serve"], ["--port PORT default: 8000", "--host HOST default: 127.0.0.1"]),
        (["demo"], ["--timeout TIMEOUT default: 1800.0", "(default: casp-home)"]),
        (["worker"], ["--log-level LOG_LEVEL default: info"]),
        (["keys", "create"], ["--name NAME"]),
        (
            ["submit"],
            [
                "(default: http://127.0.0.1:8000)",
                "--alpha ALPHA allocation temperature, or auto: the grid's best on held-out calibration windows "
                "(default: 0.5)",
                "(default: 3)",
            ],
        ),
        (["status"], ["(default: http://127.0.0.1:8000)", "(default: 3)"]),
        (["wait"], ["(default: http://127.0.0.1:8000)"]),
        (["download"], ["(default: http://127.0.0.1:8000)"]),
    ],
)
def test_help_shows_defaults(
    command: list[str], shown: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CASP_URL", raising=False)
    monkeypatch.setenv("CASP_API_KEY", "casp-secret-key")
    text = help_of(command, capsys)
    for part in shown:
        assert part in text, text
    assert "default: None" not in text and "default: False" not in text
    assert "casp-secret-key" not in text  # the key is read when needed, never shown as a default
