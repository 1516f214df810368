"""Perplexity in llama.cpp (casp_core.artifacts.gguf.engine) against the transformers perplexity of the same
checkpoint, on
the same windows of the same token ids; the job's table of files as deployed, in report.json, report.md and the
model card; and what a machine without llama-cpp-python gets instead."""

import json
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.artifacts.gguf import engine
from casp_core.artifacts.gguf.engine import (
    ENGINE_MISSING,
    artifact_table,
    gguf_bits_per_weight,
    gguf_perplexity,
    measure_exports,
    measure_gguf,
)
from casp_core.artifacts.gguf.writer import export_gguf
from casp_core.cli.main import main
from casp_core.eval.perplexity import evaluation_text, windows_perplexity
from casp_core.job.run import run_job
from casp_core.method.surgery import LayerPruning, remove_units
from casp_core.model import load_model
from casp_core.report.evaluation_section import render_evaluation_section
from casp_core.run import Run
from casp_core.settings import EvaluationConfig
from tests.conftest import DATASETS_DIR, PTBWIKI, STORIES, tiny_config
from tests.core.eval.eval_helpers import one_torch_thread  # noqa: F401 (autouse fixture)

WINDOWS = 4  # per data set, of SEQ_LEN tokens: enough tokens for a figure that a misaligned NLL moves
SEQ_LEN = 128
RELATIVE = 1e-3  # the bound: within 0.1 % of the transformers perplexity
DATASETS = ("wikitext2", "ptb")

# ptbwiki-7M (8 heads, FFN 704, 8 layers) with a different shape in every layer, a layer without heads among
# them, so that the file is llama.cpp's per-layer `deci` architecture.
PTBWIKI_MASKS = [
    LayerPruning((0,), tuple(range(0, 704, 4))),
    LayerPruning((1, 2), tuple(range(0, 704, 3))),
    LayerPruning(tuple(range(8)), tuple(range(100))),
    LayerPruning((3, 4, 5), ()),
    LayerPruning((), tuple(range(0, 704, 2))),
    LayerPruning((7,), tuple(range(300))),
    LayerPruning((0, 6), tuple(range(0, 704, 5))),
    LayerPruning((2,), tuple(range(50))),
]


def ptbwiki_pruned(directory: Path) -> Path:
    model, tokenizer = load_model(str(PTBWIKI), dtype="float32")
    save_pruned(remove_units(model, PTBWIKI_MASKS), tokenizer, directory)
    return directory


@pytest.mark.parametrize(("name", "chunk"), [("stories260K", None), ("ptbwiki-7M pruned", None), ("stories260K", 48)])
def test_f32_gguf_perplexity_in_llama_cpp_equals_transformers(tmp_path, monkeypatch, name, chunk):
    """`chunk`: the positions llama.cpp takes at a time (a small vocabulary's chunk holds a whole window; 48 splits
    each 128-token window as a 128K vocabulary's 130 splits a 2048-token one, with a shorter last chunk)."""
    if chunk is not None:
        monkeypatch.setattr(engine, "tokens_per_chunk", lambda vocab: chunk)
    if name == "stories260K":
        checkpoint = STORIES
        model, tokenizer = load_model(str(STORIES), dtype="float32")
    else:
        checkpoint = ptbwiki_pruned(tmp_path / "pruned")
        model, tokenizer = load_pruned(checkpoint, dtype="float32")
    exported = export_gguf(checkpoint, tmp_path / "model-f32.gguf", "f32")
    assert exported.architecture == ("llama" if name == "stories260K" else "deci")
    texts = {
        dataset: evaluation_text(tokenizer, dataset, SEQ_LEN, datasets_dir=str(DATASETS_DIR), max_windows=WINDOWS)
        for dataset in DATASETS
    }
    assert all(text.windows.shape == (WINDOWS, SEQ_LEN) for text in texts.values())

    figures = measure_gguf(exported.path, texts)

    for dataset, text in texts.items():
        expected = windows_perplexity(model, text, device="cpu")
        assert figures.perplexity[dataset] == pytest.approx(expected, rel=RELATIVE), dataset
    assert figures.perplexity["wikitext2"] != pytest.approx(figures.perplexity["ptb"], rel=0.05)
    assert figures.prefill_tokens_per_s > 0 and figures.decode_tokens_per_s > 0
    if name != "stories260K":  # 7M parameters: 128 tokens in one batch go far faster per token than one at a time
        assert figures.prefill_tokens_per_s > 2 * figures.decode_tokens_per_s


def test_bits_per_weight_are_those_of_the_tensor_data(tmp_path):
    f32 = export_gguf(STORIES, tmp_path / "model-f32.gguf", "f32")
    assert gguf_bits_per_weight(f32.path) == 32.0
    # ptbwiki-7M's rows are multiples of 32: every matrix is Q8_0 (34 bytes per 32 weights), the norms F32.
    q8_0 = export_gguf(PTBWIKI, tmp_path / "model-q8_0.gguf", "q8_0")
    assert not q8_0.fallbacks
    assert 8.5 < gguf_bits_per_weight(q8_0.path) < 8.52


def test_a_job_reports_each_file_with_its_perplexity_in_its_engine(tmp_path):
    evaluation = EvaluationConfig(perplexity=list(DATASETS), seq_len=64, limit=3)
    config = tiny_config(0.3, evaluation=evaluation, export=["gguf"], gguf_type="q8_0")
    out = tmp_path / "pruned"
    report = run_job(str(STORIES), config, out)

    table = report["artifacts"]
    checkpoint, engine = table["rows"]
    assert table["note"] is None and table["engine"]["threads"] == 1
    assert table["engine"]["perplexity_threads"] == torch.get_num_threads()  # this module's one (eval_helpers)
    assert checkpoint == {
        "file": "model.safetensors",
        "format": "safetensors",
        "type": "f32",
        "bytes": (out / "model.safetensors").stat().st_size,
        "bits_per_weight": 32.0,
        "perplexity": {name: report["perplexity"][name]["pruned"] for name in DATASETS},
        "perplexity_in": "transformers",
        "prefill_tokens_per_s": None,
        "decode_tokens_per_s": None,
    }
    gguf_path = out / "model-q8_0.gguf"
    assert engine["file"] == "model-q8_0.gguf" and engine["format"] == "gguf" and engine["type"] == "q8_0"
    assert engine["bytes"] == gguf_path.stat().st_size
    # Q8_0 is 8.5 bits; the pruned FFN widths (not multiples of 32) and the norms keep F16 and F32.
    assert 8.5 < engine["bits_per_weight"] < 16
    assert engine["perplexity_in"] == "llama.cpp"
    # llama.cpp's figure of this file on the job's windows, not transformers': the same figure again, at one thread
    # as the job ran and at two, since each row of a product is one thread's work whatever their number.
    _, tokenizer = load_pruned(out)
    texts = {
        name: evaluation_text(tokenizer, name, 64, datasets_dir=str(DATASETS_DIR), max_windows=3) for name in DATASETS
    }
    assert engine["perplexity"] == measure_gguf(gguf_path, texts).perplexity
    torch.set_num_threads(2)
    try:
        assert engine["perplexity"] == gguf_perplexity(gguf_path, texts)
    finally:
        torch.set_num_threads(1)
    for name in DATASETS:
        assert engine["perplexity"][name] != checkpoint["perplexity"][name]
        assert engine["perplexity"][name] == pytest.approx(checkpoint["perplexity"][name], rel=0.05)
    assert engine["prefill_tokens_per_s"] > 0 and engine["decode_tokens_per_s"] > 0
    assert "evaluation_gguf" in report["timings"]
    assert json.loads((out / "report.json").read_text())["artifacts"] == table

    markdown = (out / "report.md").read_text()
    assert "### Files as deployed" in markdown
    assert f"| `model-q8_0.gguf` | gguf | q8_0 | {engine['bytes']:,} | {engine['bits_per_weight']:.2f} |" in markdown
    card = ModelCard.load(out / "README.md")
    in_engine = {
        result.dataset_name: result.metric_value
        for result in card.data.eval_results
        if result.metric_name == "perplexity in llama.cpp, model-q8_0.gguf (q8_0, 64-token windows)"
    }
    assert in_engine == engine["perplexity"]
    assert "### Files as deployed" in card.text


def test_without_llama_cpp_the_gguf_rows_say_why_they_have_no_figures(tmp_path, monkeypatch):
    exported = export_gguf(STORIES, tmp_path / "model-f16.gguf", "f16")
    _, tokenizer = load_model(str(STORIES))
    texts = {"wikitext2": evaluation_text(tokenizer, "wikitext2", 32, datasets_dir=str(DATASETS_DIR), max_windows=1)}
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError, as when missing
    warnings: list[str] = []

    figures = measure_exports([exported], texts, Run(on_warning=warnings.append))
    table = artifact_table(STORIES, {"wikitext2": 12.5}, [exported], figures, list(texts))

    assert table["note"] == ENGINE_MISSING and warnings == [ENGINE_MISSING]
    assert table["engine"] is None
    row = table["rows"][1]
    assert row["perplexity"] == {"wikitext2": None} and row["perplexity_in"] is None
    assert row["prefill_tokens_per_s"] is None and row["decode_tokens_per_s"] is None
    assert row["bytes"] == exported.path.stat().st_size and 16 < row["bits_per_weight"] < 17
    assert table["rows"][0]["perplexity"] == {"wikitext2": 12.5}
    markdown = render_evaluation_section({"artifacts": table})
    assert f"| `model-f16.gguf` | gguf | f16 | {row['bytes']:,} |" in markdown
    assert f"**{ENGINE_MISSING}.**" in markdown


def test_casp_prune_prints_each_gguf_with_its_perplexity_in_llama_cpp(tmp_path, capsys):
    out = tmp_path / "pruned"
    arguments = ["prune", "--model", str(STORIES), "--ratio", "0.3", "--out", str(out), "--export", "gguf"]
    arguments += ["--gguf-type", "q8_0", "--datasets-dir", str(DATASETS_DIR), "--n-samples", "8", "--seq-len", "64"]
    arguments += ["--calibration-dataset", "wikitext2:validation", "--perplexity", "wikitext2", "--eval-limit", "2"]
    assert main(arguments) == 0
    (printed,) = json.loads(capsys.readouterr().out)["exports"]
    rows = json.loads((out / "report.json").read_text())["artifacts"]["rows"]
    (row,) = [row for row in rows if row["format"] == "gguf"]
    assert printed["path"] == row["file"] == "model-q8_0.gguf"
    assert printed["llama_cpp_perplexity"] == {"wikitext2": round(row["perplexity"]["wikitext2"], 3)}
