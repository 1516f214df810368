"""`casp eval` on the real stories260K checkpoint and on a checkpoint pruned by the project's pipeline."""

import argparse
import json
import math
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from casp_core.cli.eval import add_eval_parser, evaluate_checkpoint
from casp_core.errors import InvalidConfig, ModelNotFound
from casp_core.eval.efficiency import count_parameters, prefill_macs
from casp_core.eval.kept_scores import SCORES_FOLDER
from casp_core.eval.perplexity import perplexity
from casp_core.eval.shared_context import SharedContextLM
from casp_core.eval.zeroshot import kept_loglikelihoods
from tests.conftest import STORIES
from tests.core.eval.eval_helpers import (
    datasets_dir_or_skip,
    one_torch_thread,  # noqa: F401 (an autouse fixture)
)
from tests.core.eval.eval_models import pruned_checkpoint

TASKS = ["piqa", "arc_easy"]


def _casp_eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="casp")
    add_eval_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eval", *argv])
    return args.run(args)


def _run(model: Path, out: Path, datasets_dir: Path) -> dict:
    argv = [
        "--model", str(model),
        "--tasks", ",".join(TASKS),
        "--limit", "8",
        "--perplexity", "wikitext2",
        "--seq-len", "128",
        "--max-windows", "4",
        "--datasets-dir", str(datasets_dir),
        "--device", "cpu",
        "--latency-batch-size", "2", "--latency-seq-len", "16", "--new-tokens", "4",
        "--repeats", "2", "--warmup", "1",
        "--out", str(out),
    ]  # fmt: skip
    assert _casp_eval(argv) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    datasets_dir = datasets_dir_or_skip()
    pruned_dir, _ = pruned_checkpoint(datasets_dir)
    out = tmp_path_factory.mktemp("eval")
    return {
        "dense": _run(STORIES, out / "dense.json", datasets_dir),
        "pruned": _run(pruned_dir, out / "pruned.json", datasets_dir),
    }


@pytest.mark.parametrize("side", ["dense", "pruned"])
def test_output_has_the_documented_shape(outputs: dict, side: str):
    out = outputs[side]
    assert set(out) == {"model", "zero_shot", "zero_shot_summary", "perplexity", "efficiency"}
    assert list(out["zero_shot"]) == TASKS
    for task, figures in out["zero_shot"].items():
        assert 0.0 <= figures["acc"] <= 1.0 and 0.0 <= figures["acc_norm"] <= 1.0, task
        assert figures["n_samples"] == 8 and figures["num_fewshot"] == 0
    summary = out["zero_shot_summary"]
    assert summary["limit"] == 8 and summary["source"] == "local"
    assert summary["average_acc"] == pytest.approx(sum(f["acc"] for f in out["zero_shot"].values()) / 2)
    ppl = out["perplexity"]["wikitext2"]
    assert ppl["seq_len"] == 128 and ppl["n_windows"] == 4 and math.isfinite(ppl["ppl"]) and ppl["ppl"] > 1
    assert out["efficiency"]["latency"]["prefill_s"] > 0 and out["efficiency"]["latency"]["decode_s"] > 0


def test_dense_figures_are_the_library_functions_figures(outputs: dict):
    model = AutoModelForCausalLM.from_pretrained(STORIES)
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    direct = perplexity(
        model, tokenizer, "wikitext2", seq_len=128, datasets_dir=str(datasets_dir_or_skip()), device="cpu",
        max_windows=4,
    )  # fmt: skip
    assert outputs["dense"]["perplexity"]["wikitext2"]["ppl"] == pytest.approx(direct["ppl"], rel=1e-6)
    assert outputs["dense"]["efficiency"]["params"] == count_parameters(model) == 260_032
    assert outputs["dense"]["efficiency"]["macs"] == prefill_macs(model)["total"]


def test_pruned_checkpoint_is_smaller_and_worse(outputs: dict):
    dense, pruned = outputs["dense"], outputs["pruned"]
    assert pruned["efficiency"]["params"] < dense["efficiency"]["params"]
    assert pruned["efficiency"]["macs"] < dense["efficiency"]["macs"]
    # 30 % of the decoder removed without any retraining: the language model gets worse.
    assert pruned["perplexity"]["wikitext2"]["ppl"] > dense["perplexity"]["wikitext2"]["ppl"]


def test_sections_can_be_skipped_and_printed(capsys: pytest.CaptureFixture[str]):
    assert _casp_eval(["--model", str(STORIES), "--tasks", "", "--perplexity", "", "--no-efficiency"]) == 0
    assert json.loads(capsys.readouterr().out) == {"model": str(STORIES)}


def test_progress_goes_to_stderr_batch_by_batch(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """In a log (stderr not a terminal), with a line for every report: the zero-shot scoring's fractions."""
    monkeypatch.setenv("CASP_PROGRESS_INTERVAL", "0")
    datasets_dir = datasets_dir_or_skip()
    argv = ["--model", str(STORIES), "--tasks", "arc_easy", "--limit", "24", "--perplexity", "", "--no-efficiency"]
    assert _casp_eval([*argv, "--datasets-dir", str(datasets_dir), "--batch-size", "4"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["zero_shot"]["arc_easy"]["n_samples"] == 24
    # casp's lines, not the libraries' own: the harness's tqdm bar writes without a newline, so one may precede
    # a casp line on the same line of the capture.
    lines = [line[line.index("casp: ") :] for line in captured.err.splitlines() if "casp: " in line]
    assert lines[0] == "casp: evaluation: zero-shot arc_easy"
    assert len(lines) > 3 and all(line.startswith("casp: evaluation: zero-shot arc_easy (") for line in lines[1:])
    assert "(100%, " in lines[-1]


def test_an_evaluation_cut_short_and_run_again_resumes_from_the_scores_it_kept(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """`casp eval` interrupted part-way (Ctrl-C; here its second batch raises), run again, says it resumes from the
    log-likelihoods the first run kept in the cache folder, and removes them once it has its figures."""
    monkeypatch.setenv("CASP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CASP_PROGRESS_INTERVAL", "0")
    datasets_dir = datasets_dir_or_skip()
    argv = ["--model", str(STORIES), "--tasks", "arc_easy", "--limit", "24", "--perplexity", "", "--no-efficiency"]
    argv += ["--datasets-dir", str(datasets_dir), "--batch-size", "4"]
    advance = SharedContextLM._advance
    batches: list[int] = []

    def interrupted_at_the_second(lm: SharedContextLM, reads: int) -> None:
        batches.append(reads)
        if len(batches) == 2:
            raise KeyboardInterrupt
        advance(lm, reads)

    monkeypatch.setattr(SharedContextLM, "_advance", interrupted_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        _casp_eval(argv)
    (kept,) = (tmp_path / SCORES_FOLDER).iterdir()
    kept_before = kept_loglikelihoods(kept)
    assert kept_before > 0
    monkeypatch.setattr(SharedContextLM, "_advance", advance)
    capsys.readouterr()
    assert _casp_eval(argv) == 0
    captured = capsys.readouterr()
    resuming = f"zero-shot: resuming from the {kept_before:,} log-likelihoods an earlier run kept"
    assert f"casp: evaluation: {resuming}" in captured.err
    assert json.loads(captured.out)["zero_shot"]["arc_easy"]["n_samples"] == 24
    assert not any((tmp_path / SCORES_FOLDER).iterdir())


def test_bad_input_is_refused(tmp_path: Path):
    with pytest.raises(ModelNotFound):
        evaluate_checkpoint(str(tmp_path / "nothing"), tasks=[], perplexity_sets=[])
    with pytest.raises(InvalidConfig, match="mmlu"):
        evaluate_checkpoint(str(STORIES), tasks=["mmlu"], perplexity_sets=[])
    with pytest.raises(SystemExit):
        _casp_eval(["--model", str(STORIES), "--limit", "0"])
