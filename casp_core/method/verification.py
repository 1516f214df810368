"""Verification: a pruned model must reproduce its masked original before it is published.

`verify` applies the rule stage by stage; the report states it.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from transformers import PreTrainedModel

from casp_core.errors import VerificationFailed
from casp_core.method.calibration import LayerInputs, capture_first_layer_inputs
from casp_core.model import decoder_layers, release_weights

# Masked and pruned stages, both in float64, differ only in the order their sums are rounded (the masked model
# adds the removed units as exact zeros): measured at 3e-16 to 7e-15 of a stage's largest output, so 1e-10
# leaves four orders of magnitude for wider layers. One weight element changed by a relative 1e-6, about
# ten float32 steps, moves its layer's output by 1e-9 to 1e-8 of that scale, far above the bound.
VERIFY_RELATIVE_TOLERANCE = 1e-10
VERIFY_RULE = (
    "float64, stage by stage on the same input (embeddings, each decoder layer, final norm + head): "
    f"max |masked - pruned| <= {VERIFY_RELATIVE_TOLERANCE:g} x max |masked output| of that stage"
)


@dataclass
class Verification:
    """The largest masked-vs-pruned difference over the stages, absolute and relative to the stage's output."""

    max_abs_diff: float = 0.0
    max_relative_diff: float = 0.0

    def check(self, stage: str, difference: float, scale: float) -> None:
        relative = difference / scale if scale > 0 else (0.0 if difference == 0 else math.inf)
        self.max_abs_diff = max(self.max_abs_diff, difference)
        self.max_relative_diff = max(self.max_relative_diff, relative)
        if not relative <= VERIFY_RELATIVE_TOLERANCE:
            raise VerificationFailed(
                f"{stage} of the pruned model differs from the masked model by {difference:.3g} in float64, "
                f"{relative:.3g} of its largest output magnitude {scale:.3g} (allowed {VERIFY_RELATIVE_TOLERANCE:g})"
            )


HEAD_ROWS_PER_CHUNK = 8192  # the head is compared in slices of the vocabulary, so float64 never holds all of it


def _float64_inputs(model: PreTrainedModel, tokens: torch.Tensor, device: torch.device) -> LayerInputs:
    """The first decoder layer's input and its attention mask and rotary tables, as `model` builds them."""
    inputs = capture_first_layer_inputs(model, tokens, len(tokens), device, device)
    inputs.batches = [x.double() for x in inputs.batches]
    inputs.layer_kwargs = {
        size: {kind: {name: _to_float64(value) for name, value in kwargs.items()} for kind, kwargs in by_type.items()}
        for size, by_type in inputs.layer_kwargs.items()
    }
    return inputs


def _to_float64(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_to_float64(v) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    return value


class Float64Scratch:
    """One float64 buffer that each matrix is widened into in turn, grown to the largest so far.

    A fresh float64 copy per projection is a new allocation (92 MB for a 1B model's FFN weight) whose pages are
    zero-filled on first touch: about three times as long as the copy into memory already touched (measured
    0.063 s against 0.017 s). The projections run one after another, each product done before the next matrix
    is widened, so one buffer serves them all; the widened matrix has the same shape, strides and alignment as a
    fresh copy, so the products are the same bits."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def widened(self, matrix: torch.Tensor) -> torch.Tensor:
        """`matrix` in float64, in the buffer: valid until the next call."""
        if matrix.dtype == torch.float64:
            return matrix
        if self.buffer is None or self.buffer.numel() < matrix.numel() or self.buffer.device != matrix.device:
            self.buffer = None  # the old one freed before its successor is allocated
            self.buffer = torch.empty(matrix.numel(), dtype=torch.float64, device=matrix.device)
        return self.buffer[: matrix.numel()].view(matrix.shape).copy_(matrix)


class _StayFloat64(TorchFunctionMode):
    """A float64 tensor asked to become float32 (or lower) stays float64, on the device it was asked for.

    transformers' RMSNorm computes in float32 whatever its input, and eager attention takes its softmax in
    float32: float32 rounding of float64 values that differ in the last bits would differ by a float32 step.
    A projection's weight is widened into `scratch` for its product only.
    """

    def __init__(self, scratch: Float64Scratch) -> None:
        super().__init__()
        self.scratch = scratch

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
            if func in (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16):
                return args[0]
            args = tuple(torch.float64 if isinstance(a, torch.dtype) and a.is_floating_point else a for a in args)
            if isinstance(kwargs.get("dtype"), torch.dtype) and kwargs["dtype"].is_floating_point:
                kwargs = {**kwargs, "dtype": torch.float64}
            if func is F.linear:  # the input is float64 already, and so is a bias (a vector, widened up front)
                args = (args[0], self.scratch.widened(args[1]), *args[2:])
        return func(*args, **kwargs)


def float64_forward(
    module: nn.Module, device: torch.device, *args: Any, scratch: Float64Scratch | None = None, **kwargs: Any
) -> torch.Tensor:
    """`module` computed wholly in float64 on `device`; the module stays as it is.

    Vectors (norms, biases) are widened up front; matrices, which only projections read, are widened one at a
    time as each projection runs (`_StayFloat64`), into `scratch` (a caller that runs many modules passes one
    for all): a float64 copy of a whole decoder layer would be 4x its bfloat16 weights, the largest thing
    verification allocates."""
    weights = {
        name: tensor.to(device) if tensor.dim() >= 2 else tensor.to(device, torch.float64)
        for name, tensor in module.state_dict().items()
    }
    with _StayFloat64(scratch or Float64Scratch()):
        return torch.func.functional_call(module, weights, args, kwargs)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are views of the same elements (two Parameters may wrap one tensor's storage)."""
    return (a.device, a.dtype, a.shape, a.stride(), a.data_ptr()) == (
        b.device,
        b.dtype,
        b.shape,
        b.stride(),
        b.data_ptr(),
    )


@torch.no_grad()
def verify(
    masked: PreTrainedModel,
    pruned: PreTrainedModel,
    tokens: torch.Tensor,
    device: torch.device,
    *,
    fill_layer: Callable[[int], None] | None = None,
    release_masked: bool = False,
) -> Verification:
    """Removing units must compute what masking them computes; nothing is published otherwise.

    Both models are compared in float64, one stage at a time with one decoder layer of each on the device:
    the same input goes through the masked and the pruned stage, and the masked output goes on to the next
    stage, so each stage is judged on its own rounding. The rule (`VERIFY_RULE`): at
    every stage (the embeddings, each decoder layer, the final norm + head), max |masked - pruned| <=
    1e-10 x max |masked output|, else `VerificationFailed` names the stage. Float32 or float16 rounding, which
    differs between the two models' shapes, never enters: even the float32 casts inside transformers' RMSNorm
    stay float64 here. Returns the largest differences found.

    Host memory need not hold both models: `fill_layer(i)`, when given, gives the pruned model's layer i its
    weights just before it is compared, and with `release_masked` the masked layer's weights are freed once it
    is (the masked model is then left without decoder weights).
    """
    device = device if device.type != "mps" else torch.device("cpu")  # MPS has no float64
    tokens = tokens.to(device)
    masked_inputs, pruned_inputs = _float64_inputs(masked, tokens, device), _float64_inputs(pruned, tokens, device)
    (stream,), (pruned_stream,) = masked_inputs.batches, pruned_inputs.batches
    verification = Verification()
    verification.check("the embedding", float((stream - pruned_stream).abs().max()), float(stream.abs().max()))
    scratch = Float64Scratch()
    for index, (masked_layer, pruned_layer) in enumerate(
        zip(decoder_layers(masked), decoder_layers(pruned), strict=True)
    ):
        if fill_layer is not None:
            fill_layer(index)
        masked_kwargs = masked_inputs.kwargs(masked_layer, len(tokens))
        expected = float64_forward(masked_layer, device, stream, scratch=scratch, **masked_kwargs)
        pruned_kwargs = pruned_inputs.kwargs(pruned_layer, len(tokens))
        actual = float64_forward(pruned_layer, device, stream, scratch=scratch, **pruned_kwargs)
        if release_masked:
            release_weights(masked_layer)
        verification.check(
            f"decoder layer {index}", float((expected - actual).abs().max()), float(expected.abs().max())
        )
        stream = expected

    masked_normed = float64_forward(masked.model.norm, device, stream)
    pruned_normed = float64_forward(pruned.model.norm, device, stream)
    # Surgery gives the pruned model the masked model's head weights themselves (the same memory): on equal inputs
    # its logits would be the masked ones computed again, the same bits, so they are computed only where the
    # weights or the inputs differ.
    same_logits = same_memory(pruned.lm_head.weight, masked.lm_head.weight) and torch.equal(
        masked_normed, pruned_normed
    )
    difference = scale = 0.0
    vocab = masked.lm_head.out_features
    for start in range(0, vocab, HEAD_ROWS_PER_CHUNK):
        rows = slice(start, min(start + HEAD_ROWS_PER_CHUNK, vocab))
        expected = masked_normed @ scratch.widened(masked.lm_head.weight[rows].to(device)).T
        if not same_logits:
            actual = pruned_normed @ scratch.widened(pruned.lm_head.weight[rows].to(device)).T
            difference = max(difference, float((expected - actual).abs().max()))
        scale = max(scale, float(expected.abs().max()))
    verification.check("the final norm and head (logits)", difference, scale)
    return verification
