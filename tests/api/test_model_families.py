"""Submit-time refusal of model families casp cannot prune: a local model's config is read by the API."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from transformers import MixtralConfig, PhimoeConfig, Qwen2Config, Qwen3Config

from api.main import create_app
from service.settings import Settings
from tests.service_fixtures import SMALL_JOB

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Configs alone: the API reads nothing else, and the jobs below never reach a worker."""
    root = tmp_path_factory.mktemp("models")
    PhimoeConfig(num_hidden_layers=1).save_pretrained(root / "phimoe")
    Qwen2Config(
        num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256
    ).save_pretrained(root / "qwen2")
    Qwen3Config(
        num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256
    ).save_pretrained(root / "qwen3")
    MixtralConfig(
        num_hidden_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
        num_local_experts=4,
        max_position_embeddings=256,
    ).save_pretrained(root / "mixtral")
    (root / "empty").mkdir()
    return root


@pytest.fixture(scope="module")
def api_with_root(distributed_settings: Settings, model_root: Path) -> Iterator[TestClient]:
    settings = distributed_settings.model_copy(update={"allowed_model_roots": [model_root]})
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.parametrize(
    ("folder", "expected"),
    [
        ("phimoe", "unsupported_model: model type 'phimoe' is not supported"),
        ("empty", "model_not_found: cannot read the config of model"),
    ],
)
def test_unsupported_local_model_is_422_at_submit(
    api_with_root: TestClient, keys: dict[str, dict[str, str]], model_root: Path, folder: str, expected: str
) -> None:
    body = {**SMALL_JOB, "device": "cuda", "model": str(model_root / folder)}
    response = api_with_root.post("/v1/jobs", json=body, headers=keys["alice"])
    assert response.status_code == 422, response.text
    assert expected in response.text and "model" in response.text


def test_supported_local_model_is_accepted(
    api_with_root: TestClient, keys: dict[str, dict[str, str]], model_root: Path
) -> None:
    # Sent to the cuda queue, which no test worker consumes: the job stays queued.
    body = {**SMALL_JOB, "device": "cuda", "model": str(model_root / "qwen2")}
    response = api_with_root.post("/v1/jobs", json=body, headers=keys["alice"])
    assert response.status_code == 201, response.text


def test_a_uniform_shape_the_family_s_class_cannot_hold_is_422_at_submit(
    api_with_root: TestClient, keys: dict[str, dict[str, str]], model_root: Path
) -> None:
    """Qwen2ForCausalLM has no o_proj or down_proj bias for FLAP's mean-bias compensation to fill."""
    body = {**SMALL_JOB, "device": "cuda", "model": str(model_root / "qwen2"), "shape": "uniform"}
    response = api_with_root.post("/v1/jobs", json={**body, "compensation": "bias"}, headers=keys["alice"])
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "compensation" and "shape uniform cannot save it" in error["message"], error
    assert api_with_root.post("/v1/jobs", json=body, headers=keys["alice"]).status_code == 201


def test_settings_a_mixture_of_experts_is_not_pruned_with_are_422_at_submit(
    api_with_root: TestClient, keys: dict[str, dict[str, str]], model_root: Path
) -> None:
    """Mixtral is pruned with a numeric alpha and published unquantized (docs/moe.md): alpha auto and a
    quantization are refused on their fields."""
    body = {**SMALL_JOB, "device": "cuda", "model": str(model_root / "mixtral")}
    for name, value in (("alpha", "auto"), ("quantization", "w8a8_int8")):
        response = api_with_root.post("/v1/jobs", json={**body, name: value}, headers=keys["alice"])
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["param"] == name and "Mixtral (a mixture of experts)" in error["message"], error
    assert api_with_root.post("/v1/jobs", json=body, headers=keys["alice"]).status_code == 201


def test_removing_experts_below_top_k_or_from_a_dense_model_is_422_at_submit(
    api_with_root: TestClient, keys: dict[str, dict[str, str]], model_root: Path
) -> None:
    """The Mixtral has 4 experts and top-2 routing: 2 may go, not 3; a dense model has none to remove."""
    for model, removed, reason in (("mixtral", 3, "remove at most 2"), ("qwen2", 1, "has no experts to remove")):
        body = {**SMALL_JOB, "device": "cuda", "model": str(model_root / model), "moe": {"prune_experts": removed}}
        response = api_with_root.post("/v1/jobs", json=body, headers=keys["alice"])
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["param"] == "moe.prune_experts" and reason in error["message"], error
    body = {**SMALL_JOB, "device": "cuda", "model": str(model_root / "mixtral"), "moe": {"prune_experts": 2}}
    assert api_with_root.post("/v1/jobs", json=body, headers=keys["alice"]).status_code == 201


def test_recovery_windows_longer_than_the_model_s_context_are_422_at_submit(
    api_with_root: TestClient, keys: dict[str, dict[str, str]], model_root: Path
) -> None:
    body = {**SMALL_JOB, "device": "cuda", "model": str(model_root / "qwen2")}
    recovery = {"method": "lora", "dataset": "ptb:train", "max_steps": 2}
    too_long = {**body, "recovery": {**recovery, "max_seq_len": 512}}
    response = api_with_root.post("/v1/jobs", json=too_long, headers=keys["alice"])
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "recovery.max_seq_len", error
    assert "longer than the model's context of 256" in error["message"], error
    fits = {**body, "recovery": {**recovery, "max_seq_len": 256}}
    assert api_with_root.post("/v1/jobs", json=fits, headers=keys["alice"]).status_code == 201


def test_a_gguf_type_whose_block_the_hidden_size_does_not_fit_is_taken_at_submit(
    api_with_root: TestClient, keys: dict[str, dict[str, str]], model_root: Path
) -> None:
    """The qwen2 config's hidden size is 64, no multiple of the K-quants' 256: llama.cpp quantizes it all the same,
    with its fallback types, as it makes the Q4_K_M files of such models."""
    body = {**SMALL_JOB, "device": "cuda", "model": str(model_root / "qwen2"), "export": ["gguf"]}
    for gguf_type in ("q4_k_m", "q3_k_m", "q2_k"):
        response = api_with_root.post("/v1/jobs", json={**body, "gguf_type": gguf_type}, headers=keys["alice"])
        assert response.status_code == 201, response.text


def test_a_gguf_export_the_family_cannot_take_is_422_at_submit(
    api_with_root: TestClient, keys: dict[str, dict[str, str]], model_root: Path
) -> None:
    """Qwen3's per-head q/k norms have no place in llama.cpp's deci architecture: refused before the job is queued."""
    body = {**SMALL_JOB, "device": "cuda", "model": str(model_root / "qwen3")}
    response = api_with_root.post("/v1/jobs", json={**body, "export": ["gguf"]}, headers=keys["alice"])
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "export", error
    assert error["message"].startswith("export: unsupported_export: GGUF export: Qwen3 (model type 'qwen3')"), error
    assert api_with_root.post("/v1/jobs", json=body, headers=keys["alice"]).status_code == 201
