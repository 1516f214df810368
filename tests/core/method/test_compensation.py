"""Least-squares compensation: the update against a direct solve, its error formula, and the pipeline stage."""

import logging

import pytest
import torch
from torch import nn

from casp_core.errors import InvalidConfig
from casp_core.eval.perplexity import evaluation_text, windows_perplexity
from casp_core.method.calibration import (
    CalibrationPlan,
    SecondMoment,
    StreamCrossMoment,
    calibration_windows,
    capture_first_layer_inputs,
    record_inputs,
    run_layer,
)
from casp_core.method.compensation import (
    DENSE_MODEL,
    SAME_INPUTS,
    NestedRefit,
    compensate_linear,
    fit_kept_columns,
    removal_error,
)
from casp_core.method.interaction import interaction_matrix, objective
from casp_core.method.prune import prune
from casp_core.method.results import PruneResult
from casp_core.method.selection import layer_q
from casp_core.method.solvers import COMPENSATED_DAMPING, greedy, greedy_compensated, select_units
from casp_core.method.surgery import head_columns
from casp_core.model import attention_geometry, decoder_layers, load_model
from casp_core.report.build import build_report, pruning_section, render_markdown
from casp_core.settings import CalibrationConfig, PruneConfig
from tests.conftest import PTBWIKI, STORIES, small_config


def correlated_inputs(tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose columns are correlated, as real activations are, so the refit has something to recover."""
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(width, width, generator=generator, dtype=torch.float64)
    return torch.randn(tokens, width, generator=generator, dtype=torch.float64) @ mixing


def moment_of(inputs: torch.Tensor) -> SecondMoment:
    moment = SecondMoment(inputs.shape[1], torch.device("cpu"))
    moment.update(inputs)
    return moment


def split(width: int, pruned: list[int]) -> list[int]:
    return [i for i in range(width) if i not in set(pruned)]


def test_update_equals_a_direct_least_squares_solve():
    inputs = correlated_inputs(400, 12)
    weight = torch.randn(5, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pruned = [1, 4, 5, 9]
    kept = split(12, pruned)
    fit = fit_kept_columns(weight, moment_of(inputs).second_moment, pruned, kept, damping=1e-12)
    # min over D of sum_t ||W_p y_p(t) - D y_k(t)||²: an ordinary least-squares problem in the rows of Dᵀ.
    direct = torch.linalg.lstsq(inputs[:, kept], inputs[:, pruned] @ weight[:, pruned].T).solution.T
    torch.testing.assert_close(fit.update, direct, rtol=1e-7, atol=1e-9)


def paired_inputs(tokens: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same tokens on the dense stream and on a pruned stream that drifted from it."""
    dense = correlated_inputs(tokens, width, seed)
    generator = torch.Generator().manual_seed(seed + 100)
    drift = torch.eye(width, dtype=torch.float64) + 0.3 * torch.randn(
        width, width, generator=generator, dtype=torch.float64
    )
    return dense, dense @ drift + 0.5 * torch.randn(tokens, width, generator=generator, dtype=torch.float64)


def cross_moment_of(dense: torch.Tensor, inputs: torch.Tensor) -> StreamCrossMoment:
    moment = StreamCrossMoment(inputs.shape[1], torch.device("cpu"))
    moment.update(dense, inputs)
    return moment


def test_dense_target_update_equals_a_direct_least_squares_solve():
    dense, inputs = paired_inputs(500, 12, seed=10)
    weight = torch.randn(5, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    pruned = [0, 3, 4, 10]
    kept = split(12, pruned)
    cross = cross_moment_of(dense, inputs)
    fit = fit_kept_columns(weight, moment_of(inputs).second_moment, pruned, kept, 1e-12, cross)
    # min over W' of sum_t ||W y_d(t) - W' y_k(t)||², y_k the kept columns of the pruned stream; D = W' - W_k.
    refitted = torch.linalg.lstsq(inputs[:, kept], dense @ weight.T).solution.T
    torch.testing.assert_close(fit.update, refitted - weight[:, kept], rtol=1e-7, atol=1e-9)
    # The errors it reports are the mean squared distance to the dense model's output, before and after.
    for update, reported in ((torch.zeros_like(fit.update), fit.error_before), (fit.update, fit.error_after)):
        residual = dense @ weight.T - inputs[:, kept] @ (weight[:, kept] + update).T
        assert reported == pytest.approx(float(residual.pow(2).sum(1).mean()), rel=1e-9)
    assert removal_error(weight, moment_of(inputs).second_moment, pruned, kept, cross) == fit.error_before


def test_dense_target_with_one_stream_is_the_symmetric_fit_and_refits_a_layer_that_loses_nothing():
    inputs = correlated_inputs(300, 10, seed=12)
    weight = torch.randn(4, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(13))
    pruned = [2, 5, 6]
    kept = split(10, pruned)
    c = moment_of(inputs).second_moment
    same_stream = cross_moment_of(inputs, inputs)
    symmetric = fit_kept_columns(weight, c, pruned, kept, 0.05).update
    torch.testing.assert_close(fit_kept_columns(weight, c, pruned, kept, 0.05, same_stream).update, symmetric)
    # Nothing pruned: against its own output there is nothing to refit; against the dense model's there is.
    dense, drifted = paired_inputs(300, 10, seed=14)
    linear = nn.Linear(10, 4, bias=False)
    report = compensate_linear(linear, moment_of(drifted), [], 0.01, cross_moment_of(dense, drifted))
    assert report.error_after < 0.5 * report.error_before and report.reference == DENSE_MODEL


def test_damping_is_ridge_regression_scaled_by_the_mean_diagonal():
    inputs = correlated_inputs(300, 10, seed=2)
    weight = torch.randn(4, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    pruned, damping = [0, 7], 0.05
    kept = split(10, pruned)
    c = inputs.T @ inputs / inputs.shape[0]
    # λ scales with the mean diagonal of the whole C, not of C_kk: the same for every pruned set of the sub-layer.
    ridge = c[kept][:, kept] + damping * c.diagonal().mean() * torch.eye(len(kept), dtype=torch.float64)
    expected = weight[:, pruned] @ c[pruned][:, kept] @ torch.linalg.inv(ridge)
    fit = fit_kept_columns(weight, c, pruned, kept, damping)
    torch.testing.assert_close(fit.update, expected, rtol=1e-9, atol=1e-12)
    assert fit.damping == damping


def test_removal_error_is_the_mean_squared_output_error_and_z_q_z():
    inputs = correlated_inputs(250, 9, seed=4)
    weight = torch.randn(6, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    pruned = [2, 3, 8]
    kept = split(9, pruned)
    c = moment_of(inputs).second_moment
    before = removal_error(weight, c, pruned, kept)
    assert before == pytest.approx(float((inputs[:, pruned] @ weight[:, pruned].T).pow(2).sum(1).mean()), rel=1e-9)
    assert before == pytest.approx(objective(interaction_matrix(weight, c), torch.tensor(pruned)), rel=1e-9)
    fit = fit_kept_columns(weight, c, pruned, kept, damping=0.01)
    assert fit.error_before == before and fit.error_after < 0.5 * before


def direct_errors(
    weight: torch.Tensor, inputs: torch.Tensor, dense: torch.Tensor | None, kept: list[int], update: torch.Tensor
) -> tuple[float, float]:
    """The mean squared output error over the tokens, kept columns as they were and with `update`: against the
    layer's own output on `inputs`, or against the dense model's on `dense` (its inputs on the dense stream)."""
    target = (inputs if dense is None else dense) @ weight.T
    return tuple(
        float((target - inputs[:, kept] @ (weight[:, kept] + d).T).pow(2).sum(1).mean())
        for d in (torch.zeros_like(update), update)
    )


# (out, width, pruned): which order `fit_kept_columns` solves in, |p| (|k| + out) < out |k| or not.
SHAPES = {
    "solve on C_kp": (30, 12, [4, 9]),  # 2 x 40 < 300
    "solve on the numerator": (5, 12, [1, 4, 5, 9, 11]),  # 5 x 12 >= 35
}


@pytest.mark.parametrize("reference", [SAME_INPUTS, DENSE_MODEL])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_error_after_the_refit_follows_from_the_error_before(reference, shape):
    """after = before - <D, N> - λ||D||², against the direct formula on the tokens: both solve orders, both
    references, damping strong enough that dropping the λ term shows."""
    out, width, pruned = SHAPES[shape]
    kept, damping = split(width, pruned), 0.2
    dense, inputs = paired_inputs(300, width, seed=15)
    weight = torch.randn(out, width, dtype=torch.float64, generator=torch.Generator().manual_seed(16))
    c = moment_of(inputs).second_moment
    cross = None if reference == SAME_INPUTS else cross_moment_of(dense, inputs)
    fit = fit_kept_columns(weight, c, pruned, kept, damping, cross)
    # The ridge solution written out: D (C_kk + λI) = N.
    ridge = c[kept][:, kept] + damping * c.diagonal().mean() * torch.eye(len(kept), dtype=c.dtype)
    if cross is None:
        numerator = weight[:, pruned] @ c[pruned][:, kept]
    else:
        numerator = weight @ cross.cross_moment[:, kept] - weight[:, kept] @ c[kept][:, kept]
    torch.testing.assert_close(fit.update, numerator @ torch.linalg.inv(ridge), rtol=1e-9, atol=1e-12)
    before, after = direct_errors(weight, inputs, None if cross is None else dense, kept, fit.update)
    assert fit.error_before == pytest.approx(before, rel=1e-9)
    assert fit.error_after == pytest.approx(after, rel=1e-9)
    assert fit.error_after < fit.error_before


def test_compensate_linear_updates_only_the_kept_columns_and_reports_both_errors():
    inputs = correlated_inputs(200, 8, seed=6).float()
    linear = nn.Linear(8, 3, bias=False)
    original = linear.weight.detach().clone()
    report = compensate_linear(linear, moment_of(inputs), [1, 6], damping=0.01)
    assert torch.equal(linear.weight[:, [1, 6]], original[:, [1, 6]])  # masking zeroes these later
    assert not torch.equal(linear.weight[:, [0, 2, 3, 4, 5, 7]], original[:, [0, 2, 3, 4, 5, 7]])
    assert report.error_after < report.error_before and report.damping == 0.01
    # Nothing pruned, or nothing kept: nothing to refit.
    for pruned in ([], list(range(8))):
        same = nn.Linear(8, 3, bias=False)
        before = same.weight.detach().clone()
        untouched = compensate_linear(same, moment_of(inputs), pruned, damping=0.01)
        assert torch.equal(same.weight, before) and untouched.error_after == untouched.error_before


def test_an_indefinite_block_gets_stronger_damping_with_a_warning(caplog):
    # Rounding in float32 statistics can leave C_kk with a tiny negative eigenvalue.
    c = torch.tensor([[1.0, 0.0, 0.3], [0.0, -1e-3, 0.1], [0.3, 0.1, 2.0]], dtype=torch.float64)
    weight = torch.ones(2, 3, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="casp_core.method.compensation"):
        fit = fit_kept_columns(weight, c, [2], [0, 1], damping=1e-6)
    assert fit.damping == pytest.approx(1e-2)  # 1e-6 x 10^3 x mean diag (0.9997) < 1e-3 < 1e-6 x 10^4 x 0.9997
    assert "not positive definite" in caplog.text


@pytest.fixture(scope="module")
def ptbwiki_layer():
    """Layer 1 of ptbwiki-7M on 8 windows of 128 tokens of WikiText-2 (valid): the layer, its geometry, its
    statistics and Q, as a dense-mode prune takes them."""
    model, tokenizer = load_model(str(PTBWIKI))
    config = small_config(0.3)
    config.calibration.n_samples = 8
    cpu = torch.device("cpu")
    inputs = capture_first_layer_inputs(
        model, calibration_windows(tokenizer, CalibrationPlan.of(config, model.config)), 8, cpu, cpu
    )
    first, layer = decoder_layers(model)[:2]
    inputs.batches = run_layer(first, inputs, cpu, cpu)
    with record_inputs({"attn": layer.self_attn.o_proj, "mlp": layer.mlp.down_proj}) as moments:
        run_layer(layer, inputs, cpu, cpu)
    geometry = attention_geometry(model, layer)
    return layer, geometry, moments, layer_q(layer, geometry, moments)


# A dense-mode sweep's ratios prune nested sets of one sub-layer: greedy's first k units are its first k' < k.
NESTED_SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75)


@pytest.mark.parametrize("sublayer", ["attn", "mlp"])
def test_one_factor_refits_nested_sets_as_each_sets_own_fit_on_real_statistics(ptbwiki_layer, sublayer):
    """`NestedRefit` against `fit_kept_columns` on ptbwiki-7M's statistics, for greedy's heads (their columns)
    and channels at several counts: both solve orders of the per-set fit (few and many pruned columns), the same
    update and errors to 1e-10."""
    layer, geometry, moments, q = ptbwiki_layer
    if sublayer == "attn":
        weight, units = layer.self_attn.o_proj.weight, q.heads
        counts = sorted({max(1, round(share * len(units))) for share in NESTED_SHARES})
        sets = [head_columns(geometry, sorted(greedy(units, count).tolist())) for count in counts]
    else:
        weight, units = layer.mlp.down_proj.weight, q.channels
        sets = [sorted(greedy(units, round(share * len(units))).tolist()) for share in NESTED_SHARES]
    c = moments[sublayer].second_moment
    refit = NestedRefit.of(weight, c, sets, 0.01)
    assert refit is not None and len(sets) >= 5
    for pruned in sets:
        own = fit_kept_columns(weight, c, pruned, split(weight.shape[1], pruned), 0.01)
        shared = refit.fit(pruned)
        assert own.columns is None and shared.columns is not None
        assert sorted(shared.columns.tolist()) == split(weight.shape[1], pruned)
        in_column_order = shared.update[:, torch.argsort(shared.columns)]
        scale = float(own.update.abs().max())
        assert float((in_column_order - own.update).abs().max()) <= 1e-10 * scale
        assert shared.error_before == pytest.approx(own.error_before, rel=1e-10)
        assert shared.error_after == pytest.approx(own.error_after, rel=1e-10)
        assert shared.damping == own.damping
        assert shared.error_after < shared.error_before


def test_no_shared_factor_where_the_sets_do_not_nest_or_are_too_few_or_the_damped_c_is_indefinite():
    c = moment_of(correlated_inputs(200, 8, seed=20)).second_moment
    weight = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(21))
    assert NestedRefit.of(weight, c, [[1, 4], [1, 4, 6], [0, 1, 4, 6]], 0.01) is not None
    assert NestedRefit.of(weight, c, [[1, 4], [1, 6]], 0.01) is None  # neither contains the other
    # One set to refit: nothing pruned and nothing kept have no fit, and a set met twice is one fit.
    assert NestedRefit.of(weight, c, [[], [2, 3], [3, 2], list(range(8))], 0.01) is None
    indefinite = torch.tensor([[1.0, 0.0, 0.3], [0.0, -1e-3, 0.1], [0.3, 0.1, 2.0]], dtype=torch.float64)
    assert NestedRefit.of(torch.ones(2, 3, dtype=torch.float64), indefinite, [[2], [1, 2]], 1e-6) is None


def test_configuration_is_checked():
    assert small_config(0.3).compensation == "least_squares"  # the default, from bench/results/compensation.md
    with pytest.raises(InvalidConfig, match="compensation: must be one of none, least_squares"):
        small_config(0.3, compensation="lstsq").validate()
    with pytest.raises(InvalidConfig, match="compensation_damping"):
        small_config(0.3, compensation_damping=0.0).validate()


def test_none_leaves_kept_weights_as_they_were(stories):
    model, tokenizer = stories
    dense = {name: p.detach().clone() for name, p in model.named_parameters()}
    result = prune(model, tokenizer, small_config(0.5, allocation="uniform", compensation="none"))
    for index, layer in enumerate(result.layers):
        kept = split(dense[f"model.layers.{index}.mlp.down_proj.weight"].shape[1], layer.pruned_channels)
        pruned_weight = result.model.model.layers[index].mlp.down_proj.weight
        assert torch.equal(pruned_weight, dense[f"model.layers.{index}.mlp.down_proj.weight"][:, kept])
        assert layer.mlp.compensation is None


# `make test-slow`: a quality claim on the 7M toy model; the real model's prune (tests/worker/test_real_model.py)
# runs compensation, and its evidence is bench/ (issue 38).
@pytest.mark.slow
def test_compensated_model_verifies_and_is_better_on_the_real_model(datasets_dir):
    """stories260K at 0.5: the refit lowers the per-layer error and the perplexity of the pruned model."""
    figures = {}
    for compensation in ("none", "least_squares"):
        model, tokenizer = load_model(str(STORIES))
        config = small_config(0.5, allocation="uniform", compensation=compensation)
        result = prune(model, tokenizer, config)
        assert result.verification_max_abs_diff <= 1e-5  # the published model equals the compensated masked one
        text = evaluation_text(tokenizer, "wikitext2", 128, datasets_dir=datasets_dir, max_windows=20)
        figures[compensation] = (windows_perplexity(result.model, text, device="cpu", batch_size=8), result)
    with_refit = figures["least_squares"][1]
    for layer in with_refit.layers:
        for sub in (layer.attn, layer.mlp):
            assert sub.compensation.error_after < sub.compensation.error_before
    assert figures["least_squares"][0] < 0.8 * figures["none"][0]


def refit_error(weight: torch.Tensor, damped: torch.Tensor, units: list[int], block: int) -> float:
    """tr(W_S [(C^-1)_SS]^-1 W_Sᵀ): what is left of the removed units' output after the least-squares refit."""
    columns = [u * block + i for u in units for i in range(block)]
    h_ss = torch.linalg.inv(damped)[columns][:, columns]
    w_s = weight[:, columns]
    return float(torch.trace(w_s @ torch.linalg.inv(h_ss) @ w_s.T))


@pytest.mark.parametrize("block", [1, 2])
def test_greedy_compensated_is_greedy_on_the_error_left_after_the_refit(block):
    inputs = correlated_inputs(300, 12, seed=7)
    weight = torch.randn(5, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    c = moment_of(inputs).second_moment
    damped = c + COMPENSATED_DAMPING * c.diagonal().mean() * torch.eye(12, dtype=torch.float64)
    units, k = 12 // block, 4
    chosen: list[int] = []
    for _ in range(k):  # from scratch at every step: no OBS updates
        costs = {u: refit_error(weight, damped, [*chosen, u], block) for u in range(units) if u not in chosen}
        chosen.append(min(costs, key=costs.get))
    assert greedy_compensated(weight, c, k, block).tolist() == chosen


def test_greedy_compensated_removes_a_unit_the_others_can_stand_in_for():
    inputs = torch.randn(300, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    inputs[:, 3] *= 2.0  # the largest z'Qz cost of all channels...
    inputs[:, 5] = inputs[:, 3]  # ...but channel 5 always carries the same value, so the refit restores it
    weight = torch.full((3, 8), 10.0, dtype=torch.float64)
    c = moment_of(inputs).second_moment
    assert greedy(interaction_matrix(weight, c), 1).item() not in (3, 5)
    assert greedy_compensated(weight, c, 1).item() == 3
    chosen, _ = select_units("greedy_compensated", c, 1, weight=weight, second_moment=c, mean=c[0], block=1)
    assert chosen.tolist() == [3]


TINY_CALIBRATION = {"dataset": "wikitext2:validation", "n_samples": 8, "seq_len": 64, "batch_size": 4}


def pruned_with(compensation: str, mode: str) -> PruneResult:
    return prune(*load_model(str(STORIES)), tiny_config(compensation, mode))


def tiny_config(compensation: str, mode: str) -> PruneConfig:
    calibration = CalibrationConfig(**TINY_CALIBRATION, mode=mode)
    return small_config(0.5, allocation="uniform", compensation=compensation, calibration=calibration)


def test_dense_target_is_the_symmetric_fit_with_dense_calibration():
    symmetric = pruned_with("least_squares", "dense")
    dense_target = pruned_with("least_squares_dense_target", "dense")
    for (name, expected), actual in zip(
        symmetric.model.state_dict().items(), dense_target.model.state_dict().values(), strict=True
    ):
        assert torch.equal(actual, expected), name


def test_dense_target_differs_after_the_first_layer_with_sequential_calibration_and_verifies():
    symmetric = pruned_with("least_squares", "sequential")
    dense_target = pruned_with("least_squares_dense_target", "sequential")
    assert dense_target.verification_max_abs_diff <= 1e-5  # prune() verifies; the bound is fp32's
    first, *later = zip(symmetric.layers, dense_target.layers, strict=True)
    # Layer 0 sees the dense model's inputs on both streams: the same selection, the same fit.
    assert first[0].pruned_heads == first[1].pruned_heads and first[0].pruned_channels == first[1].pruned_channels
    for sub in ("attn", "mlp"):
        a, b = getattr(first[0], sub).compensation, getattr(first[1], sub).compensation
        assert b.error_after == pytest.approx(a.error_after, rel=1e-9)
        assert (a.reference, b.reference) == (SAME_INPUTS, DENSE_MODEL)
    for layer in dense_target.layers:
        for sub in (layer.attn, layer.mlp):
            assert sub.compensation.error_after < sub.compensation.error_before
    # report.md says what the errors are measured against.
    for result, compensation, against in (
        (symmetric, "least_squares", "against each layer unpruned on the inputs it sees"),
        (dense_target, "least_squares_dense_target", "against the dense model's layer on the dense model's inputs"),
    ):
        report = build_report(
            model_name="stories260K",
            config=tiny_config(compensation, "sequential"),
            pruning=pruning_section(result),
            perplexity={},
            device="cpu",
            dtype="float32",
        )
        assert f"sub-layer output error {against}" in render_markdown(report)
    # From layer 1 on the two streams differ, and so do the refitted weights.
    for index, _ in enumerate(later, start=1):
        weights = [r.model.model.layers[index].mlp.down_proj.weight for r in (symmetric, dense_target)]
        assert weights[0].shape != weights[1].shape or (weights[0] - weights[1]).abs().max() > 1e-3
