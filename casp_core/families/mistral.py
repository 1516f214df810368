"""Mistral: LLaMA with a sliding window on every layer."""

from transformers import PretrainedConfig

from casp_core.families.base import Family


class Mistral(Family):
    """Differs from LLaMA in its attention span and in its class's biases (none can be switched on)."""

    name = "Mistral"
    model_types = ("mistral",)
    # MistralConfig has no bias switches: mean-bias compensation's o_proj and down_proj biases have no place.
    plain_bias_switches = False
    # MistralConfig takes any head count with an explicit head_dim.
    plain_heads_divide_hidden = False

    def layer_types(self, model_config: PretrainedConfig) -> tuple[int | None, list[str]]:
        """Mistral's modeling slides on every layer when the config has a window, and ignores `layer_types`."""
        window = getattr(model_config, "sliding_window", None)
        return window, ["sliding_attention" if window else "full_attention"] * model_config.num_hidden_layers


MISTRAL = Mistral()
