"""Perplexity, by the convention in docs/method-notes.md (LLM-Pruner's, from GPTQ): the split's Hugging Face
rows joined with "\n\n" (PTB: validation unless `ptb:test` is asked for), tokenized once with BOS once at the
start, non-overlapping windows of `seq_len` (remainder dropped), exp(mean next-token NLL over every predicted
token). docs/evaluation.md states it for users. The NLL is taken from the final hidden states a chunk of tokens at
a time (casp_core.method.next_token), never from a batch's logits."""

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from casp_core import data
from casp_core.method.next_token import final_hidden_states, token_losses
from casp_core.model import resolve_device
from casp_core.run import Run

BOS_POLICY = "once, at the start of the joined text"
NO_BOS = "none: the tokenizer has no BOS token"


@dataclass(frozen=True)
class EvaluationText:
    """A data set's windows, tokenized once and shared by the dense and the pruned model."""

    dataset: str
    split: str | None
    windows: torch.Tensor
    bos: str = BOS_POLICY

    @property
    def convention(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "split": self.split,
            "seq_len": self.windows.shape[1],
            "n_windows": self.windows.shape[0],
            "n_tokens": self.windows[:, 1:].numel(),
            "bos": self.bos,
        }


def default_seq_len(model_config: PretrainedConfig) -> int:
    """A perplexity window's default length: the model's context, up to 2048 tokens."""
    return min(2048, model_config.max_position_embeddings)


def evaluation_text(
    tokenizer: PreTrainedTokenizerBase,
    dataset: str,
    seq_len: int,
    *,
    datasets_dir: str | None = None,
    max_windows: int | None = None,
) -> EvaluationText:
    """`max_windows` keeps the first windows only, for quick runs; the count is part of the convention."""
    source = data.evaluation_source(dataset)
    tokens = data.tokenize(data.load_text(source, datasets_dir), tokenizer, add_bos=True)
    return EvaluationText(
        source.name,
        source.split or None,
        data.evaluation_windows(tokens, seq_len)[:max_windows],
        BOS_POLICY if tokenizer.bos_token_id is not None else NO_BOS,
    )


@torch.no_grad()
def windows_perplexity(
    model: PreTrainedModel,
    text: EvaluationText,
    *,
    device: str = "auto",
    batch_size: int = 8,
    run: Run | None = None,
) -> float:
    run = run or Run()
    target = resolve_device(device)
    model.to(target)
    total_nll, total_tokens = 0.0, 0
    windows = text.windows
    for start in range(0, len(windows), batch_size):
        run.check_cancelled()  # a full test split takes minutes on a CPU: stop between batches
        batch = windows[start : start + batch_size].to(target)
        # From the hidden states a chunk of tokens at a time: a batch's logits would be the largest thing in memory.
        hidden = final_hidden_states(model, batch)
        total_nll += float(token_losses(model, hidden[:, :-1], batch[:, 1:]).double().sum())
        total_tokens += batch[:, 1:].numel()
        run.report("evaluation", min(1.0, (start + batch_size) / len(windows)), f"perplexity {text.dataset}")
    return math.exp(total_nll / total_tokens)


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
) -> dict[str, Any]:
    """One model on one data set: {"ppl", "dataset", "split", "seq_len", "n_windows", "n_tokens", "bos"}."""
    text = evaluation_text(
        tokenizer, dataset, seq_len or default_seq_len(model.config), datasets_dir=datasets_dir, max_windows=max_windows
    )
    ppl = windows_perplexity(model, text, device=device, batch_size=batch_size)
    return {"ppl": ppl, **text.convention}
