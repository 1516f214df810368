"""Phi-3 / Phi-4 (model_type phi3): LLaMA's units in fused projections, and partial rotary embeddings.

A Phi-3 decoder layer fuses q, k and v into one `qkv_proj` (rows: every query head's, then every key head's, then
every value head's) and gate and up into one `gate_up_proj` (rows: the gate's, then the up's). The units are
LLaMA's: a query head is head_dim rows of the query block and head_dim columns of o_proj; a key/value head is
head_dim rows of the key block and of the value block; an FFN channel is one row of each half of gate_up_proj
and one column of down_proj. `projections` hands the pipeline those blocks as row views of the fused weights, so
geometry, counting, budgets and calibration see a LLaMA layer; surgery cuts the kept rows out of each fused weight
in one gather, keeping it fused (casp_core/families/modeling/modeling_casp_phi3.py).
"""

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from casp_core.errors import UnsupportedExport
from casp_core.families.base import (
    Family,
    LayerProjections,
    RowSlice,
    kept_units,
    pruned_columns,
    pruned_rows,
    unit_rows,
)
from casp_core.families.modeling.modeling_casp_phi3 import CaspPhi3Config, CaspPhi3ForCausalLM
from casp_core.units import AttentionGeometry, LayerPruning

QKV, GATE_UP = "self_attn.qkv_proj", "mlp.gate_up_proj"


class Phi3(Family):
    """Differs from LLaMA in its fused projections, its rotary embedding (partial rotary, longrope) and its class:
    - `projections` are row views of qkv_proj and gate_up_proj (no copy), and `pruned_layer_tensors` gathers the
      kept rows of each fused weight in one index_select, so the pruned layer stays fused;
    - the per-layer class is CaspPhi3ForCausalLM (transformers' Phi3 classes with each layer's own counts);
    - Phi3Config accepts any head count with an explicit head_dim, but its rope check sizes longrope's factors
      from hidden_size // heads, so a longrope model keeps only the head counts that leave that size unchanged;
    - no projection has a bias, and Phi3Config has no bias switch: the uniform shape cannot hold mean-bias
      compensation;
    - GGUF: with full rotary embeddings and plain RoPE, the unfused layer is LLaMA's, which llama.cpp's deci
      architecture builds with per-layer counts; partial rotary (Phi-4-mini) and longrope (Phi-3.5, Phi-4-mini,
      the 128k Phi-3s) have no place there, and llama.cpp's own phi3 architecture sizes attention from
      hidden_size, so it cannot take pruned heads.
    """

    name = "Phi-3"
    model_types = ("phi3",)
    pruned_model_type = CaspPhi3Config.model_type
    pruned_model_class = CaspPhi3ForCausalLM
    projection_paths = {
        "q": QKV,
        "k": QKV,
        "v": QKV,
        "o": "self_attn.o_proj",
        "gate": GATE_UP,
        "up": GATE_UP,
        "down": "mlp.down_proj",
    }
    plain_bias_switches = False
    plain_heads_divide_hidden = False
    # LoRA adapts the fused modules: an adapter on qkv_proj adapts q, k and v together.
    lora_targets = {
        "q_proj": "qkv_proj",
        "k_proj": "qkv_proj",
        "v_proj": "qkv_proj",
        "o_proj": "o_proj",
        "gate_proj": "gate_up_proj",
        "up_proj": "gate_up_proj",
        "down_proj": "down_proj",
    }

    def projections(self, layer: nn.Module) -> LayerProjections:
        """q/k/v as row blocks of qkv_proj, gate/up as its halves of gate_up_proj: views, so what is written to
        them (compensation, recovery) is written to the fused weight. Phi-3's fused projections have no bias."""
        attention, mlp = layer.self_attn, layer.mlp
        kv_rows = attention.num_key_value_heads * attention.head_dim
        query_rows = attention.qkv_proj.out_features - 2 * kv_rows
        q, k, v = attention.qkv_proj.weight.split([query_rows, kv_rows, kv_rows])
        gate, up = mlp.gate_up_proj.weight.chunk(2)
        return LayerProjections(
            q=RowSlice(q),
            k=RowSlice(k),
            v=RowSlice(v),
            o=attention.o_proj,
            gate=RowSlice(gate),
            up=RowSlice(up),
            down=mlp.down_proj,
        )

    def layer_types(self, model_config: PretrainedConfig) -> tuple[int | None, list[str]]:
        """Phi-3's modeling slides on every layer when the config has a window (Phi-3-mini-4k: 2047)."""
        window = getattr(model_config, "sliding_window", None)
        return window, ["sliding_attention" if window else "full_attention"] * model_config.num_hidden_layers

    def pruned_config(
        self, model: PreTrainedModel, kv_maps: list[list[int]], widths: list[int], head_dim: int
    ) -> PretrainedConfig:
        """The dense settings (rope, window, ...), the head size stated, and per layer the counts; Phi3Config's
        own `sliding_window` already says where attention slides, and only o_proj and down_proj may carry a
        bias (mean-bias compensation)."""
        settings = {k: v for k, v in model.config.to_dict().items() if k not in self.dense_only_keys}
        parts = self.projections(model.model.layers[0])
        settings.update(
            head_dim=head_dim,
            attention_o_bias=parts.o.bias is not None,
            mlp_down_bias=parts.down.bias is not None,
            layer_kv_of_query=kv_maps,
            layer_num_kv_heads=[len(set(kv_map)) for kv_map in kv_maps],
            layer_intermediate_sizes=widths,
            architectures=[self.pruned_model_class.__name__],
        )
        return CaspPhi3Config(**settings)

    def pruned_layer_tensors(
        self, layer: nn.Module, geometry: AttentionGeometry, pruning: LayerPruning
    ) -> dict[str, torch.Tensor]:
        """The kept rows of each fused weight, still fused in Phi-3's order (query heads, key heads, value heads;
        gate channels, up channels) and gathered in one index_select each; o_proj's and down_proj's kept columns
        and the norms as the base cuts them."""
        attention, mlp = layer.self_attn, layer.mlp
        head_dim, width = geometry.head_dim, mlp.down_proj.in_features
        heads, kv_heads, channels = kept_units(geometry, pruning, width, attention.qkv_proj.weight.device)
        query_rows, kv_rows = geometry.num_heads * head_dim, geometry.num_kv_heads * head_dim
        kept_kv_rows = unit_rows(kv_heads, head_dim)
        qkv = torch.cat([unit_rows(heads, head_dim), query_rows + kept_kv_rows, query_rows + kv_rows + kept_kv_rows])
        gate_up = torch.cat([channels, width + channels])
        return {
            **pruned_rows(attention.qkv_proj, qkv, QKV),
            **pruned_columns(attention.o_proj, heads, head_dim, "self_attn.o_proj"),
            **pruned_rows(mlp.gate_up_proj, gate_up, GATE_UP),
            **pruned_columns(mlp.down_proj, channels, 1, "mlp.down_proj"),
            **self.whole_parameters(layer),
        }

    def allows_head_count(self, model_config: PretrainedConfig, heads: int) -> bool:
        """Phi3Config checks longrope's factors against (hidden_size // heads) * partial_rotary_factor / 2 rotary
        frequencies, whatever head_dim says: with factors, only head counts that keep that number."""
        rope = getattr(model_config, "rope_parameters", None) or {}
        if heads <= 0:
            return False
        if rope.get("short_factor") is None and rope.get("long_factor") is None:
            return True
        factor = rope.get("partial_rotary_factor", 1.0)
        rotary = int(model_config.hidden_size // heads * factor)
        return rotary // 2 == int(model_config.hidden_size // model_config.num_attention_heads * factor) // 2

    def unfused_rows(
        self, heads: int, kv_heads: int, ffn_width: int, head_dim: int
    ) -> dict[str, tuple[str, tuple[int, int]]]:
        """q, k and v are consecutive row blocks of qkv_proj; gate and up the halves of gate_up_proj."""
        q, kv = heads * head_dim, kv_heads * head_dim
        return {
            "self_attn.q_proj.weight": (f"{QKV}.weight", (0, q)),
            "self_attn.k_proj.weight": (f"{QKV}.weight", (q, q + kv)),
            "self_attn.v_proj.weight": (f"{QKV}.weight", (q + kv, q + 2 * kv)),
            "mlp.gate_proj.weight": (f"{GATE_UP}.weight", (0, ffn_width)),
            "mlp.up_proj.weight": (f"{GATE_UP}.weight", (ffn_width, 2 * ffn_width)),
        }

    def check_gguf(self, model_config: PretrainedConfig) -> None:
        """The deci architecture rotates whole heads with plain RoPE: partial rotary and longrope are refused by
        name; the rest as the base checks it."""
        rope = getattr(model_config, "rope_parameters", None) or {}
        if rope.get("partial_rotary_factor", 1.0) != 1.0 or rope.get("rope_type", "default") != "default":
            raise UnsupportedExport(
                f"GGUF export: {self.name} (model type {model_config.model_type!r}) with "
                f"partial_rotary_factor {rope.get('partial_rotary_factor', 1.0)} and RoPE type "
                f"{rope.get('rope_type', 'default')!r}: llama.cpp's deci architecture, the one that takes per-layer "
                "head counts, rotates whole heads with plain RoPE, and its phi3 architecture cannot take pruned "
                "heads; use the safetensors checkpoint"
            )
        super().check_gguf(model_config)


PHI3 = Phi3()
