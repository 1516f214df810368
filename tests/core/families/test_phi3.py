"""Phi-3 / Phi-4: fused qkv_proj and gate_up_proj cut per head and per channel, exactly.

Tiny random checkpoints built with transformers' Phi3Config: a Phi-3-mini-4k-like one (full rotary, a sliding
window on every layer), a Phi-4-mini-like one (partial rotary 0.75, longrope, tied embeddings) and a Phi-4-like
one (full rotary, plain RoPE, no window: what the GGUF export takes). Their numbers say nothing about quality.
"""

import copy
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import AutoTokenizer, Phi3Config, Phi3ForCausalLM, PretrainedConfig

from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.artifacts.gguf.writer import export_gguf
from casp_core.cli import main as cli
from casp_core.errors import InvalidConfig, UnsupportedExport
from casp_core.families import check_export, family_of, projections
from casp_core.families.modeling.modeling_casp_phi3 import CaspPhi3ForCausalLM
from casp_core.method.budget import attention_params_removed, channel_params
from casp_core.method.surgery import remove_units
from casp_core.model import attention_geometry, decoder_layers, load_model, sublayer_parameters
from casp_core.recovery.train import recover
from casp_core.settings import RecoveryConfig
from tests.core.artifacts.gguf.test_gguf import EXACT, engine
from tests.core.artifacts.test_generation import LOWEST_TRANSFORMERS
from tests.core.families.helpers import (
    COMMON,
    VOCAB,
    WINDOW,
    assert_computes_the_same,
    chosen_prunings,
    masked_copy,
    prune_small,
    small_run_arguments,
    small_training_data,
    write_dense,
    written_and_loaded_back,
)
from tests.core.fresh_process import run_python

PHI3 = {**COMMON, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}
HEAD_DIM = COMMON["hidden_size"] // COMMON["num_attention_heads"]
# Phi-3.5 / Phi-4-mini's longrope: one factor per rotated frequency (head_dim * 3/4 / 2 = 3 here), the long ones
# from position 16 on, which the test inputs pass.
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.75,
    "short_factor": [1.0, 1.3, 1.7],
    "long_factor": [2.0, 3.0, 5.0],
}
CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "phi3-mini": lambda: Phi3Config(**PHI3, sliding_window=WINDOW),
    "phi4-mini": lambda: Phi3Config(
        **PHI3, rope_parameters=LONGROPE, original_max_position_embeddings=16, tie_word_embeddings=True
    ),
    "phi4": lambda: Phi3Config(**PHI3),
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense")
    return {name: write_dense(make(), root / name) for name, make in CONFIGS.items()}


def fused_rows(model: torch.nn.Module) -> list[tuple[int, int]]:
    """Each layer's (qkv_proj rows, gate_up_proj rows)."""
    return [
        (layer.self_attn.qkv_proj.out_features, layer.mlp.gate_up_proj.out_features) for layer in model.model.layers
    ]


@pytest.mark.parametrize("name", ["phi3-mini", "phi4-mini"])
def test_chosen_units_prune_exactly(name: str, dense: dict[str, Path], tmp_path: Path) -> None:
    """Uneven key/value groups, a layer without heads, a whole group gone: still fused, and what the masked model
    computes after writing and loading back (in this process with the file the checkpoint carries)."""
    model, tokenizer = load_model(str(dense[name]))
    prunings = chosen_prunings(8)
    pruned = remove_units(model, prunings)
    assert type(pruned) is CaspPhi3ForCausalLM and pruned.model.layers[0].self_attn.gather_kv
    # Layer 0 keeps 5 query heads over 2 key/value heads, layer 1 none, layer 2 4 heads over 1; FFN 93, 48, 96.
    assert fused_rows(pruned) == [((5 + 2 * 2) * HEAD_DIM, 2 * 93), (0, 2 * 48), ((4 + 2 * 1) * HEAD_DIM, 2 * 96)]
    assert_computes_the_same(masked_copy(model, prunings), written_and_loaded_back(pruned, tokenizer, tmp_path))


def test_projections_are_views_and_counts_agree_with_surgery(dense: dict[str, Path]) -> None:
    """q/k/v/gate/up are row blocks of the fused weights (no copy), and what the budget counts as removed is what
    surgery removes."""
    model, _ = load_model(str(dense["phi4-mini"]))
    layer = decoder_layers(model)[0]
    parts = projections(layer)
    qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
    width = COMMON["intermediate_size"]
    starts = {"q": qkv[0], "k": qkv[8 * HEAD_DIM], "v": qkv[10 * HEAD_DIM], "gate": gate_up[0], "up": gate_up[width]}
    for part, first_row in starts.items():
        assert getattr(parts, part).weight.data_ptr() == first_row.data_ptr(), part
    assert [p.out_features for p in (parts.q, parts.k, parts.v, parts.gate, parts.up)] == [64, 16, 16, 96, 96]
    prunings = chosen_prunings(8)
    pruned = remove_units(model, prunings)
    for dense_layer, pruned_layer, pruning in zip(decoder_layers(model), decoder_layers(pruned), prunings, strict=True):
        geometry = attention_geometry(model, dense_layer)
        expected = attention_params_removed(dense_layer, geometry, list(pruning.pruned_heads))
        expected += len(pruning.pruned_channels) * channel_params(dense_layer)
        assert sum(sublayer_parameters(dense_layer)) - sum(sublayer_parameters(pruned_layer)) == expected


@pytest.mark.parametrize(("name", "ratio"), [("phi4-mini", "0.3"), ("phi4-mini", "0.5"), ("phi3-mini", "0.5")])
def test_casp_prune_succeeds_and_verifies(
    name: str,
    ratio: str,
    dense: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "pruned"
    arguments = ["prune", "--model", str(dense[name]), "--ratio", ratio, "--out", str(out)]
    status = cli.main([*arguments, *small_run_arguments(tmp_path)])
    assert status == 0, capsys.readouterr().err
    assert json.loads((out / "report.json").read_text())["verification"]["max_relative_diff"] <= 1e-10
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "casp_phi3" and sum(map(len, config["layer_kv_of_query"])) < 3 * 8
    assert (out / "modeling_casp_phi3.py").is_file() and (out / "modeling_casp_llama.py").is_file()


# Run in a fresh interpreter from another folder, nothing of this repository importable (tests/core/fresh_process):
# the lowest transformers first on the path when its folder is given; for each pair, the masked dense model and the
# checkpoint loaded as a user would (remote code for the per-layer class, none for the uniform shape), and the
# float64 logits and greedy tokens through the cache of both saved. The reference runs in the same process: with
# longrope, transformers 5.4's own Phi3ForCausalLM generates other tokens through the cache than 5.24's once the
# sequence passes original_max_position_embeddings.
LOAD_FRESH = """
import json, sys
lowest, *pairs = sys.argv[1:]
if lowest:
    sys.path.insert(0, lowest)
import torch, transformers
from transformers import AutoModelForCausalLM
tokens = torch.load("tokens.pt")
def outputs(path, remote):
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=remote).eval().double()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        logits = model(tokens, use_cache=False).logits
        generated = model.generate(tokens[:1, :6], max_new_tokens=14, do_sample=False, use_cache=True)
    return type(model).__name__, {"logits": logits, "generated": generated}
for index, pair in enumerate(pairs):
    reference, checkpoint, remote = pair.split(":")
    _, expected = outputs(reference, False)
    name, actual = outputs(checkpoint, remote == "remote")
    torch.save({"expected": expected, "actual": actual}, f"{index}.pt")
    print(json.dumps({"class": name, "transformers": transformers.__version__}))
print(json.dumps({"casp_core_imported": "casp_core" in sys.modules}))
"""


@pytest.fixture(scope="module")
def pipeline_checkpoints(dense: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[tuple]:
    """(masked dense checkpoint, pruned checkpoint, loads with remote code, the masked model, the pruned model) of
    the pipeline at 0.5: per layer on the Phi-4-mini-like model, and the uniform shape on it (longrope: only head
    counts that keep Phi3Config's rope check) and on the Phi-3-mini-like model."""
    root = tmp_path_factory.mktemp("pipeline")
    built = []
    for name, shape in (("phi4-mini", "per_layer"), ("phi4-mini", "uniform"), ("phi3-mini", "uniform")):
        model, tokenizer = load_model(str(dense[name]))
        result = prune_small(model, tokenizer, 0.5, "greedy", shape=shape)  # masks `model`
        folder = root / f"{name}-{shape}"
        save_pruned(result.model, tokenizer, folder)
        model.save_pretrained(root / f"{name}-{shape}-masked")
        built.append((root / f"{name}-{shape}-masked", folder, shape == "per_layer", model, result.model))
    return built


def test_uniform_shape_is_phi3_s_own_class(pipeline_checkpoints: list[tuple]) -> None:
    (*_, per_layer), (_, longrope_folder, _, _, longrope), (_, folder, _, masked, uniform) = pipeline_checkpoints
    assert type(per_layer) is CaspPhi3ForCausalLM
    for checkpoint, model in ((longrope_folder, longrope), (folder, uniform)):
        assert type(model) is Phi3ForCausalLM
        assert "auto_map" not in json.loads((checkpoint / "config.json").read_text())
        assert len(set(fused_rows(model))) == 1
    assert longrope.config.num_attention_heads in (6, 8)  # what Phi3Config's longrope check accepts here (below)
    assert uniform.config.num_attention_heads < 8
    assert_computes_the_same(masked, [uniform])


def test_longrope_keeps_the_head_counts_phi3config_accepts() -> None:
    """Phi3Config sizes longrope's factors from hidden_size // heads, whatever head_dim says: the uniform shape
    offers exactly the head counts it accepts. Phi-4-mini's own shape keeps all 24 heads."""
    tiny = CONFIGS["phi4-mini"]()
    accepted = []
    for heads in range(1, 9):
        try:
            Phi3Config(**{**tiny.to_dict(), "num_attention_heads": heads, "head_dim": HEAD_DIM})
            accepted.append(heads)
        except StrictDataclassClassValidationError:  # the locked transformers' config validation
            pass
    assert accepted == [h for h in range(1, 9) if family_of(tiny).allows_head_count(tiny, h)] == [6, 7, 8]
    rope = {**LONGROPE, "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}
    phi4_mini = Phi3Config(hidden_size=3072, num_attention_heads=24, num_key_value_heads=8, rope_parameters=rope)
    assert [h for h in range(1, 25) if family_of(phi4_mini).allows_head_count(phi4_mini, h)] == [24]
    assert family_of(CONFIGS["phi3-mini"]()).allows_head_count(CONFIGS["phi3-mini"](), 3)  # plain RoPE: any count


# the lowest transformers: `make test-slow` (tests/core/artifacts/test_generation.py keeps it for LLaMA in `make test`)
@pytest.mark.parametrize("version", ["locked", pytest.param("lowest", marks=pytest.mark.slow)])
def test_checkpoints_load_in_a_fresh_process_as_the_masked_model(
    version: str, pipeline_checkpoints: list[tuple], tmp_path: Path
) -> None:
    """The per-layer checkpoint with trust_remote_code=True, the uniform ones with trust_remote_code=False, in a
    process that never imports casp_core, under the locked and the lowest supported transformers: the masked
    model's float64 logits (to rounding) and greedy tokens through the cache."""
    tokens = torch.randint(0, VOCAB, (2, 4 * WINDOW), generator=torch.Generator().manual_seed(3))
    torch.save(tokens, tmp_path / "tokens.pt")
    lowest = str(LOWEST_TRANSFORMERS) if version == "lowest" else ""
    assert not lowest or LOWEST_TRANSFORMERS.is_dir(), f"{LOWEST_TRANSFORMERS} is missing: run `make install`"
    pairs = [
        f"{masked}:{folder}:{'remote' if remote else 'plain'}" for masked, folder, remote, *_ in pipeline_checkpoints
    ]
    completed = run_python(LOAD_FRESH, lowest, *pairs, cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    records = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    assert records[-1] == {"casp_core_imported": False}
    for index, (record, (_, _, remote, masked, _)) in enumerate(zip(records[:-1], pipeline_checkpoints, strict=True)):
        assert record["class"] == ("CaspPhi3ForCausalLM" if remote else "Phi3ForCausalLM")
        assert record["transformers"] == ("5.4.0" if version == "lowest" else transformers.__version__)
        saved = torch.load(tmp_path / f"{index}.pt")
        expected, actual = saved["expected"], saved["actual"]
        with torch.no_grad():  # the reference loaded there is the masked model of this process
            assert torch.equal(expected["logits"], copy.deepcopy(masked).double()(tokens, use_cache=False).logits)
        difference = (actual["logits"] - expected["logits"]).abs().max().item()
        assert difference <= 1e-9 * expected["logits"].abs().max().item()
        assert torch.equal(actual["generated"], expected["generated"])


def test_what_phi3_cannot_carry_is_refused(
    dense: dict[str, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Mean-bias compensation in the uniform shape (Phi3 has no bias switch), and the GGUF export of partial rotary
    and longrope: by `casp prune` in one line before any work, and by the writer."""
    out = tmp_path / "out"
    arguments = ["prune", "--model", str(dense["phi4-mini"]), "--ratio", "0.3", "--out", str(out), "--export", "gguf"]
    capfd.readouterr()
    status = cli.main([*arguments, *small_run_arguments(tmp_path)])
    errors = [line for line in capfd.readouterr().err.splitlines() if not line.startswith("casp: load:")]
    assert status == 2 and len(errors) == 1, errors
    assert errors[0].startswith("casp: error: unsupported_export: GGUF export: Phi-3 (model type 'phi3')"), errors
    assert not out.exists()
    model, tokenizer = load_model(str(dense["phi3-mini"]))
    with pytest.raises(InvalidConfig, match=r"compensation: bias .* shape uniform cannot save it"):
        prune_small(model, tokenizer, 0.5, "greedy", shape="uniform", compensation="bias")
    longrope = load_model(str(dense["phi4-mini"]))[0]
    with pytest.raises(UnsupportedExport, match=r"Phi-3 .* partial_rotary_factor 0.75 and RoPE type 'longrope'"):
        check_export(longrope.config, ["gguf"])
    pruned = remove_units(longrope, chosen_prunings(8))
    save_pruned(pruned, tokenizer, tmp_path / "pruned")
    with pytest.raises(UnsupportedExport, match=r"partial_rotary_factor 0\.75"):
        export_gguf(tmp_path / "pruned", tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()
    assert family_of(pruned.config).name == "Phi-3"


@pytest.mark.parametrize("variant", ["dense", "by hand", "pipeline 0.5", "uniform 0.5"])
def test_gguf_f32_logits_match_transformers_in_llama_cpp(variant: str, dense: dict[str, Path], tmp_path: Path) -> None:
    """Full rotary and plain RoPE (Phi-4): unfused, the layer is LLaMA's, written as llama.cpp's llama (dense, and the
    uniform shape: Phi3ForCausalLM with fewer heads and an explicit head_dim) or deci (per-layer counts: uneven
    groups, a layer without heads, one that lost half its channels)."""
    checkpoint = dense["phi4"]
    if variant != "dense":
        model, tokenizer = load_model(str(checkpoint))
        if variant == "by hand":
            pruned = remove_units(model, chosen_prunings(8))
        else:
            shape = {"pipeline 0.5": "per_layer", "uniform 0.5": "uniform"}[variant]
            pruned = prune_small(model, tokenizer, 0.5, "greedy", shape=shape).model
        checkpoint = tmp_path / "pruned"
        save_pruned(pruned, tokenizer, checkpoint)
    exported = export_gguf(checkpoint, tmp_path / "model.gguf", "f32")
    assert exported.architecture == ("deci" if variant in ("by hand", "pipeline 0.5") else "llama")
    ids = torch.randint(0, VOCAB, (96,), generator=torch.Generator().manual_seed(11)).tolist()
    with torch.no_grad():
        expected = load_pruned(checkpoint, dtype="float32")[0](torch.tensor([ids])).logits[0].numpy()
    llm = engine(exported.path, len(ids))
    llm.eval(ids)
    actual = np.asarray(llm.scores[: len(ids)])
    llm.close()
    assert np.abs(actual - expected).max() / np.abs(expected).max() <= EXACT["relative"]
    assert (actual.argmax(-1) == expected.argmax(-1)).mean() >= EXACT["agreement"]


def test_recovery_adapts_the_fused_projections(pipeline_checkpoints: list[tuple], tmp_path: Path) -> None:
    """LoRA on the pruned Phi-3 targets the modules it has (qkv_proj, o_proj, gate_up_proj, down_proj), trains,
    and merges into every fused weight of every layer that kept rows."""
    *_, pruned = pipeline_checkpoints[0]
    assert family_of(pruned.config).lora_modules(["q_proj", "k_proj", "up_proj"]) == ["qkv_proj", "gate_up_proj"]
    tokenizer = AutoTokenizer.from_pretrained(pipeline_checkpoints[0][1])
    data = small_training_data(tokenizer, tmp_path)
    settings = RecoveryConfig(method="lora", max_steps=2, batch_size=2, grad_accum=1, max_seq_len=32, lr=1e-2)
    recovered, _ = recover(copy.deepcopy(pruned), tokenizer, data, settings, device="cpu", adapter_dir=tmp_path / "a")
    adapter = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    for before, after in zip(decoder_layers(pruned), decoder_layers(recovered), strict=True):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            weight, merged = before.get_submodule(name).weight, after.get_submodule(name).weight
            assert merged.shape == weight.shape
            assert weight.numel() == 0 or not torch.equal(merged, weight), name
