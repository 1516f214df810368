"""The next-token loss from a model's final hidden states, a chunk of tokens at a time.

A batch's logits are vocabulary-wide: 8 windows of 2048 tokens over SmolLM2's 49,152-token vocabulary are 3.2 GB
in float32, over Llama 3's 128K 8.4 GB, more than a 1B model's weights. So nothing that needs a loss asks the model
for logits: it takes the decoder's hidden states (`final_hidden_states`, or a layer's output through the final norm)
and `token_losses` puts them through the head `LOGITS_CHUNK_BYTES` of float32 logits at a time. Where the loss is
differentiated, each chunk's logits are recomputed in the backward pass (activation checkpointing) instead of kept,
so a backward pass too holds one chunk's logits at a time.
"""

from collections.abc import Callable

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

# Float32 logits of one chunk; with their log-softmax and, in the backward pass, their gradient, about three times
# this is alive at once, small beside the 2 x weights + 1.5 GB a job may hold. 341 tokens of a 49K vocabulary, 130
# of a 128K one: rows enough for the head's product to run at the matrix speed.
LOGITS_CHUNK_BYTES = 64 * 2**20
FLOAT32_BYTES = 4


def tokens_per_chunk(vocab: int) -> int:
    return max(1, LOGITS_CHUNK_BYTES // (FLOAT32_BYTES * vocab))


def final_hidden_states(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The decoder's output after the final norm, what the model's head takes: batch x tokens x hidden. Taken from
    the model's own forward, with the head applied to the last position alone: a checkpoint in compressed-tensors
    format runs its quantized layers only through the model's forward, not its decoder's."""
    captured: list[torch.Tensor] = []
    hook = model.model.register_forward_hook(lambda _, __, output: captured.append(output.last_hidden_state))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    return captured[0]


def head_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The float32 logits the model's own forward computes from `hidden` (final hidden states): its head, then
    Granite's logits scaling and Gemma's final soft-capping where the config sets them, in the model's dtype as
    transformers takes them."""
    logits = model.lm_head(hidden)
    scaling = getattr(model.config, "logits_scaling", None)
    if scaling is not None:
        logits = logits / scaling
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


def token_losses(model: PreTrainedModel, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of each position of `hidden` (final hidden states, ... x hidden) against its next token in
    `targets` (...), shaped as `targets`; the logits of `tokens_per_chunk` positions at a time. Differentiable with
    respect to `hidden` (and the head) where grad mode is on: each chunk is checkpointed."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    losses = of_chunks(model, rows, _cross_entropies, targets.reshape(-1))
    return torch.cat(losses).view(targets.shape)


def of_chunks(
    model: PreTrainedModel,
    rows: torch.Tensor,
    of_logits: Callable[..., torch.Tensor],
    *aligned: torch.Tensor,
) -> list[torch.Tensor]:
    """`of_logits(logits, *pieces)` for each chunk of `tokens_per_chunk` rows of `rows` (final hidden states,
    rows x hidden), `pieces` the same rows of each of `aligned` (targets, a teacher's rows). Where grad mode needs
    it each chunk is checkpointed: its logits are recomputed in the backward pass instead of kept."""
    chunk = tokens_per_chunk(model.config.vocab_size)
    differentiable = torch.is_grad_enabled() and (rows.requires_grad or model.lm_head.weight.requires_grad)

    def of_chunk(piece: torch.Tensor, *pieces: torch.Tensor) -> torch.Tensor:
        return of_logits(head_logits(model, piece), *pieces)

    values = []
    for start in range(0, len(rows), chunk):
        pieces = [tensor[start : start + chunk] for tensor in (rows, *aligned)]
        values.append(checkpoint(of_chunk, *pieces, use_reentrant=False) if differentiable else of_chunk(*pieces))
    return values


def _cross_entropies(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets, reduction="none")
