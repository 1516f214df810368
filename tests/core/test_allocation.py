"""Layer-wise allocation: budget kept exactly, cap respected, monotone in sensitivity."""

import math

import pytest
import torch

from casp_core import data
from casp_core.allocation import allocate_ratios, layer_sensitivities
from casp_core.run import Run

SENSITIVITIES = [3e-1, 1.2e-1, 4e-2, 9e-3, 2e-3, 2.5e-3, 7e-4, 1e-4]


@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.3, 0.5, 0.7])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 2.0, 4.0])
def test_mean_is_the_budget_and_cap_holds(ratio, alpha):
    r_max = 0.8
    ratios = allocate_ratios(SENSITIVITIES, ratio, alpha, r_max)
    assert sum(ratios) / len(ratios) == pytest.approx(ratio, abs=1e-6)
    assert all(0.0 <= r <= r_max + 1e-12 for r in ratios)
    # A more sensitive layer never gets a larger ratio.
    for (s_a, r_a), (s_b, r_b) in zip(
        sorted(zip(SENSITIVITIES, ratios, strict=True)),
        sorted(zip(SENSITIVITIES, ratios, strict=True))[1:],
        strict=False,
    ):
        assert s_a <= s_b and r_a >= r_b - 1e-12


def test_alpha_zero_is_uniform():
    assert allocate_ratios(SENSITIVITIES, 0.3, 0.0, 0.9) == pytest.approx([0.3] * len(SENSITIVITIES))


def test_formula_before_the_cap():
    # Two layers: Ŝ = (1, 0), c = (0, 1): all pruning goes to the insensitive layer.
    assert allocate_ratios([10.0, 1.0], 0.2, 1.0, 0.9) == pytest.approx([0.0, 0.4])
    logs = [math.log(s + 1e-12) for s in (4.0, 2.0, 1.0)]
    normalised = [(x - min(logs)) / (max(logs) - min(logs)) for x in logs]
    c = [(1 - n) ** 2.0 for n in normalised]
    expected = [3 * ci / sum(c) * 0.3 for ci in c]
    assert allocate_ratios([4.0, 2.0, 1.0], 0.3, 2.0, 0.95) == pytest.approx(expected)


def test_what_the_cap_cuts_goes_to_the_others_in_proportion():
    ratios = allocate_ratios([1.0, 0.5, 0.01, 0.001], 0.5, 1.0, 0.7)
    assert ratios[3] == pytest.approx(0.7)
    assert sum(ratios) == pytest.approx(2.0)
    assert ratios[0] == 0.0 and ratios[1] < ratios[2]


def test_equal_sensitivities_give_uniform():
    assert allocate_ratios([0.5] * 4, 0.25, 1.5, 0.9) == pytest.approx([0.25] * 4)


def test_sensitivities_of_the_real_model_fall_with_depth(stories, datasets_dir):
    model, tokenizer = stories
    text = data.load_text(data.parse_source("wikitext2:validation", "train"), datasets_dir)
    windows = data.sample_windows(data.tokenize(text, tokenizer, add_bos=False), 8, 128, seed=0)
    sensitivities = layer_sensitivities(model, windows, batch_size=4, device=torch.device("cpu"), run=Run())
    assert len(sensitivities) == 5
    assert all(math.isfinite(s) and s > 0 for s in sensitivities)
    assert sensitivities[0] > sensitivities[-1]  # the paper's observation holds on this model too
    assert all(p.requires_grad for p in model.parameters())  # the model is left as it was
