"""Activation statistics of the pruned sub-layers' inputs, streamed over calibration batches.

For o_proj the input is the concatenation of head outputs; for down_proj it is the gated intermediate
activation. Each accumulator holds C = E[yᵀy] (and E[y], which the FLAP baseline needs) over all tokens,
one d x d matrix: activations are never kept beyond the batch that produced them.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

# Below this width the statistics are kept in float64: it costs nothing and keeps Q exactly symmetric PSD.
FLOAT64_MAX_DIM = 4096


class SecondMoment:
    def __init__(self, dim: int, device: torch.device) -> None:
        self.dtype = torch.float64 if dim <= FLOAT64_MAX_DIM else torch.float32
        self.outer = torch.zeros(dim, dim, dtype=self.dtype, device=device)
        self.total = torch.zeros(dim, dtype=self.dtype, device=device)
        self.count = 0

    @torch.no_grad()
    def update(self, inputs: torch.Tensor) -> None:
        rows = inputs.reshape(-1, inputs.shape[-1]).to(self.dtype)
        self.outer.addmm_(rows.T, rows)
        self.total += rows.sum(dim=0)
        self.count += rows.shape[0]

    @property
    def second_moment(self) -> torch.Tensor:
        return self.outer / self.count

    @property
    def mean(self) -> torch.Tensor:
        return self.total / self.count


@contextmanager
def record_inputs(modules: dict[str, nn.Linear]) -> Iterator[dict[str, SecondMoment]]:
    """While active, every forward through one of `modules` adds its input to that module's accumulator."""
    moments = {name: SecondMoment(module.in_features, module.weight.device) for name, module in modules.items()}
    handles = [
        module.register_forward_pre_hook(lambda _module, args, moment=moments[name]: moment.update(args[0]))
        for name, module in modules.items()
    ]
    try:
        yield moments
    finally:
        for handle in handles:
            handle.remove()
