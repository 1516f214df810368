"""The settings a job names reach the method: allocation from the sensitivities with alpha and r_max, the seed."""

import pytest
import torch

from casp_core.method.allocation import allocate_ratios, layer_sensitivities
from casp_core.method.calibration import CalibrationPlan, calibration_windows
from casp_core.method.prune import prune
from casp_core.model import decoder_layers
from casp_core.run import Run
from tests.conftest import small_config

RATIO, ALPHA, R_MAX = 0.4, 2.0, 0.6


def test_gradient_allocation_follows_the_sensitivities_alpha_and_r_max(stories):
    model, tokenizer = stories
    config = small_config(RATIO, alpha=ALPHA, r_max=R_MAX)
    config.calibration.n_samples, config.calibration.seq_len = 8, 64
    windows = calibration_windows(tokenizer, CalibrationPlan.of(config, model.config))
    sensitivities = layer_sensitivities(
        model,
        windows,
        batch_size=config.calibration.batch_size,
        device=torch.device("cpu"),
        run=Run(),
    )
    expected = allocate_ratios(sensitivities, RATIO, ALPHA, R_MAX)
    # The settings are chosen so that each of them changes the allocation here.
    assert expected != pytest.approx(allocate_ratios(sensitivities, RATIO, 1.0, R_MAX), abs=1e-3)
    assert max(allocate_ratios(sensitivities, RATIO, ALPHA, 1.0)) > R_MAX + 1e-3
    assert max(expected) == pytest.approx(R_MAX)

    result = prune(model, tokenizer, config, windows=windows)
    assert [layer.sensitivity for layer in result.layers] == pytest.approx(sensitivities, rel=1e-9)
    assert [layer.ratio for layer in result.layers] == pytest.approx(expected, abs=1e-12)
    # No layer loses more than r_max of its heads or of its channels, even where r_l * units rounds up past it.
    for layer in result.layers:
        assert len(layer.pruned_heads) <= int(R_MAX * 8), layer.index
        assert len(layer.pruned_channels) <= int(R_MAX * 172), layer.index


def test_given_sensitivities_are_used_instead_of_measured_ones(stories):
    """The bench measures S_l once per model and passes them: prune must allocate from those, not its own."""
    model, tokenizer = stories
    config = small_config(RATIO, alpha=ALPHA)
    given = [0.9 ** (5 - i) for i in range(len(decoder_layers(model)))]  # rising with depth, unlike the model's
    result = prune(model, tokenizer, config, sensitivities=given)
    assert [layer.sensitivity for layer in result.layers] == given
    assert [layer.ratio for layer in result.layers] == pytest.approx(allocate_ratios(given, RATIO, ALPHA, 0.9))


def test_the_calibration_seed_picks_the_windows(stories):
    model, tokenizer = stories
    config = small_config(0.3)
    first = calibration_windows(tokenizer, CalibrationPlan.of(config, model.config))
    assert torch.equal(first, calibration_windows(tokenizer, CalibrationPlan.of(config, model.config)))
    config.calibration.seed = 1
    second = calibration_windows(tokenizer, CalibrationPlan.of(config, model.config))
    assert first.shape == second.shape == (16, 128)
    assert not torch.equal(first, second)
