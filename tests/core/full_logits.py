"""References taken the plain way, from the model's own forward and its vocabulary-wide logits: what the chunked
losses of casp_core.method.next_token must reproduce (the allocation's S_l, the held-out and perplexity losses)."""

import torch
from torch import nn
from transformers import PreTrainedModel

from casp_core.model import decoder_layers


def summed_sequence_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Sum over sequences of each sequence's mean next-token loss."""
    return (
        torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none"
        )
        .view(tokens.shape[0], -1)
        .mean(dim=1)
        .sum()
    )


def one_graph_sensitivities(model: PreTrainedModel, windows: torch.Tensor, batch_size: int) -> list[float]:
    """S_l by definition: per batch, one autograd graph through the whole model from its logits, the gradient
    taken at each decoder layer's output (how the allocation took it on the CPU before #37)."""
    layers = decoder_layers(model)
    sums = torch.zeros(len(layers), dtype=torch.float64)
    outputs: list[torch.Tensor] = []

    def keep_output(_module: nn.Module, _args: tuple, output: torch.Tensor | tuple) -> None:
        outputs.append(output[0] if isinstance(output, tuple) else output)

    def make_differentiable(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        return (hidden.detach().requires_grad_(True), *args[1:]), kwargs

    handles = [layers[0].register_forward_pre_hook(make_differentiable, with_kwargs=True)]
    handles += [layer.register_forward_hook(keep_output) for layer in layers]
    try:
        for start in range(0, len(windows), batch_size):
            outputs.clear()
            batch = windows[start : start + batch_size]
            loss = summed_sequence_losses(model(batch, use_cache=False).logits.float(), batch)
            sums += torch.stack([g.double().pow(2).sum() for g in torch.autograd.grad(loss, outputs)])
    finally:
        for handle in handles:
            handle.remove()
    return (sums / len(windows)).tolist()
