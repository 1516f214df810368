"""The ratio the user asked for: reached within one rounding unit, or refused before any work.

One rounding unit is the parameters of `round_to` FFN channels of one layer (stories260K: 192 per channel,
of 226,560 prunable parameters). The capped budget (layers at r_max) is the case that used to fall short.
"""

import re

import pytest
import torch

from casp_core.cli.main import main
from casp_core.errors import InvalidConfig
from casp_core.job.plan import plan_job
from casp_core.job.run import run_job
from casp_core.method.budget import (
    AllocationPlan,
    BudgetPlan,
    channel_params,
    channels_to_prune,
    heads_emptying_groups_last,
    layer_budget,
    plan_budget,
)
from casp_core.method.prune import prune
from casp_core.method.solvers import select_units
from casp_core.model import attention_geometry, decoder_layers, load_config, load_model
from casp_core.rounding import channel_counts
from casp_core.run import Run
from casp_core.settings import CalibrationConfig
from tests.conftest import DATASETS_DIR, STORIES, small_config

WIDTH, HEADS = 172, 8  # stories260K: FFN channels and query heads per layer (4 key/value heads)


def tiny_config(ratio: float, **overrides):
    """A few short windows: the budget does not depend on how good the statistics are."""
    config = small_config(ratio, **overrides)
    config.calibration = CalibrationConfig(dataset="wikitext2:validation", n_samples=4, seq_len=64, batch_size=4)
    return config


def rounding_unit(model, round_to: int) -> int:
    return round_to * channel_params(decoder_layers(model)[0])


def assert_within_caps(result, r_max: float) -> None:
    for layer in result.layers:
        assert len(layer.pruned_heads) <= int(r_max * HEADS + 1e-9)
        assert len(layer.pruned_channels) <= int(r_max * WIDTH + 1e-9)


# ---------------------------------------------------------------- end to end on the real GQA model


@pytest.mark.parametrize("ratio", [0.5, 0.7, 0.8, 0.85])
def test_gradient_allocation_reaches_the_ratio_within_one_rounding_unit(stories, ratio):
    model, tokenizer = stories
    unit = rounding_unit(model, 1)
    result = prune(model, tokenizer, tiny_config(ratio))
    removed = result.params_dense - result.params_pruned
    assert abs(removed - ratio * result.params_dense) <= unit, (result.achieved_ratio, ratio)
    assert_within_caps(result, 0.9)
    if ratio >= 0.7:  # the capped budget: the allocation put layers at r_max, and they cannot hold r_max
        assert sum(layer.ratio == pytest.approx(0.9) for layer in result.layers) >= 3


def test_round_to_reaches_the_ratio_and_spares_layers_the_allocation_spared(stories):
    model, tokenizer = stories
    unit = rounding_unit(model, 8)
    result = prune(model, tokenizer, tiny_config(0.3, round_to=8))
    spared = [layer for layer in result.layers if layer.ratio == 0.0]
    assert spared, "gradient allocation with alpha 1 gives the most sensitive layer r_l = 0"
    assert all(not layer.pruned_heads and not layer.pruned_channels for layer in spared)
    widths = result.model.config.layer_intermediate_sizes
    assert all(width % 8 == 0 for layer, width in zip(result.layers, widths, strict=True) if layer.ratio > 0)
    assert abs(result.params_dense - result.params_pruned - 0.3 * result.params_dense) <= unit
    assert_within_caps(result, 0.9)


def test_capped_round_to_in_dense_mode(stories):
    model, tokenizer = stories
    # r_max 0.85 and round_to 4 hold 0.7909 a layer (6 heads, 2 key/value heads, 144 channels): layers at the cap
    # fall short of 0.85, and the others must make up for it.
    config = tiny_config(0.75, round_to=4, r_max=0.85)
    config.calibration.mode = "dense"
    result = prune(model, tokenizer, config)
    assert sum(layer.ratio == pytest.approx(0.85) for layer in result.layers) >= 2
    assert abs(result.params_dense - result.params_pruned - 0.75 * result.params_dense) <= rounding_unit(model, 4)
    assert_within_caps(result, 0.85)


# ---------------------------------------------------------------- refused before any work


def test_an_unreachable_ratio_is_refused_by_the_plan_with_the_reachable_maximum(stories):
    model, tokenizer = stories
    # r_max 0.9 of 8 heads is 7 (0.875), and of 172 channels 154 (0.895): 0.9 of the parameters is out of reach.
    with pytest.raises(InvalidConfig, match=r"ratio: 0\.9 cannot be reached") as refused:
        plan_job(tiny_config(0.9), load_config(str(STORIES)))  # the config alone, before any weight loads
    assert refused.value.code == "invalid_config"
    reachable = float(re.search(r"at most (0\.\d+) of the decoder", refused.value.message).group(1))
    assert reachable == 0.8785  # 5 layers x (7 heads + 3 key/value heads + 154 channels) of 5 x 45,312

    # `prune` called without a plan refuses it alike, once its budget is planned: after the allocation, before
    # any layer is pruned.
    stages: list[str] = []
    with pytest.raises(InvalidConfig) as unplanned:
        prune(model, tokenizer, tiny_config(0.9), Run(progress=lambda stage, *_: stages.append(stage)))
    assert unplanned.value.message == refused.value.message
    assert "allocation" in stages and "pruning" not in stages

    # The stated maximum is itself reached.
    fresh, tokenizer = load_model(str(STORIES))
    result = prune(fresh, tokenizer, tiny_config(reachable, allocation="uniform"))
    assert abs(result.params_dense - result.params_pruned - reachable * result.params_dense) <= rounding_unit(fresh, 1)


def test_run_job_and_the_command_line_refuse_before_calibration(tmp_path, capsys):
    stages: list[str] = []
    with pytest.raises(InvalidConfig, match=r"at most 0\.8785"):
        run_job(str(STORIES), tiny_config(0.88), tmp_path / "out", Run(progress=lambda stage, *_: stages.append(stage)))
    assert stages == []  # refused from the config, before the first stage
    assert not (tmp_path / "out").exists()

    argv = ["prune", "--model", str(STORIES), "--ratio", "0.85", "--r-max", "0.85", "--out", str(tmp_path / "cli")]
    argv += ["--datasets-dir", str(DATASETS_DIR), "--n-samples", "2", "--seq-len", "32", "--eval-limit", "1"]
    assert main(argv) == 2
    error = capsys.readouterr().err.splitlines()[-1]  # after the weights' loading bar
    assert error.startswith("casp: error: invalid_config: ratio: 0.85 cannot be reached")


# ---------------------------------------------------------------- the planner, driven directly


def simulate(plan: BudgetPlan, extra_kv: dict[int, int] | None = None) -> list[int]:
    """Channel counts chosen layer by layer, when layer l's heads take along `extra_kv[l]` more parameters
    (key/value heads) than the fewest the plan counts on."""
    extra_kv = extra_kv or {}
    removed, counts = 0, []
    for index, layer in enumerate(plan.layers):
        attention = layer.least_attention_removed + extra_kv.get(index, 0)
        count = channels_to_prune(plan, index, removed, attention)
        assert count in layer.channel_counts
        counts.append(count)
        removed += attention + count * layer.channel_params
    return counts


def removed_by(plan: BudgetPlan, counts: list[int], extra_kv: dict[int, int] | None = None) -> int:
    extra = sum((extra_kv or {}).values())
    return extra + sum(
        p.least_attention_removed + c * p.channel_params for p, c in zip(plan.layers, counts, strict=True)
    )


def most_per_layer_at_cap(round_to: int) -> int:
    """r_max 0.9: 7 query heads (1024 each), the 3 key/value heads (1024 each) they empty at the least, and the
    most channels (192 each) that leave a multiple of round_to within 154."""
    return 10 * 1024 + max(c for c in range(155) if (WIDTH - c) % round_to == 0) * 192


@pytest.mark.parametrize("round_to", [1, 4, 8])
@pytest.mark.parametrize(
    "ratios",
    [
        [0.0, 0.8, 0.9, 0.9, 0.9],  # gradient allocation at 0.7: the capped layers fall short
        [0.4, 0.9, 0.9, 0.9, 0.9],
        [0.0, 0.3, 0.54, 0.76, 0.9],
        [0.875, 0.875, 0.875, 0.875, 0.0],  # the last layer spared: the earlier ones must take all of it
    ],
)
def test_planned_counts_reach_the_target_and_keep_to_r_l_zero_and_r_max(stories, ratios, round_to):
    model, _ = stories
    config = tiny_config(round(sum(ratios) / len(ratios), 6), round_to=round_to)
    plan = plan_budget(model, ratios, AllocationPlan.of(config))
    for extra_kv in ({}, {1: 1024, 3: 2048}):  # GQA: chosen heads that empty more key/value groups
        counts = simulate(plan, extra_kv)
        assert abs(removed_by(plan, counts, extra_kv) - plan.target) <= rounding_unit(model, round_to) / 2
    for ratio, layer in zip(ratios, plan.layers, strict=True):
        assert layer.heads <= 7 and layer.channel_counts[-1] <= 154  # r_max 0.9 of 8 heads and of 172 channels
        assert all((WIDTH - count) % round_to == 0 for count in layer.channel_counts if ratio > 0)
    spared = [i for i, ratio in enumerate(ratios) if ratio == 0.0]
    others_hold_it = (len(ratios) - len(spared)) * most_per_layer_at_cap(round_to) >= plan.target
    for index in spared:  # a layer the allocation spared loses nothing, unless the others cannot hold the target
        untouched = plan.layers[index].heads == 0 and plan.layers[index].channel_counts == (0,)
        assert untouched == others_hold_it


def test_what_capped_layers_cannot_hold_goes_to_the_next_layer_below_the_cap(stories):
    model, _ = stories
    plan = plan_budget(model, [0.9, 0.9, 0.9, 0.4, 0.2], AllocationPlan.of(tiny_config(0.66)))
    counts = simulate(plan)
    own = [(layer.share - layer.least_attention_removed) / layer.channel_params for layer in plan.layers]
    # Each capped layer holds 0.8785 of its 45,312 parameters, 5 channels short of 0.9: layer 3 takes all 15.
    assert counts[3] >= own[3] + 14
    assert abs(counts[4] - own[4]) <= 1


def test_heads_are_added_where_rounding_cut_most_when_the_cap_binds(stories):
    model, _ = stories
    # Layer 1 at 0.8 rounds to 6 heads; the layers at 0.9 (7 heads, 154 channels) hold 0.8785 each, so layer 1
    # must also go to 7 heads for the four layers to hold 0.7 of five.
    plan = plan_budget(model, [0.0, 0.8, 0.9, 0.9, 0.9], AllocationPlan.of(tiny_config(0.7)))
    assert [layer.heads for layer in plan.layers] == [0, 7, 7, 7, 7]
    # Only when no layer below its head cap is left do layers with r_l = 0 take part.
    plan = plan_budget(model, [0.0, 0.9, 0.9, 0.9, 0.9], AllocationPlan.of(tiny_config(0.72)))
    assert plan.layers[0].channel_counts[-1] == 154
    assert abs(removed_by(plan, simulate(plan)) - plan.target) <= rounding_unit(model, 1) / 2


def test_planned_heads_take_along_the_fewest_key_value_heads(stories):
    model, _ = stories
    geometry = attention_geometry(model, decoder_layers(model)[0])
    order = heads_emptying_groups_last(geometry)
    assert [geometry.kv_of_query[head] for head in order] == [0, 1, 2, 3, 0, 1, 2, 3]
    # 4 heads, one of each group, take no key/value head along; 6 take 2 (4 x 1024 + 2 x 1024).
    assert [layer_budget(model, decoder_layers(model)[0], n, (0,), 0.5).least_removed for n in (4, 6)] == [4096, 8192]


def test_channel_counts_respect_r_max_and_round_to():
    assert channel_counts(WIDTH, 0.9, 1) == tuple(range(155))
    assert channel_counts(WIDTH, 0.9, 8) == tuple(range(4, 149, 8))  # keeps 168, 160, ..., 24
    assert channel_counts(WIDTH, 1.0, 1)[-1] == WIDTH - 1  # a layer keeps at least one rounding unit
    with pytest.raises(InvalidConfig, match="round_to: a layer of 172 FFN channels cannot keep a multiple of 256"):
        channel_counts(WIDTH, 0.9, 256)


# ---------------------------------------------------------------- solvers refuse an impossible k


@pytest.mark.parametrize("solver", ["greedy", "diagonal", "relaxation", "greedy_refine", "wanda_sp", "flap"])
@pytest.mark.parametrize("k", [-1, 7])
def test_every_solver_refuses_k_outside_zero_to_d(solver, k):
    generator = torch.Generator().manual_seed(0)
    y = torch.randn(32, 6, generator=generator, dtype=torch.float64)
    second_moment = y.T @ y / 32
    weight = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    q = (weight.T @ weight) * second_moment
    arguments = {"weight": weight, "second_moment": second_moment, "mean": y.mean(dim=0), "block": 1}
    with pytest.raises(ValueError, match=rf"cannot prune k = {k} of 6 units: k must be in \[0, 6\]"):
        select_units(solver, q, k, **arguments)
    assert len(select_units(solver, q, 6, **arguments)[0]) == 6  # the bounds themselves are fine
    assert len(select_units(solver, q, 0, **arguments)[0]) == 0
