"""The HTTP API against PostgreSQL, Redis and S3, without running the pipeline: jobs sent to the `cuda`
queue, which no test worker consumes, stay queued."""

import re
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from service import api_keys, job_queue
from service.db import session_scope
from service.settings import Settings
from service.tables import Job, utcnow
from tests.service_fixtures import REPO, SMALL_JOB, settings_env, wait_for

pytestmark = pytest.mark.service

PARKED = {**SMALL_JOB, "device": "cuda"}


def refusal(response: Any, status: int = 422) -> dict[str, Any]:
    """The service's one error shape: {"error": {"code", "message", "param"}}."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "param"}, body
    return body["error"]


@pytest.mark.parametrize(
    ("change", "param", "reason"),
    [
        ({"ratio": 1.5}, "ratio", "less than 1"),
        ({"ratio": 0}, "ratio", "greater than 0"),
        ({"alpha": -1}, "alpha", 'must be a number in [0, 100] or "auto", got -1'),
        ({"alpha": "hot"}, "alpha", 'must be a number in [0, 100] or "auto", got hot'),
        ({"alpha": "auto", "calibration": {**PARKED["calibration"], "n_samples": 1}}, "alpha", "n_samples >= 2"),
        ({"solver": "magic"}, "solver", "'greedy'"),
        ({"shape": "square"}, "shape", "'per_layer' or 'uniform'"),
        ({"round_to": 0}, "round_to", "round_to: must be auto or an integer in [1, 65536], got 0"),
        ({"round_to": "fast"}, "round_to", "round_to: must be auto or an integer in [1, 65536], got fast"),
        ({"max_device_memory": "24 parsecs"}, "max_device_memory", "one with a unit such as 24GiB or 500MB, got 24"),
        ({"placement": "gpu"}, "placement", "'auto', 'resident' or 'offload'"),
        ({"model": "/etc"}, "model", "CASP_ALLOWED_MODEL_ROOTS"),
        ({"model": f"{REPO}/demo/../casp_core"}, "model", "CASP_ALLOWED_MODEL_ROOTS"),
        ({"model": f"{REPO}/demo/missing"}, "model", "no such model folder"),
        ({"model": "not a model"}, "model", "Hugging Face id"),
        ({"revision": "main"}, "revision", "only a Hugging Face id"),
        (
            {"calibration": {"n_samples": 0}},
            "calibration.n_samples",
            "greater than or equal to 1",
        ),
        ({"calibration": {"dataset": "/etc/passwd"}}, "calibration.dataset", ".txt or .jsonl"),
        ({"calibration": {"dataset": "wikitext3"}}, "calibration.dataset", "wikitext2, ptb, c4"),
        ({"calibration": {"dataset": "ptb:dev"}}, "calibration.dataset", "no split 'dev'"),
        ({"evaluation": {"zero_shot": ["chess"]}}, "evaluation.zero_shot.0", "'boolq'"),
        (
            {"evaluation": {"perplexity": ["ptb", "x/../y.txt"]}},
            "evaluation.perplexity.1",
            "local paths must be absolute",
        ),
        ({"recovery": {"rank": 0}}, "recovery.rank", "greater than or equal to 1"),
        ({"recovery": {"method": "sft"}}, "recovery.method", "'lora'"),
        ({"recovery": {"loss": "distill"}}, "recovery.loss", "distill trains the pruned model: give recovery.method"),
        (
            {"recovery": {"method": "full", "dataset": "ptb", "target_modules": ["q_proj"]}},
            "recovery.target_modules",
            "a LoRA setting, unused by recovery.method full",
        ),
        ({"recovery": {"method": "lora", "loss": "kl"}}, "recovery.loss", "'cross_entropy', 'distill' or 'distill_ce'"),
        ({"recovery": {"method": "lora", "temperature": 0}}, "recovery.temperature", "greater than 0"),
        ({"recovery": {"method": "lora", "ce_weight": 1.5}}, "recovery.ce_weight", "less than or equal to 1"),
        ({"recovery": {"method": "lora", "teacher_top_k": 0}}, "recovery.teacher_top_k", "greater than or equal to 1"),
        ({"recovery": {"method": "lora", "dataset": "/etc/alpaca.json"}}, "recovery.dataset", "CASP_ALLOWED_MODEL"),
        ({"recovery": {"method": "lora", "dataset": "/x/notes.csv"}}, "recovery.dataset", ".txt or .jsonl or .json"),
        ({"recovery": {"method": "lora", "dataset": "ptb:dev"}}, "recovery.dataset", "no split 'dev'"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
        ({"colour": "blue"}, "colour", "Extra inputs are not permitted"),
    ],
)
def test_bad_input_is_422_naming_the_field(
    api: TestClient,
    keys: dict[str, dict[str, str]],
    change: dict[str, Any],
    param: str,
    reason: str,
) -> None:
    response = api.post("/v1/jobs", json={**PARKED, **change}, headers=keys["alice"])
    error = refusal(response)
    assert error["code"] == "invalid_request" and error["param"] == param and reason in error["message"], error


def test_bad_recovery_data_is_422_naming_the_line(api: TestClient, keys: dict[str, dict[str, str]]) -> None:
    # A file the server may read (under CASP_ALLOWED_MODEL_ROOTS, the demo folder in these tests), read at submit.
    bad = REPO / "demo" / f".alpaca-{uuid.uuid4().hex}.jsonl"
    bad.write_text('{"instruction": "Say hi.", "output": "Hi."}\n{"instruction": "No output."}\n', encoding="utf-8")
    try:
        body = {**PARKED, "recovery": {"method": "lora", "dataset": str(bad)}}
        error = refusal(api.post("/v1/jobs", json=body, headers=keys["alice"]))
    finally:
        bad.unlink()
    assert error["param"] == "recovery.dataset" and error["message"] == (
        f"recovery.dataset: invalid_dataset: {bad} line 2: missing `output`"
    ), error
    # Off, the data set is not read.
    body = {**PARKED, "recovery": {"dataset": str(bad)}}
    assert api.post("/v1/jobs", json=body, headers=keys["alice"]).status_code == 201


def test_casp_config_checks_surface_as_422(api: TestClient, keys: dict[str, dict[str, str]]) -> None:
    # r_max is casp_core's own rule (ratio <= r_max), checked by PruneConfig.validate(): ratio 0.95 > 0.9.
    response = api.post("/v1/jobs", json={**PARKED, "ratio": 0.95}, headers=keys["alice"])
    assert refusal(response) == {
        "code": "invalid_request",
        "message": "r_max: must be in [ratio, 1], got 0.9",
        "param": "r_max",
    }


def test_submit_answers_201_with_the_job_and_maps_settings(
    api: TestClient, keys: dict[str, dict[str, str]], distributed_settings: Settings
) -> None:
    body = {**PARKED, "alpha": "auto", "solver": "diagonal", "export": ["gguf"], "metadata": {"team": "llm"}}
    body["shape"] = "uniform"
    response = api.post("/v1/jobs", json=body, headers=keys["alice"])
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["status"] == "queued" and job["progress"] == 0 and job["attempts"] == 0
    assert job["device"] == "cuda" and job["metadata"] == {"team": "llm"}
    assert job["settings"]["alpha"] == "auto" and job["settings"]["solver"] == "diagonal"
    assert job["settings"]["export"] == ["gguf"] and job["settings"]["gguf_type"] == "f16"
    assert job["settings"]["shape"] == "uniform"
    assert job["settings"]["calibration"] == {
        "dataset": "wikitext2:validation",
        "n_samples": 8,
        "seq_len": 128,
        "seed": 0,
        "mode": "sequential",
        "batch_size": 8,
    }
    with session_scope(distributed_settings.database) as session:
        row = session.get_one(Job, job["id"])
        assert row.queue == "casp-cuda"
        assert row.config["datasets_dir"] == str(distributed_settings.datasets_dir)
    # The message is on the broker, on the queue of the job's device.
    assert redis.Redis.from_url(distributed_settings.broker_url).llen("casp-cuda") >= 1
    assert api.post(f"/v1/jobs/{job['id']}/cancel", headers=keys["alice"]).json()["status"] == "cancelled"


def test_idempotency_key(api: TestClient, keys: dict[str, dict[str, str]]) -> None:
    alice = {**keys["alice"], "Idempotency-Key": "submit-1"}
    first = api.post("/v1/jobs", json=PARKED, headers=alice)
    again = api.post("/v1/jobs", json=PARKED, headers=alice)
    assert first.status_code == again.status_code == 201
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    conflict = api.post("/v1/jobs", json={**PARKED, "ratio": 0.4}, headers=alice)
    error = refusal(conflict, 409)
    assert error["code"] == "conflict" and "Idempotency-Key" in error["message"]
    # Keys are per API key: bob's identical key makes bob's own job.
    bobs = api.post("/v1/jobs", json=PARKED, headers={**keys["bob"], "Idempotency-Key": "submit-1"})
    assert bobs.status_code == 201 and bobs.json()["id"] != first.json()["id"]
    for job, headers in ((first, alice), (bobs, keys["bob"])):
        api.post(f"/v1/jobs/{job.json()['id']}/cancel", headers=headers)


def test_a_key_sees_only_its_own_jobs(api: TestClient, keys: dict[str, dict[str, str]]) -> None:
    job = api.post("/v1/jobs", json=PARKED, headers=keys["alice"]).json()
    bob = keys["bob"]
    for method, path in (
        ("GET", f"/v1/jobs/{job['id']}"),
        ("GET", f"/v1/jobs/{job['id']}/events"),
        ("GET", f"/v1/jobs/{job['id']}/artifacts"),
        ("POST", f"/v1/jobs/{job['id']}/cancel"),
        ("DELETE", f"/v1/jobs/{job['id']}"),
    ):
        assert api.request(method, path, headers=bob).status_code == 404, (method, path)
    assert job["id"] not in [j["id"] for j in api.get("/v1/jobs?limit=100", headers=bob).json()["data"]]
    assert job["id"] in [j["id"] for j in api.get("/v1/jobs?limit=100", headers=keys["alice"]).json()["data"]]
    assert api.get(f"/v1/jobs/{job['id']}").status_code == 401
    assert api.get("/v1/jobs", headers={"Authorization": "Bearer casp_wrong"}).status_code == 401
    # Still queued, untouched by bob's cancel.
    assert api.post(f"/v1/jobs/{job['id']}/cancel", headers=keys["alice"]).json()["status"] == "cancelled"


def test_keys_create_command_makes_a_working_key(api: TestClient, distributed_settings: Settings) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "casp_cli.main", "keys", "create", "--name", "carol"],
        cwd=REPO,
        env=settings_env(distributed_settings),
        capture_output=True,
        text=True,
        check=True,
    )
    key = result.stdout.strip()
    assert key.startswith("casp_") and "carol" in result.stderr
    assert api.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}).json() == {
        "data": [],
        "has_more": False,
    }
    with session_scope(distributed_settings.database) as session:
        # Stored hashed: the key itself appears nowhere in the table.
        row = api_keys.find_api_key(session, key)
        assert row is not None and row.key_hash != key and key not in row.key_hash


def test_pagination_newest_first_and_status_filter(api: TestClient, distributed_settings: Settings) -> None:
    with session_scope(distributed_settings.database) as session:
        _, key = api_keys.create_api_key(session, "pager")
    headers = {"Authorization": f"Bearer {key}"}
    ids = [api.post("/v1/jobs", json=PARKED, headers=headers).json()["id"] for _ in range(5)]
    api.post(f"/v1/jobs/{ids[1]}/cancel", headers=headers)
    seen, after = [], None
    while True:
        page = api.get("/v1/jobs", params={"limit": 2, **({"after": after} if after else {})}, headers=headers)
        body = page.json()
        seen += [job["id"] for job in body["data"]]
        if not body["has_more"]:
            break
        after = body["data"][-1]["id"]
    assert seen == ids[::-1]
    cancelled = api.get("/v1/jobs", params={"status": "cancelled"}, headers=headers).json()["data"]
    assert [job["id"] for job in cancelled] == [ids[1]]
    assert api.get("/v1/jobs", params={"limit": 101}, headers=headers).status_code == 422
    assert api.get("/v1/jobs", params={"status": "sleeping"}, headers=headers).status_code == 422
    events = api.get(f"/v1/jobs/{ids[1]}/events", params={"limit": 1}, headers=headers).json()
    assert events["has_more"] and events["data"][0]["message"] == "queued"
    rest = api.get(f"/v1/jobs/{ids[1]}/events", params={"after": events["data"][0]["id"]}, headers=headers).json()
    assert [e["status"] for e in rest["data"]] == ["cancelled"] and not rest["has_more"]
    for job_id in ids:
        api.post(f"/v1/jobs/{job_id}/cancel", headers=headers)


def test_cancel_a_queued_job_and_finished_jobs_answer_409(api: TestClient, keys: dict[str, dict[str, str]]) -> None:
    job = api.post("/v1/jobs", json=PARKED, headers=keys["alice"]).json()
    cancelled = api.post(f"/v1/jobs/{job['id']}/cancel", headers=keys["alice"]).json()
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"] is not None
    assert api.post(f"/v1/jobs/{job['id']}/cancel", headers=keys["alice"]).status_code == 409
    assert api.get(f"/v1/jobs/{job['id']}/artifacts", headers=keys["alice"]).status_code == 409
    assert api.get("/v1/jobs/0123456789abcdef", headers=keys["alice"]).status_code == 404


def test_reaper_requeues_then_fails_a_job_whose_worker_died(
    api: TestClient, keys: dict[str, dict[str, str]], distributed_settings: Settings
) -> None:
    """Attempts are bounded: a job whose worker keeps dying ends failed with `worker_lost`, never running."""
    job_id = api.post("/v1/jobs", json=PARKED, headers=keys["alice"]).json()["id"]
    database = distributed_settings.database
    for attempt in range(1, distributed_settings.max_attempts + 1):
        with session_scope(database) as session:
            claimed = job_queue.claim_job(session, job_id, f"doomed-worker-{attempt}")
            assert claimed is not None and claimed.attempts == attempt
            # The worker dies at once: its heartbeat is older than the timeout.
            claimed.heartbeat_at = utcnow() - timedelta(seconds=distributed_settings.heartbeat_timeout_seconds + 1)
        expected = "queued" if attempt < distributed_settings.max_attempts else "failed"
        job = wait_for(
            lambda expected=expected: (
                (j := api.get(f"/v1/jobs/{job_id}", headers=keys["alice"]).json())["status"] == expected and j
            ),
            30,
            f"the reaper to make the job {expected}",
        )
    assert job["error"]["code"] == "worker_lost" and job["attempts"] == distributed_settings.max_attempts
    messages = [e["message"] for e in api.get(f"/v1/jobs/{job_id}/events", headers=keys["alice"]).json()["data"]]
    requeued = [m for m in messages if m.startswith("worker lost; queued again, to start over")]
    assert len(requeued) == distributed_settings.max_attempts - 1


def test_health_ready_metrics_and_docs(api: TestClient, keys: dict[str, dict[str, str]]) -> None:
    assert api.get("/healthz").json() == {"status": "ok"}
    # Without a key, only whether it is ready; with one, each check.
    assert api.get("/readyz").json() == {"ready": True}
    ready = api.get("/readyz", headers=keys["alice"])
    assert ready.status_code == 200 and ready.json()["checks"] == {
        "database": "ok",
        "broker": "ok",
        "storage": "ok",
    }
    metrics = api.get("/metrics").text
    assert 'casp_jobs{status="queued"}' in metrics and 'casp_queue_depth{queue="casp-cuda"}' in metrics
    assert "casp_broker_up 1.0" in metrics
    assert api.get("/docs").status_code == 200
    assert "/v1/jobs/{job_id}/artifacts" in api.get("/openapi.json").json()["paths"]


def test_an_unreachable_broker_fails_readyz_and_shows_in_metrics(
    distributed_settings: Settings, keys: dict[str, dict[str, str]]
) -> None:
    from api.main import create_app

    broken = distributed_settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0"})
    with TestClient(create_app(broken)) as client:
        response = client.get("/readyz", headers=keys["alice"])
        assert client.get("/readyz").json() == {"error": {"code": "not_ready", "message": "not ready", "param": None}}
        metrics = client.get("/metrics")
    assert response.status_code == 503
    reasons = response.json()["error"]["message"]
    assert reasons.startswith("not ready: broker: ") and "database" not in reasons and "storage" not in reasons
    # The metrics still answer, from the database, and say the broker is away.
    assert metrics.status_code == 200, metrics.text
    assert "casp_broker_up 0.0" in metrics.text and 'casp_jobs{status="queued"}' in metrics.text


def test_a_job_over_its_time_limit_fails_with_a_clear_error(
    api: TestClient, keys: dict[str, dict[str, str]], distributed_settings: Settings
) -> None:
    """The deadline is checked wherever casp_core polls for cancellation; the job ends failed, not running."""
    from service.storage import make_storage
    from worker.runner import execute

    job_id = api.post("/v1/jobs", json=PARKED, headers=keys["alice"]).json()["id"]
    with session_scope(distributed_settings.database) as session:
        session.get(Job, job_id).device = "cpu"  # parked on the cuda queue, run here by hand on the CPU
    hurried = distributed_settings.model_copy(update={"job_time_limit_seconds": 1})
    status = execute(job_id, hurried, make_storage(hurried), worker_id="hurried-worker")
    assert status == "failed"
    job = api.get(f"/v1/jobs/{job_id}", headers=keys["alice"]).json()
    assert job["status"] == "failed"
    assert job["error"]["code"] == "time_limit_exceeded"
    assert "time limit of 1 s" in job["error"]["message"]
    assert api.get(f"/v1/jobs/{job_id}/artifacts", headers=keys["alice"]).status_code == 409


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_every_asset_from_the_service(api: TestClient, page: str) -> None:
    """No CDN: on a machine without internet the page must still render."""
    html = api.get(page)
    assert html.status_code == 200
    assets = re.findall(r'(?:src|href)="([^"]+)"', html.text)
    assert assets and all(url.startswith("/") and not url.startswith("//") for url in assets), assets
    scripts = [url for url in assets if url.endswith(".js")]
    assert scripts, assets
    for url in assets:
        response = api.get(url)
        assert response.status_code == 200, url
        expected = {".js": "javascript", ".css": "text/css", ".png": "image/png"}[Path(url).suffix]
        assert expected in response.headers["content-type"] and len(response.content) > 1000, url
