"""`round_to`: auto's multiple per FFN width, the warning for explicit settings that forfeit the speedup, and the
pipeline keeping auto's multiples on a real model (ptbwiki-7M: 8 layers of 704 FFN channels, auto rounds to 8)."""

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from casp_core.artifacts.gguf.types import FLOAT_TYPES
from casp_core.method.budget import AllocationPlan, plan_budget, plan_uniform_shape
from casp_core.method.prune import prune
from casp_core.model import decoder_layers, load_model
from casp_core.rounding import (
    BLOCK_32_TYPES,
    K_QUANTS,
    aligned_heads,
    auto_round_to,
    block_of,
    channel_counts,
    fallback_warning,
    head_multiple,
    round_to_for,
    speed_warning,
)
from casp_core.settings import GGUF_TYPES
from tests.conftest import PTBWIKI, STORIES, small_config


@pytest.mark.parametrize(
    ("width", "expected"),
    [(172, 1), (511, 1), (512, 8), (704, 8), (1024, 16), (1536, 16), (2752, 32), (4096, 64), (11008, 64)],
)
def test_auto_is_the_largest_power_of_two_up_to_64_within_a_64th_of_the_width(width: int, expected: int) -> None:
    assert auto_round_to(width) == expected
    assert round_to_for(width, "auto") == expected and round_to_for(width, 3) == 3


def test_auto_channel_counts_keep_multiples_and_step_by_one_unit() -> None:
    counts = channel_counts(4096, 0.9, "auto")
    assert all((4096 - count) % 64 == 0 for count in counts)
    assert counts == tuple(range(0, 3649, 64))  # 3648 = the most within r_max that keeps a multiple of 64


def test_an_explicit_round_to_that_leaves_slow_widths_warns_once_naming_the_multiple() -> None:
    warning = speed_warning([704] * 8, 1)
    assert warning is not None and warning.startswith("round_to = 1 keeps FFN widths that are not multiples of 8")
    assert "704 channels" in warning and "\n" not in warning
    assert speed_warning([704, 4096], 8) is not None and "multiples of 64 on layers of 4096" in speed_warning(
        [704, 4096], 8
    )
    # auto, a multiple of auto's choice, or a model too narrow for any kernel to care: no warning.
    assert speed_warning([4096] * 4, "auto") is None
    assert speed_warning([704] * 8, 16) is None
    assert speed_warning([172] * 5, 1) is None


def test_the_pipeline_keeps_autos_multiples_and_reaches_the_ratio() -> None:
    model, tokenizer = load_model(str(PTBWIKI))
    calibration = {"dataset": "wikitext2:validation", "n_samples": 2, "seq_len": 32}
    # The budget does not depend on how units are chosen: the fastest choice and no compensation will do.
    config = small_config(0.3, calibration=calibration, solver="diagonal", compensation="none", allocation="uniform")
    result = prune(model, tokenizer, config)
    widths = [layer.mlp.down_proj.in_features for layer in decoder_layers(result.model)]
    assert all(width % 8 == 0 for width in widths) and min(widths) < 704
    # Within half a rounding unit (8 channels of one layer) of the target.
    unit = 8 * 3 * 256
    assert abs(result.params_dense - result.params_pruned - 0.3 * result.params_dense) <= unit / 2


# ---------------------------------------------------------------- widths for llama.cpp's quantizer (issue 22 item 2)


@pytest.mark.parametrize(
    ("width", "block", "expected"),
    [(704, 256, 256), (512, 256, 256), (511, 256, 1), (4096, 256, 256), (172, 32, 32), (64, 32, 32), (63, 32, 1)],
)
def test_auto_rounds_to_the_quantizers_block_where_the_layer_is_twice_as_wide(width, block, expected) -> None:
    assert round_to_for(width, "auto", block) == expected
    assert round_to_for(width, 8, block) == 8  # an explicit round_to stays what it says
    counts = channel_counts(width, 0.9, "auto", block)
    assert all((width - count) % expected == 0 and width - count >= expected for count in counts)


@pytest.mark.parametrize(
    ("block", "head_dim", "multiple"),
    [(256, 128, 2), (256, 64, 4), (256, 32, 8), (32, 8, 4), (32, 64, 1), (None, 8, 1)],
)
def test_the_head_multiple_makes_o_proj_rows_whole_blocks(block, head_dim, multiple) -> None:
    assert head_multiple(block, head_dim) == multiple


@pytest.mark.parametrize(
    ("exact", "pruned", "num_heads", "multiple", "cap", "expected"),
    [
        (9.6, 10, 32, 2, 28, 10),  # 22 kept: already even
        (10.6, 11, 32, 2, 28, 10),  # 21 kept: 10 pruned is nearer the exact 10.6 than 12
        (11.4, 11, 32, 2, 28, 12),  # ... and 12 nearer 11.4
        (11.0, 11, 32, 2, 28, 10),  # a tie keeps more heads
        (2.4, 2, 8, 4, 7, 2),  # 6 kept of 8, head multiple 4: two heads away either way, o_proj falls back
        (3.2, 3, 8, 4, 7, 4),  # 5 kept: one head more pruned leaves 4
        (5.0, 5, 8, 4, 5, 4),  # 3 kept: 4 kept is one head back
        (2.6, 3, 8, 4, 3, 3),  # 5 kept: 4 kept would prune 4, above the cap (r_max): o_proj falls back
        (0.0, 0, 8, 8, 7, 0),  # nothing pruned, all 8 kept: whole blocks already
    ],
)
def test_head_counts_move_by_one_at_most_to_whole_blocks(exact, pruned, num_heads, multiple, cap, expected) -> None:
    assert aligned_heads(exact, pruned, num_heads, multiple, cap) == expected


def test_an_explicit_round_to_that_forces_fallbacks_warns_naming_the_block() -> None:
    warning = fallback_warning([704] * 8, 8, "q4_k_m", 256)
    assert warning is not None and "\n" not in warning
    assert warning.startswith("round_to = 8 keeps FFN widths that are not multiples of 256, the block of q4_k_m")
    assert "round_to auto, the default, picks 256 on layers of 704 channels" in warning
    assert fallback_warning([704] * 8, "auto", "q4_k_m", 256) is None
    assert fallback_warning([704] * 8, 512, "q4_k_m", 256) is None  # whole blocks
    assert fallback_warning([704] * 8, 8, "f16", None) is None  # no quantizer
    assert fallback_warning([172] * 5, 1, "q4_k_m", 256) is None  # too narrow for the block: auto would not round
    assert fallback_warning([172] * 5, 1, "q8_0", 32) is not None


def test_every_gguf_type_has_a_block_or_is_a_float_type() -> None:
    assert set(GGUF_TYPES) == {*FLOAT_TYPES, *K_QUANTS, *BLOCK_32_TYPES}
    assert {block_of(name) for name in K_QUANTS} == {256}
    assert {block_of(name) for name in BLOCK_32_TYPES} == {32}


def test_the_budget_plans_whole_blocks_and_moves_heads_by_one_for_a_quantized_gguf() -> None:
    model, _ = load_model(str(STORIES))  # 8 heads of 8 over 4 key/value heads, FFN 172, hidden 64
    ratios = [0.0, 0.3, 0.4, 0.5, 0.6]
    plain = plan_budget(model, ratios, AllocationPlan.of(small_config(0.3)))
    plan = plan_budget(model, ratios, AllocationPlan.of(small_config(0.3, export=["gguf"], gguf_type="q8_0")))
    # Heads x 8 must be a multiple of 32: 4 or 8 heads kept. 2.4 -> 2 pruned keeps 6 (two heads from 4 or 8: left);
    # 3.2 -> 3 keeps 5 (4 is one away: moved); 4 keeps 4; 4.8 -> 5 keeps 3 (moved back to 4 kept).
    assert [layer.heads for layer in plain.layers] == [0, 2, 3, 4, 5]
    assert [layer.heads for layer in plan.layers] == [0, 2, 4, 4, 4]
    # FFN widths in whole blocks of 32, the spared layer too (172 -> 160); without the GGUF it keeps all 172.
    assert plain.layers[0].channel_counts == (0,) and plan.layers[0].channel_counts == (12,)
    assert all((172 - count) % 32 == 0 for layer in plan.layers for count in layer.channel_counts)
    # The uniform shape's channels too: ptbwiki-7M's 704 keep 512 or 256.
    model, _ = load_model(str(PTBWIKI))
    uniform = small_config(0.3, shape="uniform", allocation="uniform", export=["gguf"], gguf_type="q4_k_m")
    assert (704 - plan_uniform_shape(model, AllocationPlan.of(uniform)).pruned_channels) in (256, 512)


def test_the_uniform_shape_takes_the_head_count_whose_o_proj_rows_are_whole_blocks() -> None:
    """4 heads of 128 (a LLaMA shape; the fixtures' head_dim of 8 and 32 leave no one-head move): at 0.3, 1.2 heads
    go. Without a quantized GGUF the rule keeps 3, which LlamaConfig refuses (it must divide 512), and the tie
    between 2 and 4 goes to 4; for q4_k_m, 3 x 128 is no multiple of 256, so 2 go (nearer 1.2 than none)."""
    config = LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2
    )
    model = LlamaForCausalLM(config)
    settings = {"shape": "uniform", "allocation": "uniform"}
    plain = plan_uniform_shape(model, AllocationPlan.of(small_config(0.3, **settings)))
    quantized = plan_uniform_shape(
        model, AllocationPlan.of(small_config(0.3, **settings, export=["gguf"], gguf_type="q4_k_m"))
    )
    assert plain.kv_heads * plain.heads_per_kv == 4
    assert quantized.kv_heads * quantized.heads_per_kv == 2
    assert (1024 - quantized.pruned_channels) % 256 == 0
