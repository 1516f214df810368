"""Perplexity, by the convention in docs/method-notes.md: the split's rows joined with blank lines,
tokenized once with BOS once at the start, non-overlapping windows of `seq_len` (remainder dropped),
exp(mean next-token NLL over every predicted token)."""

import math
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core import data
from casp_core.model import resolve_device
from casp_core.progress import ProgressFn, no_progress

BOS_POLICY = "once, at the start of the joined text"


def default_seq_len(model: PreTrainedModel) -> int:
    return min(2048, model.config.max_position_embeddings)


@torch.no_grad()
def perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: str,
    *,
    seq_len: int | None = None,
    datasets_dir: str | None = None,
    device: str = "auto",
    batch_size: int = 8,
    max_windows: int | None = None,
    progress: ProgressFn = no_progress,
) -> dict[str, Any]:
    """`max_windows` keeps the first windows only, for quick runs; the count is part of the result."""
    source = data.parse_source(dataset, "test")
    seq_len = seq_len or default_seq_len(model)
    tokens = data.tokenize(data.load_text(source, datasets_dir), tokenizer, add_bos=True)
    windows = data.evaluation_windows(tokens, seq_len)[:max_windows]
    target = resolve_device(device)
    model.to(target)
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size].to(target)
        logits = model(batch, use_cache=False).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total_nll += float(nll)
        total_tokens += batch[:, 1:].numel()
        progress("evaluation", min(1.0, (start + batch_size) / len(windows)), f"perplexity {dataset}")
    return {
        "ppl": math.exp(total_nll / total_tokens),
        "dataset": source.name,
        "split": source.split or None,
        "seq_len": seq_len,
        "n_windows": len(windows),
        "n_tokens": total_tokens,
        "bos": BOS_POLICY,
    }
