"""The CASP pipeline: calibration -> allocation -> per layer (statistics, Q, solver, mask) -> surgery.

`prune` works on a loaded model; `run_job` is the whole job (load, evaluate dense, prune, verify, save,
evaluate pruned, report) that the command line and the service call.
"""

import contextlib
import math
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core import data
from casp_core.allocation import allocate_ratios, layer_sensitivities, uniform_ratios
from casp_core.checkpoint import save_pruned
from casp_core.compensation import CompensationReport, compensate_layer
from casp_core.config import DENSE_TARGET_COMPENSATION, PruneConfig
from casp_core.efficiency import efficiency_ratios, measure_efficiency
from casp_core.errors import InvalidConfig
from casp_core.export.gguf import export_checkpoint
from casp_core.interaction import block_aggregate, interaction_matrix, objective, offdiag_ratio
from casp_core.model import (
    AttentionGeometry,
    attention_geometry,
    check_model_reference,
    decoder_layers,
    load_model,
    prunable_parameters,
    resolve_device,
    sublayer_parameters,
)
from casp_core.modeling_casp_llama import CaspLlamaForCausalLM
from casp_core.numerics import check_finite
from casp_core.perplexity import EvaluationText, default_seq_len, evaluation_text, windows_perplexity
from casp_core.plots import write_plots
from casp_core.progress import (
    CancelCheck,
    ProgressFn,
    StageTimer,
    check_cancelled,
    never_cancelled,
    no_progress,
)
from casp_core.report import build_report, write_report
from casp_core.solvers import diagonal, select_units
from casp_core.statistics import (
    SecondMoment,
    StreamPairRecording,
    check_finite_moments,
    record_inputs,
    record_stream_pair,
)
from casp_core.surgery import LayerPruning, kept_kv_heads, mask_layer, remove_units
from casp_core.verification import Verification
from casp_core.zeroshot import evaluate_zero_shot


@dataclass
class SubLayerReport:
    units: int
    pruned: list[int]
    objective: float  # the chosen solver's z'Qz
    diagonal_objective: float  # the independent baseline's z'Qz on the same Q
    offdiag_ratio: float  # rho of the unit-level Q (block-aggregated for heads)
    lower_bound: float | None = None  # relaxation only
    compensation: CompensationReport | None = None  # least-squares refit of the kept units, when asked for


@dataclass
class LayerReport:
    index: int
    ratio: float  # r_l from the allocation
    sensitivity: float | None
    pruned_heads: list[int]
    pruned_channels: list[int]
    pruned_kv_heads: list[int]
    attn: SubLayerReport
    mlp: SubLayerReport
    params_before: int
    params_after: int


@dataclass
class PruneResult:
    model: CaspLlamaForCausalLM
    layers: list[LayerReport]
    params_dense: int
    params_pruned: int
    verification_max_abs_diff: float  # float64, largest over the stages `verify` compares
    verification_max_relative_diff: float  # what the rule bounds: difference / the stage's largest output
    timings: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def achieved_ratio(self) -> float:
        return 1.0 - self.params_pruned / self.params_dense


# ---------------------------------------------------------------- calibration activations, layer by layer


class _InputsCaptured(Exception):
    """Raised by the first decoder layer's hook: the rest of the forward pass is not needed."""


@dataclass
class LayerInputs:
    """Hidden states entering the current decoder layer, one tensor per batch, kept on `store`."""

    batches: list[torch.Tensor]
    layer_kwargs: dict[int, dict]  # by batch size: attention mask and rotary tables, already on the device


@torch.no_grad()
def capture_first_layer_inputs(
    model: PreTrainedModel, windows: torch.Tensor, batch_size: int, device: torch.device, store: torch.device
) -> LayerInputs:
    inputs = LayerInputs([], {})

    def capture(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        inputs.batches.append(hidden.to(store))
        inputs.layer_kwargs.setdefault(
            hidden.shape[0],
            {k: kwargs[k] for k in ("attention_mask", "position_embeddings", "position_ids") if k in kwargs},
        )
        raise _InputsCaptured

    base = model.model
    base.embed_tokens.to(device)
    base.rotary_emb.to(device)
    handle = decoder_layers(model)[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        for start in range(0, len(windows), batch_size):
            with contextlib.suppress(_InputsCaptured):
                base(windows[start : start + batch_size].to(device), use_cache=False)
    finally:
        handle.remove()
    return inputs


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs, device: torch.device, store: torch.device) -> list[torch.Tensor]:
    return [layer(x.to(device), **inputs.layer_kwargs[x.shape[0]]).to(store) for x in inputs.batches]


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
        layer_kwargs = inputs.layer_kwargs[x.shape[0]]
        with recording.dense_stream():
            dense_outputs.append(layer(x_dense.to(device), **layer_kwargs).to(store))
        layer(x.to(device), **layer_kwargs)
    return dense_outputs


# ---------------------------------------------------------------- from ratios to unit counts
#
# The budget is planned from the ratios and the shapes alone, before any statistics: in sequential mode layer l
# is masked before layer l+1 is measured, so a shortfall found after the last layer could not go back to the
# earlier ones. Each layer prunes round(r_l x heads) query heads and FFN channels for the rest of its share,
# never more than r_max of either. Where layers at r_max cannot hold the target that way (whole heads round
# down), heads go first to the layers whose rounding cut most, and only then do layers the allocation spared
# (r_l = 0) take part. Channels are then chosen layer by layer: the layer's share plus what the earlier layers
# still owe, but at least what the later layers cannot hold and at most what leaves them their least, so the
# last layer's channels close the gap to within half a rounding unit (round_to FFN channels of one layer).
# Only how many key/value heads the chosen query heads take along (GQA) is not known in advance: the plan
# counts the fewest, and the channels of the later layers absorb the difference.


def attention_params_removed(layer: nn.Module, geometry: AttentionGeometry, heads: list[int]) -> int:
    """q rows and o columns of each head, plus k and v rows of each key/value head left with no query head."""
    attention = layer.self_attn
    hidden = attention.q_proj.in_features
    per_head = geometry.head_dim * (2 * hidden + (attention.q_proj.bias is not None))
    per_kv_head = 2 * geometry.head_dim * (hidden + (attention.k_proj.bias is not None))
    kv_gone = geometry.num_kv_heads - len(kept_kv_heads(geometry, tuple(heads)))
    return len(heads) * per_head + kv_gone * per_kv_head


def channel_params(layer: nn.Module) -> int:
    mlp = layer.mlp
    return mlp.down_proj.out_features + 2 * (mlp.gate_proj.in_features + (mlp.gate_proj.bias is not None))


def heads_cap(geometry: AttentionGeometry, r_max: float) -> int:
    return int(r_max * geometry.num_heads + 1e-9)


def heads_emptying_groups_last(geometry: AttentionGeometry) -> list[int]:
    """Query heads ordered one from each key/value group, then a second from each...: any prefix of this order
    takes along the fewest key/value heads that so many query heads can."""
    seen: Counter[int] = Counter()
    rank = []
    for kv in geometry.kv_of_query:
        rank.append(seen[kv])
        seen[kv] += 1
    return sorted(range(geometry.num_heads), key=lambda head: (rank[head], head))


def channel_counts(width: int, r_max: float, round_to: int) -> tuple[int, ...]:
    """The FFN channel counts a layer may prune: at most r_max of them, keeping a positive multiple of round_to."""
    most = int(r_max * width + 1e-9)
    counts = tuple(c for c in range(most + 1) if (width - c) % round_to == 0 and width - c >= round_to)
    if not counts:
        raise InvalidConfig(
            f"round_to: a layer of {width} FFN channels cannot keep a multiple of {round_to} channels "
            f"while pruning at most r_max = {r_max} of them"
        )
    return counts


@dataclass(frozen=True)
class LayerPlan:
    """One layer's part of the budget: its query heads, fixed, and the FFN channel counts it may choose from."""

    heads: int
    least_attention_removed: int  # parameters those heads remove when they take along the fewest key/value heads
    channel_params: int
    channel_counts: tuple[int, ...]  # ascending
    share: float  # r_l times the layer's parameters

    @property
    def least_removed(self) -> int:
        return self.least_attention_removed + self.channel_counts[0] * self.channel_params

    @property
    def most_removed(self) -> int:
        return self.least_attention_removed + self.channel_counts[-1] * self.channel_params


@dataclass(frozen=True)
class BudgetPlan:
    target: float  # parameters to remove: the ratio times the dense decoder layers' parameters
    layers: tuple[LayerPlan, ...]


def layer_plan(
    model: PreTrainedModel, layer: nn.Module, heads: int, counts: tuple[int, ...], ratio: float
) -> LayerPlan:
    geometry = attention_geometry(model, layer)
    return LayerPlan(
        heads=heads,
        least_attention_removed=attention_params_removed(layer, geometry, heads_emptying_groups_last(geometry)[:heads]),
        channel_params=channel_params(layer),
        channel_counts=counts,
        share=ratio * sum(sublayer_parameters(layer)),
    )


def check_reachable(model: PreTrainedModel, config: PruneConfig) -> None:
    """Refuse, before any work, a ratio that whole heads and channels within r_max cannot reach."""
    most = 0
    for layer in decoder_layers(model):
        counts = channel_counts(layer.mlp.down_proj.in_features, config.r_max, config.round_to)
        cap = heads_cap(attention_geometry(model, layer), config.r_max)
        most += layer_plan(model, layer, cap, counts, config.r_max).most_removed
    reachable = most / prunable_parameters(model)
    if config.ratio > reachable + 1e-9:
        rounding = f" and round_to = {config.round_to}" if config.round_to > 1 else ""
        raise InvalidConfig(
            f"ratio: {config.ratio} cannot be reached on this model: whole heads and FFN channels, at most "
            f"r_max = {config.r_max} of each layer's{rounding}, remove at most {math.floor(reachable * 1e4) / 1e4} "
            "of the decoder layers' parameters (ask for that or less, or raise r_max)"
        )


def plan_budget(model: PreTrainedModel, ratios: list[float], config: PruneConfig) -> BudgetPlan:
    """Heads per layer and the channel counts each may take, such that the layers can hold the target."""
    layers = decoder_layers(model)
    geometries = [attention_geometry(model, layer) for layer in layers]
    counts = [channel_counts(layer.mlp.down_proj.in_features, config.r_max, config.round_to) for layer in layers]
    caps = [heads_cap(geometry, config.r_max) for geometry in geometries]
    heads = [min(round(r * g.num_heads), cap) for r, g, cap in zip(ratios, geometries, caps, strict=True)]
    spared = [r <= 0.0 for r in ratios]

    def plan_of(index: int) -> LayerPlan:
        if spared[index]:
            return layer_plan(model, layers[index], 0, (0,), 0.0)
        return layer_plan(model, layers[index], heads[index], counts[index], ratios[index])

    plans = [plan_of(index) for index in range(len(layers))]
    target = config.ratio * prunable_parameters(model)
    while sum(plan.most_removed for plan in plans) < target:
        growing = [i for i in range(len(layers)) if not spared[i] and heads[i] < caps[i]]
        if growing:
            index = max(growing, key=lambda i: ratios[i] * geometries[i].num_heads - heads[i])
            heads[index] += 1
        elif any(spared):
            index = spared.index(True)
            spared[index] = False
        else:
            break  # unreachable: check_reachable refuses such a ratio before any work
        plans[index] = plan_of(index)
    return BudgetPlan(target, tuple(plans))


def channels_to_prune(plan: BudgetPlan, index: int, removed_before: int, attention_removed: int) -> int:
    """Layer `index`'s share and what the earlier layers still owe, within what the later layers can hold.

    `removed_before` is what the earlier layers removed, `attention_removed` what this layer's heads removed
    with the key/value heads they took along.
    """
    layer, later = plan.layers[index], plan.layers[index + 1 :]
    owed = plan.target - removed_before - attention_removed  # by this layer's channels and the later layers
    least = owed - sum(p.most_removed for p in later)
    most = owed - sum(p.least_removed for p in later)
    owed_before = sum(p.share for p in plan.layers[:index]) - removed_before
    wanted = max(min(layer.share - attention_removed + owed_before, most), least) / layer.channel_params
    return min(layer.channel_counts, key=lambda count: abs(count - wanted))


# ---------------------------------------------------------------- one layer


def solve_sublayer(
    solver: str, q_units: torch.Tensor, k: int, weight: torch.Tensor, moment: SecondMoment, block: int
) -> SubLayerReport:
    pruned, lower_bound = select_units(
        solver, q_units, k, weight=weight, second_moment=moment.second_moment, mean=moment.mean, block=block
    )
    return SubLayerReport(
        units=q_units.shape[0],
        pruned=sorted(int(i) for i in pruned),
        objective=objective(q_units, pruned),
        diagonal_objective=objective(q_units, diagonal(q_units, k)),
        offdiag_ratio=offdiag_ratio(q_units),
        lower_bound=lower_bound,
    )


def prune_layer(
    model: PreTrainedModel,
    layer: nn.Module,
    moments: dict[str, SecondMoment],
    plan: BudgetPlan,
    index: int,
    removed_before: int,
    config: PruneConfig,
) -> tuple[LayerPruning, SubLayerReport, SubLayerReport, int]:
    """Choose the layer's planned heads, then its channels; returns the pruning and the parameters it removes."""
    geometry = attention_geometry(model, layer)
    o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj
    q_heads = block_aggregate(interaction_matrix(o_proj.weight, moments["attn"].second_moment), geometry.head_dim)
    check_finite(q_heads, "interaction", "Q of the attention heads", layer.self_attn.layer_idx)
    n_heads = plan.layers[index].heads
    attn = solve_sublayer(config.solver, q_heads, n_heads, o_proj.weight, moments["attn"], geometry.head_dim)

    attention_removed = attention_params_removed(layer, geometry, attn.pruned)
    n_channels = channels_to_prune(plan, index, removed_before, attention_removed)
    q_channels = interaction_matrix(down_proj.weight, moments["mlp"].second_moment)
    check_finite(q_channels, "interaction", "Q of the FFN channels", layer.self_attn.layer_idx)
    mlp = solve_sublayer(config.solver, q_channels, n_channels, down_proj.weight, moments["mlp"], 1)

    removed = attention_removed + n_channels * channel_params(layer)
    return LayerPruning(tuple(attn.pruned), tuple(mlp.pruned)), attn, mlp, removed


# ---------------------------------------------------------------- the whole model


def calibration_windows(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: PruneConfig
) -> torch.Tensor:
    """The calibration token windows (sequence length capped at the model's context)."""
    calibration = config.calibration
    seq_len = min(calibration.seq_len, model.config.max_position_embeddings)
    text = data.load_text(data.calibration_source(calibration.dataset), config.datasets_dir)
    tokens = data.tokenize(text, tokenizer, add_bos=False)
    return data.calibration_windows(tokens, calibration.n_samples, seq_len, calibration.seed)


def prune(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config: PruneConfig,
    *,
    windows: torch.Tensor | None = None,
    progress: ProgressFn = no_progress,
    should_cancel: CancelCheck = never_cancelled,
    timer: StageTimer | None = None,
) -> PruneResult:
    """Prune `model` (masked in place along the way) and return the physically smaller model.

    `windows` are the calibration tokens, read from `config.calibration` when not given.
    """
    config.validate()
    check_reachable(model, config)
    device = resolve_device(config.device)
    timer = timer or StageTimer(device)
    store = torch.device("cpu")  # calibration activations wait here between layers
    layers = decoder_layers(model)
    calibration = config.calibration
    if windows is None:
        with timer.stage("calibration_data"):
            progress("calibration", 0.0, "loading calibration text")
            windows = calibration_windows(model, tokenizer, config)
    seq_len = windows.shape[1]

    sensitivities: list[float | None] = [None] * len(layers)
    with timer.stage("allocation"):
        if config.allocation == "gradient":
            progress("allocation", 0.0, "layer sensitivities from the cross-entropy gradient")
            model.to(device)
            sensitivities = layer_sensitivities(
                model,
                windows,
                batch_size=calibration.batch_size,
                device=device,
                progress=progress,
                should_cancel=should_cancel,
            )
            model.to(store)
            ratios = allocate_ratios(sensitivities, config.ratio, config.alpha, config.r_max)
        else:
            ratios = uniform_ratios(len(layers), config.ratio)
        plan = plan_budget(model, ratios, config)

    params_dense = prunable_parameters(model)
    with timer.stage("calibration_forward"):
        inputs = capture_first_layer_inputs(model, windows, calibration.batch_size, device, store)
    # Compensating towards the dense model needs its inputs to each layer beside the pruned ones: a second set of
    # parked activations, carried only then (in dense mode the pruned stream is the dense one).
    dense_inputs = None
    if config.compensation == DENSE_TARGET_COMPENSATION and calibration.mode == "sequential":
        dense_inputs = LayerInputs(list(inputs.batches), inputs.layer_kwargs)

    prunings: list[LayerPruning] = []
    chosen: list[tuple[SubLayerReport, SubLayerReport, list[int]]] = []
    removed = 0
    for index, layer in enumerate(layers):
        check_cancelled(should_cancel)
        progress("pruning", index / len(layers), f"layer {index + 1} of {len(layers)}")
        layer.to(device)
        sublayers = {"attn": layer.self_attn.o_proj, "mlp": layer.mlp.down_proj}
        cross_moments = None
        if dense_inputs is None:
            with timer.stage("statistics"), record_inputs(sublayers) as moments:
                dense_outputs = run_layer(layer, inputs, device, store)
            if calibration.mode == "sequential":
                del dense_outputs  # the next layer must see this one as pruned: recomputed below
        else:
            with timer.stage("statistics"), record_stream_pair(sublayers) as recording:
                dense_inputs.batches = run_layer_on_stream_pair(layer, inputs, dense_inputs, recording, device, store)
            moments, cross_moments = recording.moments, recording.cross_moments
        check_finite_moments(moments, index)
        with timer.stage("solver"):
            pruning, attn, mlp, layer_removed = prune_layer(model, layer, moments, plan, index, removed, config)
            removed += layer_removed
        geometry = attention_geometry(model, layer)
        if config.compensation != "none":
            with timer.stage("compensation"):
                attn.compensation, mlp.compensation = compensate_layer(
                    layer, geometry, pruning, moments, config.compensation_damping, cross_moments
                )
        del moments, cross_moments
        kv_kept = kept_kv_heads(geometry, pruning.pruned_heads)
        mask_layer(layer, geometry, pruning)
        with timer.stage("calibration_forward"):
            if calibration.mode == "sequential":
                inputs.batches = run_layer(layer, inputs, device, store)
            else:
                inputs.batches = dense_outputs
        layer.to(store)
        prunings.append(pruning)
        chosen.append((attn, mlp, [h for h in range(geometry.num_kv_heads) if h not in kv_kept]))
    progress("pruning", 1.0, "all layers pruned")
    del inputs, dense_inputs

    with timer.stage("surgery"):
        pruned = remove_units(model, prunings)
    reports = [
        LayerReport(
            index=index,
            ratio=ratios[index],
            sensitivity=sensitivities[index],
            pruned_heads=list(pruning.pruned_heads),
            pruned_channels=list(pruning.pruned_channels),
            pruned_kv_heads=pruned_kv_heads,
            attn=attn,
            mlp=mlp,
            params_before=sum(sublayer_parameters(dense_layer)),
            params_after=sum(sublayer_parameters(pruned_layer)),
        )
        for index, (pruning, (attn, mlp, pruned_kv_heads), dense_layer, pruned_layer) in enumerate(
            zip(prunings, chosen, layers, decoder_layers(pruned), strict=True)
        )
    ]
    with timer.stage("verification"):
        progress("verification", 0.0, "pruned model against the masked model")
        verification = verify(model, pruned, windows[:2, : min(seq_len, 128)], device)
    return PruneResult(
        model=pruned,
        layers=reports,
        params_dense=params_dense,
        params_pruned=prunable_parameters(pruned),
        verification_max_abs_diff=verification.max_abs_diff,
        verification_max_relative_diff=verification.max_relative_diff,
        timings=timer.stages,
    )


HEAD_ROWS_PER_CHUNK = 8192  # the head is compared in slices of the vocabulary, so float64 never holds all of it


def _float64_inputs(model: PreTrainedModel, tokens: torch.Tensor, device: torch.device) -> LayerInputs:
    """The first decoder layer's input and its attention mask and rotary tables, as `model` builds them."""
    inputs = capture_first_layer_inputs(model, tokens, len(tokens), device, device)
    model.model.embed_tokens.to("cpu")
    model.model.rotary_emb.to("cpu")
    inputs.batches = [x.double() for x in inputs.batches]
    inputs.layer_kwargs = {
        size: {name: _to_float64(value) for name, value in kwargs.items()}
        for size, kwargs in inputs.layer_kwargs.items()
    }
    return inputs


def _to_float64(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_to_float64(v) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    return value


class _StayFloat64(TorchFunctionMode):
    """A float64 tensor asked to become float32 (or lower) stays float64, on the device it was asked for.

    transformers' RMSNorm computes in float32 whatever its input, and eager attention takes its softmax in
    float32: float32 rounding of float64 values that differ in the last bits would differ by a float32 step.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
            if func in (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16):
                return args[0]
            args = tuple(torch.float64 if isinstance(a, torch.dtype) and a.is_floating_point else a for a in args)
            if isinstance(kwargs.get("dtype"), torch.dtype) and kwargs["dtype"].is_floating_point:
                kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


def float64_forward(module: nn.Module, device: torch.device, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`module` computed wholly in float64 with a copy of its weights on `device`; the module stays as it is."""
    weights = {name: tensor.to(device, torch.float64) for name, tensor in module.state_dict().items()}
    with _StayFloat64():
        return torch.func.functional_call(module, weights, args, kwargs)


@torch.no_grad()
def verify(
    masked: PreTrainedModel, pruned: PreTrainedModel, tokens: torch.Tensor, device: torch.device
) -> Verification:
    """Removing units must compute what masking them computes; nothing is published otherwise.

    Both models are compared in float64, one stage at a time with one decoder layer of each on the device:
    the same input goes through the masked and the pruned stage, and the masked output goes on to the next
    stage, so each stage is judged on its own rounding. The rule (`casp_core.verification.VERIFY_RULE`): at
    every stage (the embeddings, each decoder layer, the final norm + head), max |masked - pruned| <=
    1e-10 x max |masked output|, else `VerificationFailed` names the stage. Float32 or float16 rounding, which
    differs between the two models' shapes, never enters: even the float32 casts inside transformers' RMSNorm
    stay float64 here. Returns the largest differences found.
    """
    device = device if device.type != "mps" else torch.device("cpu")  # MPS has no float64
    tokens = tokens.to(device)
    masked_inputs, pruned_inputs = _float64_inputs(masked, tokens, device), _float64_inputs(pruned, tokens, device)
    (stream,), (pruned_stream,) = masked_inputs.batches, pruned_inputs.batches
    verification = Verification()
    verification.check("the embedding", float((stream - pruned_stream).abs().max()), float(stream.abs().max()))
    masked_kwargs, pruned_kwargs = masked_inputs.layer_kwargs[len(tokens)], pruned_inputs.layer_kwargs[len(tokens)]
    for index, (masked_layer, pruned_layer) in enumerate(
        zip(decoder_layers(masked), decoder_layers(pruned), strict=True)
    ):
        expected = float64_forward(masked_layer, device, stream, **masked_kwargs)
        actual = float64_forward(pruned_layer, device, stream, **pruned_kwargs)
        verification.check(
            f"decoder layer {index}", float((expected - actual).abs().max()), float(expected.abs().max())
        )
        stream = expected

    masked_normed = float64_forward(masked.model.norm, device, stream)
    pruned_normed = float64_forward(pruned.model.norm, device, stream)
    difference = scale = 0.0
    vocab = masked.lm_head.out_features
    for start in range(0, vocab, HEAD_ROWS_PER_CHUNK):
        rows = slice(start, min(start + HEAD_ROWS_PER_CHUNK, vocab))
        expected = masked_normed @ masked.lm_head.weight[rows].to(device, torch.float64).T
        actual = pruned_normed @ pruned.lm_head.weight[rows].to(device, torch.float64).T
        difference = max(difference, float((expected - actual).abs().max()))
        scale = max(scale, float(expected.abs().max()))
    verification.check("the final norm and head (logits)", difference, scale)
    return verification


# ---------------------------------------------------------------- the job: load, measure, prune, publish


def _prepare_output(out_dir: Path) -> Path:
    """Work goes to a staging directory renamed into place at the end: a crash never leaves a half checkpoint."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise InvalidConfig(f"out: {out_dir} exists and is not empty")
    staging = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _evaluation_texts(
    tokenizer: PreTrainedTokenizerBase, config: PruneConfig, seq_len: int
) -> dict[str, EvaluationText]:
    evaluation = config.evaluation
    return {
        name: evaluation_text(
            tokenizer,
            name,
            evaluation.seq_len or seq_len,
            datasets_dir=config.datasets_dir,
            max_windows=evaluation.limit,
        )
        for name in evaluation.perplexity
    }


def _evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: dict[str, EvaluationText],
    config: PruneConfig,
    progress: ProgressFn,
    should_cancel: CancelCheck,
) -> dict[str, Any]:
    """One model's figures: perplexity per text, and zero-shot accuracy and efficiency when asked for."""
    evaluation = config.evaluation
    figures: dict[str, Any] = {"perplexity": {}}
    for name, text in texts.items():
        figures["perplexity"][name] = windows_perplexity(
            model,
            text,
            device=config.device,
            batch_size=config.calibration.batch_size,
            progress=progress,
            should_cancel=should_cancel,
        )
    if evaluation.zero_shot:
        check_cancelled(should_cancel)
        progress("evaluation", 0.0, f"zero-shot {', '.join(evaluation.zero_shot)}")
        figures["zero_shot"] = evaluate_zero_shot(
            model,
            tokenizer,
            evaluation.zero_shot,
            limit=evaluation.limit,
            datasets_dir=config.datasets_dir,
            device=config.device,
        )
    if evaluation.efficiency:
        check_cancelled(should_cancel)
        progress("evaluation", 0.0, "parameters, MACs and latency")
        figures["efficiency"] = measure_efficiency(model, device=config.device)
    model.to("cpu")
    return figures


def _combine(dense: dict[str, Any], pruned: dict[str, Any], texts: dict[str, EvaluationText]) -> dict[str, Any]:
    """The evaluation card's layout: each figure's dense and pruned values side by side."""
    combined: dict[str, Any] = {
        "perplexity": {
            name: {"dense": dense["perplexity"][name], "pruned": pruned["perplexity"][name], **text.convention}
            for name, text in texts.items()
        }
    }
    if "zero_shot" in dense:
        combined["zero_shot"] = {"dense": dense["zero_shot"], "pruned": pruned["zero_shot"]}
    if "efficiency" in dense:
        combined["efficiency"] = {
            "dense": dense["efficiency"],
            "pruned": pruned["efficiency"],
            "pruned_over_dense": efficiency_ratios(dense["efficiency"], pruned["efficiency"]),
        }
    return combined


def run_job(
    model: str,
    config: PruneConfig,
    out_dir: Path,
    *,
    revision: str | None = None,
    progress: ProgressFn = no_progress,
    should_cancel: CancelCheck = never_cancelled,
) -> dict[str, Any]:
    """The whole job; `out_dir` ends up holding the checkpoint, report.json and report.md, or nothing."""
    config.validate()
    check_model_reference(model)
    out_dir = Path(out_dir)
    staging = _prepare_output(out_dir)
    try:
        device = resolve_device(config.device)
        timer = StageTimer(device)
        with timer.stage("load"):
            progress("load", 0.0, f"loading {model}")
            dense, tokenizer = load_model(model, revision=revision, dtype=config.dtype)
            check_reachable(dense, config)
            dtype = str(dense.dtype).removeprefix("torch.")
        with timer.stage("calibration_data"):
            # Every input is read before the long work starts, so a missing file fails the job at once.
            progress("calibration", 0.0, "loading calibration and evaluation text")
            windows = calibration_windows(dense, tokenizer, config)
            texts = _evaluation_texts(tokenizer, config, default_seq_len(dense))
        with timer.stage("evaluation_dense"):
            dense_figures = _evaluate(dense, tokenizer, texts, config, progress, should_cancel)
        result = prune(
            dense, tokenizer, config, windows=windows, progress=progress, should_cancel=should_cancel, timer=timer
        )
        del dense
        with timer.stage("checkpoint"):
            progress("checkpoint", 0.0, "writing the checkpoint")
            result.model.config.casp = {"source_model": model, "revision": revision, "settings": config.to_dict()}
            save_pruned(result.model, tokenizer, staging)
        exports = []
        if config.export:
            with timer.stage("export"):
                progress("checkpoint", 1.0, f"exporting {', '.join(config.export)}")
                exports = export_checkpoint(staging, config.export, config.gguf_type)
        with timer.stage("evaluation_pruned"):
            pruned_figures = _evaluate(result.model, tokenizer, texts, config, progress, should_cancel)
        progress("report", 0.0, "writing the report")
        evaluation = _combine(dense_figures, pruned_figures, texts)
        report = build_report(
            model_name=model,
            config=config,
            result=result,
            perplexity=evaluation.pop("perplexity"),
            evaluation=evaluation,
            device=str(device),
            dtype=dtype,
        )
        if exports:
            report["exports"] = [{**export.summary(), "path": export.path.name} for export in exports]
        report["plots"] = [str(path.relative_to(staging)) for path in write_plots(report, staging)]
        write_report(report, staging)
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
        progress("report", 1.0, f"written to {out_dir}")
        return report
    finally:
        shutil.rmtree(staging, ignore_errors=True)
