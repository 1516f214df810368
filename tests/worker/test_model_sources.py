"""Models from where teams keep them, through the API and a real Celery worker (PostgreSQL, Redis, SeaweedFS S3):
a model in a bucket (downloaded once, then read from the worker's cache), a model uploaded as a tar, in the request
or to a presigned URL (its key's alone, checked before it is kept), and what is refused at submit with a 422 naming
`model`. A GGUF file (stories260K written by casp's own exporter) as each of these: a local file, an object in a
bucket, an upload; and the files named `.gguf` that are no model to prune (text, cut short, an architecture casp
does not prune) refused at submit and at upload, or, when they get past the submit, failing their job with the
check's code."""

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from casp_cli.app import service_app
from casp_cli.client import CaspClient
from casp_core.artifacts.gguf.writer import export_gguf
from service.api_keys import create_api_key
from service.db import session_scope
from service.reaper import sweep_expired_pending_uploads, sweep_expired_uploads
from service.settings import S3Credentials, Settings
from service.storage import make_storage
from service.tables import PendingUpload, UploadedModel, utcnow
from tests.api.test_api import refusal
from tests.core.artifacts.gguf.test_gguf_source import write_gguf
from tests.service_fixtures import (
    ALLOWED_MODELS_PREFIX,
    DEMO_MODEL,
    JOB_TIMEOUT,
    MODELS_BUCKET,
    REPO,
    TINY_JOB,
    WorkerProcess,
    download,
    embedded_settings,
    expected_parameters,
    finished,
    free_port,
    put_model,
    serving,
    settings_env,
    wait_job,
)
from worker.runner import execute

pytestmark = pytest.mark.service

S3_MODEL = f"s3://{MODELS_BUCKET}/{ALLOWED_MODELS_PREFIX}/stories260K"


def events_of(api: TestClient, job_id: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    return api.get(f"/v1/jobs/{job_id}/events", headers=headers).json()["data"]


def run(api: TestClient, headers: dict[str, str], model: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    created = api.post("/v1/jobs", json={**TINY_JOB, "model": model}, headers=headers)
    assert created.status_code == 201, created.text
    job = wait_job(api, created.json()["id"], headers, finished, "the job to finish")
    assert job["status"] == "succeeded", job["error"]
    return job, events_of(api, job["id"], headers)


# slow (12 s, two jobs): make test keeps a GGUF file in a bucket pruned by a job through the worker
# (test_a_gguf_file_in_a_bucket_is_pruned_and_one_that_is_no_model_refused) and the model cache's reuse and its
# check of changed objects in the library (tests/service/test_model_cache.py)
@pytest.mark.slow
def test_a_model_in_a_bucket_is_pruned_and_read_from_s3_once(
    api: TestClient,
    worker: WorkerProcess,
    keys: dict[str, dict[str, str]],
    models_bucket: tuple[Any, Any],
    distributed_settings: Settings,
) -> None:
    put_model(models_bucket, S3_MODEL.removeprefix(f"s3://{MODELS_BUCKET}/"))
    alice = keys["alice"]
    first, first_events = run(api, alice, S3_MODEL)
    assert first["model"] == S3_MODEL and abs(first["result"]["achieved_ratio"] - 0.3) < 0.02
    downloads = [e for e in first_events if e["stage"] == "download"]
    assert downloads[-1]["message"] == f"downloaded {S3_MODEL}: 6 files, 1.1 MB"
    # The download comes first, and its progress is the job's: then loading, at a higher percentage.
    load = next(e for e in first_events if e["stage"] == "load")
    assert downloads[0]["progress"] < load["progress"] and load["id"] > downloads[-1]["id"]
    # The model card and the report name the model by its folder, not by the worker's cache.
    listed = api.get(f"/v1/jobs/{first['id']}/artifacts", headers=alice).json()["data"]
    artifacts = {a["name"]: a["url"] for a in listed}
    assert json.loads(download(artifacts["report.json"]).text)["model"] == "stories260K"
    assert "model-cache" not in download(artifacts["README.md"]).text

    second, second_events = run(api, alice, S3_MODEL)
    assert [e["message"] for e in second_events if e["stage"] == "download"] == [
        f"{S3_MODEL}: in the model cache, its objects unchanged; nothing downloaded"
    ]
    assert second["result"]["params"] == first["result"]["params"]
    cache = distributed_settings.home / "model-cache"
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 1


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (f"s3://other-bucket/{ALLOWED_MODELS_PREFIX}/stories260K", "CASP_ALLOWED_MODEL_BUCKETS"),
        (f"s3://{MODELS_BUCKET}/elsewhere/stories260K", "CASP_ALLOWED_MODEL_BUCKETS"),
        # Prefixes are folders: `allowed-not` is not under `allowed`.
        (f"s3://{MODELS_BUCKET}/{ALLOWED_MODELS_PREFIX}-not/stories260K", "CASP_ALLOWED_MODEL_BUCKETS"),
        (f"s3://{MODELS_BUCKET}/{ALLOWED_MODELS_PREFIX}/../x", "not empty, . or .."),
        ("s3://No_Bucket/x", "not an S3 bucket name"),
        ("casp://models/" + "0" * 32, "no uploaded model"),
        ("casp://models/nope", "an uploaded model is `casp://models/<id>`"),
    ],
)
def test_models_the_server_does_not_allow_are_refused_at_submit(
    api: TestClient, keys: dict[str, dict[str, str]], model: str, reason: str
) -> None:
    error = refusal(api.post("/v1/jobs", json={**TINY_JOB, "model": model}, headers=keys["alice"]))
    assert error["param"] == "model" and reason in error["message"], error


def model_tar(folder: Path = DEMO_MODEL, *, top: str | None = None, change: dict[str, bytes] | None = None) -> bytes:
    """The folder as a tar: its files at the top, or under one folder `top`; `change` replaces files' contents."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(folder.iterdir()):
            data = (change or {}).get(path.name, path.read_bytes())
            info = tarfile.TarInfo(f"{top}/{path.name}" if top else path.name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def config_with(**changes: Any) -> bytes:
    return json.dumps({**json.loads((DEMO_MODEL / "config.json").read_text()), **changes}).encode()


def upload(api: TestClient, headers: dict[str, str], archive: bytes, **form: str) -> Any:
    return api.post("/v1/models", headers=headers, files={"file": ("model.tar", archive)}, data=form)


def test_an_uploaded_model_is_its_keys_alone_and_pruned_by_its_jobs(
    api: TestClient, worker: WorkerProcess, keys: dict[str, dict[str, str]]
) -> None:
    alice, bob = keys["alice"], keys["bob"]
    created = upload(api, alice, model_tar(top="tiny-stories"))
    assert created.status_code == 201, created.text
    uploaded = created.json()
    assert (uploaded["name"], uploaded["model_type"], uploaded["files"]) == ("tiny-stories", "llama", 6)
    assert uploaded["model"] == f"casp://models/{uploaded['id']}"
    assert uploaded["size"] == sum(path.stat().st_size for path in DEMO_MODEL.iterdir())

    listed = [m["id"] for m in api.get("/v1/models", headers=alice).json()["data"]]
    assert uploaded["id"] in listed
    assert uploaded["id"] not in [m["id"] for m in api.get("/v1/models", headers=bob).json()["data"]]
    error = refusal(api.post("/v1/jobs", json={**TINY_JOB, "model": uploaded["model"]}, headers=bob))
    assert error["param"] == "model" and "no uploaded model" in error["message"]
    assert api.delete(f"/v1/models/{uploaded['id']}", headers=bob).status_code == 404

    job, events = run(api, alice, uploaded["model"])
    assert abs(job["result"]["achieved_ratio"] - 0.3) < 0.02
    assert [e["message"] for e in events if e["stage"] == "download"][-1].startswith("downloaded s3://")

    assert api.delete(f"/v1/models/{uploaded['id']}", headers=alice).status_code == 204
    assert uploaded["id"] not in [m["id"] for m in api.get("/v1/models", headers=alice).json()["data"]]
    error = refusal(api.post("/v1/jobs", json={**TINY_JOB, "model": uploaded["model"]}, headers=alice))
    assert error["param"] == "model"


@pytest.mark.parametrize(
    ("archive", "reason"),
    [
        (b"not a tar at all", "not a readable tar archive"),
        (model_tar(change={"config.json": config_with(model_type="gpt2")}), "unsupported_model: model type 'gpt2'"),
        (
            model_tar(change={"config.json": config_with(intermediate_size=176)}),
            "unsupported_model: the weights do not match config.json: model.layers.0.mlp.down_proj.weight has shape"
            " [64, 172], config.json makes it [64, 176]",
        ),
        (
            model_tar(change={"config.json": config_with(num_hidden_layers=6)}),
            "model.layers.5.input_layernorm.weight is missing",
        ),
        (model_tar(change={"model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}"}), "model_not_found"),
    ],
)
def test_a_bad_upload_is_refused_with_the_reason(
    api: TestClient, keys: dict[str, dict[str, str]], archive: bytes, reason: str
) -> None:
    before = api.get("/v1/models", headers=keys["alice"]).json()["data"]
    error = refusal(upload(api, keys["alice"], archive))
    assert error["param"] == "file" and reason in error["message"], error
    assert "/tmp" not in error["message"] and "uploads" not in error["message"]  # no server path
    assert api.get("/v1/models", headers=keys["alice"]).json()["data"] == before


def test_the_uploads_list_pages_newest_first(api: TestClient, distributed_settings: Settings) -> None:
    with session_scope(distributed_settings.database) as session:
        _, key = create_api_key(session, "pages")  # a key of its own: no other test's uploads in its list
    headers = {"Authorization": f"Bearer {key}"}
    created = []
    for name in ("first", "second", "third"):
        response = upload(api, headers, model_tar(top=name))
        assert response.status_code == 201, response.text
        created.append(response.json()["id"])

    pages, after = [], None
    while True:
        page = api.get("/v1/models", headers=headers, params={"limit": 2, **({"after": after} if after else {})})
        assert page.status_code == 200, page.text
        pages.append([model["name"] for model in page.json()["data"]])
        if not page.json()["has_more"]:
            break
        after = page.json()["data"][-1]["id"]
    assert pages == [["third", "second"], ["first"]]
    assert refusal(api.get("/v1/models", headers=headers, params={"limit": 101}))["param"] == "limit"
    for model_id in created:
        assert api.delete(f"/v1/models/{model_id}", headers=headers).status_code == 204


def api_key(headers: dict[str, str]) -> str:
    return headers["Authorization"].removeprefix("Bearer ")


def casp_models_upload(settings: Settings, key: str, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "casp_cli.main", "models", "upload", *args, "--url", url],
        cwd=REPO,
        env={**settings_env(settings), "CASP_API_KEY": key},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_casp_models_upload_shows_its_progress_and_prints_the_model(
    distributed_settings: Settings, keys: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    key = api_key(keys["alice"])
    with serving(service_app(distributed_settings)) as url:
        uploaded = []
        for how in ([], ["--presigned"]):  # through the API, or straight into the bucket
            done = casp_models_upload(distributed_settings, key, url, str(DEMO_MODEL), *how)
            assert done.returncode == 0, done.stderr
            uploaded.append(json.loads(done.stdout))
            assert uploaded[-1]["name"] == "stories260K" and uploaded[-1]["model"].startswith("casp://models/")
            assert uploaded[-1]["size"] == sum(path.stat().st_size for path in DEMO_MODEL.iterdir())
            assert "uploading: 100%" in done.stderr
        assert uploaded[0]["id"] != uploaded[1]["id"]
        missing = casp_models_upload(distributed_settings, key, url, str(REPO / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0, missing.stderr
    with serving(service_app(embedded_settings(tmp_path))) as url:  # local storage: no presigned uploads
        refused = casp_models_upload(distributed_settings, key, url, str(DEMO_MODEL), "--presigned")
    assert refused.returncode == 2 and "presigned uploads need S3 storage" in refused.stderr.splitlines()[-1]


def presign(api: TestClient, headers: dict[str, str], **body: Any) -> dict[str, Any]:
    created = api.post("/v1/models/presigned", json=body, headers=headers)
    assert created.status_code == 201, created.text
    return created.json()


def test_a_presigned_upload_is_checked_when_completed_and_is_its_keys_alone(
    api: TestClient,
    worker: WorkerProcess,
    keys: dict[str, dict[str, str]],
    distributed_settings: Settings,
    models_bucket: tuple[Any, Any],
) -> None:
    alice, bob = keys["alice"], keys["bob"]
    upload = presign(api, alice, name="presigned-stories")
    assert upload["upload_method"] == "PUT" and upload["complete_url"] == f"/v1/models/{upload['id']}/complete"
    # Completing before the tar is there says so; the URL takes the tar with no other credentials.
    assert refusal(api.post(upload["complete_url"], headers=alice), 409)["code"] == "conflict"
    assert httpx.put(upload["upload_url"], content=model_tar(), timeout=30).status_code == 200
    # Another key's complete answers as for an unknown upload, and leaves it be.
    assert refusal(api.post(upload["complete_url"], headers=bob), 404)["code"] == "not_found"

    completed = api.post(upload["complete_url"], headers=alice)
    assert completed.status_code == 201, completed.text
    model = completed.json()
    assert (model["id"], model["name"], model["model_type"], model["files"]) == (
        upload["id"],
        "presigned-stories",
        "llama",
        6,
    )
    assert model["size"] == sum(path.stat().st_size for path in DEMO_MODEL.iterdir())
    # The tar is gone from the bucket once completed, and the upload with it.
    client, _ = models_bucket
    leftover = client.list_objects_v2(Bucket="casp-test", Prefix="artifacts/model-uploads/").get("Contents", [])
    assert leftover == []
    assert refusal(api.post(upload["complete_url"], headers=alice), 404)["code"] == "not_found"

    assert model["id"] in [m["id"] for m in api.get("/v1/models", headers=alice).json()["data"]]
    assert model["id"] not in [m["id"] for m in api.get("/v1/models", headers=bob).json()["data"]]
    error = refusal(api.post("/v1/jobs", json={**TINY_JOB, "model": model["model"]}, headers=bob))
    assert error["param"] == "model" and "no uploaded model" in error["message"]
    job, _ = run(api, alice, model["model"])
    assert abs(job["result"]["achieved_ratio"] - 0.3) < 0.02


def test_a_bad_presigned_upload_is_refused_with_the_reason_and_deleted(
    api: TestClient, keys: dict[str, dict[str, str]], models_bucket: tuple[Any, Any]
) -> None:
    alice = keys["alice"]
    before = api.get("/v1/models", headers=alice).json()["data"]
    upload = presign(api, alice)
    wrong_width = model_tar(change={"config.json": config_with(intermediate_size=176)})
    assert httpx.put(upload["upload_url"], content=wrong_width, timeout=30).status_code == 200
    error = refusal(api.post(upload["complete_url"], headers=alice))
    reason = "unsupported_model: the weights do not match config.json: model.layers.0.mlp.down_proj.weight has shape"
    assert error["param"] == "file" and f"{reason} [64, 172], config.json makes it [64, 176]" in error["message"]
    assert "uploads" not in error["message"]  # no server path
    assert api.get("/v1/models", headers=alice).json()["data"] == before
    client, _ = models_bucket
    assert client.list_objects_v2(Bucket="casp-test", Prefix="artifacts/model-uploads/").get("Contents", []) == []
    assert refusal(api.post(upload["complete_url"], headers=alice), 404)["code"] == "not_found"
    # A name that is no model name is refused when the upload is asked for.
    assert refusal(api.post("/v1/models/presigned", json={"name": "../x"}, headers=alice))["param"] == "name"


def test_presigned_uploads_need_s3_storage(tmp_path: Path) -> None:
    with TestClient(service_app(embedded_settings(tmp_path))) as client:
        error = refusal(client.post("/v1/models/presigned", json={}), 400)
    assert "presigned uploads need S3 storage" in error["message"] and "multipart" in error["message"]


def test_a_presigned_upload_never_completed_is_deleted_once_it_expires(
    api: TestClient, keys: dict[str, dict[str, str]], distributed_settings: Settings, models_bucket: tuple[Any, Any]
) -> None:
    alice = keys["alice"]
    upload = presign(api, alice)
    assert httpx.put(upload["upload_url"], content=model_tar(), timeout=30).status_code == 200
    client, _ = models_bucket
    tar_key = f"artifacts/model-uploads/{upload['id']}.tar"
    assert client.head_object(Bucket="casp-test", Key=tar_key)["ContentLength"] > 0
    storage = make_storage(distributed_settings)
    assert upload["id"] not in sweep_expired_pending_uploads(distributed_settings, storage)  # not expired yet
    with session_scope(distributed_settings.database) as session:
        session.get_one(PendingUpload, upload["id"]).expires_at = utcnow() - timedelta(seconds=1)
    assert upload["id"] in sweep_expired_pending_uploads(distributed_settings, storage)
    assert client.list_objects_v2(Bucket="casp-test", Prefix=tar_key).get("Contents", []) == []
    assert refusal(api.post(upload["complete_url"], headers=alice), 404)["code"] == "not_found"


def test_an_upload_is_kept_for_its_retention_then_swept(
    api: TestClient, keys: dict[str, dict[str, str]], distributed_settings: Settings, models_bucket: tuple[Any, Any]
) -> None:
    alice = keys["alice"]
    too_long = distributed_settings.max_artifact_retention_seconds + 1
    error = refusal(upload(api, alice, model_tar(), retention_seconds=str(too_long)))
    assert error["param"] == "retention_seconds" and "CASP_MAX_ARTIFACT_RETENTION_SECONDS" in error["message"]
    model = upload(api, alice, model_tar(), retention_seconds="60").json()
    created, expires = (datetime.fromisoformat(model[name]) for name in ("created_at", "expires_at"))
    assert abs((expires - created).total_seconds() - 60) < 1
    client, _ = models_bucket
    stored = f"artifacts/models/{model['id']}/"
    assert len(client.list_objects_v2(Bucket="casp-test", Prefix=stored).get("Contents", [])) == 6
    storage = make_storage(distributed_settings)
    assert model["id"] not in sweep_expired_uploads(distributed_settings, storage)
    with session_scope(distributed_settings.database) as session:
        session.get_one(UploadedModel, model["id"]).expires_at = utcnow() - timedelta(seconds=1)
    assert model["id"] in sweep_expired_uploads(distributed_settings, storage)
    assert client.list_objects_v2(Bucket="casp-test", Prefix=stored).get("Contents", []) == []
    assert model["id"] not in [m["id"] for m in api.get("/v1/models", headers=alice).json()["data"]]
    error = refusal(api.post("/v1/jobs", json={**TINY_JOB, "model": model["model"]}, headers=alice))
    assert error["param"] == "model" and "no uploaded model" in error["message"]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """stories260K as an f32 GGUF written by casp's exporter (1 MB; transformers' loader reads it back), and files
    named `.gguf` that are no model to prune."""
    folder = tmp_path_factory.mktemp("gguf")
    stories = export_gguf(DEMO_MODEL, folder / "stories260K.gguf", "f32").path
    text = folder / "notes.gguf"
    text.write_text("not a model\n")
    truncated = folder / "cut.gguf"
    truncated.write_bytes(stories.read_bytes()[: stories.stat().st_size // 2])
    return {"stories": stories, "text": text, "truncated": truncated, "gpt2": write_gguf(folder / "gpt2.gguf", "gpt2")}


# What the 422 (on `model` at submit, on `file` at upload) or the failed job says of each file that is no model.
GGUF_REFUSALS = {
    "text": "invalid_model_file: notes.gguf is not a GGUF file: it does not start with the GGUF magic bytes",
    "truncated": "invalid_model_file: cut.gguf is a damaged or truncated GGUF file",
    "gpt2": "unsupported_model: gpt2.gguf: model type 'gpt2'",
}


@pytest.mark.parametrize("kind", GGUF_REFUSALS)
def test_a_gguf_file_that_is_no_model_to_prune_is_refused_at_submit_and_upload(
    gguf_files: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    settings = embedded_settings(tmp_path, allowed_model_roots=[gguf_files["stories"].parent])
    path = gguf_files[kind]
    with TestClient(service_app(settings)) as client:
        error = refusal(client.post("/v1/jobs", json={**TINY_JOB, "model": str(path)}))
        assert error["param"] == "model" and GGUF_REFUSALS[kind] in error["message"], error
        # Uploaded: named `.gguf`, it is checked as a GGUF file (a text file is not read as a tar), with no name given
        # and with one, by the multipart file's name or its first bytes.
        error = refusal(client.post("/v1/models", files={"file": (path.name, path.read_bytes())}))
        assert error["param"] == "file" and GGUF_REFUSALS[kind] in error["message"], error
        assert client.get("/v1/jobs").json()["data"] == [] and client.get("/v1/models").json()["data"] == []
    assert not (settings.home / "artifacts" / "models").exists()
    assert list((settings.home / "uploads").iterdir()) == []  # the scratch copy went too


def test_a_gguf_file_is_taken_at_submit_and_upload_and_one_changed_since_fails_its_job(
    gguf_files: dict[str, Path], tmp_path: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    local = Path(shutil.copy(gguf_files["stories"], models / "stories260K.gguf"))
    # As the Hugging Face cache keeps a file: a link named `.gguf` to a blob named by its digest.
    shutil.copy(local, models / "blob")
    (models / "linked.gguf").symlink_to(models / "blob")
    settings = embedded_settings(tmp_path, allowed_model_roots=[models])
    with TestClient(service_app(settings)) as client:
        linked = client.post("/v1/jobs", json={**TINY_JOB, "model": str(models / "linked.gguf")})
        assert linked.status_code == 201 and linked.json()["model"] == str(models / "linked.gguf"), linked.text
        missing = refusal(client.post("/v1/jobs", json={**TINY_JOB, "model": str(models / "absent.gguf")}))
        assert missing["param"] == "model" and missing["message"] == "model: no such GGUF file"

        uploaded = client.post("/v1/models", files={"file": ("stories260K.gguf", local.read_bytes())})
        assert uploaded.status_code == 201, uploaded.text
        model = uploaded.json()
        assert (model["name"], model["model_type"], model["files"]) == ("stories260K.gguf", "llama", 1)
        assert model["size"] == local.stat().st_size
        stored = settings.home / "artifacts" / "models" / model["id"] / "stories260K.gguf"
        assert stored.read_bytes() == local.read_bytes()
        # Its first bytes say GGUF: a name without the suffix gets it.
        named = client.post("/v1/models", files={"file": ("blob", local.read_bytes())}, data={"name": "tiny"})
        assert named.status_code == 201 and named.json()["name"] == "tiny.gguf", named.text

        on_file, on_upload = (
            client.post("/v1/jobs", json={**TINY_JOB, "model": name}) for name in (str(local), model["model"])
        )
        assert on_file.status_code == 201 and on_file.json()["model"] == str(local), on_file.text
        assert on_upload.status_code == 201, on_upload.text
        # Both files are cut short after the submit: each job fails with the check's code before any work.
        for changed in (local, stored):
            changed.write_bytes(gguf_files["truncated"].read_bytes())
        for created in (on_file, on_upload):
            job_id = created.json()["id"]
            assert execute(job_id, settings, make_storage(settings), worker_id="by-hand") == "failed"
            error = client.get(f"/v1/jobs/{job_id}").json()["error"]
            assert error["code"] == "invalid_model_file", error
            assert error["message"].startswith("stories260K.gguf is a damaged or truncated GGUF file"), error
            assert refusal(client.get(f"/v1/jobs/{job_id}/artifacts"), 409)["code"] == "conflict"
    assert not (settings.home / "work").exists() or list((settings.home / "work").iterdir()) == []
    assert not (settings.home / "artifacts" / "jobs").exists()
    assert not (settings.cache / "gguf").exists() or list((settings.cache / "gguf").iterdir()) == []


def test_a_gguf_object_whose_s3_server_does_not_answer_is_a_503_at_submit(tmp_path: Path) -> None:
    nobody = S3Credentials(endpoint_url=f"http://127.0.0.1:{free_port()}", access_key_id="a", secret_access_key="b")
    settings = embedded_settings(
        tmp_path, allowed_model_buckets=[MODELS_BUCKET], model_bucket_credentials={MODELS_BUCKET: nobody}
    )
    model = f"s3://{MODELS_BUCKET}/stories260K.gguf"
    with TestClient(service_app(settings)) as client:
        answer = client.post("/v1/jobs", json={**TINY_JOB, "model": model})
        error = refusal(answer, 503)
        assert client.get("/v1/jobs").json()["data"] == []
    assert error["code"] == "s3_unreachable" and answer.headers["Retry-After"] == "5"
    assert error["message"] == f"the S3 server of {model} could not be reached (EndpointConnectionError); retry later"


def test_casp_models_upload_of_a_gguf_file_is_pruned_and_its_artifacts_load(
    distributed_settings: Settings,
    worker: WorkerProcess,
    keys: dict[str, dict[str, str]],
    gguf_files: dict[str, Path],
    tmp_path: Path,
) -> None:
    key = api_key(keys["alice"])
    stories = gguf_files["stories"]
    with serving(service_app(distributed_settings)) as url:
        done = casp_models_upload(distributed_settings, key, url, str(stories), "--presigned")
        assert done.returncode == 0, done.stderr
        uploaded = json.loads(done.stdout)
        assert (uploaded["name"], uploaded["model_type"], uploaded["files"]) == ("stories260K.gguf", "llama", 1)
        refused = casp_models_upload(distributed_settings, key, url, str(gguf_files["text"]))
        assert refused.returncode == 2 and refused.stderr.splitlines()[-1] == (
            f"casp: error: invalid_request: file: {GGUF_REFUSALS['text']}"
        ), refused.stderr
        with CaspClient(url, api_key=key) as client:
            job = client.submit({**TINY_JOB, "model": uploaded["model"]})
            job = client.wait(job["id"], timeout=JOB_TIMEOUT)
            assert job["status"] == "succeeded", job["error"]
            client.download(job["id"], tmp_path / "pruned")  # every sha256 checked
    source = job["result"]["source"]
    assert (source["file"], source["sha256"]) == ("stories260K.gguf", hashlib.sha256(stories.read_bytes()).hexdigest())
    assert abs(job["result"]["achieved_ratio"] - 0.3) < 0.02
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True)
    # The dequantized f32 file holds the demo model's very weights: the pruned model has its parameters, less those
    # the report says went.
    assert sum(p.numel() for p in pruned.parameters()) == expected_parameters(job["result"])
    with torch.no_grad():
        logits = pruned(torch.tensor([[1, 403, 407, 261, 378]])).logits
    assert logits.shape == (1, 5, 512) and torch.isfinite(logits).all()


def test_a_gguf_file_in_a_bucket_is_pruned_and_one_that_is_no_model_refused(
    api: TestClient,
    worker: WorkerProcess,
    keys: dict[str, dict[str, str]],
    models_bucket: tuple[Any, Any],
    distributed_settings: Settings,
    gguf_files: dict[str, Path],
) -> None:
    client, _ = models_bucket
    prefix = f"{ALLOWED_MODELS_PREFIX}/gguf"
    for kind in ("stories", "text", "truncated"):
        client.upload_file(str(gguf_files[kind]), MODELS_BUCKET, f"{prefix}/{gguf_files[kind].name}")
    alice = keys["alice"]
    model = f"s3://{MODELS_BUCKET}/{prefix}/stories260K.gguf"
    job, events = run(api, alice, model)
    assert job["model"] == model and job["result"]["source"]["file"] == "stories260K.gguf"
    assert [e["message"] for e in events if e["stage"] == "download"][-1] == f"downloaded {model}: 1 file, 1.1 MB"

    # At submit the API reads an object's first bytes: a text file, or no object, is refused there.
    text = refusal(
        api.post("/v1/jobs", json={**TINY_JOB, "model": f"s3://{MODELS_BUCKET}/{prefix}/notes.gguf"}, headers=alice)
    )
    assert text["param"] == "model" and text["message"] == f"model: {GGUF_REFUSALS['text']}", text
    absent = f"s3://{MODELS_BUCKET}/{prefix}/absent.gguf"
    error = refusal(api.post("/v1/jobs", json={**TINY_JOB, "model": absent}, headers=alice))
    assert error["param"] == "model" and error["message"] == f"model: model_not_found: {absent}: no such object", error

    # One cut short starts as GGUF: the worker checks its whole header once downloaded, before it enters the cache.
    cache = distributed_settings.home / "model-cache"
    cached = sorted(cache.iterdir())
    created = api.post("/v1/jobs", json={**TINY_JOB, "model": f"s3://{MODELS_BUCKET}/{prefix}/cut.gguf"}, headers=alice)
    assert created.status_code == 201, created.text
    failed = wait_job(api, created.json()["id"], alice, finished, "the job to finish")
    assert failed["status"] == "failed" and failed["error"]["code"] == "invalid_model_file", failed["error"]
    assert failed["error"]["message"].startswith(GGUF_REFUSALS["truncated"].removeprefix("invalid_model_file: "))
    assert refusal(api.get(f"/v1/jobs/{failed['id']}/artifacts", headers=alice), 409)["code"] == "conflict"
    assert sorted(cache.iterdir()) == cached  # no entry, no partial folder left
