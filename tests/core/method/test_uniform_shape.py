"""The uniform shape on the real fixtures: a plain LlamaForCausalLM that loads with no remote code and exports as
llama.cpp's `llama` architecture.

stories260K: 8 query heads over 4 key/value heads, hidden 64, FFN 172, 5 layers; ptbwiki-7M: 8 heads (MHA),
hidden 256, FFN 704, 8 layers. LlamaConfig takes only head counts that divide hidden_size: 1, 2, 4 or 8 here.
"""

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from casp_core.artifacts.checkpoint import save_pruned
from casp_core.artifacts.gguf.writer import export_gguf
from casp_core.cli.main import main
from casp_core.errors import InvalidConfig
from casp_core.method.budget import AllocationPlan, UniformShape, channel_params, plan_uniform_shape
from casp_core.method.calibration import SecondMoment
from casp_core.method.interaction import block_aggregate, interaction_matrix, offdiag_ratio
from casp_core.method.prune import prune
from casp_core.method.selection import solve_uniform_heads
from casp_core.method.solvers import greedy
from casp_core.model import attention_geometry, decoder_layers, load_model
from casp_core.rounding import auto_round_to
from tests.conftest import DATASETS_DIR, PTBWIKI, STORIES, small_config
from tests.core.artifacts.gguf.test_gguf import CALIBRATION, EXACT, compare, evaluation_text

MODELS = {"stories260K": STORIES, "ptbwiki-7M": PTBWIKI}
CASES = [("stories260K", 0.3), ("stories260K", 0.5), ("ptbwiki-7M", 0.3)]
# What each case keeps: (key/value heads, query heads per key/value head, FFN channels). At 0.3 the per-layer
# rule's 6 heads do not divide hidden_size, and of 4 and 8 the larger is taken; at 0.5, 4 heads as 2 whole
# groups (the fewer key/value heads).
SHAPES = {
    ("stories260K", 0.3): (4, 2, 101),
    ("stories260K", 0.5): (2, 2, 86),
    ("ptbwiki-7M", 0.3): (8, 1, 392),  # round_to auto: 704 channels keep multiples of 8
}
# Run in a fresh interpreter that never imports casp_core (what a vLLM or TGI host has): for each checkpoint
# directory given, its class name and its logits on the ids, saved beside the directory.
LOAD_WITHOUT_CASP = """
import sys
import numpy as np
import torch
from transformers import AutoModelForCausalLM
ids = torch.tensor([[int(t) for t in sys.argv[1].split(",")]])
for directory in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=False, dtype=torch.float32).eval()
    with torch.no_grad():
        np.save(directory + ".npy", model(ids).logits[0].numpy())
    print(type(model).__name__)
assert "casp_core" not in sys.modules
"""
IDS = list(range(1, 200, 3))


@pytest.fixture(scope="module")
def pruned(tmp_path_factory) -> dict[tuple[str, float], tuple[object, Path]]:
    """(result, checkpoint directory) per case, pruned once for the module."""
    root = tmp_path_factory.mktemp("uniform")
    built = {}
    for name, ratio in CASES:
        model, tokenizer = load_model(str(MODELS[name]), dtype="float32")
        result = prune(model, tokenizer, small_config(ratio, shape="uniform", calibration=CALIBRATION))
        save_pruned(result.model, tokenizer, root / f"{name}-{ratio}")
        built[name, ratio] = (result, root / f"{name}-{ratio}")
    return built


@pytest.mark.parametrize(("name", "ratio"), CASES)
def test_every_layer_keeps_the_same_shape_within_one_rounding_unit(pruned, name, ratio):
    result, directory = pruned[name, ratio]
    kv_heads, per_kv, width = SHAPES[name, ratio]
    for layer in decoder_layers(result.model):
        head_dim = layer.self_attn.head_dim
        assert layer.self_attn.q_proj.out_features == kv_heads * per_kv * head_dim
        assert layer.self_attn.k_proj.out_features == layer.self_attn.v_proj.out_features == kv_heads * head_dim
        assert layer.mlp.down_proj.in_features == width
    # The solver still chooses which units: the layers keep different heads where heads go.
    if kv_heads * per_kv < 8:
        assert len({tuple(layer.pruned_heads) for layer in result.layers}) > 1
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert "auto_map" not in config and not list(directory.glob("*.py"))
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (kv_heads * per_kv, kv_heads)
    assert config["intermediate_size"] == width
    # A rounding unit: round_to auto's multiple of channels in every layer (1 on stories260K, 8 on ptbwiki-7M).
    multiple = auto_round_to(width + len(result.layers[0].pruned_channels))
    unit = multiple * len(result.layers) * channel_params(decoder_layers(result.model)[0])
    assert abs(result.params_dense - result.params_pruned - ratio * result.params_dense) <= unit / 2
    assert all(layer.sensitivity is None for layer in result.layers)  # no gradient allocation was run


def test_loads_with_no_remote_code_and_computes_the_pruned_model_s_logits(pruned, tmp_path):
    directories = [str(pruned[case][1]) for case in CASES]
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_CASP, ",".join(map(str, IDS)), *directories],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split() == ["LlamaForCausalLM"] * len(CASES)
    for case, directory in zip(CASES, directories, strict=True):
        with torch.no_grad():
            expected = pruned[case][0].model(torch.tensor([IDS])).logits[0].numpy()
        assert np.abs(np.load(directory + ".npy") - expected).max() <= 1e-5 * np.abs(expected).max(), case


@pytest.mark.parametrize(("name", "ratio"), [("stories260K", 0.5), ("ptbwiki-7M", 0.3)])
def test_gguf_is_plain_llama_and_matches_transformers(pruned, tmp_path, name, ratio):
    _, directory = pruned[name, ratio]
    exported = export_gguf(directory, tmp_path / "model.gguf", "f32")
    assert exported.architecture == "llama"
    assert gguf.GGUFReader(exported.path).get_field("general.architecture").contents() == "llama"
    measured = compare(directory, exported.path)
    assert measured["relative"] <= EXACT["relative"], measured
    assert measured["agreement"] >= EXACT["agreement"], measured


def test_mean_bias_compensation_exports_its_zero_biases_exactly(tmp_path):
    model, tokenizer = load_model(str(STORIES), dtype="float32")
    config = small_config(0.5, shape="uniform", compensation="bias", calibration=CALIBRATION)
    result = prune(model, tokenizer, config)
    assert result.model.config.attention_bias and result.model.config.mlp_bias
    assert not decoder_layers(result.model)[0].self_attn.q_proj.bias.any()
    save_pruned(result.model, tokenizer, tmp_path / "pruned")
    exported = export_gguf(tmp_path / "pruned", tmp_path / "model.gguf", "f32")
    assert "blk.0.attn_output.bias" in exported.tensor_types and exported.architecture == "llama"
    measured = compare(tmp_path / "pruned", exported.path)
    assert measured["relative"] <= EXACT["relative"], measured


def real_statistics():
    """Q of stories260K's first layer's heads, from its o_proj inputs on a few real windows."""
    model, tokenizer = load_model(str(STORIES), dtype="float32")
    layer = decoder_layers(model)[0]
    ids = torch.tensor([tokenizer(evaluation_text()).input_ids[:256]])
    moment = SecondMoment(layer.self_attn.o_proj.in_features, torch.device("cpu"))
    handle = layer.self_attn.o_proj.register_forward_pre_hook(lambda _m, args: moment.update(args[0]))
    with torch.no_grad():
        model(ids)
    handle.remove()
    geometry = attention_geometry(model, layer)
    weight = layer.self_attn.o_proj.weight
    q_heads = block_aggregate(interaction_matrix(weight, moment.second_moment), geometry.head_dim)
    return geometry, q_heads, weight, moment


def test_whole_groups_go_by_the_group_aggregated_q_then_heads_within_each_kept_group():
    geometry, q_heads, weight, moment = real_statistics()
    # Three of four groups stay, one head of each: greedy on the groups' Q, then on each kept pair's 2 x 2 block.
    report = solve_uniform_heads(
        "greedy", q_heads, offdiag_ratio(q_heads), geometry, UniformShape(3, 1, 0), weight, moment
    )
    (gone_group,) = greedy(block_aggregate(q_heads, 2), 1).tolist()
    expected = {2 * gone_group, 2 * gone_group + 1}
    for kv in set(range(4)) - {gone_group}:
        pair = [2 * kv, 2 * kv + 1]
        expected.add(pair[int(q_heads[pair][:, pair].diagonal().argmin())])
    assert set(report.pruned) == expected and len(report.pruned) == 5
    kept = [h for h in range(8) if h not in expected]
    assert sorted({geometry.kv_of_query[h] for h in kept}) == sorted(set(range(4)) - {gone_group})


def test_plan_refuses_what_no_uniform_shape_reaches():
    model, _ = load_model(str(STORIES), dtype="float32")
    assert plan_uniform_shape(model, AllocationPlan.of(small_config(0.5, shape="uniform"))) == UniformShape(2, 2, 86)
    # At r_max 0.5 at most 4 of 8 heads go, and with round_to 16 at most 76 of 172 channels (96 kept): 86
    # channels were needed, and the nearest count falls short by more than half a rounding unit.
    with pytest.raises(InvalidConfig, match=r"ratio: 0\.5 cannot be reached with shape uniform"):
        plan_uniform_shape(model, AllocationPlan.of(small_config(0.5, shape="uniform", r_max=0.5, round_to=16)))


def test_casp_prune_shape_uniform_writes_a_plain_checkpoint_and_a_llama_gguf(tmp_path, capsys):
    out = tmp_path / "pruned"
    arguments = ["prune", "--model", str(STORIES), "--ratio", "0.5", "--shape", "uniform", "--out", str(out)]
    arguments += ["--export", "gguf", "--gguf-type", "f32", "--calibration-dataset", "wikitext2:validation"]
    arguments += ["--n-samples", "8", "--seq-len", "64", "--perplexity", "", "--datasets-dir", str(DATASETS_DIR)]
    assert main(arguments) == 0
    (export,) = json.loads(capsys.readouterr().out)["exports"]
    assert export["architecture"] == "llama"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config
    assert config["casp"]["settings"]["shape"] == "uniform"
    report = (out / "report.md").read_text()
    assert "shape `uniform` (every layer pruned alike" in report and "allocation `gradient`" not in report
    card = (out / "README.md").read_text()
    assert 'AutoModelForCausalLM.from_pretrained("stories260K-casp-50")' in card and "trust_remote_code" not in card
    assert "vllm serve" in card
    reader = gguf.GGUFReader(out / export["path"])
    name = reader.get_field("general.name")
    # Named after the source model, not the staging directory the job wrote it in.
    assert name.contents() == "stories260K (CASP-pruned, ratio 0.5)"
    with pytest.raises(SystemExit) as exited:
        main([*arguments[:5], "--shape", "square", "--out", str(tmp_path / "other")])
    assert exited.value.code == 2
    assert "--shape: must be one of per_layer, uniform, got 'square'" in capsys.readouterr().err
