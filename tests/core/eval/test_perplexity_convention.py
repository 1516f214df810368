"""One perplexity convention (LLM-Pruner's, from GPTQ), whichever reader produced the rows.

The expected rows are rebuilt here independently, by the rules of the Hugging Face builders that read the same
files: `wikitext` yields every line of wiki.*.raw with its newline, blank lines as ""; `ptb_text_only` yields
every line of ptb.*.txt stripped. The row counts are those of the hub's splits.
"""

import datasets
import pytest

from casp_core import data
from casp_core.cli.eval import evaluate_checkpoint
from casp_core.eval.perplexity import BOS_POLICY, NO_BOS, evaluation_text, perplexity
from casp_core.report.evaluation_section import render_evaluation_section
from tests.conftest import DATASETS_DIR, STORIES


def hf_wikitext_rows(relative: str) -> list[str]:
    text = (DATASETS_DIR / relative).read_bytes().decode("utf-8")
    *lines, last = text.split("\n")
    assert last == ""  # the file ends with a newline
    return [line + "\n" if line.strip() else "" for line in lines]


def hf_ptb_rows(relative: str) -> list[str]:
    *lines, last = (DATASETS_DIR / relative).read_bytes().decode("utf-8").split("\n")
    assert last == ""
    return [line.strip() for line in lines]


def test_wikitext2_raw_test_is_the_hub_rows():
    expected = hf_wikitext_rows("wikitext-2-raw/wiki.test.raw")
    assert len(expected) == 4358 and expected[:2] == ["", " = Robert Boulter = \n"]
    source = data.evaluation_source("wikitext2")
    assert source.split == "test"
    assert data.load_rows(source, str(DATASETS_DIR)) == expected
    assert data.load_text(source, str(DATASETS_DIR)) == "\n\n".join(expected)


@pytest.mark.parametrize(
    ("spec", "split", "relative", "n_rows"),
    [("ptb", "validation", "ptb/ptb.valid.txt", 3370), ("ptb:test", "test", "ptb/ptb.test.txt", 3761)],
)
def test_ptb_is_the_hub_rows_validation_by_default(spec: str, split: str, relative: str, n_rows: int):
    expected = hf_ptb_rows(relative)
    assert len(expected) == n_rows and not expected[0].startswith(" ")
    source = data.evaluation_source(spec)
    assert source.split == split
    assert data.load_rows(source, str(DATASETS_DIR)) == expected
    assert data.load_text(source, str(DATASETS_DIR)) == "\n\n".join(expected)


@pytest.fixture
def hub_from_fixture_rows(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The hub cannot be reached: `datasets.load_dataset` serves independently rebuilt rows as a real Dataset,
    so data.py's hub path runs as it would online. Returns the (path, name, split, revision) it was asked for."""
    files = {
        ("ptb", "validation"): ("sentence", hf_ptb_rows("ptb/ptb.valid.txt")),
        ("ptb", "test"): ("sentence", hf_ptb_rows("ptb/ptb.test.txt")),
        ("wikitext", "test"): ("text", hf_wikitext_rows("wikitext-2-raw/wiki.test.raw")),
    }
    calls: list[tuple] = []

    def load_dataset(path: str, name: str | None = None, *, split: str, revision: str | None = None):
        calls.append((path, name, split, revision))
        field, rows = files["ptb" if "ptb" in path else "wikitext", split]
        return datasets.Dataset.from_dict({field: rows})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_dense_perplexity_is_the_same_from_the_hub_rows_and_the_local_files(stories, hub_from_fixture_rows):
    model, tokenizer = stories
    for spec in ("ptb", "ptb:test", "wikitext2"):
        local = evaluation_text(tokenizer, spec, 128, datasets_dir=str(DATASETS_DIR))
        hub = evaluation_text(tokenizer, spec, 128, datasets_dir=None)
        assert local.convention == hub.convention
        assert hub.windows.equal(local.windows)  # the whole token stream, every window
    assert hub_from_fixture_rows == [
        ("ptb-text-only/ptb_text_only", None, "validation", "refs/convert/parquet"),
        ("ptb-text-only/ptb_text_only", None, "test", "refs/convert/parquet"),
        ("Salesforce/wikitext", "wikitext-2-raw-v1", "test", None),
    ]
    from_files = perplexity(model, tokenizer, "ptb", seq_len=128, datasets_dir=str(DATASETS_DIR), max_windows=8)
    from_hub = perplexity(model, tokenizer, "ptb", seq_len=128, datasets_dir=None, max_windows=8)
    assert from_hub == from_files
    assert from_files["split"] == "validation"


def test_casp_eval_and_the_card_record_the_convention():
    out = evaluate_checkpoint(
        str(STORIES),
        tasks=[],
        perplexity_sets=["ptb", "ptb:test"],
        seq_len=64,
        max_windows=3,
        datasets_dir=str(DATASETS_DIR),
        device="cpu",
    )
    validation, test = out["perplexity"]["ptb"], out["perplexity"]["ptb:test"]
    for result, split in ((validation, "validation"), (test, "test")):
        assert {k: result[k] for k in ("dataset", "split", "seq_len", "n_windows", "n_tokens", "bos")} == {
            "dataset": "ptb",
            "split": split,
            "seq_len": 64,
            "n_windows": 3,
            "n_tokens": 3 * 63,
            "bos": BOS_POLICY,
        }
    assert validation["ppl"] != test["ppl"]
    card = render_evaluation_section(
        {"perplexity": {name: {"dense": r["ppl"], **r} for name, r in out["perplexity"].items()}}
    )
    assert f"| ptb | validation | 64 | 3 | {BOS_POLICY} | {validation['ppl']:.3f} |" in card
    assert f"| ptb:test | test | 64 | 3 | {BOS_POLICY} | {test['ppl']:.3f} |" in card


def test_a_tokenizer_without_bos_is_recorded_as_such(stories):
    _, tokenizer = stories
    with_bos = evaluation_text(tokenizer, "ptb", 64, datasets_dir=str(DATASETS_DIR), max_windows=2)
    tokenizer.bos_token = None
    without = evaluation_text(tokenizer, "ptb", 64, datasets_dir=str(DATASETS_DIR), max_windows=2)
    assert with_bos.convention["bos"] == BOS_POLICY and without.convention["bos"] == NO_BOS
    assert without.windows.flatten()[:63].equal(with_bos.windows.flatten()[1:64])


def test_a_file_has_no_split_and_the_card_says_so(stories, tmp_path):
    _, tokenizer = stories
    notes = tmp_path / "notes.txt"
    notes.write_text("Once upon a time there was a little dog.\nIt liked to play in the park with its friends.\n")
    text = evaluation_text(tokenizer, str(notes), 8)
    assert text.convention["split"] is None
    card = render_evaluation_section({"perplexity": {"notes.txt": {"dense": 2.0, **text.convention}}})
    assert f"| notes.txt | - | 8 | {text.windows.shape[0]} | {BOS_POLICY} | 2.000 |" in card
