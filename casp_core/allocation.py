"""Layer-wise allocation (paper, section 3.3): sensitivities S_l, then ratios r_l with mean r.

S_l = mean over calibration sequences of ||dJ/dZ_l||_F^2, where J is the dense model's next-token
cross-entropy on the sequence and Z_l the output hidden state of decoder layer l.
"""

import torch
from transformers import PreTrainedModel

from casp_core.model import decoder_layers
from casp_core.numerics import check_finite
from casp_core.run import Run

EPSILON = 1e-12


def layer_sensitivities(
    model: PreTrainedModel,
    windows: torch.Tensor,
    *,
    batch_size: int,
    device: torch.device,
    run: Run,
) -> list[float]:
    """One forward and backward pass per batch, gradients taken only with respect to layer outputs."""
    layers = decoder_layers(model)
    outputs: list[torch.Tensor] = []

    def keep_output(_module: torch.nn.Module, _args: tuple, output: torch.Tensor | tuple) -> None:
        outputs.append(output[0] if isinstance(output, tuple) else output)

    def make_differentiable(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # No weight requires grad, so the graph starts at the first layer's input.
        hidden = args[0] if args else kwargs.pop("hidden_states")
        return (hidden.detach().requires_grad_(True), *args[1:]), kwargs

    sums = torch.zeros(len(layers), dtype=torch.float64)
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    model.requires_grad_(False)
    handles = [layers[0].register_forward_pre_hook(make_differentiable, with_kwargs=True)]
    handles += [layer.register_forward_hook(keep_output) for layer in layers]
    try:
        for start in range(0, len(windows), batch_size):
            run.check_cancelled()
            batch = windows[start : start + batch_size].to(device)
            outputs.clear()
            logits = model(batch, use_cache=False).logits.float()
            # Sum over sequences of each sequence's mean loss: each sequence's gradient is its own dJ/dZ.
            loss = (
                torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"
                )
                .view(batch.shape[0], -1)
                .mean(dim=1)
                .sum()
            )
            done = min(start + batch_size, len(windows))
            if not torch.isfinite(loss):
                # The loss says only that something overflowed: the first layer output that did names where.
                first = next((i for i, output in enumerate(outputs) if not torch.isfinite(output).all()), None)
                check_finite(
                    loss,
                    "allocation",
                    f"the calibration loss of sequences {start}-{done - 1}, first in the output",
                    first,
                )
            squared_norms = torch.stack([g.double().pow(2).sum() for g in torch.autograd.grad(loss, outputs)]).cpu()
            # Gradients flow from the last layer down: the highest non-finite layer is where it started.
            for index in reversed(range(len(layers))):
                check_finite(
                    squared_norms[index], "allocation", "S_l, the squared gradient of the loss at the output", index
                )
            sums += squared_norms
            run.report("allocation", done / len(windows), f"gradients of {done} of {len(windows)} sequences")
    finally:
        for handle in handles:
            handle.remove()
        outputs.clear()
        for name, p in model.named_parameters():
            p.requires_grad_(requires_grad[name])
    return (sums / len(windows)).tolist()


def allocate_ratios(sensitivities: list[float], ratio: float, alpha: float, r_max: float) -> list[float]:
    """c_l = (1 - Ŝ_l)^alpha on min-max normalised log sensitivities; r_l = L c_l / sum(c) * r, capped.

    What the cap cuts goes to the layers below it in proportion to c_l, until the mean is r again.
    """
    logs = torch.tensor(sensitivities, dtype=torch.float64).add(EPSILON).log()
    spread = logs.max() - logs.min()
    normalised = (logs - logs.min()) / spread if spread > 0 else torch.zeros_like(logs)
    scores = (1.0 - normalised).pow(alpha)
    n_layers = len(sensitivities)
    capped = torch.zeros(n_layers, dtype=torch.bool)
    while True:
        budget = ratio * n_layers - r_max * int(capped.sum())
        free = ~capped
        weights = scores * free
        if weights.sum() <= 0:  # only zero-score layers left: share what remains evenly
            weights = free.double()
        ratios = torch.where(capped, torch.full_like(scores, r_max), budget * weights / weights.sum())
        over = ratios > r_max + 1e-12
        if not over.any():
            return ratios.clamp(0.0, r_max).tolist()
        capped |= over


def uniform_ratios(n_layers: int, ratio: float) -> list[float]:
    return [ratio] * n_layers
