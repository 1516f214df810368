"""Calibration: the token windows, the activations entering each decoder layer, and their statistics.

The windows are drawn from the calibration text; the first decoder layer's inputs are captured once and then
carried from layer to layer (`run_layer`). While a layer runs, the inputs of its pruned sub-layers are
streamed into statistics. For o_proj the input is the concatenation of head outputs; for down_proj it is the
gated intermediate activation. Each accumulator holds C = E[yᵀy] (and E[y], which the FLAP baseline needs)
over all tokens, one d x d matrix: activations are never kept beyond the batch that produced them.

For compensation towards the dense model (sequential calibration), `record_stream_pair` also accumulates, per
sub-layer, the cross-moment between its input on the dense stream and on the pruned stream for the same tokens.
"""

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from casp_core import data
from casp_core.model import attention_layer_types, on_device
from casp_core.numerics import check_finite
from casp_core.run import CPU
from casp_core.settings import PruneConfig

# Below this width the statistics are kept in float64: it costs nothing and keeps Q exactly symmetric PSD.
FLOAT64_MAX_DIM = 4096


class _Averaged:
    """Sums over tokens that become averages in place when first read: a d x d copy would be one of a layer's
    largest allocations at FFN width (127 MB at 5632 in float32). Once read, no more inputs are taken."""

    sums: tuple[str, ...]  # the attributes holding sums over the tokens

    def __init__(self) -> None:
        self.count = 0
        self.averaged = False

    def _take(self, rows: int) -> None:
        if self.averaged:
            raise RuntimeError("statistics already read as averages take no more inputs")
        self.count += rows

    def _averaged(self, name: str) -> torch.Tensor:
        if not self.averaged:
            for sum_name in self.sums:
                getattr(self, sum_name).div_(self.count)
            self.averaged = True
        return getattr(self, name)


class SecondMoment(_Averaged):
    sums = ("outer", "total")

    def __init__(self, dim: int, device: torch.device) -> None:
        super().__init__()
        self.dtype = torch.float64 if dim <= FLOAT64_MAX_DIM else torch.float32
        self.outer = torch.zeros(dim, dim, dtype=self.dtype, device=device)
        self.total = torch.zeros(dim, dtype=self.dtype, device=device)

    @torch.no_grad()
    def update(self, inputs: torch.Tensor, tokens: int | None = None) -> None:
        """Add these rows; `tokens`: how many tokens they stand for, when the others count as zero rows (the
        tokens the router sends to other experts)."""
        rows = inputs.reshape(-1, inputs.shape[-1]).to(self.dtype)
        self._take(rows.shape[0] if tokens is None else tokens)
        self.outer.addmm_(rows.T, rows)
        self.total += rows.sum(dim=0)

    @property
    def second_moment(self) -> torch.Tensor:
        return self._averaged("outer")

    @property
    def mean(self) -> torch.Tensor:
        return self._averaged("total")


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


class StreamCrossMoment(_Averaged):
    """M = E[y_d yᵀ] and C_d = E[y_d y_dᵀ]: a sub-layer's input on the dense stream (y_d) against the pruned (y)."""

    sums = ("cross", "dense_outer")

    def __init__(self, dim: int, device: torch.device) -> None:
        super().__init__()
        self.dtype = torch.float64 if dim <= FLOAT64_MAX_DIM else torch.float32
        self.cross = torch.zeros(dim, dim, dtype=self.dtype, device=device)
        self.dense_outer = torch.zeros(dim, dim, dtype=self.dtype, device=device)

    @torch.no_grad()
    def update(self, dense_inputs: torch.Tensor, inputs: torch.Tensor) -> None:
        dense_rows = dense_inputs.reshape(-1, dense_inputs.shape[-1]).to(self.dtype)
        rows = inputs.reshape(-1, inputs.shape[-1]).to(self.dtype)
        self._take(rows.shape[0])
        self.cross.addmm_(dense_rows.T, rows)
        self.dense_outer.addmm_(dense_rows.T, dense_rows)

    @property
    def cross_moment(self) -> torch.Tensor:
        return self._averaged("cross")

    @property
    def dense_second_moment(self) -> torch.Tensor:
        return self._averaged("dense_outer")


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


# ---------------------------------------------------------------- the windows and the layer inputs


@dataclass(frozen=True)
class CalibrationPlan:
    """The calibration text and how it is cut and fed: `n_samples` windows of `seq_len` tokens (capped at the
    model's context), in batches of `batch_size`, sequential or dense (module docstring)."""

    dataset: str  # a calibration source (casp_core.data.calibration_source)
    datasets_dir: str | None  # local copies of the named data sets
    n_samples: int
    seq_len: int
    seed: int
    mode: str  # "sequential" | "dense"
    batch_size: int

    @classmethod
    def of(cls, settings: PruneConfig, model_config: PretrainedConfig) -> "CalibrationPlan":
        calibration = settings.calibration
        return cls(
            dataset=calibration.dataset,
            datasets_dir=settings.datasets_dir,
            n_samples=calibration.n_samples,
            seq_len=min(calibration.seq_len, model_config.max_position_embeddings),
            seed=calibration.seed,
            mode=calibration.mode,
            batch_size=calibration.batch_size,
        )

    @property
    def sequential(self) -> bool:
        return self.mode == "sequential"


def calibration_windows(tokenizer: PreTrainedTokenizerBase, calibration: CalibrationPlan) -> torch.Tensor:
    """The calibration token windows."""
    text = data.load_text(data.calibration_source(calibration.dataset), calibration.datasets_dir)
    tokens = data.tokenize(text, tokenizer, add_bos=False)
    return data.sample_windows(tokens, calibration.n_samples, calibration.seq_len, calibration.seed)


class _InputsCaptured(Exception):
    """Raised once every attention type's layer arguments are noted: the rest of the forward pass is not needed."""


# What a decoder layer takes besides its hidden states: the same for every layer of one attention type.
LAYER_ARGUMENTS = ("attention_mask", "position_embeddings", "position_ids")


@dataclass
class LayerInputs:
    """Hidden states entering the current decoder layer, one tensor per batch, kept on `store`, and what the
    model gives each layer beside them."""

    batches: list[torch.Tensor]
    layer_types: list[str]  # per layer, full or sliding-window attention, as the model's family reads its config
    layer_kwargs: dict[int, dict[str, dict]]  # by batch size, then layer type: attention mask and rotary tables

    def kwargs(self, layer: nn.Module, batch_size: int) -> dict:
        """The keyword arguments the model gives `layer` for a batch of `batch_size` windows."""
        return self.layer_kwargs[batch_size][self.layer_types[layer.self_attn.layer_idx]]


class _LayerArgumentsRecorder(nn.Module):
    """Stands in for a decoder layer while the first layer's inputs are captured: passes the hidden states on
    untouched (no layer's weights are used) after `record` has seen what the model gives the layer."""

    def __init__(self, index: int, record: Callable[[int, torch.Tensor, dict], None]) -> None:
        super().__init__()
        self.index = index
        self.record = record

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.record(self.index, hidden_states, kwargs)
        return hidden_states


@torch.no_grad()
def capture_first_layer_inputs(
    model: PreTrainedModel,
    windows: torch.Tensor,
    batch_size: int,
    device: torch.device,
    store: torch.device,
    home: torch.device = CPU,
) -> LayerInputs:
    """The first decoder layer's input for each batch of `windows`, on `store`, and each layer type's arguments;
    the embedding and the rotary tables run on `device` and go back to `home` (casp_core.model.on_device).

    The model runs with its decoder layers replaced by recorders: a sliding-window layer's attention mask is not
    the full layers' one, so each type's is noted where the model hands it over (the first layer of that type)."""
    _, layer_types = attention_layer_types(model.config)
    first_of_type = {kind: layer_types.index(kind) for kind in set(layer_types)}
    last_needed = max(first_of_type.values())
    inputs = LayerInputs([], layer_types, {})

    def record(index: int, hidden: torch.Tensor, kwargs: dict) -> None:
        if index == 0:
            inputs.batches.append(hidden.to(store))
        if first_of_type.get(layer_types[index]) == index:
            noted = inputs.layer_kwargs.setdefault(hidden.shape[0], {})
            noted.setdefault(layer_types[index], {k: kwargs[k] for k in LAYER_ARGUMENTS if k in kwargs})
        if index == last_needed:
            raise _InputsCaptured

    base = model.model
    layers = base.layers
    base.layers = nn.ModuleList(_LayerArgumentsRecorder(index, record) for index in range(len(layers)))
    try:
        with on_device(nn.ModuleList([base.embed_tokens, base.rotary_emb]), device, home):
            for start in range(0, len(windows), batch_size):
                with contextlib.suppress(_InputsCaptured):
                    base(windows[start : start + batch_size].to(device), use_cache=False)
    finally:
        base.layers = layers
    return inputs


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs, device: torch.device, store: torch.device) -> list[torch.Tensor]:
    return [layer(x.to(device), **inputs.kwargs(layer, x.shape[0])).to(store) for x in inputs.batches]


@torch.no_grad()
def advance_layer(layer: nn.Module, inputs: LayerInputs, device: torch.device, store: torch.device) -> None:
    """`inputs` moved on through `layer` in place: each batch's input is let go as its output comes, so the host
    holds one set of the windows' activations, not the layer's inputs and outputs side by side (128 windows of
    2048 tokens of a 576-wide model in float32: 0.6 GB each). The tensors themselves are not written to."""
    for index, x in enumerate(inputs.batches):
        inputs.batches[index] = layer(x.to(device), **inputs.kwargs(layer, x.shape[0])).to(store)


@torch.no_grad()
def feed_layer(layer: nn.Module, inputs: LayerInputs, device: torch.device) -> None:
    """`layer` on each batch of `inputs`, its outputs dropped as they come: for hooks on its sub-layers."""
    for x in inputs.batches:
        layer(x.to(device), **inputs.kwargs(layer, x.shape[0]))


@torch.no_grad()
def run_layer_on_stream_pair(
    layer: nn.Module,
    inputs: LayerInputs,
    dense_inputs: LayerInputs,
    recording: StreamPairRecording,
    device: torch.device,
    store: torch.device,
) -> list[torch.Tensor]:
    """The layer, still dense, on each batch of the dense stream and then on the same tokens of the pruned stream.

    Returns the dense stream's outputs: the dense model's inputs to the next layer.
    """
    dense_outputs = []
    for x, x_dense in zip(inputs.batches, dense_inputs.batches, strict=True):
        layer_kwargs = inputs.kwargs(layer, x.shape[0])
        with recording.dense_stream():
            dense_outputs.append(layer(x_dense.to(device), **layer_kwargs).to(store))
        layer(x.to(device), **layer_kwargs)
    return dense_outputs


@dataclass
class CalibrationStream:
    """The activations entering the current layer, on `store` between layers; where layers run, and where their
    weights rest between uses (`home`: the CPU, or `device` when the model is resident there)."""

    inputs: LayerInputs
    dense_inputs: LayerInputs | None  # the dense model's, beside the pruned ones: dense-target compensation only
    sequential: bool  # each layer sees the earlier ones pruned (else: the dense model's activations)
    device: torch.device
    store: torch.device
    home: torch.device
