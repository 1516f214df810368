"""Supported model families prune exactly; any other model is refused before any work.

The dense models are tiny, randomly initialised checkpoints built with transformers' own config classes: fine
for exactness (pruned == masked), never for quality numbers.
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PhimoeConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.cli import main as cli
from casp_core.errors import InvalidConfig, UnsupportedModel
from casp_core.method.budget import attention_params_removed, channel_params
from casp_core.method.calibration import capture_first_layer_inputs, run_layer
from casp_core.method.surgery import remove_units
from casp_core.model import (
    attention_geometry,
    check_supported_config,
    decoder_layers,
    load_model,
    sublayer_parameters,
)
from casp_core.run import CPU
from tests.core.families.helpers import (
    COMMON,
    VOCAB,
    WINDOW,
    assert_computes_the_same,
    chosen_prunings,
    layer_outputs_of_the_model_s_own_forward,
    masked_copy,
    prune_small,
    small_run_arguments,
    write_dense,
    written_and_loaded_back,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
FAMILIES: dict[str, Callable[[], PretrainedConfig]] = {
    # Llama 1 / Llama 2 7B: every query head has its own key/value head.
    "llama": lambda: LlamaConfig(**{**COMMON, "num_key_value_heads": 8}),
    # Llama 3.x: grouped-query attention, llama3 rope scaling, tied embeddings (as 3.2 1B/3B).
    "llama3": lambda: LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
    # Llama-layout models that bias every projection.
    "llama-biases": lambda: LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=WINDOW),
    # Qwen2/2.5: q/k/v biased, o not; a sliding window on the layers from max_window_layers on.
    "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    # Qwen3: per-head q/k norms; head_dim 16 with 6 heads, so q_proj is 96 wide on a 64-wide model.
    "qwen3": lambda: Qwen3Config(**{**COMMON, "num_attention_heads": 6}, head_dim=16),
}
MAIN_FAMILIES = ("llama3", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def dense_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense")
    return {name: write_dense(make(), root / name) for name, make in FAMILIES.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_chosen_units_prune_exactly(family: str, dense_folders: dict[str, Path], tmp_path: Path) -> None:
    model, tokenizer = load_model(str(dense_folders[family]))
    prunings = chosen_prunings(attention_geometry(model, decoder_layers(model)[0]).num_heads)
    masked = masked_copy(model, prunings)
    pruned = remove_units(model, prunings)
    assert pruned.config.layer_kv_of_query[1] == []
    if model.config.num_key_value_heads < model.config.num_attention_heads:
        assert pruned.model.layers[0].self_attn.gather_kv  # the uneven groups
    assert_computes_the_same(masked, written_and_loaded_back(pruned, tokenizer, tmp_path / "pruned"))


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_counts_agree_with_surgery(family: str, dense_folders: dict[str, Path]) -> None:
    """What the budget counts as removed (q/k/v biases included) is what surgery removes."""
    model, _ = load_model(str(dense_folders[family]))
    prunings = chosen_prunings(attention_geometry(model, decoder_layers(model)[0]).num_heads)
    pruned = remove_units(model, prunings)
    for dense_layer, pruned_layer, pruning in zip(decoder_layers(model), decoder_layers(pruned), prunings, strict=True):
        geometry = attention_geometry(model, dense_layer)
        expected = attention_params_removed(dense_layer, geometry, list(pruning.pruned_heads))
        expected += len(pruning.pruned_channels) * channel_params(dense_layer)
        assert sum(sublayer_parameters(dense_layer)) - sum(sublayer_parameters(pruned_layer)) == expected


@pytest.mark.parametrize("family", MAIN_FAMILIES)
def test_pipeline_checkpoint_loads_back_exact(family: str, dense_folders: dict[str, Path], tmp_path: Path) -> None:
    model, tokenizer = load_model(str(dense_folders[family]))
    result = prune_small(model, tokenizer, 0.5, "greedy")
    assert_computes_the_same(model, written_and_loaded_back(result.model, tokenizer, tmp_path / "pruned"))


@pytest.mark.parametrize("family", [*MAIN_FAMILIES, "pruned qwen2"])
def test_the_layer_by_layer_stream_is_the_model_s_own_forward(family: str, dense_folders: dict[str, Path]) -> None:
    """Calibration, allocation and verification carry the hidden states from layer to layer with the arguments
    captured before the first layer: each layer must get its own attention type's mask. Qwen2's layers slide from
    the second one on, past the window here; the pruned model keeps that per-layer pattern."""
    model, tokenizer = load_model(str(dense_folders[family.removeprefix("pruned ")]))
    if family.startswith("pruned"):
        model = prune_small(model, tokenizer, 0.5, "greedy").model
    windows = torch.randint(0, VOCAB, (2, 4 * WINDOW), generator=torch.Generator().manual_seed(7))
    expected = layer_outputs_of_the_model_s_own_forward(model, windows)
    inputs = capture_first_layer_inputs(model, windows, 2, CPU, CPU)
    for index, layer in enumerate(decoder_layers(model)):
        inputs.batches = run_layer(layer, inputs, CPU, CPU)
        assert torch.equal(inputs.batches[0], expected[index]), f"layer {index}"


@pytest.mark.parametrize("ratio", [0.2, 0.5, 0.8])
@pytest.mark.parametrize("solver", ["greedy", "diagonal"])
@pytest.mark.parametrize("family", MAIN_FAMILIES)
def test_pipeline_prunes_exactly(family: str, solver: str, ratio: float, dense_folders: dict[str, Path]) -> None:
    model, tokenizer = load_model(str(dense_folders[family]))
    result = prune_small(model, tokenizer, ratio, solver)  # raises unless its own verification passes
    assert_computes_the_same(model, [result.model], generation=False)  # generation: checked above, at 0.5
    # Within one rounding unit (one FFN channel's parameters), coarse 16-wide heads included.
    unit = channel_params(decoder_layers(model)[0])
    assert abs(result.params_dense - result.params_pruned - ratio * result.params_dense) <= unit


@pytest.mark.parametrize(
    ("family", "ratio", "settings"),
    [
        ("llama3", 0.35, {}),  # 8 query heads over 2 key/value heads: one whole group goes
        ("llama3", 0.5, {"compensation": "bias"}),  # o/down biases beside zero q/k/v/gate/up biases
        ("llama-biases", 0.5, {"compensation": "bias"}),
        ("mistral", 0.5, {"solver": "diagonal"}),
        ("qwen2", 0.5, {}),
        ("qwen3", 0.35, {}),  # 6 heads over 2: both groups stay, each loses one of its three heads
    ],
)
def test_uniform_shape_is_the_family_s_own_class(
    family: str, ratio: float, settings: dict[str, Any], dense_folders: dict[str, Path], tmp_path: Path
) -> None:
    """No remote code: the checkpoint loads as the dense model's class and computes what the masked model does."""
    model, tokenizer = load_model(str(dense_folders[family]))
    dense_class = type(model)
    result = prune_small(model, tokenizer, ratio, settings.pop("solver", "greedy"), shape="uniform", **settings)
    layers = decoder_layers(result.model)
    shapes = {(len(layer.self_attn.q_proj.weight), len(layer.self_attn.k_proj.weight)) for layer in layers}
    assert len(shapes) == 1 and len({layer.mlp.down_proj.in_features for layer in layers}) == 1
    assert type(result.model) is dense_class
    save_pruned(result.model, tokenizer, tmp_path / "pruned")
    assert "auto_map" not in json.loads((tmp_path / "pruned" / "config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=False).eval()
    assert type(loaded) is dense_class
    assert_computes_the_same(model, [loaded])


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_uniform_shape_refuses_a_bias_the_family_s_class_has_not(family: str, dense_folders: dict[str, Path]) -> None:
    model, tokenizer = load_model(str(dense_folders[family]))
    with pytest.raises(InvalidConfig, match=r"compensation: bias .* shape uniform cannot save it"):
        prune_small(model, tokenizer, 0.5, "greedy", shape="uniform", compensation="bias")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return small_run_arguments(tmp_path_factory.mktemp("text"))


@pytest.mark.parametrize(
    ("family", "solver", "ratio"),
    [
        ("llama3", "greedy", "0.2"),
        ("mistral", "diagonal", "0.5"),
        ("qwen2", "greedy", "0.8"),
        ("qwen3", "diagonal", "0.5"),
    ],
)
def test_casp_prune_succeeds(
    family: str,
    solver: str,
    ratio: str,
    dense_folders: dict[str, Path],
    small_run: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The whole job through the command line (evaluation, checkpoint, report, plots) once per family."""
    out = tmp_path / "pruned"
    model = str(dense_folders[family])
    status = cli.main(["prune", "--model", model, "--ratio", ratio, "--solver", solver, "--out", str(out), *small_run])
    assert status == 0, capsys.readouterr().err
    assert json.loads((out / "report.json").read_text())["verification"]["max_relative_diff"] <= 1e-10
    assert load_pruned(out)[0].config.casp["source_model"] == dense_folders[family].name


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (GPT2Config(n_layer=1, n_embd=32, n_head=2), "model type 'gpt2' is not supported"),
        (PhimoeConfig(num_hidden_layers=1), "model type 'phimoe' is not supported"),
        (LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=4), "6 attention heads cannot share 4"),
    ],
)
def test_unsupported_configs_are_refused(config: PretrainedConfig, named: str) -> None:
    with pytest.raises(UnsupportedModel, match=named):
        check_supported_config(config)


def test_settings_the_pruned_model_cannot_carry_are_refused() -> None:
    quantized = LlamaConfig()
    quantized.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(UnsupportedModel, match="quantization_config"):
        check_supported_config(quantized)
    unknown_rope = LlamaConfig()
    unknown_rope.rope_parameters = {"rope_type": "spiral", "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModel, match="rope type 'spiral'"):
        check_supported_config(unknown_rope)
    chunked = Qwen3Config(num_hidden_layers=2)
    chunked.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(UnsupportedModel, match="chunked_attention"):
        check_supported_config(chunked)


def test_cli_says_in_one_line_what_is_wrong_with_the_model_folder(
    tmp_path: Path, small_run: list[str], capfd: pytest.CaptureFixture[str]
) -> None:
    """Each folder is broken in one way; the refusal comes before any calibration or pruning."""
    unknown_type = tmp_path / "unknown-type"
    unknown_type.mkdir()
    (unknown_type / "config.json").write_text(json.dumps({"model_type": "no_such_model", "hidden_size": 8}))
    moe = tmp_path / "moe"
    PhimoeConfig(num_hidden_layers=1).save_pretrained(moe)  # a config alone: refused without weights
    cases = {
        unknown_type: "casp: error: unsupported_model: model type 'no_such_model' is not supported",
        moe: "casp: error: unsupported_model: model type 'phimoe' is not supported",
        write_dense(FAMILIES["qwen2"](), tmp_path / "no-weights", weights=False): (
            "casp: error: model_not_found: cannot load the weights of model"
        ),
        write_dense(FAMILIES["qwen2"](), tmp_path / "no-tokenizer", tokenizer=False): (
            "casp: error: model_not_found: cannot load the tokenizer of model"
        ),
    }
    capfd.readouterr()
    for folder, expected in cases.items():
        out = tmp_path / f"{folder.name}-out"
        status = cli.main(["prune", "--model", str(folder), "--ratio", "0.3", "--out", str(out), *small_run])
        # All of stderr but the stage line naming the model being loaded: one line, no traceback.
        errors = [line for line in capfd.readouterr().err.splitlines() if not line.startswith("casp: load:")]
        assert status == 2 and len(errors) == 1 and errors[0].startswith(expected), errors
        assert not out.exists()
