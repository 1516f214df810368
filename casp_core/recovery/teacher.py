"""The dense model as the recovery stage's teacher: its next-token distribution over the recovery data, kept as the
top-k log-probabilities per position and the rest of the mass as one bucket, computed once before pruning frees
the dense model and cached on disk, so that training never holds teacher and student together.

A cache row belongs to each position whose next token carries a label (every position of a text window but the
last; an Alpaca record's response), in the order of the sequences and, within one, of the positions: the rows of
sequence i are `offsets[i]:offsets[i + 1]`, the rows `logits[:, :-1][labels[:, 1:] != IGNORED]` of a batch yields.
The log-probabilities are at the recovery's temperature (the rest bucket cannot be rescaled afterwards), so the
temperature is part of what the cache must match.

One safetensors file: `indices` (int16 where the vocabulary fits in it, else int32) and `logprobs` (float32),
both rows x k, `rest` (float32, the log of the mass outside the top k) and `offsets` (int64); the metadata holds
the fingerprint (what it was computed from) and the seconds it took. A row costs k x (2 or 4) + k x 4 + 4 bytes:
388 bytes at k = 64 with a LLaMA-2 vocabulary, 516 with Llama-3's.
"""

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from casp_core.errors import DiskSpaceTooSmall
from casp_core.method.next_token import final_hidden_states, head_logits, tokens_per_chunk
from casp_core.method.placement import byte_size
from casp_core.model import resolve_device
from casp_core.recovery.data import IGNORED, TrainingData, collate
from casp_core.run import Run
from casp_core.settings import CROSS_ENTROPY_LOSS, RecoveryConfig

TEACHER_FILE = "teacher-topk.safetensors"
# Room left on the disk beyond the cache itself (its partial copy is renamed, not copied, into place).
DISK_MARGIN = 64 * 2**20
INT16_VOCAB = 2**15
FLOAT32 = 4


def needs_teacher(config: RecoveryConfig) -> bool:
    return config.enabled and config.loss != CROSS_ENTROPY_LOSS


@dataclass
class TeacherCache:
    indices: torch.Tensor  # rows x k, the k most likely next tokens
    logprobs: torch.Tensor  # rows x k, their log-probabilities at the temperature
    rest: torch.Tensor  # rows, the log of the probability of every other token
    offsets: torch.Tensor  # sequences + 1: sequence i's rows are offsets[i]:offsets[i + 1]
    temperature: float
    seconds: float  # what computing it took
    path: Path

    @property
    def top_k(self) -> int:
        return self.indices.shape[1]

    def rows_of(self, sequences: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows of `sequences`, in their order: what a batch of them predicts at its labelled positions."""
        spans = [range(int(self.offsets[i]), int(self.offsets[i + 1])) for i in sequences]
        rows = torch.tensor([row for span in spans for row in span], dtype=torch.long)
        return self.indices[rows].long(), self.logprobs[rows], self.rest[rows]

    def summary(self) -> dict[str, Any]:
        tokens, k = self.indices.shape
        size = self.path.stat().st_size if self.path.is_file() else 0
        return {
            "file": self.path.name,
            "top_k": k,
            "tokens": tokens,
            "bytes": size,
            "bytes_per_token": row_bytes(k, self.indices.element_size()),
            "temperature": self.temperature,
            "seconds": self.seconds,
        }


def row_bytes(k: int, index_bytes: int) -> int:
    return k * (index_bytes + FLOAT32) + FLOAT32


def index_dtype(vocab: int) -> torch.dtype:
    return torch.int16 if vocab <= INT16_VOCAB else torch.int32


def labelled_positions(labels: torch.Tensor) -> torch.Tensor:
    """Of one sequence's labels (or a batch's, rows x length): the positions whose next token carries a label."""
    return labels[..., 1:] != IGNORED


def data_digest(data: TrainingData) -> str:
    """The token sequences and their labels: a cache is only valid for exactly the data it was computed on."""
    digest = hashlib.sha256()
    for sequence, labels in zip(data.sequences, data.labels, strict=True):
        digest.update(sequence.numpy().tobytes())
        digest.update(labels.numpy().tobytes())
    return digest.hexdigest()


def teacher_fingerprint(dense: dict[str, Any], data: TrainingData, config: RecoveryConfig) -> dict[str, Any]:
    """`dense` says which dense model (source, revision, dtype); the rest what was computed from it."""
    return {
        "dense": dense,
        "data": data_digest(data),
        "top_k": config.teacher_top_k,
        "temperature": config.temperature,
    }


def load_teacher(directory: Path | None, fingerprint: dict[str, Any]) -> TeacherCache | None:
    """The cache in `directory` when there is one computed from the same model, data and settings, else None."""
    path = directory / TEACHER_FILE if directory is not None else None
    if path is None or not path.is_file():
        return None
    with safe_open(path, framework="pt") as opened:
        metadata = opened.metadata() or {}
    if json.loads(metadata.get("fingerprint", "null")) != json.loads(json.dumps(fingerprint)):
        return None
    tensors = load_file(path)
    return TeacherCache(
        tensors["indices"],
        tensors["logprobs"],
        tensors["rest"],
        tensors["offsets"],
        fingerprint["temperature"],
        float(metadata["seconds"]),
        path,
    )


def check_free_disk(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if needed + DISK_MARGIN > free:
        raise DiskSpaceTooSmall(
            f"recovery.teacher_top_k: the distillation cache needs {byte_size(needed)} in {directory.name}/, "
            f"which has {byte_size(free)} free; a smaller teacher_top_k, less recovery data or more disk"
        )


@torch.no_grad()
def compute_teacher(
    model: PreTrainedModel,
    data: TrainingData,
    config: RecoveryConfig,
    directory: Path,
    fingerprint: dict[str, Any],
    run: Run | None = None,
    *,
    device: str = "auto",
) -> TeacherCache:
    """Runs `model` (the dense one) over the recovery data and writes its top-k cache to `directory`, whole (renamed
    into place); the free disk is checked first. The model is back on the CPU at the end."""
    run = run or Run()
    started = time.perf_counter()
    vocab = model.config.vocab_size
    k = min(config.teacher_top_k, vocab)
    counts = [int(labelled_positions(labels).sum()) for labels in data.labels]
    offsets = torch.tensor([0, *counts], dtype=torch.long).cumsum(0)
    rows = int(offsets[-1])
    directory.mkdir(parents=True, exist_ok=True)
    check_free_disk(directory, rows * row_bytes(k, index_dtype(vocab).itemsize))
    indices = torch.empty((rows, k), dtype=index_dtype(vocab))
    logprobs = torch.empty((rows, k), dtype=torch.float32)
    rest = torch.empty(rows, dtype=torch.float32)
    chunk = tokens_per_chunk(vocab)
    target = resolve_device(device)
    model.to(target)
    was_training = model.training
    model.eval()
    for start in range(0, len(data), config.batch_size):
        run.check_cancelled()
        sequences = list(range(start, min(start + config.batch_size, len(data))))
        # Padding (any id: it has no attention and no label) comes after every labelled position.
        batch = {name: tensor.to(target) for name, tensor in collate(data, sequences, 0).items()}
        hidden = final_hidden_states(model, batch["input_ids"], batch["attention_mask"])
        # The batch's rows: its sequences' rows one after another, as the cache's offsets lay them out; their
        # logits a chunk at a time (casp_core.method.next_token), never the batch's.
        positions = hidden[:, :-1][labelled_positions(batch["labels"])]
        first = int(offsets[sequences[0]])
        for start in range(0, len(positions), chunk):
            span = slice(first + start, first + min(start + chunk, len(positions)))
            logits = head_logits(model, positions[start : start + chunk])
            top, rest_of_mass = top_k_logprobs(logits, k, config.temperature)
            logprobs[span] = top.values.cpu()
            indices[span] = top.indices.to(indices.dtype).cpu()
            rest[span] = rest_of_mass.cpu()
        run.report("evaluation", (sequences[-1] + 1) / len(data), f"teacher: top-{k} of {rows:,} tokens")
    model.to("cpu")
    model.train(was_training)
    seconds = time.perf_counter() - started
    metadata = {"fingerprint": json.dumps(fingerprint), "seconds": repr(seconds)}
    partial = directory / f".{TEACHER_FILE}.partial"
    save_file({"indices": indices, "logprobs": logprobs, "rest": rest, "offsets": offsets}, partial, metadata)
    os.replace(partial, directory / TEACHER_FILE)
    return TeacherCache(indices, logprobs, rest, offsets, config.temperature, seconds, directory / TEACHER_FILE)


def top_k_logprobs(logits: torch.Tensor, k: int, temperature: float) -> tuple[Any, torch.Tensor]:
    """The k largest log-probabilities of softmax(logits / temperature) per row, and the log of the rest's mass
    (minus infinity when k is the whole vocabulary)."""
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    top = logprobs.topk(k, dim=-1)
    return top, rest_logprob(logprobs, top.indices)


def rest_logprob(logprobs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """log(sum of the probabilities outside `indices`), from the log-probabilities themselves: exact, where
    log(1 - sum(top)) would lose the tail to rounding."""
    return logprobs.scatter(-1, indices, float("-inf")).logsumexp(-1)


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_indices: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    teacher_rest: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """The summed KL(teacher || student) over rows, both distributions at `temperature` and reduced to the
    teacher's top k plus one bucket for the rest, times temperature squared (Hinton et al.: the gradients keep
    their scale across temperatures)."""
    student = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    student_top = student.gather(-1, teacher_indices)
    student_rest = rest_logprob(student, teacher_indices)
    teacher = torch.cat([teacher_logprobs, teacher_rest.unsqueeze(-1)], dim=-1)
    students = torch.cat([student_top, student_rest.unsqueeze(-1)], dim=-1)
    # A bucket the teacher gives no mass (the rest, when k is the vocabulary) adds nothing, not 0 x -inf.
    terms = torch.where(teacher > float("-inf"), teacher.exp() * (teacher - students), 0.0)
    return terms.sum() * temperature**2
