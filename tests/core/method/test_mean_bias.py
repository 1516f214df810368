"""FLAP's mean-bias compensation: the bias against a direct computation, and pruned models that carry it."""

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.method.calibration import record_inputs
from casp_core.method.compensation import add_mean_bias, compensate_layer
from casp_core.method.prune import prune
from casp_core.method.surgery import head_columns, remove_units
from casp_core.method.verification import verify
from casp_core.model import attention_geometry, decoder_layers, load_model
from casp_core.settings import CalibrationConfig
from tests.conftest import STORIES, small_config
from tests.core.families.helpers import (
    VOCAB,
    assert_computes_the_same,
    chosen_prunings,
    masked_copy,
    write_dense,
    written_and_loaded_back,
)
from tests.core.families.test_families import FAMILIES
from tests.core.method.test_compensation import TINY_CALIBRATION, correlated_inputs, moment_of


@pytest.mark.parametrize("has_bias", [False, True])
def test_bias_is_the_removed_columns_mean_output(has_bias: bool):
    inputs = correlated_inputs(300, 10, seed=20) + 0.7  # a mean away from zero, as real activations have
    linear = nn.Linear(10, 4, bias=has_bias).double()
    weight = linear.weight.detach().clone()
    original_bias = linear.bias.detach().clone() if has_bias else torch.zeros(4, dtype=torch.float64)
    pruned = [1, 4, 8]
    report = add_mean_bias(linear, moment_of(inputs), pruned)
    direct = weight[:, pruned] @ inputs[:, pruned].mean(dim=0)  # W[:, p] @ mean(y_p) over the tokens
    torch.testing.assert_close(linear.bias.detach(), original_bias + direct, rtol=1e-10, atol=1e-12)
    assert torch.equal(linear.weight, weight)  # the kept (and pruned) columns as they were
    # The errors are E||W_p y_p||² and, with the bias, E||W_p y_p - b||²: the removed part around its mean.
    removed = inputs[:, pruned] @ weight[:, pruned].T
    assert report.error_before == pytest.approx(float(removed.pow(2).sum(1).mean()), rel=1e-9)
    assert report.error_after == pytest.approx(float((removed - direct).pow(2).sum(1).mean()), rel=1e-9)
    assert report.error_after < report.error_before and report.damping == 0.0


def test_a_sub_layer_that_loses_nothing_gets_a_zero_bias():
    linear = nn.Linear(6, 3, bias=False)
    add_mean_bias(linear, moment_of(correlated_inputs(50, 6, seed=21).float() + 1), [])
    assert linear.bias is not None and torch.equal(linear.bias, torch.zeros(3))


@pytest.mark.parametrize("family", ["llama", "llama-biases"])
def test_bias_compensated_units_prune_exactly(family: str, tmp_path: Path):
    """Chosen units (uneven groups, a layer that loses every head), the biases fitted on real activations: the
    pruned model, saved and loaded back by both loaders, computes what the masked one does. Where the source
    model has an o_proj / down_proj bias, the compensation is added to it."""
    model, tokenizer = load_model(str(write_dense(FAMILIES[family](), tmp_path / "dense")))
    layers = decoder_layers(model)
    sublayers = {f"{i}.{name}": p for i, layer in enumerate(layers) for name, p in sublayer_pairs(layer)}
    tokens = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), record_inputs(sublayers) as moments:
        model(tokens)
    prunings = chosen_prunings(attention_geometry(model, layers[0]).num_heads)
    for index, (layer, pruning) in enumerate(zip(layers, prunings, strict=True)):
        geometry = attention_geometry(model, layer)
        columns = {"attn": head_columns(geometry, list(pruning.pruned_heads)), "mlp": list(pruning.pruned_channels)}
        expected = {}
        for name, linear in sublayer_pairs(layer):
            before = linear.bias.detach().double() if linear.bias is not None else 0.0
            mean = moments[f"{index}.{name}"].mean
            expected[name] = before + linear.weight.detach().double()[:, columns[name]] @ mean[columns[name]]
        layer_moments = {name: moments[f"{index}.{name}"] for name in ("attn", "mlp")}
        compensate_layer(layer, geometry, pruning, layer_moments, "bias", 0.01)
        for name, linear in sublayer_pairs(layer):
            torch.testing.assert_close(linear.bias.detach().double(), expected[name], rtol=1e-6, atol=1e-7)
    masked = masked_copy(model, prunings)
    pruned = remove_units(model, prunings)
    assert pruned.config.attention_o_bias and pruned.config.mlp_down_bias
    assert pruned.config.mlp_bias == (family == "llama-biases")  # gate/up biased only where the source was
    # The layer that lost every head: its o_proj has no columns left and outputs its bias, the mean output.
    assert pruned.model.layers[1].self_attn.o_proj.in_features == 0
    assert pruned.model.layers[1].self_attn.o_proj.bias.abs().max() > 0
    verify(masked, pruned, tokens[:2], torch.device("cpu"))  # raises past the float64 rule
    assert_computes_the_same(masked, written_and_loaded_back(pruned, tokenizer, tmp_path / "pruned"))


def sublayer_pairs(layer: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [("attn", layer.self_attn.o_proj), ("mlp", layer.mlp.down_proj)]


def test_flap_with_bias_verifies_and_round_trips(tmp_path: Path):
    """The pipeline with FLAP's selection and its bias: verified against the masked model, and the checkpoint
    loads back (own loader and trust_remote_code) with identical logits."""
    calibration = CalibrationConfig(**TINY_CALIBRATION, mode="sequential")
    config = small_config(0.5, solver="flap", allocation="uniform", compensation="bias", calibration=calibration)
    model, tokenizer = load_model(str(STORIES))
    result = prune(model, tokenizer, config)
    assert result.verification_max_relative_diff <= 1e-10
    for layer, pruned_layer in zip(result.layers, result.model.model.layers, strict=True):
        for sub, linear in ((layer.attn, pruned_layer.self_attn.o_proj), (layer.mlp, pruned_layer.mlp.down_proj)):
            assert sub.compensation.error_after < sub.compensation.error_before
            assert linear.bias is not None and linear.bias.abs().max() > 0
        assert pruned_layer.mlp.gate_proj.bias is None and pruned_layer.mlp.up_proj.bias is None
    # The biases are parameters of the pruned model: counted after, never before.
    assert sum(layer.params_before for layer in result.layers) == result.params_dense
    save_pruned(result.model, tokenizer, tmp_path)
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = result.model(tokens).logits
        assert torch.equal(load_pruned(tmp_path)[0](tokens).logits, expected)
        remote = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
        assert torch.equal(remote(tokens).logits, expected)


def test_without_compensation_the_pruned_model_has_no_new_bias(stories):
    result = prune(*stories, small_config(0.3, solver="flap", compensation="none"))
    assert not result.model.config.attention_o_bias and not result.model.config.mlp_down_bias
    assert not any(name.endswith(("o_proj.bias", "down_proj.bias")) for name in result.model.state_dict())
    assert all(layer.attn.compensation is None for layer in result.layers)
