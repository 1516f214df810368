"""Granite 3 prunes exactly under its four multipliers: per-layer heads (uneven groups, a layer without heads) and
FFN widths, the uniform shape as GraniteForCausalLM, the written checkpoints loaded by a user's fresh process (and
by the lowest supported transformers), recovery, and the GGUF export with the multipliers folded into the weights,
computing in llama.cpp what transformers computes."""

import json
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GraniteConfig, GraniteForCausalLM

from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.artifacts.gguf.writer import export_gguf
from casp_core.cli import main as cli
from casp_core.families.modeling.modeling_casp_granite import CaspGraniteConfig, CaspGraniteForCausalLM
from casp_core.method.surgery import remove_units
from casp_core.model import attention_geometry, decoder_layers, load_model
from tests.core.artifacts.test_generation import lowest_supported_transformers
from tests.core.families.checkpoints import (
    assert_recovery_trains_and_reloads,
    fresh_logits,
    pipeline_checkpoints_of,
    test_tokens,
)
from tests.core.families.helpers import (
    COMMON,
    assert_computes_the_same,
    chosen_prunings,
    masked_copy,
    prune_small,
    small_run_arguments,
    write_dense,
    written_and_loaded_back,
)

# Far from 1 (and attention's far from 1/sqrt(head_dim)), so that a multiplier lost anywhere changes the logits.
MULTIPLIERS = {
    "embedding_multiplier": 12.0,
    "attention_multiplier": 0.015625,
    "residual_multiplier": 0.22,
    "logits_scaling": 8.0,
}


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dense(GraniteConfig(**COMMON, **MULTIPLIERS), tmp_path_factory.mktemp("dense") / "granite")


def test_chosen_units_prune_exactly(dense_folder: Path, tmp_path: Path) -> None:
    """Uneven key/value groups, a layer that keeps no head, a layer that loses a whole group."""
    model, tokenizer = load_model(str(dense_folder))
    prunings = chosen_prunings(attention_geometry(model, decoder_layers(model)[0]).num_heads)
    pruned = remove_units(model, prunings)
    assert type(pruned) is CaspGraniteForCausalLM and pruned.config.layer_kv_of_query[1] == []
    assert pruned.model.layers[0].self_attn.gather_kv
    assert_computes_the_same(masked_copy(model, prunings), written_and_loaded_back(pruned, tokenizer, tmp_path))
    # The modeling file and the Llama-family one it imports travel with the checkpoint.
    assert {"modeling_casp_granite.py", "modeling_casp_llama.py"} <= {path.name for path in tmp_path.iterdir()}


@pytest.mark.parametrize("multiplier", MULTIPLIERS)
def test_every_multiplier_reaches_the_logits(multiplier: str, dense_folder: Path) -> None:
    """The exactness above could not hold with a multiplier lost: the pruned model without it computes otherwise."""
    model, _ = load_model(str(dense_folder))
    prunings = chosen_prunings(attention_geometry(model, decoder_layers(model)[0]).num_heads)
    pruned = remove_units(model, prunings)
    without = CaspGraniteForCausalLM(CaspGraniteConfig(**{**pruned.config.to_dict(), multiplier: 1.0})).eval()
    without.load_state_dict(pruned.state_dict())
    tokens = test_tokens()
    with torch.no_grad():
        difference = (pruned(tokens).logits - without(tokens).logits).abs().max().item()
    assert difference > 1e-3


@pytest.mark.parametrize(("ratio", "solver", "export"), [("0.3", "greedy", []), ("0.5", "diagonal", ["gguf"])])
def test_casp_prune_succeeds(
    ratio: str,
    solver: str,
    export: list[str],
    dense_folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The whole job through the command line: calibration, allocation, verification, evaluation, checkpoint (and
    at 0.5 the GGUF export the job asks for)."""
    out = tmp_path / "pruned"
    arguments = ["prune", "--model", str(dense_folder), "--ratio", ratio, "--solver", solver, "--out", str(out)]
    arguments += [argument for kind in export for argument in ("--export", kind, "--gguf-type", "f32")]
    assert cli.main([*arguments, *small_run_arguments(tmp_path)]) == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["verification"]["max_relative_diff"] <= 1e-10
    assert json.loads((out / "config.json").read_text())["model_type"] == "casp_granite"
    if export:
        assert llama_cpp_relative_difference(out, out / "model-f32.gguf") <= 1e-4


@pytest.mark.parametrize("shape", ["per_layer", "uniform"])
def test_mean_bias_compensation_is_carried(shape: str, dense_folder: Path, tmp_path: Path) -> None:
    """FLAP's o_proj and down_proj biases: CaspGraniteConfig's own switches per layer; GraniteConfig's
    `attention_bias`/`mlp_bias` in the uniform shape, beside zero q/k/v/gate/up biases."""
    model, tokenizer = load_model(str(dense_folder))
    result = prune_small(model, tokenizer, 0.5, "greedy", shape=shape, compensation="bias")  # masks `model`
    layer = decoder_layers(result.model)[0]
    assert layer.self_attn.o_proj.bias is not None and layer.mlp.down_proj.bias is not None
    if shape == "per_layer":
        assert_computes_the_same(model, written_and_loaded_back(result.model, tokenizer, tmp_path), generation=False)
    else:
        save_pruned(result.model, tokenizer, tmp_path)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        assert_computes_the_same(model, [loaded], generation=False)


@pytest.fixture(scope="module")
def pipeline_checkpoints(dense_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Per shape, the masked dense model's logits and the written checkpoint of the real pipeline at 0.5."""
    return pipeline_checkpoints_of(dense_folder, tmp_path_factory.mktemp("granite-pruned"))


# the lowest transformers: `make test-slow` (tests/core/artifacts/test_generation.py keeps it for LLaMA in `make test`)
@pytest.mark.parametrize("lowest", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["locked", "lowest"])
def test_written_checkpoints_load_where_casp_core_is_not(
    lowest: bool, pipeline_checkpoints: dict[str, tuple], tmp_path: Path
) -> None:
    """A user's fresh process, under the locked and the lowest supported transformers: the per-layer checkpoint
    with its own modeling file (trust_remote_code=True), the uniform one as GraniteForCausalLM without remote code;
    both compute the masked model's logits."""
    checkpoints = {pipeline_checkpoints[shape][1]: shape == "per_layer" for shape in ("per_layer", "uniform")}
    logits, records = fresh_logits(checkpoints, tmp_path, lowest=lowest)
    assert records[-1] == {"casp_core_imported": False}
    assert {record["transformers"] for record in records[:-1]} == {
        lowest_supported_transformers() if lowest else transformers.__version__
    }
    classes = {record["checkpoint"]: record["class"] for record in records[:-1]}
    for shape, expected_class in (("per_layer", "CaspGraniteForCausalLM"), ("uniform", "GraniteForCausalLM")):
        expected, checkpoint = pipeline_checkpoints[shape][:2]
        assert classes[str(checkpoint)] == expected_class
        assert (logits[str(checkpoint)] - expected).abs().max().item() <= 1e-9 * expected.abs().max().item()
    assert "auto_map" not in json.loads((pipeline_checkpoints["uniform"][1] / "config.json").read_text())
    assert isinstance(pipeline_checkpoints["uniform"][2], GraniteForCausalLM)


def test_recovery_trains_the_pruned_checkpoint(
    pipeline_checkpoints: dict[str, tuple],
    tmp_path: Path,
) -> None:
    _, _, pruned, tokenizer = pipeline_checkpoints["per_layer"]
    assert_recovery_trains_and_reloads(pruned, tokenizer, tmp_path)


@pytest.fixture(scope="module")
def tied_dense_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As Granite 3's 2B and 8B models: the head is the embedding, which the GGUF must write apart, scaled."""
    config = GraniteConfig(**COMMON, **MULTIPLIERS, tie_word_embeddings=True)
    return write_dense(config, tmp_path_factory.mktemp("dense") / "granite-tied")


def llama_cpp_relative_difference(checkpoint: Path, gguf_path: Path) -> float:
    """max |llama.cpp - transformers| / max |transformers| over the logits of 64 tokens, f32 throughout."""
    model = (
        load_pruned(checkpoint, dtype="float32")
        if (checkpoint / "modeling_casp_granite.py").is_file()
        else load_model(str(checkpoint), dtype="float32")
    )[0]
    ids = test_tokens()[0].tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    llm = llama_cpp.Llama(
        model_path=str(gguf_path),
        n_ctx=len(ids),
        n_batch=len(ids),
        logits_all=True,
        n_threads=2,
        verbose=False,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
    )
    llm.eval(ids)
    actual = np.asarray(llm.scores[: len(ids)])
    llm.close()
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("checkpoint", ["dense", "per_layer", "per_layer_tied", "uniform"])
def test_f32_gguf_computes_what_transformers_computes(
    checkpoint: str,
    dense_folder: Path,
    tied_dense_folder: Path,
    pipeline_checkpoints: dict[str, tuple],
    tmp_path: Path,
) -> None:
    """The multipliers folded into the weights: llama.cpp's deci (per layer: uneven groups, a layer without heads)
    or llama graph computes Granite's logits, as for LLaMA (tests/core/artifacts/gguf/test_gguf.py's bound, 1e-4)."""
    if checkpoint == "dense":
        folder = dense_folder
    elif checkpoint == "uniform":
        folder = pipeline_checkpoints["uniform"][1]
    else:
        model, tokenizer = load_model(str(tied_dense_folder if checkpoint.endswith("tied") else dense_folder))
        folder = tmp_path / "pruned"
        save_pruned(remove_units(model, chosen_prunings(COMMON["num_attention_heads"])), tokenizer, folder)
    exported = export_gguf(folder, tmp_path / "model.gguf", "f32")
    assert exported.architecture == ("deci" if checkpoint.startswith("per_layer") else "llama")
    assert llama_cpp_relative_difference(folder, exported.path) <= 1e-4
