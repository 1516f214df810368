"""The family interface, with LLaMA as the reference: a family subclasses `Family` and overrides only what differs.

A decoder layer has attention and a gated MLP. The units CASP prunes:
- query heads: `head_dim` consecutive rows of q_proj and the same columns of o_proj each; a key/value head
  (`head_dim` rows of k_proj and v_proj) goes when the last query head that reads it goes;
- FFN channels: one row of gate_proj and up_proj and one column of down_proj each.
Masking (casp_core.method.surgery.mask_layer), the calibration hooks and compensation work on o_proj and down_proj,
which are real modules in every family (`layer.self_attn.o_proj`, `layer.mlp.down_proj`). Every other access to the
projections goes through `Family.projections`, so a family that fuses them (q/k/v in one matrix) answers with row
views of its fused weights.

A family object is stateless: its methods take the transformers config, model or layer.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from casp_core.errors import InvalidConfig, UnsupportedExport, UnsupportedModel, VerificationFailed
from casp_core.families.modeling.modeling_casp_llama import CaspLlamaConfig, CaspLlamaForCausalLM
from casp_core.rounding import channel_counts
from casp_core.settings import LORA_TARGETS, MEAN_BIAS_COMPENSATION, UNIFORM_SHAPE, PruneSettings
from casp_core.units import AttentionGeometry, LayerPruning, kept_kv_heads

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Settings of the dense config that name its class or its files, not the pruned model's shape.
SOURCE_ONLY_KEYS = ("transformers_version", "_name_or_path")


@dataclass(frozen=True)
class RowSlice:
    """Some consecutive rows of a fused projection (a view of its weight, no copy), standing in for the nn.Linear
    a LLaMA-layout layer has in that place: what `Family.projections` returns for a fused family."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


@dataclass(frozen=True)
class ExpertStack:
    """One projection of every expert of a layer (gate, up or down), standing in for the one projection of the
    layer's FFN written as a single FFN: the experts' rows (gate, up) or input columns (down) one after another.
    `weights` are views of each expert's [out, in] weight; the counts are the stacked projection's."""

    weights: tuple[torch.Tensor, ...]
    stacked_rows: bool  # gate and up stack rows; down stacks input columns
    bias: None = None

    @property
    def parameters(self) -> int:
        return sum(weight.numel() for weight in self.weights)

    @property
    def in_features(self) -> int:
        return self.weights[0].shape[1] if self.stacked_rows else sum(w.shape[1] for w in self.weights)

    @property
    def out_features(self) -> int:
        return sum(w.shape[0] for w in self.weights) if self.stacked_rows else self.weights[0].shape[0]


Projection = nn.Linear | RowSlice | ExpertStack


@dataclass(frozen=True)
class GgufScales:
    """Factors the GGUF writer folds into the weights, for a family's multipliers that llama.cpp's llama and deci
    graphs do not apply: on the token embeddings, on q_proj's rows (the attention scale over llama.cpp's
    1/sqrt(head_dim)), on o_proj's and down_proj's outputs (before the residual add), and on the logits. All 1 for
    LLaMA."""

    embedding: float = 1.0
    query: float = 1.0
    sublayer_output: float = 1.0
    logits: float = 1.0


def projection_parameters(projection: Projection) -> int:
    """Its weights and bias."""
    if isinstance(projection, ExpertStack):
        return projection.parameters
    return projection.weight.numel() + (projection.bias.numel() if projection.bias is not None else 0)


@dataclass(frozen=True)
class LayerProjections:
    """The seven projections of a decoder layer, each `weight` [out, in] with an optional `bias`."""

    q: Projection
    k: Projection
    v: Projection
    o: nn.Linear
    gate: Projection
    up: Projection
    down: nn.Linear | ExpertStack  # a real module but in a mixture of experts

    @property
    def attention(self) -> tuple[Projection, ...]:
        return self.q, self.k, self.v, self.o

    @property
    def mlp(self) -> tuple[Projection, ...]:
        return self.gate, self.up, self.down


def pruned_rows(projection: Projection, rows: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    # Each gather is one index_select straight into a new tensor: one copy of the kept weights, not two. Rows
    # are gathered one at a time (contiguous: a memcpy each); torch's CPU index_select copies slices of 32k
    # elements or more one after another, and by blocks of rows that took several times as long as a copy.
    tensors = {f"{prefix}.weight": projection.weight.index_select(0, rows)}
    if projection.bias is not None:
        tensors[f"{prefix}.bias"] = projection.bias.index_select(0, rows)
    return tensors


def pruned_columns(linear: nn.Linear, units: torch.Tensor, unit_size: int, prefix: str) -> dict[str, torch.Tensor]:
    """The columns of the kept units, each unit `unit_size` consecutive columns (a head's, or one channel's);
    the bias whole. A head's columns are gathered as one block: one strided column at a time, o_proj's gather
    costs about half again a copy at 4096 x 4096, a block at a time about a copy."""
    weight = linear.weight.unflatten(1, (-1, unit_size)).index_select(1, units).flatten(1, 2)
    tensors = {f"{prefix}.weight": weight}
    if linear.bias is not None:
        tensors[f"{prefix}.bias"] = linear.bias.clone()
    return tensors


def unit_rows(units: torch.Tensor, unit_size: int) -> torch.Tensor:
    """The row numbers of these units, each `unit_size` consecutive rows."""
    return (units[:, None] * unit_size + torch.arange(unit_size, device=units.device)).flatten()


def kept_index(total: int, pruned: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The units not in `pruned`, as an index tensor built in torch: a Python list of thousands of ints costs
    milliseconds."""
    keep = torch.ones(total, dtype=torch.bool, device=device)
    keep[torch.tensor(pruned, dtype=torch.long, device=device)] = False
    return keep.nonzero().flatten()


class Family:
    """LLaMA (Llama 1/2/3/3.x, and any rope scaling transformers computes): the reference every family subclasses.

    Pruned, a model of this family is a `casp_llama` checkpoint (casp_core.families.modeling.modeling_casp_llama: each
    layer keeps its own heads and FFN width), or with `shape: uniform` the family's own class (LlamaForCausalLM).
    """

    name: ClassVar[str] = "Llama"
    # The dense model types this family serves (config.json's model_type).
    model_types: ClassVar[tuple[str, ...]] = ("llama",)
    # The per-layer checkpoint: its model_type and its model class (a self-contained modeling file, copied into
    # every checkpoint and named in its auto_map).
    pruned_model_type: ClassVar[str] = CaspLlamaConfig.model_type
    pruned_model_class: ClassVar[type[PreTrainedModel]] = CaspLlamaForCausalLM
    # False: only FFN channels are pruned, attention is kept whole (the allocation's ratio comes from the MLP).
    prunes_heads: ClassVar[bool] = True
    # True: the MLP is routed experts (families.moe.MixtureOfExperts), pruned by the experts' step of the loop.
    has_experts: ClassVar[bool] = False
    # Where each projection sits in a decoder layer, and the name its pruned rows and columns get.
    projection_paths: ClassVar[dict[str, str]] = {
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj",
        "up": "mlp.up_proj",
        "down": "mlp.down_proj",
    }
    # Settings of the dense config that the pruned config does not take (they describe the dense class or uniform
    # layers, or the pruned config states them its own way).
    dense_only_keys: ClassVar[tuple[str, ...]] = ("model_type", "architectures", "auto_map", *SOURCE_ONLY_KEYS)
    # The uniform shape, in the family's own class. LlamaConfig switches biases per block (`attention_bias`:
    # q/k/v/o, `mlp_bias`: gate/up/down), so it carries mean-bias compensation's o_proj and down_proj biases
    # beside zero q/k/v/gate/up ones; a class without such switches cannot, and the combination is refused.
    plain_bias_switches: ClassVar[bool] = True
    # LlamaConfig refuses a head count that does not divide hidden_size even when head_dim is set (its
    # validate_architecture, through which vLLM reads configs too).
    plain_heads_divide_hidden: ClassVar[bool] = True
    # The llama.cpp architecture a per-layer checkpoint of this family is written as (`deci` takes per-layer head
    # counts and FFN widths; a checkpoint whose layers are all alike is written as `llama`), or None where the
    # GGUF export is refused, `gguf_refusal` saying why.
    gguf: ClassVar[str | None] = "deci"
    gguf_refusal: ClassVar[str] = ""
    # The norms a decoder layer puts the hidden states through (LLaMA's before attention and before the MLP), and
    # whether q and k have norms of their own: each keeps its input and output for recovery's backward pass
    # (casp_core.method.placement.kept_per_token).
    hidden_norms: ClassVar[int] = 2
    qk_norms: ClassVar[bool] = False
    # Recovery's `target_modules` (LORA_TARGETS, LLaMA's names) -> the module names peft adapts in this family.
    lora_targets: ClassVar[dict[str, str]] = {name: name for name in LORA_TARGETS}
    # ... and the weights that are no nn.Linear's, which peft adapts as parameters (`target_parameters`) by name.
    lora_parameter_targets: ClassVar[dict[str, str]] = {}

    # ------------------------------------------------------------ what the family is and what it accepts

    def check_config(self, model_config: PretrainedConfig) -> None:
        """Refuse (UnsupportedModel), from the config alone, settings the pruned class cannot carry."""
        model_type = model_config.model_type
        if model_config.num_attention_heads % model_config.num_key_value_heads:
            raise UnsupportedModel(
                f"model type {model_type!r}: {model_config.num_attention_heads} attention heads cannot share "
                f"{model_config.num_key_value_heads} key/value heads in equal groups"
            )
        if getattr(model_config, "quantization_config", None) is not None:
            raise UnsupportedModel(
                f"model type {model_type!r}: quantized weights (quantization_config) cannot be pruned"
            )
        rope_type = (getattr(model_config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise UnsupportedModel(f"model type {model_type!r}: rope type {rope_type!r} is not supported")
        unknown = set(self.layer_types(model_config)[1]) - set(ATTENTION_LAYER_TYPES)
        if unknown:
            raise UnsupportedModel(
                f"model type {model_type!r}: attention layer types {sorted(unknown)} are not supported"
            )

    def check_settings(self, model_config: PretrainedConfig, settings: PruneSettings) -> None:
        """Refuse (InvalidConfig), from the config alone, pruning settings the family cannot be pruned with; the
        LLaMA-layout families take them all but whole-expert removal, having no experts."""
        if settings.moe.prune_experts:
            raise InvalidConfig(f"moe.prune_experts: {self.name} has no experts to remove (a dense model)")

    def prepare(self, model: PreTrainedModel) -> None:
        """Set the loaded model up for pruning (a mixture of experts: the experts' eager implementation)."""

    def layer_types(self, model_config: PretrainedConfig) -> tuple[int | None, list[str]]:
        """The sliding window (None when no layer slides) and, per layer, "full_attention" or
        "sliding_attention", as the family's own modeling reads them. Llama has no `layer_types` and attends
        fully; a config that states `layer_types` (Qwen2/3 compute them from their own settings, the pruned
        config stores them) is followed."""
        window = getattr(model_config, "sliding_window", None)
        layer_types = list(
            getattr(model_config, "layer_types", None) or ["full_attention"] * model_config.num_hidden_layers
        )
        return (window if "sliding_attention" in layer_types else None), layer_types

    # ------------------------------------------------------------ the units

    def projections(self, layer: nn.Module) -> LayerProjections:
        """The seven projections of a decoder layer (dense or pruned); LLaMA layout: the modules themselves."""
        return LayerProjections(**{part: layer.get_submodule(path) for part, path in self.projection_paths.items()})

    @torch.no_grad()
    def mask_channels(self, layer: nn.Module, channels: tuple[int, ...]) -> None:
        """Zero these FFN channels' input columns of down_proj, which removes their contribution exactly."""
        layer.mlp.down_proj.weight[:, list(channels)] = 0

    def channel_counts(
        self, layer: nn.Module, r_max: float, round_to: int | str, block: int | None, removed_experts: int = 0
    ) -> tuple[int, ...]:
        """The FFN channel counts the layer may prune (casp_core.rounding.channel_counts of its width);
        `removed_experts` is a mixture of experts' (a dense family's is always 0)."""
        return channel_counts(self.projections(layer).down.in_features, r_max, round_to, block)

    def uniform_channel_counts(
        self, layer: nn.Module, r_max: float, round_to: int | str, block: int | None, removed_experts: int = 0
    ) -> tuple[int, ...]:
        """The FFN channel counts the uniform shape may prune in each layer: the layer's own."""
        return self.channel_counts(layer, r_max, round_to, block, removed_experts)

    def mask_experts(self, layer: nn.Module, experts: tuple[int, ...]) -> None:
        """Take whole experts out of the layer's routing (a mixture of experts' `moe.prune_experts`)."""
        raise VerificationFailed(f"{self.name} has no experts to remove")

    def kept_width(self, layer: nn.Module, pruning: LayerPruning) -> int | tuple[int, ...]:
        """What the layer's FFN keeps: its width (a mixture of experts: each expert's)."""
        return self.projections(layer).down.in_features - len(set(pruning.pruned_channels))

    def lora_modules(self, target_modules: list[str]) -> list[str]:
        """The module names peft adapts for recovery's `target_modules`, each once, in their order."""
        return _each_once(self.lora_targets, target_modules)

    def lora_parameters(self, target_modules: list[str]) -> list[str]:
        """The parameter names peft adapts directly for recovery's `target_modules`, each once, in their order."""
        return _each_once(self.lora_parameter_targets, target_modules)

    def unfused_rows(
        self, heads: int, kv_heads: int, ffn_width: int, head_dim: int
    ) -> dict[str, tuple[str, tuple[int, int]]]:
        """Where a layer of these counts keeps LLaMA's projections inside fused weights: LLaMA's weight name in the
        layer ("self_attn.q_proj.weight", ...) -> (the fused weight's name, (first row, end row)). The GGUF writer
        reads LLaMA's tensors through it. LLaMA fuses nothing."""
        return {}

    # ------------------------------------------------------------ the per-layer checkpoint

    def pruned_config(
        self, model: PreTrainedModel, kv_maps: list[list[int]], widths: list[int], head_dim: int
    ) -> PretrainedConfig:
        """The per-layer checkpoint's config: the dense settings, and per layer the kept query heads' key/value
        map (`kv_maps[l][q]`: the kept key/value head query head q reads) and FFN width."""
        settings = {k: v for k, v in model.config.to_dict().items() if k not in self.dense_only_keys}
        settings["head_dim"] = head_dim
        # Read from the dense layer itself: the families differ in which projections carry a bias, and
        # mean-bias compensation gives o_proj and down_proj one.
        projections = self.projections(model.model.layers[0])
        sliding_window, layer_types = self.layer_types(model.config)
        settings.update(
            attention_qkv_bias=projections.q.bias is not None,
            attention_o_bias=projections.o.bias is not None,
            mlp_down_bias=projections.down.bias is not None,
            sliding_window=sliding_window,
            layer_types=layer_types,
            layer_kv_of_query=kv_maps,
            layer_num_kv_heads=[len(set(kv_map)) for kv_map in kv_maps],
            layer_intermediate_sizes=widths,
            casp=settings.get("casp"),
            architectures=[self.pruned_model_class.__name__],
        )
        return self.pruned_model_class.config_class(**settings)

    def pruned_layer_tensors(
        self, layer: nn.Module, geometry: AttentionGeometry, pruning: LayerPruning
    ) -> dict[str, torch.Tensor]:
        """The kept rows and columns of one dense layer's weights, named as in the pruned layer: q/k/v/gate/up
        rows and o/down columns through `projections`; every other parameter of the layer (the norms) whole."""
        projections = self.projections(layer)
        heads, kv_heads, channels = kept_units(
            geometry, pruning, projections.down.in_features, projections.q.weight.device
        )
        head_rows, kv_rows = unit_rows(heads, geometry.head_dim), unit_rows(kv_heads, geometry.head_dim)
        paths = self.projection_paths
        tensors = {
            **pruned_rows(projections.q, head_rows, paths["q"]),
            **pruned_rows(projections.k, kv_rows, paths["k"]),
            **pruned_rows(projections.v, kv_rows, paths["v"]),
            **pruned_columns(projections.o, heads, geometry.head_dim, paths["o"]),
            **pruned_rows(projections.gate, channels, paths["gate"]),
            **pruned_rows(projections.up, channels, paths["up"]),
            **pruned_columns(projections.down, channels, 1, paths["down"]),
        }
        return tensors | self.whole_parameters(layer)

    def whole_parameters(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        """Copies of the layer's parameters outside its projections (the norms), which pruning keeps whole."""
        cut = tuple(f"{path}." for path in self.projection_paths.values())
        return {name: p.detach().clone() for name, p in layer.named_parameters() if not name.startswith(cut)}

    # ------------------------------------------------------------ the uniform shape: the family's own class

    def check_plain_shape(self, model_config: PretrainedConfig, settings: PruneSettings) -> None:
        """Refuse (InvalidConfig), from the config alone, a uniform-shape job whose result the family's own class
        cannot hold."""
        if settings.shape != UNIFORM_SHAPE or settings.compensation != MEAN_BIAS_COMPENSATION:
            return
        if not self.plain_bias_switches:
            family = (model_config.architectures or [model_config.model_type])[0]
            raise InvalidConfig(
                f"compensation: bias puts a bias on o_proj and down_proj, which {family} has not, so shape uniform "
                "cannot save it as a plain checkpoint; use shape per_layer or another compensation"
            )

    def allows_head_count(self, model_config: PretrainedConfig, heads: int) -> bool:
        """Whether the family's config accepts `heads` query heads."""
        return heads > 0 and (not self.plain_heads_divide_hidden or model_config.hidden_size % heads == 0)

    def plain_config(
        self,
        model_config: PretrainedConfig,
        *,
        heads: int,
        kv_heads: int,
        ffn_width: int,
        head_dim: int,
        attention_bias: bool,
        mlp_bias: bool,
    ) -> PretrainedConfig:
        """The dense config with the pruned counts: same class, so the same model_type and architectures."""
        settings = {k: v for k, v in model_config.to_dict().items() if k not in SOURCE_ONLY_KEYS}
        settings.update(
            num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=ffn_width, head_dim=head_dim
        )
        if self.plain_bias_switches:
            settings.update(attention_bias=attention_bias, mlp_bias=mlp_bias)
        return type(model_config)(**settings)

    # ------------------------------------------------------------ exports

    def plain_layer_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`pruned_layer_tensors`' tensors as the family's own class names them (the same for LLaMA)."""
        return tensors

    def check_gguf(self, model_config: PretrainedConfig) -> None:
        """Refuse (UnsupportedExport), from the config alone, a GGUF export of this family or of settings the
        GGUF writer (casp_core.artifacts.gguf.writer) cannot write."""
        if self.gguf is None:
            raise UnsupportedExport(
                f"GGUF export: {self.name} (model type {model_config.model_type!r}): {self.gguf_refusal}"
            )
        activation = getattr(model_config, "hidden_act", "silu")
        if activation != "silu":
            raise UnsupportedExport(
                f"GGUF export: activation {activation!r} of model type {model_config.model_type!r} "
                "(llama.cpp's llama and deci use silu)"
            )
        rope = getattr(model_config, "rope_parameters", None) or {}
        if "full_attention" in rope:  # per layer type; the deci graph has one
            rope = rope["full_attention"]
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedExport(
                f"GGUF export: model type {model_config.model_type!r} uses RoPE type {rope_type!r} with scaling, which "
                "the GGUF writer does not write"
            )
        if getattr(model_config, "qk_norm", False):
            raise UnsupportedExport(
                f"GGUF export: model type {model_config.model_type!r} has per-head q/k norms, which llama.cpp's deci "
                "architecture does not apply"
            )

    def gguf_scales(self, model_config: PretrainedConfig) -> GgufScales:
        """What the GGUF writer multiplies into the weights so that llama.cpp computes what this family's own
        modeling computes; LLaMA's graph is llama.cpp's, so nothing."""
        return GgufScales()


def kept_units(
    geometry: AttentionGeometry, pruning: LayerPruning, ffn_width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept query heads, key/value heads and FFN channels of one layer, as index tensors on `device`."""
    heads = kept_index(geometry.num_heads, pruning.pruned_heads, device)
    kv_heads = torch.tensor(kept_kv_heads(geometry, pruning.pruned_heads), dtype=torch.long, device=device)
    return heads, kv_heads, kept_index(ffn_width, pruning.pruned_channels, device)


def _each_once(targets: dict[str, str], target_modules: list[str]) -> list[str]:
    """What `targets` maps `target_modules` to, each once, in their order (names it has no entry for left out)."""
    return list(dict.fromkeys(targets[name] for name in target_modules if name in targets))
