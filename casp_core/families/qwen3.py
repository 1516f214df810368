"""Qwen3: Qwen2's layout without the q/k/v biases, plus per-head q/k norms and a head_dim of its own."""

from transformers import PretrainedConfig, PreTrainedModel

from casp_core.families.qwen2 import Qwen2


class Qwen3(Qwen2):
    """Differs from Qwen2 in its query and key norms: one RMSNorm over head_dim for all query heads, one for all key
    heads. They are shared by the heads, so removing heads leaves them whole (the base carries every norm of the
    layer whole); the pruned class applies them where `qk_norm` says so. llama.cpp's deci architecture has no such
    norms, so the GGUF export is refused."""

    name = "Qwen3"
    model_types = ("qwen3",)
    qk_norms = True
    gguf = None
    gguf_refusal = (
        "its per-head q/k norms have no place in llama.cpp's deci architecture, the one that takes per-layer head "
        "counts; use the safetensors checkpoint"
    )

    def pruned_config(
        self, model: PreTrainedModel, kv_maps: list[list[int]], widths: list[int], head_dim: int
    ) -> PretrainedConfig:
        config = super().pruned_config(model, kv_maps, widths, head_dim)
        config.qk_norm = True
        return config


QWEN3 = Qwen3()
