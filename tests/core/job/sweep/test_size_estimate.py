"""The sizes a budget is turned into candidates by, estimated from the config alone (casp_core.job.sweep.shapes),
against the files written from the fixtures: dense and pruned, GGUF in f16, q8_0, q5_k_m, q4_k_m, q3_k_m and q2_k (on
stories260K, whose hidden size of 64 is no multiple of 256, the K-quants' weights nearly all in llama.cpp's fallback
types), safetensors unquantized and quantized.

Each pruned checkpoint is pruned as a job that exports that type prunes it (a quantized GGUF's block sets the
rounding), once for the module. The estimate of a file is within ESTIMATE_TOLERANCE of its size (the README
states it), and the estimate of the parameters within one rounding unit (round_to FFN channels of one layer) of
the pruned model's: the plan lands within half a unit of the target, from either side.
"""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.artifacts.compressed_tensors.quantize import quantize_weights, weight_bytes
from casp_core.artifacts.gguf.size import gguf_tensors
from casp_core.artifacts.gguf.types import llama_cpp_types
from casp_core.artifacts.gguf.writer import GgufExport, attention_layout, export_gguf
from casp_core.artifacts.gguf.writer import LayerShape as GgufLayer
from casp_core.artifacts.shapes import LayerShape, PlannedShape
from casp_core.job.sweep.candidates import Candidate, Estimator
from casp_core.job.sweep.shapes import meta_model, planned_shape
from casp_core.method.prune import PrunePlan, prune
from casp_core.model import load_config, load_model
from casp_core.rounding import quantizer_block, round_to_for
from casp_core.settings import CalibrationConfig
from tests.conftest import PTBWIKI, STORIES, small_config

ESTIMATE_TOLERANCE = 0.03
# The sizes do not depend on which units go, only on how many: a few short windows choose them.
CALIBRATION = CalibrationConfig(dataset="wikitext2:validation", n_samples=4, seq_len=32, batch_size=4)
MODELS = {"stories260K": STORIES, "ptbwiki-7M": PTBWIKI}
# (model, ratio, GGUF types written from one checkpoint: those whose block is the same, so it is pruned alike)
PRUNED = [
    ("stories260K", 0.3, ("f16",)),
    ("stories260K", 0.3, ("q8_0",)),
    ("stories260K", 0.3, ("q4_k_m", "q3_k_m", "q2_k")),
    ("stories260K", 0.5, ("f16",)),
    ("stories260K", 0.5, ("q8_0",)),
    ("ptbwiki-7M", 0.3, ("f16",)),
    ("ptbwiki-7M", 0.3, ("q8_0",)),
    ("ptbwiki-7M", 0.5, ("q5_k_m", "q4_k_m", "q3_k_m", "q2_k")),
]
DENSE_TYPES = {
    "stories260K": ("f16", "q8_0", "q4_k_m", "q3_k_m", "q2_k"),
    "ptbwiki-7M": ("f16", "q8_0", "q5_k_m", "q4_k_m", "q3_k_m", "q2_k"),
}
GGUF_CASES = [(name, 0.0, gguf_type) for name, types in DENSE_TYPES.items() for gguf_type in types] + [
    (name, ratio, gguf_type) for name, ratio, types in PRUNED for gguf_type in types
]
# (model, ratio, scheme): what a quantized sweep writes; w4a16 on the dense ptbwiki-7M, whose rows its groups fit
# (pruned, its FFN widths keep multiples of 8).
SAFETENSORS_CASES = [
    ("stories260K", 0.0, "none"),
    ("stories260K", 0.5, "none"),
    ("stories260K", 0.5, "fp8_dynamic"),
    ("ptbwiki-7M", 0.0, "w4a16"),
    ("ptbwiki-7M", 0.3, "none"),
    ("ptbwiki-7M", 0.3, "w8a8_int8"),
]


def job_config(ratio: float, gguf_type: str = "f16"):
    return small_config(ratio, calibration=CALIBRATION, export=["gguf"], gguf_type=gguf_type)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[tuple[str, float, str], Path]:
    """The checkpoint directory of each (model, ratio, first GGUF type of its group), pruned once; ratio 0.0:
    the fixture itself."""
    root = tmp_path_factory.mktemp("sizes")
    folders = {(name, 0.0, gguf_type): MODELS[name] for name, types in DENSE_TYPES.items() for gguf_type in types}
    for name, ratio, types in PRUNED:
        model, tokenizer = load_model(str(MODELS[name]))
        result = prune(model, tokenizer, job_config(ratio, types[0]))
        folder = root / f"{name}-{ratio}-{types[0]}"
        save_pruned(result.model, tokenizer, folder)
        folders |= {(name, ratio, gguf_type): folder for gguf_type in types}
    return folders


@pytest.fixture(scope="module")
def exported(written, tmp_path_factory) -> Callable[[str, float, str], GgufExport]:
    """The GGUF file of a case, written once for the module."""
    root, files = tmp_path_factory.mktemp("gguf"), {}

    def export(name: str, ratio: float, gguf_type: str) -> GgufExport:
        if (name, ratio, gguf_type) not in files:
            out = root / f"{name}-{ratio}-{gguf_type}.gguf"
            files[name, ratio, gguf_type] = export_gguf(written[name, ratio, gguf_type], out, gguf_type)
        return files[name, ratio, gguf_type]

    return export


def estimator(name: str, ratio: float) -> Estimator:
    return Estimator(load_config(str(MODELS[name])), job_config(ratio or 0.5))


def estimate(name: str, ratio: float, fmt: str, variant: str) -> Candidate:
    """The candidate's sizes as a sweep's plan estimates them, from the prune it plans for it (ratio 0.0: dense)."""
    model_config, settings = load_config(str(MODELS[name])), job_config(ratio or 0.5)
    prune = PrunePlan.of(settings.candidate_config(ratio, fmt, variant), model_config) if ratio else None
    return Estimator(model_config, settings).candidate(ratio, fmt, variant, prune)


def assert_close(estimate: int, real: int, what: str) -> None:
    assert abs(estimate - real) <= ESTIMATE_TOLERANCE * real, f"{what}: estimated {estimate}, written {real}"


@pytest.mark.parametrize(("name", "ratio", "gguf_type"), GGUF_CASES)
def test_the_gguf_estimate_is_within_the_tolerance_of_the_file(exported, name, ratio, gguf_type):
    out = exported(name, ratio, gguf_type)
    candidate = estimate(name, ratio, "gguf", gguf_type)
    assert_close(candidate.estimated_bytes, out.bytes, f"{name} at {ratio} in {gguf_type}")


def written_shape(folder: Path) -> PlannedShape:
    """The shape a checkpoint has, each layer's key/value heads as the GGUF writes them."""
    config = json.loads((folder / "config.json").read_text())
    if config["model_type"] != "casp_llama":
        return planned_shape(meta_model(load_config(str(folder))), None)
    layers = []
    for kv_of_query, width in zip(config["layer_kv_of_query"], config["layer_intermediate_sizes"], strict=True):
        kv_heads = len(set(kv_of_query))
        written = len(attention_layout(GgufLayer(tuple(kv_of_query), kv_heads, width)).kv_heads)
        layers.append(LayerShape(len(kv_of_query), kv_heads, written, width))
    return PlannedShape(tuple(layers), 0)


@pytest.mark.parametrize(("name", "ratio", "gguf_type"), GGUF_CASES)
def test_each_tensor_gets_the_type_llama_cpp_gives_it(written, exported, name, ratio, gguf_type):
    """The type rules alone, on the shape the checkpoint has: every tensor, in the file's order and with its type."""
    folder = written[name, ratio, gguf_type]
    out = exported(name, ratio, gguf_type)
    geometry = estimator(name, ratio).geometry
    tensors = gguf_tensors(geometry, written_shape(folder))
    choices = dict(zip((tensor.name for tensor in tensors), llama_cpp_types(tensors, gguf_type), strict=True))
    assert {tensor: choice.type for tensor, choice in choices.items()} == out.tensor_types
    # What fell back is what the export names, each instead of the type the mix gives it.
    fell_back = {tensor: (choice.type, choice.mix) for tensor, choice in choices.items() if choice.type != choice.mix}
    assert fell_back == {fallback.tensor: (fallback.type, fallback.wanted) for fallback in out.fallbacks}


@pytest.mark.parametrize(("name", "ratio", "scheme"), SAFETENSORS_CASES)
def test_the_safetensors_estimate_is_within_the_tolerance_of_the_files(written, tmp_path, name, ratio, scheme):
    folder = written[name, ratio, "f16"]
    if scheme != "none":
        model, tokenizer = load_pruned(folder)
        quantize_weights(model, scheme)
        save_pruned(model, tokenizer, tmp_path / scheme)
        folder = tmp_path / scheme
    candidate = estimate(name, ratio, "safetensors", scheme)
    assert_close(candidate.estimated_bytes, weight_bytes(folder), f"{name} at {ratio}, {scheme}")


@pytest.mark.parametrize(("name", "ratio", "types"), PRUNED)
def test_the_parameter_estimate_is_within_one_rounding_unit(written, name, ratio, types):
    model, _ = load_pruned(written[name, ratio, types[0]])
    held = sum(parameter.numel() for parameter in model.parameters())
    candidate = estimate(name, ratio, "gguf", types[0])
    config = load_config(str(MODELS[name]))
    unit = round_to_for(config.intermediate_size, "auto", quantizer_block(job_config(ratio, types[0])))
    channel = 3 * config.hidden_size  # a channel's gate and up rows and down column
    assert abs(candidate.estimated_params - held) <= unit * channel, (candidate.estimated_params, held)


def test_the_dense_estimate_counts_every_parameter_once() -> None:
    for name, path in MODELS.items():
        model, _ = load_model(str(path))
        held = sum(parameter.numel() for parameter in model.parameters())  # the tied head once
        assert estimate(name, 0.0, "gguf", "f16").estimated_params == held, name
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight), "the fixtures tie their head"


def test_the_safetensors_estimate_follows_the_dtype_setting(tmp_path) -> None:
    model, tokenizer = load_model(str(STORIES), dtype="bfloat16")  # the fixture's own dtype is float32
    save_pruned(model, tokenizer, tmp_path)
    settings = small_config(0.5, dtype="bfloat16")
    candidate = Estimator(load_config(str(STORIES)), settings).candidate(0.0, "safetensors", "none", None)
    assert_close(candidate.estimated_bytes, weight_bytes(tmp_path), "stories260K in bfloat16")
