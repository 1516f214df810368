"""Text for calibration and perplexity: named data sets or local files, turned into token windows.

A source is `name[:split]` with name in `wikitext2`, `ptb`, `c4`, or a path to a .txt or .jsonl file (a
`text` field per line). With a datasets dir, named sets are read from local files in the layout of
shared/fixtures/data; without one, through the `datasets` loader (needs the network or its cache).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from casp_core.errors import DatasetNotFound

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

# The same sets through the Hugging Face `datasets` loader: (path, name, text field).
HUB_SOURCES = {
    "wikitext2": ("wikitext", "wikitext-2-raw-v1", "text"),
    "ptb": ("ptb_text_only", "penn_treebank", "sentence"),
    "c4": ("allenai/c4", "en", "text"),
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


def _read_file(path: Path) -> str:
    """Rows joined with blank lines, like `"\n\n".join(dataset["text"])` over the loader's rows."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            return "\n\n".join(json.loads(line)["text"] for line in lines if line.strip())
    return "\n\n".join(path.read_text(encoding="utf-8").splitlines())


def load_text(source: TextSource, datasets_dir: str | None) -> str:
    """The split's text, documents joined with blank lines as the perplexity convention asks."""
    if source.is_file:
        path = Path(source.name).expanduser()
        if not path.is_file():
            raise DatasetNotFound(
                f"unknown data set {source.name!r}: not one of {', '.join(LOCAL_FILES)} and no such file"
            )
        return _read_file(path)
    if datasets_dir is not None:
        candidates = [Path(datasets_dir) / rel for rel in LOCAL_FILES[source.name][source.split]]
        for path in candidates:
            if path.is_file():
                return _read_file(path)
        raise DatasetNotFound(
            f"{source.name} {source.split}: looked for {' or '.join(str(p) for p in candidates)}, none exists"
        )
    return _load_from_hub(source)


def _load_from_hub(source: TextSource) -> str:
    import datasets  # imported here: the offline paths never need it

    path, name, field = HUB_SOURCES[source.name]
    try:
        if source.name == "c4":
            shard = f"en/c4-{source.split}.00000-of-{'01024' if source.split == 'train' else '00008'}.json.gz"
            rows = datasets.load_dataset(path, data_files={source.split: shard}, split=source.split)
        else:
            rows = datasets.load_dataset(path, name, split=source.split)
    except Exception as error:  # the loader raises many types for "offline" and "not found"
        raise DatasetNotFound(
            f"cannot load {source.name} {source.split} with the datasets loader ({error}); "
            "give a local copy with --datasets-dir or CASP_DATASETS_DIR"
        ) from error
    return "\n\n".join(rows[field])


def tokenize(text: str, tokenizer: PreTrainedTokenizerBase, *, add_bos: bool) -> torch.Tensor:
    """Tokenize once; the BOS token (if the tokenizer has one and `add_bos`) goes once, at the very start."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    if add_bos and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id, *ids]
    return torch.tensor(ids, dtype=torch.long)


def calibration_windows(tokens: torch.Tensor, n_samples: int, seq_len: int, seed: int) -> torch.Tensor:
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
