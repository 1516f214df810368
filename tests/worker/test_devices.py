"""Jobs run on the device the machine has: `auto` by default, and a device the machine lacks is refused at
submit (embedded) or fails the job with `device_unavailable` (a worker), never with torch's assertion."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from api.main import create_app
from service.db import session_scope
from service.settings import Settings
from service.storage import make_storage
from service.tables import Job
from tests.service_fixtures import REPO, SMALL_JOB, embedded_settings, settings_env
from worker.runner import execute

pytestmark = [
    pytest.mark.service,
    pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA does"),
]

ANY_DEVICE_JOB = {key: value for key, value in SMALL_JOB.items() if key != "device"}


def test_the_default_device_is_auto_and_the_embedded_service_resolves_it(tmp_path: Path) -> None:
    settings = embedded_settings(tmp_path)
    assert settings.default_device == "auto"
    with TestClient(create_app(settings)) as client:
        job = client.post("/v1/jobs", json=ANY_DEVICE_JOB)
        assert job.status_code == 201 and job.json()["device"] == "cpu"
        refused = client.post("/v1/jobs", json={**SMALL_JOB, "device": "cuda"})
    assert refused.status_code == 422
    error = refused.json()["error"]
    assert error["param"] == "device" and "asks for cuda; this server runs jobs on cpu" in error["message"]
    with session_scope(settings.database) as session:
        assert session.get_one(Job, job.json()["id"]).queue == "casp-cpu"


def test_an_embedded_default_of_cuda_without_a_gpu_is_refused_naming_the_device(tmp_path: Path) -> None:
    with TestClient(create_app(embedded_settings(tmp_path, default_device="cuda"))) as client:
        refused = client.post("/v1/jobs", json=ANY_DEVICE_JOB)
    assert refused.status_code == 422
    error = refused.json()["error"]
    assert error["param"] == "device" and "CASP_DEFAULT_DEVICE is cuda" in error["message"]


def test_a_cuda_job_on_a_worker_without_cuda_fails_with_device_unavailable(tmp_path: Path) -> None:
    """What a worker does with a job for a device it lacks (here run by hand: no worker serves such a queue
    on this machine): the job fails at once with a clear error, not torch's assertion."""
    settings = embedded_settings(tmp_path)
    with TestClient(create_app(settings)) as client:
        job_id = client.post("/v1/jobs", json=ANY_DEVICE_JOB).json()["id"]
        with session_scope(settings.database) as session:
            session.get_one(Job, job_id).device = "cuda"
        assert execute(job_id, settings, make_storage(settings), worker_id="cpu-only") == "failed"
        job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["error"]["code"] == "device_unavailable", job["error"]
    assert job["error"]["message"] == "device 'cuda': this torch build has no CUDA support; use cpu or auto"


def test_casp_worker_for_cuda_on_a_machine_without_it_stops_with_one_line(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, broker_url="redis://127.0.0.1:1/0")
    result = subprocess.run(
        [sys.executable, "-m", "casp_cli.main", "worker", "--device", "cuda"],
        cwd=REPO,
        env=settings_env(settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert result.stderr == "casp worker: no cuda device on this machine (torch sees: cpu)\n"
