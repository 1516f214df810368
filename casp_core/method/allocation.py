"""Layer-wise allocation (paper, section 3.3): sensitivities S_l, then ratios r_l with mean r.

S_l = mean over calibration sequences of ||dJ/dZ_l||_F^2, where J is the dense model's next-token
cross-entropy on the sequence and Z_l the output hidden state of decoder layer l.

The gradients are taken one decoder layer at a time, on every device, the CPU included: a forward pass through the
layers keeps each layer's input on the host, then the backward pass goes from the head down, recomputing each
layer's forward from its stored input to push the gradient through it. The device never holds more than one layer
(plus the embedding, or the final norm and head), and the host holds the stored inputs of a chunk of windows and
one layer's graph for one batch, never a graph through the whole model (with one, a job on SmolLM2-135M peaked at
8.5 GB, 15 x its weights, at batches of 8 x 512 tokens). The loss is taken from the last layer's output a chunk of
tokens at a time (casp_core.method.next_token), never from a batch's vocabulary-wide logits.
"""

import torch
from torch import nn
from transformers import PreTrainedModel

from casp_core.method.calibration import capture_first_layer_inputs, run_layer
from casp_core.method.next_token import token_losses
from casp_core.model import decoder_layers, on_device
from casp_core.numerics import check_finite
from casp_core.run import CPU, Run

EPSILON = 1e-12
# The layer inputs kept on the host for the backward pass take at most this share of the model's own size (at
# least one window's): the windows go through in chunks that fit, each layer moving to the device once per chunk
# and direction.
STORED_INPUTS_SHARE = 0.25


def layer_sensitivities(
    model: PreTrainedModel,
    windows: torch.Tensor,
    *,
    batch_size: int,
    device: torch.device,
    run: Run,
    store: torch.device = CPU,
    home: torch.device = CPU,
) -> list[float]:
    """S_l of every decoder layer; layer inputs wait on `store`, the weights rest at `home` between uses (the CPU,
    or `device` when the model is resident there)."""
    layers = decoder_layers(model)
    sums = torch.zeros(len(layers), dtype=torch.float64)
    chunk = windows_per_chunk(model, windows, batch_size)
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    model.requires_grad_(False)  # gradients only with respect to the hidden states
    try:
        for start in range(0, len(windows), chunk):
            stop = min(start + chunk, len(windows))
            sums += _squared_gradients(model, windows, start, stop, batch_size, device, store, home, run)
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(requires_grad[name])
    return (sums / len(windows)).tolist()


def windows_per_chunk(model: PreTrainedModel, windows: torch.Tensor, batch_size: int) -> int:
    """As many windows as keep the stored layer inputs within `STORED_INPUTS_SHARE` of the model's size, at least
    one: whole batches where a batch fits, else fewer windows than a batch (which then go through as one)."""
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    window_bytes = len(decoder_layers(model)) * windows.shape[1] * model.config.hidden_size * model.dtype.itemsize
    fitting = max(1, int(STORED_INPUTS_SHARE * model_bytes // window_bytes))
    return fitting if fitting < batch_size else fitting // batch_size * batch_size


def _squared_gradients(
    model: PreTrainedModel,
    windows: torch.Tensor,
    start: int,
    stop: int,
    batch_size: int,
    device: torch.device,
    store: torch.device,
    home: torch.device,
    run: Run,
) -> torch.Tensor:
    """Sum of ||dJ/dZ_l||^2 over windows[start:stop], one tensor entry per layer, with one decoder layer (or the
    embedding, or the final norm and head) on `device` at a time unless the model is resident there."""
    layers = decoder_layers(model)
    base = model.model
    inputs = capture_first_layer_inputs(model, windows[start:stop], batch_size, device, store, home)
    steps, done = 2 * len(layers), 0

    def progress(message: str) -> None:
        nonlocal done
        done += 1
        run.report("allocation", (start + (stop - start) * done / steps) / len(windows), message)

    stored: list[list[torch.Tensor]] = []  # stored[l]: layer l's input, one tensor per batch
    for index, layer in enumerate(layers):
        run.check_cancelled()
        stored.append(inputs.batches)
        with on_device(layer, device, home):
            inputs.batches = run_layer(layer, inputs, device, store)
        progress(f"sequences {start}-{stop - 1}: forward through layer {index + 1} of {len(layers)}")

    gradients = []
    first = start
    with on_device(nn.ModuleList([base.norm, model.lm_head]), device, home):
        for batch, hidden in enumerate(inputs.batches):
            tokens = windows[first : first + len(hidden)].to(device)
            hidden = hidden.to(device).detach().requires_grad_(True)
            with torch.enable_grad():
                loss = head_loss(model, hidden, tokens)
            if not torch.isfinite(loss):
                outputs = [batches[batch] for batches in stored[1:]] + [inputs.batches[batch]]
                _name_first_non_finite_output(loss, outputs, first, first + len(hidden))
            (gradient,) = torch.autograd.grad(loss, hidden)
            gradients.append(gradient.to(store))
            first += len(hidden)

    squared = torch.zeros(len(layers), dtype=torch.float64)
    # From the head down, each checked as it comes: the highest non-finite layer is where the overflow started.
    for index in reversed(range(len(layers))):
        run.check_cancelled()
        squared[index] = sum(gradient.double().pow(2).sum() for gradient in gradients)
        _check_squared_gradient(squared[index], index)
        if index > 0:  # below layer 0 only the embedding is left, and it has no S_l
            with on_device(layers[index], device, home):
                gradients = [
                    _input_gradient(layers[index], x, gradient, inputs.kwargs(layers[index], len(x)), device, store)
                    for x, gradient in zip(stored[index], gradients, strict=True)
                ]
        stored[index] = []
        progress(f"sequences {start}-{stop - 1}: gradient at the output of layer {index + 1}")
    return squared


def _name_first_non_finite_output(loss: torch.Tensor, outputs: list[torch.Tensor], start: int, stop: int) -> None:
    """The loss says only that something overflowed: the first layer output that did names where."""
    check_finite(
        loss,
        "allocation",
        f"the calibration loss of sequences {start}-{stop - 1}, first in the output",
        next((i for i, output in enumerate(outputs) if not torch.isfinite(output).all()), None),
    )


def _check_squared_gradient(value: torch.Tensor, index: int) -> None:
    check_finite(value, "allocation", "S_l, the squared gradient of the loss at the output", index)


def head_loss(model: PreTrainedModel, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Sum over the windows of each one's mean next-token loss, from the last decoder layer's output `hidden`
    through the final norm and the head (a chunk of tokens' logits at a time): each window's gradient is its own
    dJ/dZ."""
    return token_losses(model, model.model.norm(hidden[:, :-1]), tokens[:, 1:]).mean(dim=1).sum()


def _input_gradient(
    layer: nn.Module,
    x: torch.Tensor,
    gradient: torch.Tensor,
    layer_kwargs: dict,
    device: torch.device,
    store: torch.device,
) -> torch.Tensor:
    """dJ/dX of the layer's input X from dJ/dZ of its output, through the layer's forward recomputed with grad."""
    x = x.to(device).requires_grad_(True)
    with torch.enable_grad():
        output = layer(x, **layer_kwargs)
        output = output[0] if isinstance(output, tuple) else output
        (input_gradient,) = torch.autograd.grad(output, x, gradient.to(device))
    return input_gradient.to(store)


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
