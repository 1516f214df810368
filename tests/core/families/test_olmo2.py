"""OLMo 2 prunes FFN channels exactly, and no attention head (its q/k norms span every head; see
casp_core/families/olmo2.py): the pipeline meets the ratio from channels alone and refuses a ratio the MLP cannot
give; the uniform shape is Olmo2ForCausalLM; the written checkpoints load in a user's fresh process (and under the
lowest supported transformers); recovery works; the GGUF export is refused before any work."""

import json
from pathlib import Path

import pytest
from transformers import Olmo2Config, Olmo2ForCausalLM

from casp_core.cli import main as cli
from casp_core.errors import InvalidConfig, UnsupportedExport, VerificationFailed
from casp_core.families import check_export
from casp_core.families.modeling.modeling_casp_olmo2 import CaspOlmo2ForCausalLM
from casp_core.method.budget import channel_params
from casp_core.method.surgery import LayerPruning, remove_units
from casp_core.model import attention_geometry, decoder_layers, load_model, sublayer_parameters
from tests.core.artifacts.test_generation import lowest_supported_transformers
from tests.core.families.checkpoints import (
    assert_recovery_trains_and_reloads,
    fresh_logits,
    pipeline_checkpoints_of,
)
from tests.core.families.helpers import (
    COMMON,
    WIDTH,
    assert_computes_the_same,
    chosen_prunings,
    masked_copy,
    prune_small,
    small_run_arguments,
    write_dense,
    written_and_loaded_back,
)

# The stories260K tokenizer's <s> and </s> (Olmo2Config's defaults lie outside its 512 tokens).
TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dense(Olmo2Config(**COMMON, **TOKEN_IDS), tmp_path_factory.mktemp("dense") / "olmo2")


def channel_prunings() -> list[LayerPruning]:
    """The chosen channels of the other families' tests (half of one layer's, none of another's), no head."""
    return [LayerPruning((), pruning.pruned_channels) for pruning in chosen_prunings(COMMON["num_attention_heads"])]


def test_chosen_channels_prune_exactly(dense_folder: Path, tmp_path: Path) -> None:
    model, tokenizer = load_model(str(dense_folder))
    pruned = remove_units(model, channel_prunings())
    assert type(pruned) is CaspOlmo2ForCausalLM
    assert pruned.config.layer_intermediate_sizes == [WIDTH - 3, WIDTH // 2, WIDTH]
    assert_computes_the_same(
        masked_copy(model, channel_prunings()), written_and_loaded_back(pruned, tokenizer, tmp_path)
    )
    assert {"modeling_casp_olmo2.py", "modeling_casp_llama.py"} <= {path.name for path in tmp_path.iterdir()}


def test_surgery_refuses_to_remove_a_head(dense_folder: Path) -> None:
    model, _ = load_model(str(dense_folder))
    with pytest.raises(VerificationFailed, match="OLMo 2 keeps every attention head"):
        remove_units(model, chosen_prunings(COMMON["num_attention_heads"]))


@pytest.mark.parametrize("ratio", [0.3, 0.5])
def test_the_pipeline_meets_the_ratio_from_channels_alone(ratio: float, dense_folder: Path) -> None:
    model, tokenizer = load_model(str(dense_folder))
    result = prune_small(model, tokenizer, ratio, "greedy")  # raises unless its own verification passes
    heads = COMMON["num_attention_heads"]
    for dense_layer, layer in zip(decoder_layers(model), decoder_layers(result.model), strict=True):
        assert attention_geometry(result.model, layer).num_heads == heads
        assert sublayer_parameters(layer)[0] == sublayer_parameters(dense_layer)[0]  # attention whole
    unit = channel_params(decoder_layers(model)[0])
    assert abs(result.params_dense - result.params_pruned - ratio * result.params_dense) <= unit


def test_a_ratio_beyond_the_mlp_is_refused(dense_folder: Path) -> None:
    """The MLP holds 18432 of a layer's 28672 projection parameters here, and r_max caps each layer's channels:
    0.7 cannot come from channels alone, and the refusal says so in one line."""
    model, tokenizer = load_model(str(dense_folder))
    with pytest.raises(
        InvalidConfig, match=r"^ratio: 0.7 cannot be reached .*FFN channels alone \(OLMo 2 keeps"
    ) as refused:
        prune_small(model, tokenizer, 0.7, "greedy")
    assert "\n" not in str(refused.value)
    assert all(not layer.mlp.down_proj.weight.eq(0).all(0).any() for layer in decoder_layers(model))  # nothing masked


def test_mean_bias_compensation_is_carried_per_layer_and_refused_uniform(dense_folder: Path, tmp_path: Path) -> None:
    """FLAP's o_proj and down_proj biases: CaspOlmo2Config switches them apart from OLMo 2's one `attention_bias`
    (q/k/v stay without); Olmo2ForCausalLM has no down_proj bias, so the uniform shape refuses the combination."""
    model, tokenizer = load_model(str(dense_folder))
    with pytest.raises(InvalidConfig, match=r"compensation: bias .* Olmo2ForCausalLM .* shape uniform"):
        prune_small(model, tokenizer, 0.5, "greedy", shape="uniform", compensation="bias")
    result = prune_small(model, tokenizer, 0.5, "greedy", compensation="bias")  # masks `model`
    attention = decoder_layers(result.model)[0].self_attn
    assert attention.o_proj.bias is not None and attention.q_proj.bias is None
    assert_computes_the_same(model, written_and_loaded_back(result.model, tokenizer, tmp_path), generation=False)


@pytest.mark.parametrize(("ratio", "solver"), [("0.3", "greedy"), ("0.5", "diagonal")])
def test_casp_prune_succeeds(
    ratio: str,
    solver: str,
    dense_folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "pruned"
    arguments = ["prune", "--model", str(dense_folder), "--ratio", ratio, "--solver", solver, "--out", str(out)]
    assert cli.main([*arguments, *small_run_arguments(tmp_path)]) == 0, capsys.readouterr().err
    assert json.loads((out / "report.json").read_text())["verification"]["max_relative_diff"] <= 1e-10
    assert json.loads((out / "config.json").read_text())["model_type"] == "casp_olmo2"


@pytest.fixture(scope="module")
def pipeline_checkpoints(dense_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Per shape, the masked dense model's logits and the written checkpoint of the real pipeline at 0.5."""
    return pipeline_checkpoints_of(dense_folder, tmp_path_factory.mktemp("olmo2-pruned"))


def test_written_checkpoints_load_where_casp_core_is_not(
    pipeline_checkpoints: dict[str, tuple], tmp_path: Path
) -> None:
    """A user's fresh process: the per-layer checkpoint with its own modeling file (trust_remote_code=True), the
    uniform one as Olmo2ForCausalLM without remote code; both compute the masked model's logits."""
    checkpoints = {pipeline_checkpoints[shape][1]: shape == "per_layer" for shape in ("per_layer", "uniform")}
    logits, records = fresh_logits(checkpoints, tmp_path)
    assert records[-1] == {"casp_core_imported": False}
    classes = {record["checkpoint"]: record["class"] for record in records[:-1]}
    for shape, expected_class in (("per_layer", "CaspOlmo2ForCausalLM"), ("uniform", "Olmo2ForCausalLM")):
        expected, checkpoint = pipeline_checkpoints[shape][:2]
        assert classes[str(checkpoint)] == expected_class
        assert (logits[str(checkpoint)] - expected).abs().max().item() <= 1e-9 * expected.abs().max().item()
    assert "auto_map" not in json.loads((pipeline_checkpoints["uniform"][1] / "config.json").read_text())
    assert isinstance(pipeline_checkpoints["uniform"][2], Olmo2ForCausalLM)


# the lowest transformers: `make test-slow` (tests/core/artifacts/test_generation.py keeps it for LLaMA in `make test`)
@pytest.mark.slow
def test_the_per_layer_checkpoint_loads_under_the_lowest_transformers(
    pipeline_checkpoints: dict[str, tuple], tmp_path: Path
) -> None:
    """transformers 5.4's own Olmo2Config refuses every OLMo 2 config.json (it declares tie_word_embeddings an int,
    which huggingface_hub's strict dataclasses keep from being false), so the uniform checkpoint, like the dense
    model, needs a later transformers; the per-layer config declares it a bool and loads."""
    expected, checkpoint = pipeline_checkpoints["per_layer"][:2]
    logits, records = fresh_logits({checkpoint: True}, tmp_path, lowest=True)
    assert (
        records[0]["transformers"] == lowest_supported_transformers() and records[0]["class"] == "CaspOlmo2ForCausalLM"
    )
    assert (logits[str(checkpoint)] - expected).abs().max().item() <= 1e-9 * expected.abs().max().item()


def test_recovery_trains_the_pruned_checkpoint(
    pipeline_checkpoints: dict[str, tuple],
    tmp_path: Path,
) -> None:
    _, _, pruned, tokenizer = pipeline_checkpoints["per_layer"]
    assert_recovery_trains_and_reloads(pruned, tokenizer, tmp_path)


def test_gguf_export_is_refused_before_any_work(
    pipeline_checkpoints: dict[str, tuple], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`casp prune --export gguf` from the config alone (the folder has no weights), in one line naming the family;
    and from either written checkpoint's config (what `casp export` reads)."""
    config_only = write_dense(Olmo2Config(**COMMON, **TOKEN_IDS), tmp_path / "olmo2-config", weights=False)
    out = tmp_path / "out"
    arguments = ["prune", "--model", str(config_only), "--ratio", "0.3", "--out", str(out), "--export", "gguf"]
    capfd.readouterr()
    status = cli.main([*arguments, *small_run_arguments(tmp_path)])
    errors = capfd.readouterr().err.strip().splitlines()
    assert status == 2 and len(errors) == 1, errors
    assert errors[0].startswith("casp: error: unsupported_export: GGUF export: OLMo 2 (model type 'olmo2')"), errors
    assert "shape: uniform" in errors[0] and not out.exists()
    for _, _, pruned, _ in pipeline_checkpoints.values():
        with pytest.raises(UnsupportedExport, match=r"GGUF export: OLMo 2 .*q/k norms"):
            check_export(pruned.config, ["gguf"])
