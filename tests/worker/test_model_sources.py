"""Models from where teams keep them, through the API and a real Celery worker (PostgreSQL, Redis, SeaweedFS S3):
a model in a bucket (downloaded once, then read from the worker's cache), a model uploaded as a tar, in the request
or to a presigned URL (its key's alone, checked before it is kept), and what is refused at submit with a 422 naming
`model`."""

import io
import json
import subprocess
import sys
import tarfile
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from casp_cli.app import service_app
from service.db import session_scope
from service.reaper import sweep_expired_pending_uploads, sweep_expired_uploads
from service.settings import Settings
from service.storage import make_storage
from service.tables import PendingUpload, UploadedModel, utcnow
from tests.api.test_api import refusal
from tests.service_fixtures import (
    ALLOWED_MODELS_PREFIX,
    DEMO_MODEL,
    MODELS_BUCKET,
    REPO,
    TINY_JOB,
    WorkerProcess,
    download,
    embedded_settings,
    finished,
    put_model,
    serving,
    settings_env,
    wait_job,
)

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


def test_casp_models_upload_shows_its_progress_and_prints_the_model(
    distributed_settings: Settings, keys: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    key = keys["alice"]["Authorization"].removeprefix("Bearer ")

    def casp_models_upload(url: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "casp_cli.main", "models", "upload", *args, "--url", url],
            cwd=REPO,
            env={**settings_env(distributed_settings), "CASP_API_KEY": key},
            capture_output=True,
            text=True,
            timeout=120,
        )

    with serving(service_app(distributed_settings)) as url:
        uploaded = []
        for how in ([], ["--presigned"]):  # through the API, or straight into the bucket
            done = casp_models_upload(url, str(DEMO_MODEL), *how)
            assert done.returncode == 0, done.stderr
            uploaded.append(json.loads(done.stdout))
            assert uploaded[-1]["name"] == "stories260K" and uploaded[-1]["model"].startswith("casp://models/")
            assert uploaded[-1]["size"] == sum(path.stat().st_size for path in DEMO_MODEL.iterdir())
            assert "uploading: 100%" in done.stderr
        assert uploaded[0]["id"] != uploaded[1]["id"]
        missing = casp_models_upload(url, str(REPO / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0, missing.stderr
    with serving(service_app(embedded_settings(tmp_path))) as url:  # local storage: no presigned uploads
        refused = casp_models_upload(url, str(DEMO_MODEL), "--presigned")
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
