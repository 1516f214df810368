"""A sweep job stopped after its first candidate and run again, in the embedded mode as a worker runs it: the worker
keeps the sweep's state in the job's storage and the second run resumes from it, after the dense model's figures
and the candidate already measured (the local work folder is gone by then: only the stored state can resume it)."""

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from casp_core.artifacts.snapshot import SNAPSHOT_FILE
from casp_core.job.steps import SWEEP_STATE_FILE
from service.storage import make_storage
from tests.service_fixtures import TINY_JOB, counted_retry_saves, embedded_settings
from tests.worker.test_jobs_e2e import events_of
from worker.runner import execute

pytestmark = pytest.mark.service

SWEEP_JOB: dict[str, Any] = {
    **TINY_JOB,
    "ratio": None,
    # A pruned pick, whose model the state keeps (a dense point may win stories260K's budget otherwise).
    "target": {"max_bytes": "100MB", "candidates": "pruned"},
    "ratios": [0.2, 0.4],
    "gguf_types": ["f16"],
    "export": ["gguf"],
    "solver": "diagonal",
    "device": "cpu",
    "evaluation": {"perplexity": ["wikitext2"], "seq_len": 64, "limit": 4},
}


def test_a_sweep_stopped_after_its_first_candidate_resumes_from_the_stored_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = embedded_settings(tmp_path)
    storage = make_storage(settings)
    stored = counted_retry_saves(monkeypatch)
    with TestClient(create_app(settings)) as client:
        job_id = client.post("/v1/jobs", json={k: v for k, v in SWEEP_JOB.items() if k != "ratio"}).json()["id"]
        # The server "stops" once the state after the first candidate is stored: the job goes back to the queue.
        first_done = lambda: stored.count(SWEEP_STATE_FILE) >= 2  # noqa: E731 (the dense points', then the candidate's)
        assert execute(job_id, settings, storage, worker_id="first", stop_requested=first_done) is None
        assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
        assert stored == [SWEEP_STATE_FILE, SNAPSHOT_FILE, SWEEP_STATE_FILE]
        assert not (settings.home / "work" / job_id).exists()
        assert execute(job_id, settings, storage, worker_id="second") == "succeeded"
        job = client.get(f"/v1/jobs/{job_id}").json()
        events = events_of(client, job_id, {})
    requeued = next(e["id"] for e in events if e["message"] == "worker shut down; queued again")
    first = [e for e in events if e["id"] < requeued]
    second = [e for e in events if e["id"] > requeued]
    assert any((e["message"] or "").startswith("candidate 1 of 2") for e in first)
    messages = [e["message"] or "" for e in second]
    assert "resumed after the dense model's evaluation, 1 candidate already measured" in messages, messages
    assert not [message for message in messages if message.startswith("candidate 1 of 2")]
    assert any(message.startswith("candidate 2 of 2: ratio 0.4") for message in messages)
    assert not {"evaluation", "dense_points"} & {e["stage"] for e in second}
    # The result covers both candidates: the first from the stored state, the second measured now.
    assert job["attempts"] == 1 and job["result"]["frontier"]["pick"]["ratio"] in (0.2, 0.4)
    assert job["result"]["achieved_ratio"] == pytest.approx(job["result"]["frontier"]["pick"]["ratio"], abs=0.05)
