"""Training data of the recovery stage: a text corpus packed into windows, or instruction data in Alpaca's layout.

A dataset spec is one of
- a named set, `wikitext2`, `ptb` or `c4`, optionally `name:split` (the train split by default), read as for
  calibration (casp_core.data), joined, tokenized once with BOS at the start and cut into non-overlapping windows
  of `max_seq_len` tokens (the remainder dropped); every token is trained on;
- a `.txt` file (UTF-8), the same way, one row per line;
- a `.jsonl` file of `{"text": ...}` records, the same way;
- a `.jsonl` file or a `.json` array of Alpaca records, `{"instruction", "input" (may be empty or absent),
  "output"}`: each record one sequence, `ALPACA_PROMPT` (Stanford Alpaca's template) followed by the output and
  EOS, cut at `max_seq_len`; the loss is on the output and EOS only.

The layout of a JSON file is the first record's: `text`, or `instruction` and `output`. Anything unreadable
(missing fields, an empty file, bytes that are not UTF-8, windows longer than the model's context) raises
InvalidDataset naming the file and the line or record.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from casp_core import data
from casp_core.errors import DatasetNotFound, InvalidDataset
from casp_core.settings import PruneSettings, RecoveryConfig

TEXT_LAYOUT = "text"
ALPACA_LAYOUT = "alpaca"
ALPACA_FIELDS = ("instruction", "output")
# No loss on these positions (PyTorch's cross_entropy ignore_index).
IGNORED = -100
TRAINING_SPLIT = "train"

# Stanford Alpaca's prompt template (also LLM-Pruner's), with and without an input.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


@dataclass(frozen=True)
class TrainingData:
    """Token sequences (1-D, at most `max_seq_len` long) and their labels: the token itself where the loss
    counts, IGNORED elsewhere. `skipped` counts Alpaca records whose prompt alone filled `max_seq_len`."""

    layout: str
    sequences: list[torch.Tensor]
    labels: list[torch.Tensor]
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def loss_tokens(self) -> int:
        return sum(int((label != IGNORED).sum()) for label in self.labels)

    def summary(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "sequences": len(self),
            "loss_tokens": self.loss_tokens,
            "skipped": self.skipped,
        }


def alpaca_prompt(record: dict[str, str]) -> str:
    """The prompt of one Alpaca record: the template with its input, or the one without when it is empty."""
    if record.get("input"):
        return ALPACA_PROMPT.format(instruction=record["instruction"], input=record["input"])
    return ALPACA_PROMPT_NO_INPUT.format(instruction=record["instruction"])


def check_length(max_seq_len: int, context: int) -> None:
    if max_seq_len > context:
        raise InvalidDataset(
            f"recovery.max_seq_len: windows of {max_seq_len} tokens are longer than the model's context of {context}"
        )


@dataclass(frozen=True)
class RecoveryPlan:
    """What a job's recovery reads: its settings, the context its windows were checked to fit, where the data sets
    are, and the device it trains on."""

    settings: RecoveryConfig
    context: int  # the model's, in tokens
    datasets_dir: str | None
    device: str

    @classmethod
    def of(cls, settings: PruneSettings, model_config: PretrainedConfig) -> "RecoveryPlan":
        """Recovery as a job's `settings` ask for it; InvalidDataset where its windows overrun the model's context."""
        context = model_config.max_position_embeddings
        check_length(settings.recovery.max_seq_len, context)
        return cls(settings.recovery, context, settings.datasets_dir, settings.device)

    def training_data(self, tokenizer: PreTrainedTokenizerBase) -> "TrainingData":
        """The sequences recovery trains on, read and checked in full."""
        return load_training_data(
            self.settings.dataset,
            tokenizer,
            max_seq_len=self.settings.max_seq_len,
            context=self.context,
            datasets_dir=self.datasets_dir,
        )


def load_training_data(
    spec: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_seq_len: int,
    context: int,
    datasets_dir: str | None = None,
) -> TrainingData:
    """The spec's sequences, read and checked in full (so that bad data fails before training starts)."""
    check_length(max_seq_len, context)
    if spec.partition(":")[0] in data.LOCAL_FILES:
        text = data.load_text(data.parse_source(spec, TRAINING_SPLIT), datasets_dir)
        return text_windows(text, tokenizer, max_seq_len, where=spec)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DatasetNotFound(f"unknown data set {spec!r}: not one of {', '.join(data.LOCAL_FILES)} and no such file")
    layout, content = read_training_file(path)
    if layout == TEXT_LAYOUT:
        return text_windows(data.join_rows(content), tokenizer, max_seq_len, where=str(path))
    return alpaca_sequences(content, tokenizer, max_seq_len, where=str(path))


def read_training_file(path: Path) -> tuple[str, Any]:
    """A user's file checked in full without a tokenizer (the API checks it so at submit): `("text", rows)` or
    `("alpaca", [(where, {"instruction", "input", "output"}), ...])`."""
    content = _read_utf8(path)
    if not content.strip():
        raise InvalidDataset(f"{path}: the file is empty")
    if path.suffix == ".txt":
        return TEXT_LAYOUT, content.splitlines()
    records = _json_records(path, content)
    first_where, first = records[0]
    if "text" in first:
        return TEXT_LAYOUT, [_string_field(record, "text", where) for where, record in records]
    if all(name in first for name in ALPACA_FIELDS):
        return ALPACA_LAYOUT, [
            (
                where,
                {
                    "instruction": _string_field(record, "instruction", where),
                    "input": _string_field(record, "input", where, optional=True),
                    "output": _string_field(record, "output", where),
                },
            )
            for where, record in records
        ]
    raise InvalidDataset(
        f"{first_where}: a record needs a `text` field (a corpus) or `instruction` and `output` (Alpaca), "
        f"found {', '.join(map(repr, first)) or 'no fields'}"
    )


def _read_utf8(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise InvalidDataset(f"{path} line {line}: not UTF-8 text (byte {error.start})") from None


def _json_records(path: Path, content: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) of a .jsonl file's lines or a .json file's array; `where` names the line or the item."""
    if path.suffix == ".jsonl":
        items = [(f"{path} line {number}", line) for number, line in enumerate(content.splitlines(), 1) if line.strip()]
        records = []
        for where, line in items:
            try:
                records.append((where, json.loads(line)))
            except json.JSONDecodeError as error:
                raise InvalidDataset(f"{where}: not JSON ({error.msg})") from None
    elif path.suffix == ".json":
        try:
            array = json.loads(content)
        except json.JSONDecodeError as error:
            raise InvalidDataset(f"{path} line {error.lineno}: not JSON ({error.msg})") from None
        if not isinstance(array, list) or not array:
            raise InvalidDataset(f"{path}: a .json file must hold a non-empty array of records")
        records = [(f"{path} record {index}", record) for index, record in enumerate(array)]
    else:
        raise InvalidDataset(f"{path}: training data is a .txt, .jsonl or .json file")
    for where, record in records:
        if not isinstance(record, dict):
            raise InvalidDataset(f"{where}: a record must be a JSON object")
    return records


def _string_field(record: dict[str, Any], name: str, where: str, *, optional: bool = False) -> str:
    value = record.get(name, "" if optional else None)
    if value is None:
        raise InvalidDataset(f"{where}: missing `{name}`")
    if not isinstance(value, str):
        raise InvalidDataset(f"{where}: `{name}` must be a string")
    return value


def text_windows(text: str, tokenizer: PreTrainedTokenizerBase, max_seq_len: int, *, where: str) -> TrainingData:
    """Non-overlapping windows of the text tokenized once (BOS once at the start), the remainder dropped."""
    tokens = data.tokenize(text, tokenizer, add_bos=True)
    if tokens.numel() < max_seq_len:
        raise InvalidDataset(f"{where}: {tokens.numel()} tokens, fewer than one window of {max_seq_len}")
    windows = list(data.evaluation_windows(tokens, max_seq_len))
    return TrainingData(TEXT_LAYOUT, windows, windows)


def alpaca_sequences(
    records: list[tuple[str, dict[str, str]]], tokenizer: PreTrainedTokenizerBase, max_seq_len: int, *, where: str
) -> TrainingData:
    """Prompt and output tokenized apart, so that the loss starts exactly at the output's first token."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    sequences, labels, skipped = [], [], 0
    for _, fields in records:
        prompt = bos + tokenizer(alpaca_prompt(fields), add_special_tokens=False)["input_ids"]
        output = tokenizer(fields["output"], add_special_tokens=False)["input_ids"] + eos
        if len(prompt) >= max_seq_len:
            skipped += 1
            continue
        ids = (prompt + output)[:max_seq_len]
        sequences.append(torch.tensor(ids, dtype=torch.long))
        labels.append(torch.tensor(([IGNORED] * len(prompt) + output)[:max_seq_len], dtype=torch.long))
    if not sequences:
        raise InvalidDataset(f"{where}: every prompt is at least max_seq_len ({max_seq_len}) tokens long")
    return TrainingData(ALPACA_LAYOUT, sequences, labels, skipped)


def collate(training: TrainingData, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """A batch padded on the right to its longest sequence; padding has no attention and no loss."""
    length = max(training.sequences[i].numel() for i in indices)
    input_ids = torch.full((len(indices), length), pad_id, dtype=torch.long)
    labels = torch.full((len(indices), length), IGNORED, dtype=torch.long)
    attention_mask = torch.zeros((len(indices), length), dtype=torch.long)
    for row, index in enumerate(indices):
        size = training.sequences[index].numel()
        input_ids[row, :size] = training.sequences[index]
        labels[row, :size] = training.labels[index]
        attention_mask[row, :size] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
