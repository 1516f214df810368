"""The CASP pipeline: calibration -> allocation -> per layer (statistics, Q, solver, mask) -> surgery.

`prune` works on a loaded model; `run_job` is the whole job (load, evaluate dense, prune, verify, save,
evaluate pruned, report) that the command line and the service call.
"""

import contextlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from casp_core import data
from casp_core.allocation import allocate_ratios, layer_sensitivities, uniform_ratios
from casp_core.checkpoint import save_pruned
from casp_core.config import PruneConfig
from casp_core.efficiency import efficiency_ratios, measure_efficiency
from casp_core.errors import InvalidConfig, VerificationFailed
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
from casp_core.statistics import SecondMoment, record_inputs
from casp_core.surgery import LayerPruning, kept_kv_heads, mask_layer, remove_units
from casp_core.zeroshot import evaluate_zero_shot


@dataclass
class SubLayerReport:
    units: int
    pruned: list[int]
    objective: float  # the chosen solver's z'Qz
    diagonal_objective: float  # the independent baseline's z'Qz on the same Q
    offdiag_ratio: float  # rho of the unit-level Q (block-aggregated for heads)
    lower_bound: float | None = None  # relaxation only


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
    verification_max_abs_diff: float
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


# ---------------------------------------------------------------- from ratios to unit counts


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


def channels_to_prune(
    layer: nn.Module, target_removed: float, attention_removed: int, r_max: float, round_to: int
) -> int:
    """FFN channels absorb the rounding of whole heads, so that the layer loses its target parameters."""
    width = layer.mlp.down_proj.in_features
    count = round((target_removed - attention_removed) / channel_params(layer))
    count = min(max(count, 0), int(r_max * width))
    if round_to > 1:
        largest_multiple = width // round_to * round_to
        kept_channels = min(max(round_to, round((width - count) / round_to) * round_to), largest_multiple)
        count = width - kept_channels
    return count


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
    ratio: float,
    carry: float,
    config: PruneConfig,
) -> tuple[LayerPruning, SubLayerReport, SubLayerReport, float]:
    """Choose the layer's heads, then its channels; returns the pruning and the parameters still owed."""
    geometry = attention_geometry(model, layer)
    o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj
    q_heads = block_aggregate(interaction_matrix(o_proj.weight, moments["attn"].second_moment), geometry.head_dim)
    n_heads = min(round(ratio * geometry.num_heads), int(config.r_max * geometry.num_heads + 1e-9))
    attn = solve_sublayer(config.solver, q_heads, n_heads, o_proj.weight, moments["attn"], geometry.head_dim)

    target = ratio * sum(sublayer_parameters(layer)) + carry
    attention_removed = attention_params_removed(layer, geometry, attn.pruned)
    n_channels = channels_to_prune(layer, target, attention_removed, config.r_max, config.round_to)
    q_channels = interaction_matrix(down_proj.weight, moments["mlp"].second_moment)
    mlp = solve_sublayer(config.solver, q_channels, n_channels, down_proj.weight, moments["mlp"], 1)

    removed = attention_removed + n_channels * channel_params(layer)
    return LayerPruning(tuple(attn.pruned), tuple(mlp.pruned)), attn, mlp, target - removed


# ---------------------------------------------------------------- the whole model


def calibration_windows(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: PruneConfig
) -> torch.Tensor:
    """The calibration token windows (sequence length capped at the model's context)."""
    calibration = config.calibration
    seq_len = min(calibration.seq_len, model.config.max_position_embeddings)
    text = data.load_text(data.parse_source(calibration.dataset, "train"), config.datasets_dir)
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

    params_dense = prunable_parameters(model)
    with timer.stage("calibration_forward"):
        inputs = capture_first_layer_inputs(model, windows, calibration.batch_size, device, store)

    prunings: list[LayerPruning] = []
    chosen: list[tuple[SubLayerReport, SubLayerReport, list[int]]] = []
    carry = 0.0
    for index, layer in enumerate(layers):
        check_cancelled(should_cancel)
        progress("pruning", index / len(layers), f"layer {index + 1} of {len(layers)}")
        layer.to(device)
        with (
            timer.stage("statistics"),
            record_inputs({"attn": layer.self_attn.o_proj, "mlp": layer.mlp.down_proj}) as moments,
        ):
            dense_outputs = run_layer(layer, inputs, device, store)
        if calibration.mode == "sequential":
            del dense_outputs  # the next layer must see this one as pruned: recomputed below
        with timer.stage("solver"):
            pruning, attn, mlp, carry = prune_layer(model, layer, moments, ratios[index], carry, config)
            del moments
        geometry = attention_geometry(model, layer)
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
    del inputs

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
        max_diff = verify(model, pruned, windows[:2, : min(seq_len, 128)], device)
    return PruneResult(
        model=pruned,
        layers=reports,
        params_dense=params_dense,
        params_pruned=prunable_parameters(pruned),
        verification_max_abs_diff=max_diff,
        timings=timer.stages,
    )


VERIFY_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}


@torch.no_grad()
def verify(masked: PreTrainedModel, pruned: PreTrainedModel, tokens: torch.Tensor, device: torch.device) -> float:
    """Removing units must compute what masking them computes; nothing is published otherwise.

    The tolerance is absolute for logits of magnitude up to 1 and relative beyond, per dtype (fp32: 1e-5).
    """
    tokens = tokens.to(device)
    masked.to(device)
    expected = masked(tokens, use_cache=False).logits.float()
    masked.to("cpu")
    pruned.to(device)
    actual = pruned(tokens, use_cache=False).logits.float()
    pruned.to("cpu")
    max_diff = float((expected - actual).abs().max())
    tolerance = VERIFY_TOLERANCE[pruned.dtype] * max(1.0, float(expected.abs().max()))
    if not max_diff <= tolerance:
        raise VerificationFailed(
            f"pruned model differs from the masked model by {max_diff:.3g} in logits (tolerance {tolerance:.3g})"
        )
    return max_diff


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
        report["plots"] = [str(path.relative_to(staging)) for path in write_plots(report, staging)]
        write_report(report, staging)
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
        progress("report", 1.0, f"written to {out_dir}")
        return report
    finally:
        shutil.rmtree(staging, ignore_errors=True)
