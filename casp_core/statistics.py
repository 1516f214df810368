"""Activation statistics of the pruned sub-layers' inputs, streamed over calibration batches.

For o_proj the input is the concatenation of head outputs; for down_proj it is the gated intermediate
activation. Each accumulator holds C = E[yᵀy] (and E[y], which the FLAP baseline needs) over all tokens,
one d x d matrix: activations are never kept beyond the batch that produced them.

For compensation towards the dense model (sequential calibration), `record_stream_pair` also accumulates, per
sub-layer, the cross-moment between its input on the dense stream and on the pruned stream for the same tokens.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from casp_core.numerics import check_finite

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


class StreamCrossMoment:
    """M = E[y_d yᵀ] and C_d = E[y_d y_dᵀ]: a sub-layer's input on the dense stream (y_d) against the pruned (y)."""

    def __init__(self, dim: int, device: torch.device) -> None:
        self.dtype = torch.float64 if dim <= FLOAT64_MAX_DIM else torch.float32
        self.cross = torch.zeros(dim, dim, dtype=self.dtype, device=device)
        self.dense_outer = torch.zeros(dim, dim, dtype=self.dtype, device=device)
        self.count = 0

    @torch.no_grad()
    def update(self, dense_inputs: torch.Tensor, inputs: torch.Tensor) -> None:
        dense_rows = dense_inputs.reshape(-1, dense_inputs.shape[-1]).to(self.dtype)
        rows = inputs.reshape(-1, inputs.shape[-1]).to(self.dtype)
        self.cross.addmm_(dense_rows.T, rows)
        self.dense_outer.addmm_(dense_rows.T, dense_rows)
        self.count += rows.shape[0]

    @property
    def cross_moment(self) -> torch.Tensor:
        return self.cross / self.count

    @property
    def dense_second_moment(self) -> torch.Tensor:
        return self.dense_outer / self.count


@dataclass
class StreamPairRecording:
    """The pruned stream's moments (as `record_inputs` gives) and the cross-moments with the dense stream.

    Each batch runs first on the dense stream, inside `dense_stream()`, whose sub-layer inputs wait here until
    the same tokens run on the pruned stream.
    """

    moments: dict[str, SecondMoment]
    cross_moments: dict[str, StreamCrossMoment]
    waiting: dict[str, torch.Tensor] = field(default_factory=dict)
    on_dense_stream: bool = False

    @contextmanager
    def dense_stream(self) -> Iterator[None]:
        self.on_dense_stream = True
        try:
            yield
        finally:
            self.on_dense_stream = False

    def record(self, name: str, inputs: torch.Tensor) -> None:
        if self.on_dense_stream:
            self.waiting[name] = inputs
        else:
            self.moments[name].update(inputs)
            self.cross_moments[name].update(self.waiting.pop(name), inputs)


@contextmanager
def record_stream_pair(modules: dict[str, nn.Linear]) -> Iterator[StreamPairRecording]:
    """While active, forwards through `modules` on the dense stream and then the pruned stream are recorded."""
    recording = StreamPairRecording(
        moments={name: SecondMoment(module.in_features, module.weight.device) for name, module in modules.items()},
        cross_moments={
            name: StreamCrossMoment(module.in_features, module.weight.device) for name, module in modules.items()
        },
    )
    handles = [
        module.register_forward_pre_hook(lambda _module, args, name=name: recording.record(name, args[0]))
        for name, module in modules.items()
    ]
    try:
        yield recording
    finally:
        for handle in handles:
            handle.remove()


def check_finite_moments(moments: dict[str, SecondMoment], layer: int) -> None:
    for name, moment in moments.items():
        check_finite(moment.outer, "statistics", f"C = E[yᵀy] of the {name} sub-layer's input", layer)
