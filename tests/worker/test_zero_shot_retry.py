"""A job stopped after its dense model's zero-shot tasks and run again on another machine, in the embedded mode as
a worker runs it: the worker keeps the scores in the job's storage with the retry state, and the retry, with an
empty cache of its own, finds them there and scores nothing of the dense model again."""

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from casp_core.job.steps import ZERO_SHOT_SCORES_FILE
from service.storage import make_storage
from tests.service_fixtures import ZERO_SHOT_JOB, counted_retry_saves, embedded_settings
from tests.worker.test_jobs_e2e import events_of
from worker.runner import execute

pytestmark = pytest.mark.service

DOCUMENTS = ZERO_SHOT_JOB["evaluation"]["limit"]


def test_a_job_stopped_after_its_dense_scores_resumes_from_them_on_another_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first_machine = embedded_settings(tmp_path, cache_dir=tmp_path / "first-machine-cache")
    second_machine = embedded_settings(tmp_path, cache_dir=tmp_path / "second-machine-cache")
    storage = make_storage(first_machine)
    stored = counted_retry_saves(monkeypatch)
    with TestClient(create_app(first_machine)) as client:
        job_id = client.post("/v1/jobs", json=ZERO_SHOT_JOB).json()["id"]
        # The server "stops" once the dense model's scores are stored: the job goes back to the queue.
        assert execute(job_id, first_machine, storage, worker_id="first", stop_requested=lambda: bool(stored)) is None
        assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
        assert stored == [ZERO_SHOT_SCORES_FILE]
        assert not (first_machine.home / "work" / job_id).exists()
        assert execute(job_id, second_machine, storage, worker_id="second") == "succeeded"
        job = client.get(f"/v1/jobs/{job_id}").json()
        events = events_of(client, job_id, {})
        assert not storage.get_work(job_id, ZERO_SHOT_SCORES_FILE, tmp_path / "left")  # dropped with the job's end
    assert job["status"] == "succeeded"
    # The result gives the task's accuracies, dense and pruned, as report.json holds them, and the documents scored.
    report = json.loads((first_machine.home / "artifacts" / "jobs" / job_id / "report.json").read_text())
    zero_shot = report["evaluation"]["zero_shot"]
    accuracies = {model: zero_shot[model]["tasks"]["arc_easy"]["acc"] for model in ("dense", "pruned")}
    assert job["result"]["zero_shot"] == {"arc_easy": {**accuracies, "n_samples": DOCUMENTS}}
    requeued = next(e["id"] for e in events if e["message"] == "worker shut down; queued again")
    second = [e for e in events if e["id"] > requeued]
    # The dense model's evaluation: all of its log-likelihoods found, none scored again (no batch reported).
    dense = [
        e["message"] for e in second[: [e["stage"] for e in second].index("placement")] if e["stage"] == "evaluation"
    ]
    assert dense == [f"zero-shot: resuming from the {DOCUMENTS * 4} log-likelihoods an earlier run kept"], second
