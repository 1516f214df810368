"""The checkpoint publishes as it is: a model card whose front matter the hub's own parser reads, with the
report's numbers, and no absolute path of this machine anywhere in the directory."""

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import ModelCard, metadata_load

from casp_core.job.run import run_job
from casp_core.report.model_card import render_model_card
from casp_core.report.publish import base_model_of, without_local_paths
from tests.conftest import DATASETS_DIR, REPO, STORIES, small_config


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], Path]:
    """One job on a local fixture, evaluated on a named set and on a local text file, exported to GGUF."""
    work = tmp_path_factory.mktemp("publish")
    text = work / "notes.txt"
    with (DATASETS_DIR / "wikitext-2-raw" / "wiki.test.raw").open(encoding="utf-8") as source:
        text.write_text(source.read(20000), encoding="utf-8")
    config = small_config(0.3, export=["gguf"])
    config.evaluation.perplexity = ["wikitext2", str(text)]
    config.evaluation.zero_shot = ["piqa"]
    config.evaluation.limit = 10
    out = work / "pruned"
    return out, run_job(str(STORIES), config, out), work


def test_no_absolute_path_in_the_checkpoint(published: tuple[Path, dict[str, Any], Path]) -> None:
    out, report, work = published
    names = sorted(path.name for path in out.iterdir())
    assert "README.md" in names and "model-f16.gguf" in names
    # Every file, binary ones too (safetensors and GGUF metadata are text inside).
    forbidden = [str(work), str(STORIES), str(REPO), str(DATASETS_DIR), "/tmp/"]
    for path in out.rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            for prefix in forbidden:
                assert prefix.encode() not in content, (path.name, prefix)
    # Local sources are named by their last part instead.
    casp = json.loads((out / "config.json").read_text())["casp"]
    assert casp["source_model"] == "stories260K" and casp["base_model"] is None
    assert casp["settings"]["datasets_dir"] == "data"
    assert casp["settings"]["evaluation"]["perplexity"] == ["wikitext2", "notes.txt"]
    assert report["model"] == "stories260K" and set(report["perplexity"]) == {"wikitext2", "notes.txt"}
    assert json.loads((out / "report.json").read_text()) == report


def test_front_matter_is_the_hubs_and_holds_the_reports_numbers(published: tuple[Path, dict[str, Any], Path]) -> None:
    out, report, _ = published
    card = ModelCard.load(out / "README.md")
    metadata = metadata_load(out / "README.md")
    assert metadata is not None and metadata["library_name"] == "transformers"
    assert metadata["pipeline_tag"] == "text-generation"
    assert {"pruned", "casp", "gguf"} <= set(metadata["tags"])
    # A local fixture with no hub id recorded: no base_model, and the body names it by its folder only.
    assert "base_model" not in metadata and card.data.base_model is None
    assert "A local model, `stories260K`" in card.text

    in_engine = "perplexity in llama.cpp, model-f16.gguf (f16, 128-token windows)"
    figures = {
        (result.dataset_name, result.metric_type): result.metric_value
        for result in card.data.eval_results
        if result.metric_name != in_engine
    }
    zero_shot = report["evaluation"]["zero_shot"]["pruned"]["tasks"]["piqa"]
    assert figures == {
        ("wikitext2", "perplexity"): report["perplexity"]["wikitext2"]["pruned"],
        ("notes.txt", "perplexity"): report["perplexity"]["notes.txt"]["pruned"],
        ("piqa", "acc"): zero_shot["acc"],
        ("piqa", "acc_norm"): zero_shot["acc_norm"],
    }
    # Each GGUF's perplexity in llama.cpp is an entry of its own, as the report's table of files has it.
    gguf_row = next(row for row in report["artifacts"]["rows"] if row["format"] == "gguf")
    assert {r.dataset_name: r.metric_value for r in card.data.eval_results if r.metric_name == in_engine} == {
        "wikitext2": gguf_row["perplexity"]["wikitext2"],
        "notes.txt": gguf_row["perplexity"]["notes.txt"],
    }
    wikitext = next(result for result in card.data.eval_results if result.dataset_name == "wikitext2")
    assert (wikitext.dataset_type, wikitext.dataset_config, wikitext.dataset_split) == (
        "Salesforce/wikitext",
        "wikitext-2-raw-v1",
        "test",
    )
    assert metadata["model-index"][0]["name"] == "stories260K-casp-30"

    # The body: dense beside pruned, what was pruned, how to load this per-layer checkpoint.
    ppl = report["perplexity"]["wikitext2"]
    assert f"| {ppl['dense']:.3f} | {ppl['pruned']:.3f} |" in card.text
    assert f"{report['params']['dense']:,} -> {report['params']['pruned']:,} parameters" in card.text
    for layer in report["layers"]:
        heads = layer["attn"]["units"]
        assert (
            f"| {layer['index']} | {layer['ratio']:.3f} | {heads - len(layer['pruned_heads'])}/{heads} |" in card.text
        )
    assert 'from_pretrained("stories260K-casp-30", trust_remote_code=True)' in card.text
    assert "llama-cli -m model-f16.gguf" in card.text and "casp export" not in card.text
    assert "vllm serve" not in card.text and "shape: uniform" in card.text


def test_a_vanilla_checkpoint_loads_without_remote_code(published: tuple[Path, dict[str, Any], Path]) -> None:
    _, report, _ = published
    card = render_model_card(
        report,
        model_type="llama",
        base_model="meta-llama/Llama-3.2-1B",
    )
    assert card.data.base_model == "meta-llama/Llama-3.2-1B"
    assert "[meta-llama/Llama-3.2-1B](https://huggingface.co/meta-llama/Llama-3.2-1B)" in card.text
    assert 'from_pretrained("stories260K-casp-30")' in card.text and "trust_remote_code=True)" not in card.text
    assert "vllm serve stories260K-casp-30" in card.text
    assert "casp export stories260K-casp-30 --format gguf" in card.text  # no GGUF named: how to make one
    assert "## Recovery" not in card.text  # the job ran none
    assert "gguf" not in card.data.tags
    assert ModelCard(str(card)).data.base_model == "meta-llama/Llama-3.2-1B"  # the front matter reads back


def _folder(root: Path, config: dict[str, Any]) -> str:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def test_base_model_of_a_source(tmp_path: Path) -> None:
    assert base_model_of("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert base_model_of(str(STORIES)) is None
    # What a local folder records: its hub id, or for a CASP checkpoint the base model it was pruned from.
    assert base_model_of(_folder(tmp_path / "a", {"_name_or_path": "mistralai/Mistral-7B-v0.1"})) == (
        "mistralai/Mistral-7B-v0.1"
    )
    assert base_model_of(_folder(tmp_path / "b", {"_name_or_path": str(tmp_path / "elsewhere")})) is None
    assert base_model_of(_folder(tmp_path / "c", {"casp": {"base_model": "org/model"}})) == "org/model"
    cache = tmp_path / "hub" / "models--meta-llama--Llama-3.2-1B" / "snapshots" / "0123abcd"
    shutil.copytree(STORIES, cache)
    assert base_model_of(str(cache)) == "meta-llama/Llama-3.2-1B"


def test_local_paths_become_their_names() -> None:
    settings = {"datasets_dir": "/srv/data/", "perplexity": ["ptb", "./texts/a.txt", "~/b.jsonl"], "ratio": 0.3}
    assert without_local_paths({"/x/notes.txt": settings}) == {
        "notes.txt": {"datasets_dir": "data", "perplexity": ["ptb", "a.txt", "b.jsonl"], "ratio": 0.3}
    }
