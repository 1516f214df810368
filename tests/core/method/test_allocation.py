"""Layer-wise allocation: budget kept exactly, cap respected, monotone in sensitivity; S_l, taken one layer at a time
from chunks of the head's logits, those of one graph through the whole model from its full logits, on the CPU and
on the device, and then never more than one decoder layer there and one chunk of logits at a time."""

import math

import pytest
import torch

from casp_core import data
from casp_core.method import allocation, next_token
from casp_core.method.allocation import allocate_ratios, layer_sensitivities
from casp_core.model import load_model
from casp_core.run import Run
from tests.conftest import PTBWIKI
from tests.core.device_placement import OTHER_DEVICE, DevicePlacement
from tests.core.full_logits import one_graph_sensitivities
from tests.core.method.test_surgery import tiny_llama

# Any device other than the CPU the model is stored on takes the layer-by-layer path (OTHER_DEVICE stands in).

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


def calibration(tokenizer, n_windows: int, seq_len: int) -> torch.Tensor:
    text = data.load_text(data.parse_source("wikitext2:validation", "train"), str(PTBWIKI.parents[1] / "data"))
    tokens = data.tokenize(text[:20_000], tokenizer, add_bos=False)  # enough for the few windows, quick to tokenize
    return data.sample_windows(tokens, n_windows, seq_len, seed=0)


def three_ways(model, windows, batch_size: int) -> tuple[list[float], list[float], list[float]]:
    """S_l from one graph through the whole model and its full logits, and as the allocation takes them on the
    CPU and on the device."""
    reference = one_graph_sensitivities(model, windows, batch_size)
    on_cpu = layer_sensitivities(model, windows, batch_size=batch_size, device=torch.device("cpu"), run=Run())
    on_device = layer_sensitivities(model, windows, batch_size=batch_size, device=OTHER_DEVICE, run=Run())
    return reference, on_cpu, on_device


@pytest.mark.parametrize("fixture", ["stories260K", "ptbwiki-7M"])
def test_layer_by_layer_gives_the_sensitivities_of_one_graph(fixture, stories, monkeypatch):
    """The head's logits in chunks of 100 tokens, so that a window's loss spans several (and a chunk two windows)."""
    model, tokenizer = stories if fixture == "stories260K" else load_model(str(PTBWIKI))
    monkeypatch.setattr(next_token, "LOGITS_CHUNK_BYTES", 100 * 4 * model.config.vocab_size)
    reference, on_cpu, on_device = three_ways(model, calibration(tokenizer, 10, 64), batch_size=4)  # last batch of 2
    assert on_cpu == pytest.approx(reference, rel=1e-5)
    assert on_device == pytest.approx(reference, rel=1e-5)
    assert all(p.requires_grad for p in model.parameters())


def test_random_model_in_chunks_gives_the_same_sensitivities(monkeypatch):
    """GQA, untied head, the windows in chunks of one (a tiny host share keeps the stored layer inputs to a window's,
    fewer than a batch), the head's logits 5 tokens at a time."""
    model = tiny_llama(heads=6, kv_heads=2, layers=4, seed=1)
    model.config.tie_word_embeddings = False
    windows = torch.randint(0, 97, (7, 24), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(allocation, "STORED_INPUTS_SHARE", 1e-9)
    monkeypatch.setattr(next_token, "LOGITS_CHUNK_BYTES", 5 * 4 * model.config.vocab_size)
    assert allocation.windows_per_chunk(model, windows, 3) == 1
    reference, on_cpu, on_device = three_ways(model, windows, batch_size=3)
    assert on_cpu == pytest.approx(reference, rel=1e-5)
    assert on_device == pytest.approx(reference, rel=1e-5)
    assert len(set(on_cpu)) == 4  # each layer its own


@pytest.mark.parametrize("device", [torch.device("cpu"), OTHER_DEVICE])
def test_the_head_takes_one_chunk_of_tokens_at_a_time(stories, monkeypatch, device):
    """On every device, the head's float32 logits are one chunk's, forward and backward: a batch's over a large
    vocabulary would outweigh the model (SmolLM2's at 8 x 2048 tokens: 3.2 GB beside 0.5 GB of weights)."""
    model, tokenizer = stories
    monkeypatch.setattr(next_token, "LOGITS_CHUNK_BYTES", 50 * 4 * model.config.vocab_size)
    rows: list[int] = []
    handle = model.lm_head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    try:
        layer_sensitivities(model, calibration(tokenizer, 8, 32), batch_size=4, device=device, run=Run())
    finally:
        handle.remove()
    # Each batch's 4 x 31 predicted tokens in chunks of 50, each computed again for its backward pass.
    assert sorted(rows) == sorted([50, 50, 24] * 2 * 2)


def test_layer_by_layer_keeps_one_decoder_layer_on_the_device(stories, monkeypatch):
    model, tokenizer = stories
    placement = DevicePlacement(model, OTHER_DEVICE, monkeypatch)
    layer_sensitivities(model, calibration(tokenizer, 8, 32), batch_size=4, device=OTHER_DEVICE, run=Run())
    assert placement.offload_violations() == []
    # Forward through all five layers, then back down recomputing layers 4 to 1, for each chunk of windows: here
    # each batch is one (the layer inputs of all windows would take more than the host share of this tiny model).
    assert allocation.windows_per_chunk(model, calibration(tokenizer, 8, 32), 4) == 4
    assert placement.runs == [0, 1, 2, 3, 4, 4, 3, 2, 1] * 2
    assert placement.arrivals["head"] == 2  # once per chunk, for the gradient at the top
