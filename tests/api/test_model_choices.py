"""The models a key can pick (GET /v1/models/choices: its uploads and what lies in the allowed folders) and the
check of one (POST /v1/models/check), which answers what POST /v1/jobs would: the same 422, or the model as the
job would store it. The embedded service (SQLite, local storage) with API keys on."""

import shutil
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from casp_cli.app import service_app
from casp_core.artifacts.gguf.writer import export_gguf
from service import api_keys
from service.db import session_scope
from tests.api.test_api import refusal
from tests.service_fixtures import DEMO_MODEL, TINY_JOB, embedded_settings

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An allowed root: stories260K as a folder and as a GGUF file, a text file named `.gguf`, a model one folder
    down (`org/tiny`) and one too deep to be looked for, a hidden one, and a file that is no model."""
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(DEMO_MODEL, root / "stories260K")
    export_gguf(DEMO_MODEL, root / "stories260K.gguf", "f32")
    (root / "notes.gguf").write_text("not a model\n")
    shutil.copytree(DEMO_MODEL, root / "org" / "tiny")
    (root / "a" / "b" / "c").mkdir(parents=True)
    shutil.copy(DEMO_MODEL / "config.json", root / "a" / "b" / "c" / "config.json")
    (root / ".hidden").mkdir()
    shutil.copy(DEMO_MODEL / "config.json", root / ".hidden" / "config.json")
    (root / "readme.txt").write_text("models\n")
    return root


@pytest.fixture(scope="module")
def client(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    settings = embedded_settings(tmp_path_factory.mktemp("home"), auth="apikey", allowed_model_roots=[models])
    with session_scope(settings.database) as session:
        keys = {name: api_keys.create_api_key(session, name)[1] for name in ("alice", "bob")}
    with TestClient(service_app(settings)) as client:
        yield client, {name: {"Authorization": f"Bearer {key}"} for name, key in keys.items()}


def test_the_choices_are_the_key_s_uploads_then_the_models_in_the_allowed_folders(client: Any, models: Path) -> None:
    api, keys = client
    upload = api.post(
        "/v1/models", files={"file": ("tiny.gguf", (models / "stories260K.gguf").read_bytes())}, headers=keys["alice"]
    )
    assert upload.status_code == 201, upload.text
    local = [("notes.gguf", "gguf"), ("org/tiny", "folder"), ("stories260K", "folder"), ("stories260K.gguf", "gguf")]
    found = [
        {"model": str(models / name), "name": f"{models.name}/{name}", "source": "local", "format": kind}
        for name, kind in local
    ]
    alice = api.get("/v1/models/choices", headers=keys["alice"])
    assert alice.status_code == 200, alice.text
    uploaded = {"model": upload.json()["model"], "name": "tiny.gguf", "source": "upload", "format": "gguf"}
    assert alice.json() == {"data": [uploaded, *found], "truncated": False}
    # Another key's upload is not among bob's.
    assert api.get("/v1/models/choices", headers=keys["bob"]).json() == {"data": found, "truncated": False}
    assert refusal(api.get("/v1/models/choices"), 401)["code"] == "unauthorized"


@pytest.mark.parametrize("name", ["stories260K", "org/tiny", "stories260K.gguf"])
def test_a_model_a_job_takes_is_answered_as_the_job_would_store_it(client: Any, models: Path, name: str) -> None:
    api, keys = client
    model = str(models / name)
    checked = api.post("/v1/models/check", json={"model": model}, headers=keys["alice"])
    assert checked.status_code == 200 and checked.json() == {"model": model}, checked.text
    # As the submit stores it: `..` resolved.
    roundabout = api.post("/v1/models/check", json={"model": f"{models}/org/../{name}"}, headers=keys["alice"])
    assert roundabout.json() == {"model": model}
    job = api.post("/v1/jobs", json={**TINY_JOB, "model": model, "device": "cpu"}, headers=keys["alice"])
    assert job.status_code == 201 and job.json()["model"] == model, job.text


def test_a_model_a_job_refuses_gets_the_submit_s_own_422(client: Any, models: Path, tmp_path: Path) -> None:
    api, keys = client
    outside = Path(shutil.copytree(DEMO_MODEL, tmp_path / "stories260K"))
    uploaded = api.get("/v1/models/choices", headers=keys["alice"]).json()["data"][0]["model"]
    expected = {
        str(outside): "local paths must lie under CASP_ALLOWED_MODEL_ROOTS",
        str(models / "notes.gguf"): "invalid_model_file: notes.gguf is not a GGUF file",
        str(models / "absent.gguf"): "no such GGUF file",
        str(models / "readme.txt"): "no such model folder",
        "stories260K": "must be a Hugging Face id",
        uploaded: "no uploaded model",  # alice's, asked by bob
    }
    before = api.get("/v1/jobs", headers=keys["bob"]).json()["data"]
    for model, reason in expected.items():
        checked = api.post("/v1/models/check", json={"model": model}, headers=keys["bob"])
        error = refusal(checked)
        assert error["param"] == "model" and reason in error["message"], (model, error)
        submitted = api.post("/v1/jobs", json={**TINY_JOB, "model": model}, headers=keys["bob"])
        assert submitted.status_code == 422 and submitted.json() == checked.json(), model
    assert api.get("/v1/jobs", headers=keys["bob"]).json()["data"] == before  # no job was made


def test_the_endpoints_are_in_the_openapi_document(client: Any) -> None:
    api, _ = client
    paths = api.get("/openapi.json").json()["paths"]
    assert "get" in paths["/v1/models/choices"] and "post" in paths["/v1/models/check"]
    assert paths["/v1/models/check"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/JobCreate",
        "description": "a job as POST /v1/jobs takes it; `model` alone checks the model by itself",
    }
