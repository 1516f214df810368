"""Text for calibration and perplexity: named data sets or local files, turned into token windows.

A source is `name[:split]` with name in `wikitext2`, `ptb`, `c4`, or a path to a .txt or .jsonl file (a
`text` field per line). With a datasets dir, named sets are read from local files in the layout of
shared/fixtures/data; without one, through the `datasets` loader (needs the network or its cache).

Either way a named set becomes the rows the Hugging Face loader yields for it, joined with "\n\n" (the
convention of GPTQ and LLM-Pruner): the local readers rebuild those rows from the files the loader's builder
reads, so one split gives one token stream whichever reader ran.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from casp_core.errors import DatasetNotFound
from casp_core.model import return_freed_heap

# Local file names tried for each (set, split), in order: the raw text first, the tokenized release second.
LOCAL_FILES: dict[str, dict[str, tuple[str, ...]]] = {
    "wikitext2": {
        "train": ("wikitext-2-raw/wiki.train.raw", "wikitext-2/wiki.train.tokens"),
        "validation": ("wikitext-2-raw/wiki.valid.raw", "wikitext-2/wiki.valid.tokens"),
        "test": ("wikitext-2-raw/wiki.test.raw", "wikitext-2/wiki.test.tokens"),
    },
    "ptb": {
        "train": ("ptb/ptb.train.txt",),
        "validation": ("ptb/ptb.valid.txt",),
        "test": ("ptb/ptb.test.txt",),
    },
    "c4": {
        "train": ("c4/c4-train.jsonl",),
        "validation": ("c4/c4-validation.jsonl",),
    },
}

# How to fix a missing local copy, said with every such error.
POINT_ELSEWHERE = "point --datasets-dir or CASP_DATASETS_DIR at a folder that has it"
# The split calibration reads when a source names none.
CALIBRATION_SPLIT = "train"
# The split a perplexity is measured on when the source names none: GPTQ's and LLM-Pruner's, so that the
# numbers sit beside the paper's (PTB: validation; `ptb:test` asks for the test split).
EVALUATION_SPLITS = {"wikitext2": "test", "ptb": "validation", "c4": "validation"}


@dataclass(frozen=True)
class HubSource:
    """A named set through the Hugging Face `datasets` loader."""

    path: str
    name: str | None
    field: str
    # `ptb_text_only` is a loading script, which datasets >= 4 refuses to run; the hub's Parquet export of
    # the script's output holds the same rows.
    revision: str | None = None


HUB_SOURCES = {
    "wikitext2": HubSource("Salesforce/wikitext", "wikitext-2-raw-v1", "text"),
    "ptb": HubSource("ptb-text-only/ptb_text_only", None, "sentence", revision="refs/convert/parquet"),
    "c4": HubSource("allenai/c4", "en", "text"),
}


@dataclass(frozen=True)
class TextSource:
    name: str
    split: str

    @property
    def is_file(self) -> bool:
        return self.name not in LOCAL_FILES


def parse_source(spec: str, default_split: str) -> TextSource:
    name, _, split = spec.partition(":")
    if name in LOCAL_FILES:
        split = split or default_split
        if split not in LOCAL_FILES[name]:
            raise DatasetNotFound(f"{name} has no split {split!r} (known: {', '.join(LOCAL_FILES[name])})")
        return TextSource(name, split)
    return TextSource(spec, "")


def calibration_source(spec: str) -> TextSource:
    """`spec` for calibration: a named set without a split reads its CALIBRATION_SPLIT."""
    return parse_source(spec, CALIBRATION_SPLIT)


def evaluation_source(spec: str) -> TextSource:
    """`spec` for a perplexity: a named set without a split gets its EVALUATION_SPLITS entry."""
    return parse_source(spec, EVALUATION_SPLITS.get(spec.partition(":")[0], "test"))


def _wikitext_rows(path: Path) -> list[str]:
    """The `wikitext` builder's rows: every line of the file with its newline kept, blank ones as ""."""
    with path.open(encoding="utf-8") as lines:
        return [line if line.strip() else "" for line in lines]


def _ptb_rows(path: Path) -> list[str]:
    """The `ptb_text_only` builder's rows: every line of the file, stripped."""
    with path.open(encoding="utf-8") as lines:
        return [line.strip() for line in lines]


def _jsonl_rows(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line)["text"] for line in lines if line.strip()]


def _text_file_rows(path: Path) -> list[str]:
    """A user's .txt file: one row per line."""
    return path.read_text(encoding="utf-8").splitlines()


# How each named set's local files become the loader's rows (the tokenized WikiText release, a fallback,
# goes through the same builder on the hub as `wikitext-2-v1`).
LOCAL_ROWS = {"wikitext2": _wikitext_rows, "ptb": _ptb_rows, "c4": _jsonl_rows}


def join_rows(rows: list[str]) -> str:
    """The one way rows become text, for local files and the loader alike: `"\n\n".join(rows)`."""
    return "\n\n".join(rows)


def load_rows(source: TextSource, datasets_dir: str | None) -> list[str]:
    """The split's rows as the Hugging Face loader gives them (a user's file: its lines or `text` fields)."""
    if source.is_file:
        path = Path(source.name).expanduser()
        if not path.is_file():
            raise DatasetNotFound(
                f"unknown data set {source.name!r}: not one of {', '.join(LOCAL_FILES)} and no such file"
            )
        return _jsonl_rows(path) if path.suffix == ".jsonl" else _text_file_rows(path)
    if datasets_dir is not None:
        return LOCAL_ROWS[source.name](local_copy(source, datasets_dir))
    return _load_from_hub(source)


def local_copy(source: TextSource, datasets_dir: str) -> Path:
    """The file that holds a named set's split under `datasets_dir`."""
    candidates = [Path(datasets_dir) / rel for rel in LOCAL_FILES[source.name][source.split]]
    for path in candidates:
        if path.is_file():
            return path
    raise DatasetNotFound(
        f"{source.name} {source.split}: looked for {' or '.join(str(p) for p in candidates)}, none exists; "
        f"{POINT_ELSEWHERE}"
    )


def load_text(source: TextSource, datasets_dir: str | None) -> str:
    """The split's text: its rows joined with blank lines as the perplexity convention asks."""
    return join_rows(load_rows(source, datasets_dir))


def _load_from_hub(source: TextSource) -> list[str]:
    import datasets  # imported here: the offline paths never need it

    hub = HUB_SOURCES[source.name]
    try:
        if source.name == "c4":
            shard = f"en/c4-{source.split}.00000-of-{'01024' if source.split == 'train' else '00008'}.json.gz"
            rows = datasets.load_dataset(hub.path, data_files={source.split: shard}, split=source.split)
        else:
            rows = datasets.load_dataset(hub.path, hub.name, split=source.split, revision=hub.revision)
    except Exception as error:  # the loader raises many types for "offline" and "not found"
        raise DatasetNotFound(
            f"cannot load {source.name} {source.split} with the datasets loader ({error}); "
            "give a local copy with --datasets-dir or CASP_DATASETS_DIR"
        ) from error
    return list(rows[hub.field])


def tokenize(text: str, tokenizer: PreTrainedTokenizerBase, *, add_bos: bool) -> torch.Tensor:
    """Tokenize once; the BOS token (if the tokenizer has one and `add_bos`) goes once, at the very start."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    if add_bos and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id, *ids]
    tokens = torch.tensor(ids, dtype=torch.long)
    del ids
    # A fast tokenizer encoding a whole split allocates many small blocks (offsets, token strings, alignments: about
    # 700 MB at the peak for PTB train's 5 MB) and frees them on return, but the allocator keeps about 300 MB of
    # those pages, resident for the rest of the job on top of the weights.
    return_freed_heap()
    return tokens


def sample_windows(tokens: torch.Tensor, n_samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """`n_samples` windows of `seq_len` tokens at random offsets (fixed seed), as in SparseGPT and the paper."""
    if tokens.numel() <= seq_len:
        raise DatasetNotFound(f"calibration text has {tokens.numel()} tokens, fewer than one window of {seq_len}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seq_len, (n_samples,), generator=generator)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def evaluation_windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of `seq_len` tokens; the remainder is dropped."""
    n_windows = tokens.numel() // seq_len
    if n_windows == 0:
        raise DatasetNotFound(f"evaluation text has {tokens.numel()} tokens, fewer than one window of {seq_len}")
    return tokens[: n_windows * seq_len].view(n_windows, seq_len)
