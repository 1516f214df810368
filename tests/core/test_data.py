"""Text sources, windows and the perplexity convention."""

import math

import pytest
import torch

from casp_core import data
from casp_core.errors import DatasetNotFound
from casp_core.eval.perplexity import evaluation_text, perplexity
from tests.conftest import DATASETS_DIR


def test_named_sets_map_to_the_fixture_layout():
    text = data.load_text(data.parse_source("ptb", "test"), str(DATASETS_DIR))
    first_line = (DATASETS_DIR / "ptb" / "ptb.test.txt").read_text().splitlines()[0]
    assert text.startswith(first_line.strip() + "\n\n")  # ptb_text_only strips each line
    wiki = data.load_text(data.parse_source("wikitext2", "test"), str(DATASETS_DIR))
    assert " = Robert Boulter = " in wiki[:100]
    # The raw split is missing for validation; the tokenized release stands in.
    assert "<unk>" in data.load_text(data.parse_source("wikitext2:validation", "train"), str(DATASETS_DIR))


def test_missing_split_and_unknown_names_are_clear(tmp_path):
    with pytest.raises(DatasetNotFound, match=r"ptb test: looked for .*/ptb/ptb.test.txt, none exists"):
        data.load_text(data.parse_source("ptb", "test"), str(tmp_path))
    with pytest.raises(DatasetNotFound, match="has no split 'dev'"):
        data.parse_source("ptb:dev", "test")
    with pytest.raises(DatasetNotFound, match="unknown data set 'nonsense'"):
        data.load_text(data.parse_source("nonsense", "train"), None)


def test_local_text_and_jsonl_files(tmp_path):
    txt = tmp_path / "notes.txt"
    txt.write_text("one\ntwo\n")
    assert data.load_text(data.parse_source(str(txt), "train"), None) == "one\n\ntwo"
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "alpha"}\n{"text": "beta"}\n')
    assert data.load_text(data.parse_source(str(jsonl), "train"), None) == "alpha\n\nbeta"


def test_sample_windows_are_seeded():
    tokens = torch.arange(1000)
    first = data.sample_windows(tokens, 4, 16, seed=3)
    assert torch.equal(first, data.sample_windows(tokens, 4, 16, seed=3))
    assert not torch.equal(first, data.sample_windows(tokens, 4, 16, seed=4))
    assert all(torch.equal(w, torch.arange(int(w[0]), int(w[0]) + 16)) for w in first)  # contiguous slices


def test_evaluation_windows_drop_the_remainder():
    windows = data.evaluation_windows(torch.arange(103), 10)
    assert windows.shape == (10, 10) and int(windows[-1, -1]) == 99


def test_perplexity_follows_the_convention(stories):
    model, tokenizer = stories
    text = evaluation_text(tokenizer, "ptb", 64, datasets_dir=str(DATASETS_DIR), max_windows=6)
    windows = text.windows
    assert int(windows[0, 0]) == tokenizer.bos_token_id  # BOS once, at the start of the joined text
    assert tokenizer.bos_token_id not in windows[1:].flatten().tolist()
    with torch.no_grad():
        logits = model(windows).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    result = perplexity(model, tokenizer, "ptb", seq_len=64, datasets_dir=str(DATASETS_DIR), max_windows=6)
    assert result["ppl"] == pytest.approx(math.exp(float(nll)), rel=1e-5)
    assert result["n_windows"] == 6 and result["seq_len"] == 64 and result["n_tokens"] == 6 * 63
