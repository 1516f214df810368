"""`round_to`: auto's multiple per FFN width, the warning for explicit settings that forfeit the speedup, and the
pipeline keeping auto's multiples on a real model (ptbwiki-7M: 8 layers of 704 FFN channels, auto rounds to 8)."""

import pytest

from casp_core.budget import channel_counts
from casp_core.model import decoder_layers, load_model
from casp_core.prune import prune
from casp_core.rounding import auto_round_to, round_to_for, speed_warning
from tests.conftest import PTBWIKI, small_config


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
