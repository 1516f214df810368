"""Qwen2 / Qwen2.5: LLaMA with biased q/k/v projections and sliding windows on some layers."""

from casp_core.families.base import Family


class Qwen2(Family):
    """What differs from LLaMA is all in settings the base reads from the model itself:
    - q/k/v carry biases, o_proj none: the pruned config's bias switches are read from the dense layer, and the
      kept rows' biases are cut with the rows;
    - sliding layers: Qwen2Config turns `use_sliding_window` and `max_window_layers` into `layer_types`, which the
      base follows; the pruned config states `layer_types` and drops those two settings.
    Its own class has no bias switches, so the uniform shape cannot hold mean-bias compensation."""

    name = "Qwen2"
    model_types = ("qwen2",)
    dense_only_keys = (*Family.dense_only_keys, "use_sliding_window", "max_window_layers")
    plain_bias_switches = False
    plain_heads_divide_hidden = False


QWEN2 = Qwen2()
