"""Gemma 2 and Gemma 3 (text) prune exactly, load back where users load them, and refuse the GGUF export.

The tiny checkpoints are built with transformers' own Gemma2Config / Gemma3TextConfig and keep what makes Gemma
Gemma where a lost detail changes the logits: head_dim 16 on a 64-wide model with 8 heads, sliding layers with a
window shorter than the inputs, query_pre_attn_scalar apart from head_dim, soft-capping that bites (Gemma 2),
q/k norms and a scaled rope on the global layers only (Gemma 3), every norm and weight random. Untied embeddings
keep greedy generation from repeating one token (Gemma's sqrt(hidden_size) embedding scale would otherwise
dominate the tied head); the tied path is the Llama 3 test family's.
"""

import copy
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.artifacts.gguf.writer import export_gguf
from casp_core.artifacts.upgrade import upgrade_checkpoint
from casp_core.cli import main as cli
from casp_core.errors import InvalidConfig, UnsupportedExport, UnsupportedModel
from casp_core.families import family_of
from casp_core.families.modeling.modeling_casp_gemma import CaspGemma2ForCausalLM, CaspGemma3ForCausalLM
from casp_core.method.calibration import capture_first_layer_inputs, run_layer
from casp_core.method.surgery import remove_units
from casp_core.model import attention_geometry, check_supported_config, decoder_layers, load_model
from casp_core.recovery.train import recover
from casp_core.run import CPU
from casp_core.settings import RecoveryConfig
from tests.conftest import REPO
from tests.core.artifacts.test_generation import lowest_supported_transformers
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
    small_training_data,
    write_dense,
    written_and_loaded_back,
)
from tests.core.fresh_process import run_python

GEMMA = {**COMMON, "head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24, "tie_word_embeddings": False}
GEMMA3_ROPE = {  # Gemma 3 4B's layout: the global layers' rope scaled, the sliding layers' with their own base
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}
FAMILIES: dict[str, Callable[[], PretrainedConfig]] = {
    "gemma2": lambda: Gemma2Config(**GEMMA, attn_logit_softcapping=10.0, final_logit_softcapping=5.0),
    "gemma3": lambda: Gemma3TextConfig(
        **GEMMA,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=copy.deepcopy(GEMMA3_ROPE),
    ),
}
CLASSES = {
    "gemma2": (CaspGemma2ForCausalLM, Gemma2ForCausalLM),
    "gemma3": (CaspGemma3ForCausalLM, Gemma3ForCausalLM),
}
LOWEST_TRANSFORMERS = (
    REPO / ".venv" / "transformers-lowest"
)  # `make install`, as for tests/core/artifacts/test_generation.py
VERSIONS = ("locked", "lowest")
# Gemma 2's soft-capping has no SDPA path in transformers 5.24 (it refuses the implementation); Gemma 3 runs both.
ATTENTIONS = {"gemma2": ("eager",), "gemma3": ("eager", "sdpa")}


@pytest.fixture(scope="module")
def dense_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma")
    return {name: write_dense(make(), root / name) for name, make in FAMILIES.items()}


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return small_run_arguments(tmp_path_factory.mktemp("text"))


@pytest.mark.parametrize("family", FAMILIES)
def test_chosen_units_prune_exactly(family: str, dense_folders: dict[str, Path], tmp_path: Path) -> None:
    """Uneven key/value groups, a layer with no head and half its channels, a layer without one whole group."""
    model, tokenizer = load_model(str(dense_folders[family]))
    prunings = chosen_prunings(attention_geometry(model, decoder_layers(model)[0]).num_heads)
    pruned = remove_units(model, prunings)
    assert type(pruned) is CLASSES[family][0] and pruned.model.layers[0].self_attn.gather_kv
    assert pruned.config.layer_kv_of_query[1] == [] and pruned.config.head_dim == 16
    assert_computes_the_same(masked_copy(model, prunings), written_and_loaded_back(pruned, tokenizer, tmp_path))
    # Both modeling files travel with the checkpoint (the Gemma one imports the key/value gather from the other),
    # and `casp upgrade` finds them current.
    assert {"modeling_casp_gemma.py", "modeling_casp_llama.py"} <= {path.name for path in tmp_path.iterdir()}
    assert upgrade_checkpoint(tmp_path)["status"] == "up_to_date"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_layer_by_layer_stream_is_the_model_s_own_forward(family: str, dense_folders: dict[str, Path]) -> None:
    """Calibration carries the hidden states from layer to layer with what the model hands each attention type:
    the sliding layers' mask and, for Gemma 3, their own rope tables."""
    model, _ = load_model(str(dense_folders[family]))
    windows = torch.randint(0, VOCAB, (2, 4 * WINDOW), generator=torch.Generator().manual_seed(7))
    expected = layer_outputs_of_the_model_s_own_forward(model, windows)
    inputs = capture_first_layer_inputs(model, windows, 2, CPU, CPU)
    for index, layer in enumerate(decoder_layers(model)):
        inputs.batches = run_layer(layer, inputs, CPU, CPU)
        assert torch.equal(inputs.batches[0], expected[index]), f"layer {index}"


@pytest.fixture(scope="module")
def pipeline_pruned(dense_folders: dict[str, Path]) -> dict[str, tuple[PreTrainedModel, PreTrainedModel, Any]]:
    """Per family, the pipeline's per-layer model at 0.5, the masked dense model it was verified against, and the
    tokenizer."""
    pruned = {}
    for family, folder in dense_folders.items():
        model, tokenizer = load_model(str(folder))
        result = prune_small(model, tokenizer, 0.5, "greedy")  # masks `model` in place
        pruned[family] = (result.model, model, tokenizer)
    return pruned


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_checkpoint_loads_back_exact(
    family: str, pipeline_pruned: dict[str, tuple[PreTrainedModel, PreTrainedModel, Any]], tmp_path: Path
) -> None:
    pruned, masked, tokenizer = pipeline_pruned[family]
    assert type(pruned) is CLASSES[family][0]
    assert_computes_the_same(masked, written_and_loaded_back(pruned, tokenizer, tmp_path))


@pytest.mark.parametrize("family", FAMILIES)
def test_bias_compensation_is_carried_per_layer_and_refused_in_gemma_s_own_class(
    family: str, dense_folders: dict[str, Path], tmp_path: Path
) -> None:
    """Mean-bias compensation biases o_proj and down_proj: the per-layer class carries them (before Gemma's
    post-norms, as the masked model has them); Gemma's own config has no down_proj bias, so the uniform shape
    refuses it before any work."""
    model, tokenizer = load_model(str(dense_folders[family]))
    with pytest.raises(InvalidConfig, match=r"compensation: bias .* shape uniform cannot save it"):
        prune_small(model, tokenizer, 0.5, "greedy", shape="uniform", compensation="bias")
    result = prune_small(model, tokenizer, 0.5, "greedy", compensation="bias")
    assert result.model.config.attention_o_bias and result.model.config.mlp_down_bias
    assert not result.model.config.attention_qkv_bias
    assert_computes_the_same(model, written_and_loaded_back(result.model, tokenizer, tmp_path), generation=False)


@pytest.mark.parametrize(
    ("family", "ratio", "solver"),
    [
        ("gemma2", "0.3", "greedy"),
        ("gemma2", "0.5", "diagonal"),
        ("gemma3", "0.3", "diagonal"),
        ("gemma3", "0.5", "greedy"),
    ],
)
def test_casp_prune_succeeds(
    family: str,
    ratio: str,
    solver: str,
    dense_folders: dict[str, Path],
    small_run: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The whole job through the command line: calibration, allocation, verification, evaluation, checkpoint."""
    out = tmp_path / "pruned"
    argv = ["prune", "--model", str(dense_folders[family]), "--ratio", ratio, "--solver", solver, "--out", str(out)]
    assert cli.main([*argv, *small_run]) == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["verification"]["max_relative_diff"] <= 1e-10
    pruned = load_pruned(out)[0]
    assert type(pruned) is CLASSES[family][0]
    # The card shows no command that would fail: casp's GGUF export refuses Gemma, and the card says so instead.
    card = (out / "README.md").read_text()
    assert "casp export" not in card and "llama-cli" not in card
    name = family_of(pruned.config).name
    assert f"casp's GGUF export refuses this checkpoint (GGUF export: {name} (model type" in card


# Run in a fresh process that never imports casp_core: each argument REFERENCE:CHECKPOINT:TRUST:ATTENTIONS, the
# masked dense model and the checkpoint, loaded with trust_remote_code as TRUST says, with each attention
# implementation named (comma-separated); the first argument, where not empty, is a transformers installed apart
# that goes first on the path.
FRESH_LOAD = """
import json, sys
if sys.argv[1]:
    sys.path.insert(0, sys.argv[1])
import torch, transformers
from transformers import AutoModelForCausalLM

torch.set_num_threads(1)
tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(3))
for pair in sys.argv[2:]:
    reference_path, path, trust, attentions = pair.split(":")
    prompt = tokens[:1, :6]
    # Each implementation against the reference in the same one: eager and SDPA differ in the last digits.
    for attention in attentions.split(","):
        reference = AutoModelForCausalLM.from_pretrained(reference_path, attn_implementation=attention)
        model = AutoModelForCausalLM.from_pretrained(
            path, trust_remote_code=trust == "trust", attn_implementation=attention
        )
        reference, model = reference.double().eval(), model.double().eval()
        with torch.no_grad():
            expected = reference(tokens).logits
            difference = (model(tokens).logits - expected).abs().max().item() / max(1.0, expected.abs().max().item())
            generated = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
            reference_generated = reference.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        print(json.dumps({
            "checkpoint": path,
            "attention": attention,
            "class": type(model).__name__,
            "transformers": transformers.__version__,
            "relative_difference": difference,
            "same_generation": torch.equal(generated, reference_generated),
            "distinct_tokens": len(set(generated[0, 6:].tolist())),
            "casp_core_imported": "casp_core" in sys.modules,
        }), flush=True)
"""


@pytest.fixture(scope="module")
def fresh_loads(
    dense_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[tuple[str, str, str], dict]]:
    """Per transformers version, per (family, shape, attention), what the fresh process saw: the per-layer
    checkpoint of the chosen units (trust_remote_code=True) and the pipeline's uniform shape at 0.35
    (trust_remote_code=False)."""
    root = tmp_path_factory.mktemp("fresh")
    pairs, written = [], {}
    for family, folder in dense_folders.items():
        model, tokenizer = load_model(str(folder))
        prunings = chosen_prunings(attention_geometry(model, decoder_layers(model)[0]).num_heads)
        save_pruned(remove_units(model, prunings), tokenizer, root / f"{family}-per_layer")
        masked_copy(model, prunings).save_pretrained(root / f"{family}-per_layer-masked")
        uniform = prune_small(model, tokenizer, 0.35, "greedy", shape="uniform")  # masks `model` in place
        save_pruned(uniform.model, tokenizer, root / f"{family}-uniform")
        model.save_pretrained(root / f"{family}-uniform-masked")
        for shape, trust in (("per_layer", "trust"), ("uniform", "no")):
            checkpoint = root / f"{family}-{shape}"
            pairs.append(f"{checkpoint}-masked:{checkpoint}:{trust}:{','.join(ATTENTIONS[family])}")
            written[str(checkpoint)] = (family, shape)
    assert LOWEST_TRANSFORMERS.is_dir(), f"{LOWEST_TRANSFORMERS} is missing: run `make install`"
    cwd = root / "elsewhere"
    cwd.mkdir()
    paths = {"locked": "", "lowest": str(LOWEST_TRANSFORMERS)}
    with ThreadPoolExecutor(len(VERSIONS)) as pool:  # side by side: one process per version
        runs = {version: pool.submit(run_python, FRESH_LOAD, paths[version], *pairs, cwd=cwd) for version in VERSIONS}
        outcomes = {version: run.result() for version, run in runs.items()}
    records = {}
    for version, outcome in outcomes.items():
        assert outcome.returncode == 0, outcome.stderr[-3000:]
        lines = [json.loads(line) for line in outcome.stdout.splitlines() if line.startswith("{")]
        records[version] = {(*written[record["checkpoint"]], record["attention"]): record for record in lines}
    return records


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoints_load_where_users_load_them(
    family: str, version: str, fresh_loads: dict[str, dict[tuple[str, str, str], dict]]
) -> None:
    """The per-layer checkpoint with its own modeling file (trust_remote_code=True), the uniform shape as
    transformers' own Gemma class (trust_remote_code=False), in a process that never imports casp_core, under the
    locked and the lowest supported transformers: the masked model's logits and greedy generation."""
    per_layer_class, own_class = CLASSES[family]
    mine = {key: record for key, record in fresh_loads[version].items() if key[0] == family}
    shapes = (("per_layer", per_layer_class), ("uniform", own_class))
    assert sorted(mine) == sorted((family, shape, attention) for shape, _ in shapes for attention in ATTENTIONS[family])
    for (_, shape, attention), record in mine.items():
        where = f"{family}, {shape}, {attention}, transformers {record['transformers']}"
        assert record["class"] == dict(shapes)[shape].__name__, where
        assert not record["casp_core_imported"], where
        assert record["relative_difference"] <= 1e-9, where
        assert record["same_generation"] and record["distinct_tokens"] > 3, where
        assert (version == "lowest") == (record["transformers"] == lowest_supported_transformers()), where


@pytest.mark.parametrize("family", FAMILIES)
def test_recovery_trains_the_pruned_model(
    family: str,
    pipeline_pruned: dict[str, tuple[PreTrainedModel, PreTrainedModel, Any]],
    tmp_path: Path,
) -> None:
    """LoRA on every projection of the pruned Gemma (names as in LLaMA), merged back: same shapes, new weights, and
    the checkpoint written after it loads back to the same logits."""
    pruned, _, tokenizer = pipeline_pruned[family]
    data = small_training_data(tokenizer, tmp_path)
    settings = RecoveryConfig(method="lora", max_steps=2, batch_size=2, grad_accum=1, max_seq_len=32, lr=1e-2)
    recovered, result = recover(copy.deepcopy(pruned), tokenizer, data, settings, device="cpu")
    assert result.steps == 2 and all(torch.isfinite(torch.tensor(point["loss"])) for point in result.curve)
    assert {n: t.shape for n, t in recovered.state_dict().items()} == {
        n: t.shape for n, t in pruned.state_dict().items()
    }
    tokens = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        logits = recovered(tokens).logits
        assert not torch.allclose(pruned(tokens).logits, logits, atol=1e-4)
        save_pruned(recovered, tokenizer, tmp_path)
        torch.testing.assert_close(load_pruned(tmp_path)[0](tokens).logits, logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_export_is_refused_naming_the_family(
    family: str,
    dense_folders: dict[str, Path],
    small_run: list[str],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """casp writes llama.cpp's llama and deci architectures, neither of which has Gemma's layer: `casp prune` refuses
    from the dense config in one line before any work, suggesting the uniform shape, and the export of a pruned
    checkpoint is refused as well, writing nothing."""
    model, tokenizer = load_model(str(dense_folders[family]))
    name = family_of(model.config).name
    out = tmp_path / "out"
    arguments = ["prune", "--model", str(dense_folders[family]), "--ratio", "0.3", "--out", str(out)]
    capfd.readouterr()
    status = cli.main([*arguments, "--export", "gguf", *small_run])
    errors = capfd.readouterr().err.strip().splitlines()
    assert status == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"casp: error: unsupported_export: GGUF export: {name} (model type"), errors
    assert "use shape uniform" in errors[0] and not out.exists()
    save_pruned(remove_units(model, chosen_prunings(8)), tokenizer, tmp_path / "pruned")
    with pytest.raises(UnsupportedExport, match=rf"GGUF export: {name} \(model type 'casp_"):
        export_gguf(tmp_path / "pruned", tmp_path / "model.gguf")
    assert not list(tmp_path.glob("*gguf*"))


def test_settings_the_pruned_classes_cannot_carry_are_refused() -> None:
    bidirectional = FAMILIES["gemma2"]()
    bidirectional.use_bidirectional_attention = True
    with pytest.raises(UnsupportedModel, match="use_bidirectional_attention"):
        check_supported_config(bidirectional)
    unknown_local_rope = FAMILIES["gemma3"]()
    unknown_local_rope.rope_parameters["sliding_attention"]["rope_type"] = "spiral"
    with pytest.raises(UnsupportedModel, match="rope type 'spiral' of the sliding_attention layers"):
        check_supported_config(unknown_local_rope)
    with pytest.raises(UnsupportedModel, match="model type 'gemma3' is not supported"):
        family_of("gemma3")  # the multimodal Gemma 3: its text model saved alone is gemma3_text
