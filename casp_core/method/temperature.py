"""alpha "auto": the allocation temperature chosen for the model at the target ratio.

Each temperature of a small grid (0, the uniform allocation, included) turns the same sensitivities S_l into
ratios and a budget; each is scored by the loss of the model so pruned on held-out calibration windows, and the
lowest wins (ties: the earlier in the grid). A candidate is not a full prune: one pass over the layers serves them
all. Each layer comes to the device once; its statistics and Q come once, from the dense model on the other
calibration windows; then for each candidate its units are chosen, o_proj/down_proj compensated and masked (on
the layer itself, restored afterwards) and that candidate's held-out activations go through the layer. The cost
is one dense statistics pass plus, per candidate, the solves and a forward of the held-out windows.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from transformers import PreTrainedModel

from casp_core.errors import InvalidConfig
from casp_core.method.allocation import allocate_ratios, head_loss
from casp_core.method.budget import AllocationPlan, BudgetPlan, plan_budget
from casp_core.method.calibration import (
    capture_first_layer_inputs,
    check_finite_moments,
    record_inputs,
    run_layer,
)
from casp_core.method.compensation import compensate_layer
from casp_core.method.layer import LayerPlan
from casp_core.method.results import TemperatureChoice
from casp_core.method.selection import choose_units, layer_q, params_kept
from casp_core.method.surgery import mask_layer
from casp_core.model import attention_geometry, decoder_layers, on_device, sublayer_parameters
from casp_core.numerics import check_finite
from casp_core.run import CPU, Run
from casp_core.settings import AUTO_ALPHA_NEEDS_WINDOWS

# The paper's alpha = 1 and its neighbours, and 0 (uniform): alpha = 1 was the best fixed temperature in only 2
# of 8 settings of bench/results/quality.md.
ALPHA_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0)
HELD_OUT_SHARE = 0.25  # of the calibration windows (at least one) score the candidates; the others give statistics


@dataclass
class Candidate:
    alpha: float
    plan: BudgetPlan
    hidden: list[torch.Tensor] = field(default_factory=list)  # its held-out activations entering the current layer
    removed: int = 0  # parameters its pruning removed from the layers so far


def choose_alpha(
    model: PreTrainedModel,
    windows: torch.Tensor,
    sensitivities: list[float],
    allocation: AllocationPlan,
    layer_plan: LayerPlan,
    batch_size: int,
    device: torch.device,
    run: Run,
    store: torch.device = CPU,
    home: torch.device = CPU,
) -> TemperatureChoice:
    """The grid's temperature with the lowest held-out loss at `allocation.ratio`, each candidate's layers pruned as
    `layer_plan` says; `model` is left as it was, its weights at `home` (the CPU, or `device` when the model is
    resident there). `batch_size` windows go through a layer at once."""
    if len(windows) < 2:
        raise InvalidConfig(AUTO_ALPHA_NEEDS_WINDOWS)
    n_held_out = max(1, round(len(windows) * HELD_OUT_SHARE))
    statistics_windows, held_out = windows[:-n_held_out], windows[-n_held_out:]
    candidates = [
        Candidate(
            alpha,
            plan_budget(model, allocate_ratios(sensitivities, allocation.ratio, alpha, allocation.r_max), allocation),
        )
        for alpha in ALPHA_GRID
    ]
    statistics = capture_first_layer_inputs(model, statistics_windows, batch_size, device, store, home)
    held_out_inputs = capture_first_layer_inputs(model, held_out, batch_size, device, store, home)
    for candidate in candidates:
        candidate.hidden = list(held_out_inputs.batches)

    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        run.check_cancelled()
        run.report(
            "allocation",
            index / len(layers),
            f"alpha auto: layer {index + 1} of {len(layers)}, {len(candidates)} temperatures",
        )
        with on_device(layer, device, home):
            with record_inputs({"attn": layer.self_attn.o_proj, "mlp": layer.mlp.down_proj}) as moments:
                statistics.batches = run_layer(layer, statistics, device, store)
            check_finite_moments(moments, index)
            geometry = attention_geometry(model, layer)
            q = layer_q(layer, geometry, moments)
            params_before = sum(sublayer_parameters(layer))
            for candidate in candidates:
                with restored(layer.self_attn.o_proj, layer.mlp.down_proj):
                    choice = choose_units(
                        layer, geometry, q, moments, candidate.plan, index, candidate.removed, layer_plan.solver
                    )
                    if layer_plan.compensates:
                        compensate_layer(
                            layer,
                            geometry,
                            choice.pruning,
                            moments,
                            layer_plan.compensation,
                            layer_plan.compensation_damping,
                        )
                    candidate.removed += params_before - params_kept(layer, choice)
                    mask_layer(layer, geometry, choice.pruning)
                    candidate.hidden = run_layer(
                        layer, replace(held_out_inputs, batches=candidate.hidden), device, store
                    )

    losses = held_out_losses(model, candidates, held_out, batch_size, device, home)
    check_finite(torch.tensor(list(losses.values())), "allocation", 'the held-out losses of alpha "auto"', None)
    best = min(losses, key=losses.__getitem__)
    return TemperatureChoice(best, losses, len(held_out), len(statistics_windows))


@torch.no_grad()
def held_out_losses(
    model: PreTrainedModel,
    candidates: list[Candidate],
    held_out: torch.Tensor,
    batch_size: int,
    device: torch.device,
    home: torch.device,
) -> dict[float, float]:
    """Mean over the held-out windows of each window's mean next-token loss, per candidate."""
    base = model.model
    losses = {}
    with on_device(nn.ModuleList([base.norm, model.lm_head]), device, home):
        for candidate in candidates:
            total = 0.0
            for batch, hidden in enumerate(candidate.hidden):
                tokens = held_out[batch * batch_size : batch * batch_size + len(hidden)].to(device)
                total += float(head_loss(model, hidden.to(device), tokens))
            losses[candidate.alpha] = total / len(held_out)
    return losses


@contextmanager
def restored(*linears: nn.Linear) -> Iterator[None]:
    """The weights and biases of `linears` as they were on entry, whatever compensation and masking do inside:
    inside, each linear works on copies of its own, and its tensors, never written, are put back on exit."""
    saved = [(linear.weight, linear.bias) for linear in linears]
    for linear, (weight, bias) in zip(linears, saved, strict=True):
        linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
    try:
        yield
    finally:
        for linear, (weight, bias) in zip(linears, saved, strict=True):
            linear.weight, linear.bias = weight, bias
