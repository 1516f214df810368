"""alpha "auto": each temperature of the grid scored by the held-out loss of the model it prunes, the lowest
chosen, the model left as it was; the choice in the result, the report and the progress events."""

import copy

import pytest
import torch

from casp_core.errors import InvalidConfig
from casp_core.method.allocation import allocate_ratios, layer_sensitivities
from casp_core.method.budget import AllocationPlan
from casp_core.method.calibration import CalibrationPlan, calibration_windows
from casp_core.method.layer import LayerPlan
from casp_core.method.prune import prune
from casp_core.method.temperature import ALPHA_GRID, choose_alpha
from casp_core.report.build import build_report, pruning_section, render_markdown
from casp_core.run import Run
from casp_core.settings import CalibrationConfig
from tests.conftest import small_config
from tests.core.full_logits import summed_sequence_losses

CPU = torch.device("cpu")


@pytest.fixture
def calibrated(stories):
    model, tokenizer = stories
    config = small_config(0.5, alpha="auto")
    windows = calibration_windows(tokenizer, CalibrationPlan.of(config, model.config))
    sensitivities = layer_sensitivities(model, windows, batch_size=8, device=CPU, run=Run())
    return model, tokenizer, config, windows, sensitivities


def masked_model_loss(model, windows: torch.Tensor) -> float:
    with torch.no_grad():
        return float(summed_sequence_losses(model(windows, use_cache=False).logits.float(), windows)) / len(windows)


def test_each_score_is_the_held_out_loss_of_that_temperatures_pruning(calibrated):
    model, tokenizer, config, windows, sensitivities = calibrated
    before = copy.deepcopy(model.state_dict())
    choice = choose_alpha(
        model,
        windows,
        sensitivities,
        AllocationPlan.of(config),
        LayerPlan.of(config),
        config.calibration.batch_size,
        CPU,
        Run(),
    )
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())  # left as it was
    assert "model.layers.0.mlp.down_proj.bias" not in model.state_dict()

    assert list(choice.held_out_loss) == list(ALPHA_GRID)
    assert choice.alpha == min(choice.held_out_loss, key=choice.held_out_loss.__getitem__)
    assert (choice.held_out_windows, choice.statistics_windows) == (4, 12)
    assert len(set(choice.held_out_loss.values())) == len(ALPHA_GRID)  # the temperatures prune differently
    # The same candidates by the pipeline itself: statistics from the dense model on the other windows, the
    # configured compensation, masked in place; its loss on the held-out windows is the candidate's score.
    statistics = CalibrationConfig(**{**config.calibration.model_dump(), "mode": "dense"})
    for alpha in (0.0, 2.0):
        masked = copy.deepcopy(model)
        prune(
            masked,
            tokenizer,
            config.model_copy(update={"alpha": alpha, "calibration": statistics}),
            windows=windows[:12],
            sensitivities=sensitivities,
        )
        assert masked_model_loss(masked, windows[12:]) == pytest.approx(choice.held_out_loss[alpha], rel=1e-5)


def test_auto_prunes_with_the_chosen_temperature_and_says_so(calibrated):
    model, tokenizer, config, windows, sensitivities = calibrated
    events = []
    result = prune(
        model,
        tokenizer,
        config,
        Run(progress=lambda stage, fraction, message="": events.append((stage, message))),
        windows=windows,
        sensitivities=sensitivities,
    )
    choice = result.temperature
    assert choice is not None and choice.alpha in ALPHA_GRID
    expected = allocate_ratios(sensitivities, 0.5, choice.alpha, config.r_max)
    assert [layer.ratio for layer in result.layers] == pytest.approx(expected)
    assert ("temperature", choice.message()) in events
    assert choice.message().startswith(f"alpha auto: {choice.alpha:g}, the lowest held-out loss of 0: ")

    report = build_report(
        model_name="stories260K",
        config=config,
        pruning=pruning_section(result),
        perplexity={},
        device="cpu",
        dtype="float32",
    )
    assert report["settings"]["alpha"] == "auto"
    assert report["alpha_auto"]["chosen"] == choice.alpha
    assert [row["alpha"] for row in report["alpha_auto"]["grid"]] == list(ALPHA_GRID)
    assert f"alpha auto = {choice.alpha:g} (held-out loss of 4 windows: 0: " in render_markdown(report)


def test_auto_needs_two_calibration_windows(stories):
    model, _ = stories
    config, windows = small_config(0.5), torch.ones(1, 16, dtype=torch.long)
    with pytest.raises(InvalidConfig, match='alpha: "auto" holds out calibration windows'):
        choose_alpha(model, windows, [1.0] * 5, AllocationPlan.of(config), LayerPlan.of(config), 8, CPU, Run())
