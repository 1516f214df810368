"""Quantized checkpoints for vLLM: the job's saved checkpoint rewritten in compressed-tensors format.

The schemes are compressed-tensors' own presets, with weights rounded to nearest: each weight's scales come from its
own extremes (symmetric, so no zero points), and activations, where a scheme quantizes them, get their scale per
token at run time. None of them needs calibration data. (llmcompressor's GPTQ and AWQ would, but llmcompressor
0.14 pins transformers 5.15 to 5.17 and compressed-tensors 0.19, older than the ones this project runs.)

- w8a8_int8 (preset W8A8): int8 weights, one scale per output channel; int8 activations, one scale per token.
- fp8_dynamic (preset FP8_DYNAMIC): the same with FP8 (e4m3) weights and activations.
- w4a16 (preset W4A16): int4 weights packed eight to an int32, one scale per group of 128 input columns, or of 64
  or 32 in a weight whose rows 128 does not divide (the group sizes vLLM's Marlin kernels take); 16-bit activations.

Every decoder projection is quantized; the embeddings, the norms and lm_head stay as they are (lm_head is in the
config's `ignore`, as vLLM expects of a linear layer no scheme covers). The checkpoint keeps its class: a uniform
shape's LlamaForCausalLM (...) is what `vllm serve` reads; a per-layer shape's CaspLlamaForCausalLM loads in
transformers with trust_remote_code, through the same compressed-tensors loader.
"""

import re
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.base import compress_module
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationStatus,
    QuantizationStrategy,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.artifacts.compressed_tensors.size import GROUP_SIZES
from casp_core.errors import InvalidConfig
from casp_core.eval.evaluate import EvaluationPlan, evaluate
from casp_core.model import decoder_layers
from casp_core.rounding import round_to_for
from casp_core.run import Run
from casp_core.settings import PruneSettings

PRESETS = {"w8a8_int8": "W8A8", "fp8_dynamic": "FP8_DYNAMIC", "w4a16": "W4A16"}
GROUPED = "w4a16"
LM_HEAD = "lm_head"
LAYER_PREFIX = re.compile(r"^.*?\.\d+\.")  # `model.layers.3.` of `model.layers.3.mlp.down_proj`
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")


@dataclass(frozen=True)
class QuantizationInput:
    """What the stage needs: the published model (quantized in place, so it is spent afterwards), the folder its
    checkpoint was saved in (rewritten there), and the plan its perplexity is measured by."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    checkpoint: Path
    scheme: str
    plan: EvaluationPlan


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """What the stage wrote and measured."""

    scheme: str  # the setting's name
    preset: str  # compressed-tensors' name for it
    format: str  # how the weights are stored: int-quantized, float-quantized or pack-quantized
    group_sizes: dict[str, int]  # w4a16: weights per group size ("128": 42, ...); {} for the others
    quantized_weights: int  # linear layers quantized
    weight_bytes_before: int  # the safetensors files, unquantized
    weight_bytes_after: int
    perplexity: dict[str, float]  # by text name, the quantized checkpoint loaded back with from_pretrained

    def summary(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme,
            "preset": self.preset,
            "format": self.format,
            "group_sizes": self.group_sizes,
            "quantized_weights": self.quantized_weights,
            "weight_bytes": {"unquantized": self.weight_bytes_before, "quantized": self.weight_bytes_after},
        }


def check_quantization(model_config: PretrainedConfig, settings: PruneSettings) -> None:
    """Refuse, from the dense config and the settings alone, a scheme the pruned model's weights could not take:
    w4a16 needs every row (a projection's input width) to be a multiple of its smallest group, 32. Rows are
    hidden_size (q/k/v, gate/up), kept heads x head_dim (o_proj) and kept FFN channels (down_proj), a multiple of
    round_to in a pruned layer and the dense width in one left whole."""
    if settings.quantization != GROUPED:
        return
    group = GROUP_SIZES[-1]
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    width = model_config.intermediate_size
    for row, what in ((model_config.hidden_size, "hidden size"), (head_dim, "head_dim"), (width, "FFN width")):
        if row % group:
            raise InvalidConfig(
                f"quantization: w4a16 packs each row in groups of at least {group} columns, and this model's "
                f"{what} is {row}, not a multiple of {group}; use w8a8_int8 (one scale per channel, any width)"
            )
    unit = round_to_for(width, settings.round_to)
    if unit % group:
        closest = max(group, round(unit / group) * group)
        how = f"round_to {settings.round_to}" if settings.round_to != "auto" else f"round_to auto ({unit} here)"
        raise InvalidConfig(
            f"round_to: w4a16 packs each row in groups of at least {group} columns, and {how} keeps FFN widths "
            f"that are not multiples of {group}; use round_to {closest}"
        )


def quantize(stage: QuantizationInput, run: Run) -> QuantizedCheckpoint:
    """The stage: the model quantized and saved over its checkpoint, then loaded back as a user would and its
    perplexity measured."""
    run.report("quantization", 0.0, f"quantizing the checkpoint ({stage.scheme})")
    before = weight_bytes(stage.checkpoint)
    compressor, quantized, group_sizes = quantize_weights(stage.model, stage.scheme)
    for pattern in WEIGHT_FILES:  # a sharded checkpoint's old shards would otherwise stay beside the new ones
        for path in stage.checkpoint.glob(pattern):
            path.unlink()
    save_pruned(stage.model, stage.tokenizer, stage.checkpoint)
    compressor.update_config(str(stage.checkpoint))
    run.report("quantization", 0.5, "measuring the quantized checkpoint")
    run.check_cancelled()
    model, _ = load_pruned(stage.checkpoint)
    perplexity_only = replace(stage.plan, zero_shot=[], efficiency=None)
    # Its evaluation reports as the second half of this stage, not as another evaluation stage.
    within_stage = replace(
        run, progress=lambda _, fraction, message="": run.report("quantization", 0.5 + fraction / 2, message)
    )
    figures = evaluate(model, stage.tokenizer, perplexity_only, within_stage)
    run.report("quantization", 1.0, "quantized checkpoint written")
    return QuantizedCheckpoint(
        scheme=stage.scheme,
        preset=PRESETS[stage.scheme],
        format=CompressionFormat(compressor.quantization_config.format).value,
        group_sizes={str(size): count for size, count in sorted(group_sizes.items(), reverse=True)},
        quantized_weights=quantized,
        weight_bytes_before=before,
        weight_bytes_after=weight_bytes(stage.checkpoint),
        perplexity=figures.perplexity,
    )


def quantized_linears(model: PreTrainedModel) -> dict[str, torch.nn.Linear]:
    """Every decoder projection by its module name, those with no weights (a layer that lost every head) left out."""
    prefix = {id(layer): name for name, layer in model.named_modules()}
    return {
        f"{prefix[id(layer)]}.{name}": module
        for layer in decoder_layers(model)
        for name, module in layer.named_modules()
        if isinstance(module, torch.nn.Linear) and module.weight.numel()
    }


def quantization_config(model: PreTrainedModel, scheme: str) -> tuple[QuantizationConfig, dict[int, int]]:
    """The config.json entry: one config group for every layer with a single scheme (w4a16: one per group size,
    each naming its weights), lm_head ignored; and, for w4a16, how many weights take each group size."""
    linears = quantized_linears(model)
    if scheme != GROUPED:
        groups = {"group_0": preset_name_to_scheme(PRESETS[scheme], targets=["Linear"])}
        sizes: dict[int, int] = {}
    else:
        by_size: dict[int, list[str]] = defaultdict(list)
        for name, module in linears.items():
            by_size[group_size(module.in_features)].append(name)
        groups = {}
        for index, (size, names) in enumerate(sorted(by_size.items(), reverse=True)):
            group = preset_name_to_scheme(PRESETS[scheme], targets=targets(names, linears))
            group.weights = group.weights.model_copy(update={"group_size": size})
            groups[f"group_{index}"] = group
        sizes = {size: len(names) for size, names in by_size.items()}
    ignore = [LM_HEAD] + [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not module.weight.numel()
    ]
    return QuantizationConfig(config_groups=groups, ignore=ignore), sizes


def group_size(row: int) -> int:
    """The largest group of GROUP_SIZES that divides a row of `row` columns (check_quantization guarantees one)."""
    return next(size for size in GROUP_SIZES if row % size == 0)


def targets(names: list[str], linears: dict[str, torch.nn.Linear]) -> list[str]:
    """`names` as config targets: a projection whose weights all share this group size is one regular expression
    (`re:.*\\.mlp\\.down_proj$`), the others are named one by one."""
    chosen = set(names)
    by_projection: dict[str, list[str]] = defaultdict(list)
    for name in linears:
        by_projection[LAYER_PREFIX.sub("", name)].append(name)
    result = []
    for projection, members in by_projection.items():
        if set(members) <= chosen:
            result.append(f"re:.*\\.{re.escape(projection)}$")
        else:
            result += [name for name in members if name in chosen]
    return result


def quantize_weights(model: PreTrainedModel, scheme: str) -> tuple[ModelCompressor, int, dict[int, int]]:
    """Scales from each weight's extremes (round to nearest), then the weights compressed in place: the compressor
    whose config goes into config.json, how many weights it quantized, and w4a16's weights per group size."""
    config, group_sizes = quantization_config(model, scheme)
    apply_quantization_config(model, config, show_progress=False)
    modules = [module for module in model.modules() if getattr(module, "quantization_scheme", None) is not None]
    for module in modules:
        scale, zero_point = weight_qparams(module.weight.detach(), module.quantization_scheme.weights)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    # ModelCompressor.compress_model does this too, behind a progress bar on stderr.
    for module in modules:
        compress_module(module)
    compressor.quantization_config.quantization_status = QuantizationStatus.COMPRESSED
    return compressor, len(modules), group_sizes


def weight_qparams(weight: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of one weight from its minimum and maximum per output channel, or per group."""
    if args.strategy == QuantizationStrategy.GROUP:
        grouped = weight.unflatten(-1, (-1, args.group_size))
        return calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    return calculate_qparams(weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True), args)


def weight_bytes(checkpoint: Path) -> int:
    return sum(path.stat().st_size for path in checkpoint.glob("*.safetensors"))
