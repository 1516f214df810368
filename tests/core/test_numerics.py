"""NaN or infinity in C, Q, S_l or the calibration loss stops the job with `numerical_error`, naming the stage,
the decoder layer and what to try."""

import re

import pytest
import torch

from casp_core.errors import NumericalError
from casp_core.method.prune import prune
from tests.conftest import small_config
from tests.core.cli.test_cli import SMALL, casp


def plant(model: torch.nn.Module, layer: int, name: str, value: float) -> None:
    with torch.no_grad():
        model.model.layers[layer].get_submodule(name).weight[4, 2] = value


def prune_expecting_numerical_error(model, tokenizer, **settings) -> str:
    with pytest.raises(NumericalError) as raised:
        prune(model, tokenizer, small_config(0.5, **settings))
    assert raised.value.code == "numerical_error"
    assert "try --dtype bfloat16 or float32" in raised.value.message
    return raised.value.message


def test_infinity_in_the_statistics_names_the_layer(stories):
    model, tokenizer = stories
    plant(model, 2, "mlp.up_proj", float("inf"))  # down_proj's input in layer 2 is no longer finite
    message = prune_expecting_numerical_error(model, tokenizer, allocation="uniform")
    assert message.startswith("statistics: NaN in C = E[yᵀy] of the mlp sub-layer's input of decoder layer 2. ")


def test_nan_in_a_weight_stops_at_q(stories):
    model, tokenizer = stories
    plant(model, 3, "mlp.down_proj", float("nan"))  # the statistics of layer 3 stay finite, its Q does not
    message = prune_expecting_numerical_error(model, tokenizer, allocation="uniform")
    assert message.startswith("interaction: NaN in Q of the FFN channels of decoder layer 3. ")


# The CPU, and the CPU under another name, taken as an accelerator would be (tests/core/method/test_allocation.py).
ALLOCATION_PATHS = pytest.mark.parametrize("device", ["cpu", "cpu:0"], ids=["cpu", "as-a-device"])


@ALLOCATION_PATHS
def test_non_finite_calibration_loss_names_the_first_layer(stories, device):
    model, tokenizer = stories
    plant(model, 1, "self_attn.v_proj", float("inf"))
    message = prune_expecting_numerical_error(model, tokenizer, device=device)  # gradient allocation runs first
    # The allocation goes a chunk of windows at a time (as few as one): the first chunk holds the NaN.
    assert re.match(r"allocation: NaN in the calibration loss of sequences 0-\d+, first in the output of ", message)
    assert "of decoder layer 1. " in message


@ALLOCATION_PATHS
def test_non_finite_gradient_names_the_layer_where_it_started(stories, device):
    """A finite loss whose gradient overflows on its way down (as float16 backward passes can)."""
    model, tokenizer = stories

    def overflow_gradient(_module: torch.nn.Module, _args: tuple, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(lambda gradient: gradient * float("inf"))

    # The gradient overflows in layer 3's backward pass: S_3, taken at its output, is still finite, and every
    # layer below gets the NaN; the first to hold it is named, not layer 0.
    model.model.layers[3].register_forward_hook(overflow_gradient)
    message = prune_expecting_numerical_error(model, tokenizer, device=device)
    assert message.startswith(
        "allocation: NaN in S_l, the squared gradient of the loss at the output of decoder layer 2. "
    )


@pytest.mark.slow
def test_casp_prune_prints_the_numerical_error_in_one_line(stories, tmp_path):
    model, tokenizer = stories
    plant(model, 2, "mlp.gate_proj", float("inf"))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "out"
    completed = casp("prune", "--model", str(tmp_path / "model"), "--ratio", "0.5", "--out", str(out), *SMALL)
    assert completed.returncode == 1
    errors = [line for line in completed.stderr.splitlines() if "error" in line]
    assert errors == [completed.stderr.strip().splitlines()[-1]], completed.stderr
    assert errors[0].startswith("casp: error: numerical_error: allocation: NaN in the calibration loss")
    assert "of decoder layer 2. " in errors[0]
    assert not out.exists()
