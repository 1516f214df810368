"""One sweep of ratios over one dense model (`prune_ratios`): each ratio's result is the single prune's, the work
all ratios share is done once, and the dense model is left as it was."""

import copy

import pytest
import torch

import casp_core.job.sweep.shared_pass
import casp_core.method.compensation
import casp_core.method.prune
import casp_core.method.selection
from casp_core.errors import Cancelled, InvalidConfig
from casp_core.job.sweep.shared_pass import prune_configs, prune_ratios
from casp_core.method.calibration import CalibrationPlan, calibration_windows
from casp_core.method.prune import prune
from casp_core.model import load_model
from casp_core.run import Run
from tests.conftest import PTBWIKI, small_config

RATIOS = (0.2, 0.5)


@pytest.fixture(scope="module")
def ptbwiki():
    return load_model(str(PTBWIKI))


def sweep_config(mode: str):
    config = small_config(RATIOS[0])
    config.calibration.n_samples, config.calibration.mode = 8, mode
    return config


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_same_pruning(swept, single) -> None:
    assert [layer.pruning for layer in swept.layers] == [layer.pruning for layer in single.layers]
    assert swept.params_pruned == single.params_pruned
    assert swept.verification_max_relative_diff <= 1e-10


def counted(monkeypatch, module, name: str) -> list[int]:
    """Replaces `module.name` by a wrapper that counts its calls: the list's length is the count."""
    calls: list[int] = []
    original = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def test_sequential_sweep_equals_single_prunes_bit_for_bit(ptbwiki, monkeypatch):
    dense, tokenizer = ptbwiki
    config = sweep_config("sequential")
    dense_before = state(dense)
    started: list[float] = []
    sensitivities = counted(monkeypatch, casp_core.method.prune, "layer_sensitivities")
    first_layer_inputs = counted(monkeypatch, casp_core.method.prune, "capture_first_layer_inputs")
    sweep = prune_ratios(dense, tokenizer, config, RATIOS, on_ratio=started.append)
    results = list(sweep)
    # Measured once for both ratios, before the first.
    assert (len(sensitivities), len(first_layer_inputs)) == (1, 1)
    windows = calibration_windows(tokenizer, CalibrationPlan.of(config, dense.config))
    for ratio, swept in results:
        single = prune(copy.deepcopy(dense), tokenizer, config.model_copy(update={"ratio": ratio}), windows=windows)
        assert_same_pruning(swept, single)
        assert abs(swept.achieved_ratio - ratio) <= 0.01
        expected = single.model.state_dict()
        for name, tensor in swept.model.state_dict().items():
            assert torch.equal(tensor, expected[name]), name
    assert started == list(RATIOS)
    for name, tensor in dense.state_dict().items():
        assert torch.equal(tensor, dense_before[name]), name


# Dense mode serves every ratio from one layer pass: the same operations on the same numbers as a single prune, so
# the same units and, to float rounding (none seen), the same weights. The least-squares refits come from one
# factor per sub-layer (`NestedRefit`) rather than one per ratio: the same updates and errors to float64 rounding.
RELATIVE_TOLERANCE = 1e-5
REFIT_TOLERANCE = 1e-10


# the default's case in make test; FLAP's bias (10 s) in make test-slow
@pytest.mark.parametrize("compensation", ["least_squares", pytest.param("bias", marks=pytest.mark.slow)])
def test_dense_mode_takes_each_layers_statistics_once_for_every_ratio(ptbwiki, monkeypatch, compensation):
    dense, tokenizer = ptbwiki
    config = sweep_config("dense")
    config.compensation = compensation
    dense_before = state(dense)
    statistics = counted(monkeypatch, casp_core.job.sweep.shared_pass, "record_inputs")
    interactions = counted(monkeypatch, casp_core.job.sweep.shared_pass, "layer_q")
    offdiag_ratios = counted(monkeypatch, casp_core.method.selection, "offdiag_ratio")
    own_fits = counted(monkeypatch, casp_core.method.compensation, "fit_kept_columns")
    shared_fits = counted(monkeypatch, casp_core.method.compensation.NestedRefit, "fit")
    results = list(prune_ratios(dense, tokenizer, config, RATIOS))
    n_layers = dense.config.num_hidden_layers
    assert (len(statistics), len(interactions)) == (n_layers, n_layers)
    assert len(offdiag_ratios) == 2 * n_layers  # read off each Q once (heads, channels), not once per ratio
    if compensation == "least_squares":
        # Greedy's choices nest: a sub-layer whose ratios refit two different sets (each pruning some units and
        # keeping some) refits them all from one factor; one with a single such set fits it on its own.
        expected = {"shared": 0, "own": 0}
        for layers in zip(*(result.layers for _, result in results), strict=True):
            heads = [layer.pruned_heads for layer in layers], layers[0].attn.units
            channels = [layer.pruned_channels for layer in layers], layers[0].mlp.units
            for sets, units in (heads, channels):
                refitted = [pruned for pruned in sets if 0 < len(pruned) < units]
                expected["shared" if len({tuple(p) for p in refitted}) >= 2 else "own"] += len(refitted)
        assert (len(shared_fits), len(own_fits)) == (expected["shared"], expected["own"])
        assert expected["shared"] >= n_layers  # most of the refits
    windows = calibration_windows(tokenizer, CalibrationPlan.of(config, dense.config))
    for ratio, swept in results:
        single = prune(copy.deepcopy(dense), tokenizer, config.model_copy(update={"ratio": ratio}), windows=windows)
        assert_same_pruning(swept, single)
        for swept_layer, single_layer in zip(swept.layers, single.layers, strict=True):
            assert swept_layer.mlp.objective == pytest.approx(single_layer.mlp.objective, rel=RELATIVE_TOLERANCE)
            for swept_sub, single_sub in ((swept_layer.attn, single_layer.attn), (swept_layer.mlp, single_layer.mlp)):
                swept_report, single_report = swept_sub.compensation, single_sub.compensation
                assert swept_report.damping == single_report.damping
                for error in ("error_before", "error_after"):
                    expected = getattr(single_report, error)
                    assert getattr(swept_report, error) == pytest.approx(expected, rel=REFIT_TOLERANCE, abs=0), error
        expected = single.model.state_dict()
        for name, tensor in swept.model.state_dict().items():
            scale = float(expected[name].abs().max())
            assert float((tensor - expected[name]).abs().max()) <= RELATIVE_TOLERANCE * scale, name
    for name, tensor in dense.state_dict().items():
        assert torch.equal(tensor, dense_before[name]), name
    assert {name for name, _ in dense.named_parameters()} == set(dense_before) - {"lm_head.weight"}


def test_configs_of_other_roundings_share_the_sensitivities_and_the_layer_pass(ptbwiki, monkeypatch):
    """A sweep's GGUF types round the FFN widths differently (q8_0 to its block of 32): one call still measures
    S_l once and, in dense mode, each layer's statistics once for both roundings."""
    dense, tokenizer = ptbwiki
    config = sweep_config("dense")
    configs = [
        config.model_copy(update={"ratio": 0.3}),
        config.model_copy(update={"ratio": 0.3, "export": ["gguf"], "gguf_type": "q8_0"}),
    ]
    sensitivities = counted(monkeypatch, casp_core.method.prune, "layer_sensitivities")
    statistics = counted(monkeypatch, casp_core.job.sweep.shared_pass, "record_inputs")
    results = list(prune_configs(dense, tokenizer, configs))
    assert (len(sensitivities), len(statistics)) == (1, dense.config.num_hidden_layers)
    windows = calibration_windows(tokenizer, CalibrationPlan.of(config, dense.config))
    for (swept_config, swept), asked in zip(results, configs, strict=True):
        assert swept_config is asked
        assert_same_pruning(swept, prune(copy.deepcopy(dense), tokenizer, asked, windows=windows))
    widths = [[layer.mlp.down_proj.in_features for layer in result.model.model.layers] for _, result in results]
    assert all(width % 32 == 0 for width in widths[1]) and widths[0] != widths[1]


def test_a_bad_ratio_is_refused_before_any_work(ptbwiki):
    dense, tokenizer = ptbwiki
    with pytest.raises(InvalidConfig, match="r_max"):
        prune_ratios(dense, tokenizer, sweep_config("sequential"), [0.2, 0.95])


def test_a_ratio_whole_units_cannot_reach_is_refused_before_the_shared_layer_pass(ptbwiki):
    # A job's plan leaves such a ratio out of its sweep (casp_core.job.plan); called directly, the shared pass
    # refuses it as each ratio's budget is planned, before any layer is pruned for any ratio.
    dense, tokenizer = ptbwiki
    stages: list[str] = []
    run = Run(progress=lambda stage, *_: stages.append(stage))
    sweep = prune_ratios(dense, tokenizer, sweep_config("dense"), [0.2, 0.9], run)  # r_max 0.9: heads round down
    with pytest.raises(InvalidConfig, match=r"^ratio: 0\.9 cannot be reached .*raise r_max\)$"):
        next(sweep)
    assert "allocation" in stages and "pruning" not in stages


def test_cancelling_stops_the_sweep_before_the_next_ratio(ptbwiki):
    dense, tokenizer = ptbwiki
    cancelled, started = False, []
    run = Run(should_cancel=lambda: cancelled)
    sweep = prune_ratios(dense, tokenizer, sweep_config("sequential"), RATIOS, run, on_ratio=started.append)
    assert next(sweep)[0] == RATIOS[0]
    cancelled = True
    with pytest.raises(Cancelled):
        next(sweep)
    assert started == [RATIOS[0]]  # the second ratio never started
