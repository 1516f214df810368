"""Jobs through the real pipeline on stories260K: PostgreSQL, Redis, a Celery worker process, SeaweedFS S3."""

import json
import math
import re
import time
from datetime import datetime
from itertools import groupby
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from casp_core.artifacts.checkpoint import load_pruned
from casp_core.artifacts.dense_cache import CACHE_FOLDER as DENSE_EVALUATIONS
from casp_core.job.stages import job_stages
from casp_core.settings import PruneConfig
from service.dispatch import CeleryDispatcher
from service.settings import Settings
from service.storage import make_storage
from tests.service_fixtures import (
    FIXTURE_DATA,
    REPO,
    RUNS_UNTIL_CANCELLED,
    SMALL_JOB,
    WorkerProcess,
    download,
    download_artifacts,
    expected_parameters,
    finished,
    wait_for,
    wait_job,
)
from worker.runner import Segments

pytestmark = pytest.mark.service

CHECKPOINT_FILES = {"config.json", "model.safetensors", "generation_config.json", "modeling_casp_llama.py"}


def events_of(api: TestClient, job_id: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    events, after = [], None
    while True:
        params = {"limit": 100, **({"after": after} if after is not None else {})}
        page = api.get(f"/v1/jobs/{job_id}/events", params=params, headers=headers).json()
        events += page["data"]
        if not page["has_more"]:
            return events
        after = page["data"][-1]["id"]


def running_with_progress(job: dict[str, Any]) -> bool:
    assert not finished(job), job
    return job["status"] == "running" and job["stage"] is not None


@pytest.mark.slow
def test_job_succeeds_and_every_artifact_downloads_and_loads(
    api: TestClient,
    keys: dict[str, dict[str, str]],
    worker: WorkerProcess,
    distributed_settings: Settings,
    tmp_path: Path,
) -> None:
    alice = keys["alice"]
    job = api.post("/v1/jobs", json={**SMALL_JOB, "export": ["gguf"], "metadata": {"run": "e2e"}}, headers=alice).json()
    done = wait_job(api, job["id"], alice, finished, "the job to finish")
    assert done["status"] == "succeeded", (done, worker.log_tail())
    assert done["progress"] == 100 and done["attempts"] == 1 and done["error"] is None
    assert done["started_at"] <= done["finished_at"]

    result = done["result"]
    assert 0 < result["params"]["pruned"] < result["params"]["dense"]
    assert result["achieved_ratio"] == pytest.approx(0.3, abs=0.05)
    assert result["achieved_ratio"] == round(result["achieved_ratio"], 6)  # for display; report.json keeps it exact
    ppl = result["perplexity"]["wikitext2"]
    assert ppl["seq_len"] == 128 and 1 < ppl["dense"] < ppl["pruned"] < math.inf
    # One row per file as deployed: the checkpoint by transformers, the GGUF in llama.cpp on the same windows.
    checkpoint_row, gguf_row = result["artifacts"]["rows"]
    assert checkpoint_row["file"] == "model.safetensors" and checkpoint_row["perplexity"]["wikitext2"] == ppl["pruned"]
    assert gguf_row["file"] == "model-f16.gguf" and gguf_row["perplexity_in"] == "llama.cpp"
    assert gguf_row["perplexity"]["wikitext2"] == pytest.approx(ppl["pruned"], rel=0.01)

    events = events_of(api, job["id"], alice)
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)
    assert events[0]["status"] == "queued" and events[-1]["status"] == "succeeded"
    progress = [e["progress"] for e in events if e["kind"] == "progress"]
    assert progress == sorted(progress) and progress[-1] == 100
    # Every stage change is an event, in run_job's order (evaluation of the dense, then the pruned model), and
    # the progress bar's segments are those stages. The placement chosen is an event of its own before the
    # allocation, inside the evaluation's segment (as alpha auto's "temperature" would be).
    placement = [e for e in events if e["kind"] == "progress" and e["stage"] == "placement"]
    assert len(placement) == 1 and placement[0]["message"].startswith("the CPU holds the model ("), placement
    stages = [stage for stage, _ in groupby(e["stage"] for e in events if e["kind"] == "progress")]
    stages.remove("placement")
    # Events name no path of the server's: not the model's folder, nor where the worker wrote the checkpoint.
    assert not [e["message"] for e in events if "/" in (e["message"] or "")], events
    assert stages == list(Segments.of(job_stages(PruneConfig(ratio=0.3))).stages)

    checkpoint = tmp_path / "checkpoint"
    artifacts = download_artifacts(api, job["id"], alice, checkpoint)  # presigned by S3 itself
    names = {a["name"] for a in artifacts}
    assert CHECKPOINT_FILES | {"README.md", "report.json", "report.md", "model-f16.gguf"} <= names  # gguf: llama.cpp
    assert any(name.startswith("tokenizer") for name in names)

    report = json.loads((checkpoint / "report.json").read_text())
    assert round(report["achieved_ratio"], 6) == result["achieved_ratio"]  # the result rounds it for display
    assert report["achieved_ratio"] == 1 - report["params"]["pruned"] / report["params"]["dense"]  # exact there
    # Nothing the job shows names a folder of the server's: its home (where the worker works and writes), the model
    # root, the data sets' folder; not its events, its result or any field of its report. (The job echoes the model
    # as the caller named it, a path under an allowed root.)
    assert done["model"] == SMALL_JOB["model"]
    server_folders = [str(distributed_settings.home), str(REPO / "demo"), str(FIXTURE_DATA)]
    shown = json.dumps([{**done, "model": None}, events, report])
    assert [folder for folder in server_folders if folder in shown] == []
    assert report["params"] == result["params"]
    assert report["artifacts"] == result["artifacts"]
    # Every GGUF written is an artifact, with the digest the export computed.
    digests = {artifact["name"]: artifact["sha256"] for artifact in artifacts}
    assert {export["path"]: export["sha256"] for export in report["exports"]}.items() <= digests.items()

    model, tokenizer = load_pruned(checkpoint)
    assert sum(p.numel() for p in model.parameters()) == expected_parameters(result)
    ids = tokenizer("Once upon a time there was a little girl", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
        again = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)(ids).logits
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()
    torch.testing.assert_close(again, logits)

    # A tampered or expired presigned URL is refused by S3.
    url = artifacts[0]["url"]
    assert download(url.replace("X-Amz-Signature=", "X-Amz-Signature=0")).status_code == 403
    # Valid for 2 s from X-Amz-Date, which is truncated to the second: at least 1 s left to use it.
    short = make_storage(distributed_settings).url(job["id"], artifacts[0]["name"], 2, "")
    assert download(short).status_code == 200
    time.sleep(3.1)
    assert download(short).status_code == 403

    metrics = api.get("/metrics").text
    assert 'casp_stage_duration_seconds_count{stage="pruning"}' in metrics
    assert 'casp_jobs{status="succeeded"} 0.0' not in metrics

    # Another job on the same model, at another ratio: the worker keeps the dense evaluation in its cache
    # ($CASP_HOME/cache), so this one reuses it and says from when (the first job's own evaluation, or the one
    # it reused in turn when an earlier test ran the same model).
    assert list((distributed_settings.cache / DENSE_EVALUATIONS).glob("*.json"))
    again = api.post("/v1/jobs", json={**SMALL_JOB, "ratio": 0.2}, headers=alice).json()
    again_done = wait_job(api, again["id"], alice, finished, "the second job to finish")
    assert again_done["status"] == "succeeded", (again_done, worker.log_tail())
    assert again_done["result"]["perplexity"]["wikitext2"]["dense"] == ppl["dense"]
    reuse = re.compile(r"dense model: figures reused from its evaluation of (\S+)")
    reused_by_first = [match[1] for e in events if (match := reuse.fullmatch(e["message"] or ""))]
    again_events = events_of(api, again["id"], alice)
    (measured_at,) = [match[1] for e in again_events if (match := reuse.fullmatch(e["message"] or ""))]
    if reused_by_first:
        assert reused_by_first == [measured_at]
    else:
        started, ended = (
            datetime.fromisoformat(done[key]).replace(microsecond=0) for key in ("started_at", "finished_at")
        )
        assert started <= datetime.fromisoformat(measured_at) <= ended
        assert "evaluation_dense" in report["timings"]
    report_url = next(
        a["url"]
        for a in api.get(f"/v1/jobs/{again['id']}/artifacts", headers=alice).json()["data"]
        if a["name"] == "report.json"
    )
    again_report = download(report_url).json()
    assert again_report["evaluation"]["dense_reused"] == {"measured_at": measured_at}
    assert "evaluation_dense" not in again_report["timings"]

    # The same job delivered again (a duplicate message) is dropped: it neither reruns nor changes.
    CeleryDispatcher(distributed_settings).enqueue(job["id"], "casp-cpu")
    wait_for(lambda: f"job {job['id']} is not queued" in worker.log_tail(), 60, "the duplicate to be dropped")
    assert api.get(f"/v1/jobs/{job['id']}", headers=alice).json() == done

    assert api.delete(f"/v1/jobs/{job['id']}", headers=alice).status_code == 204
    assert api.get(f"/v1/jobs/{job['id']}/artifacts", headers=alice).status_code == 410
    assert download(url).status_code == 404  # still validly signed, but the object is gone


def test_cancel_a_running_job_and_a_queued_one_behind_it(
    api: TestClient, keys: dict[str, dict[str, str]], worker: WorkerProcess, distributed_settings: Settings
) -> None:
    alice = keys["alice"]
    running = api.post("/v1/jobs", json=RUNS_UNTIL_CANCELLED, headers=alice).json()
    wait_job(api, running["id"], alice, running_with_progress, "the job to run")
    # One worker, one job at a time: this one waits in the queue.
    queued = api.post("/v1/jobs", json=SMALL_JOB, headers=alice).json()
    assert api.post(f"/v1/jobs/{queued['id']}/cancel", headers=alice).json()["status"] == "cancelled"

    flagged = api.post(f"/v1/jobs/{running['id']}/cancel", headers=alice).json()
    assert flagged["status"] == "running" and flagged["cancel_requested"]
    done = wait_job(api, running["id"], alice, finished, "the running job to stop")
    assert done["status"] == "cancelled" and done["result"] is None and done["error"] is None, done
    # Progress may still arrive until the worker reads the flag at its next layer boundary.
    messages = [e["message"] for e in events_of(api, running["id"], alice)]
    assert messages[-1] == "cancelled" and "cancel requested" in messages[:-1]
    assert api.get(f"/v1/jobs/{running['id']}/artifacts", headers=alice).status_code == 409

    # The queued job's message still reaches the worker, which must not start it.
    wait_for(lambda: f"job {queued['id']} is not queued" in worker.log_tail(), 60, "the queued job's message")
    never_ran = api.get(f"/v1/jobs/{queued['id']}", headers=alice).json()
    assert never_ran["status"] == "cancelled" and never_ran["attempts"] == 0 and never_ran["started_at"] is None
    assert redis.Redis.from_url(distributed_settings.broker_url).llen("casp-cpu") == 0


@pytest.mark.slow
def test_a_killed_worker_does_not_lose_the_job(
    api: TestClient, keys: dict[str, dict[str, str]], worker: WorkerProcess, distributed_settings: Settings
) -> None:
    alice = keys["alice"]
    job = api.post("/v1/jobs", json=SMALL_JOB, headers=alice).json()
    wait_job(api, job["id"], alice, running_with_progress, "the job to run")
    worker.kill()  # SIGKILL to the worker and its pool child: no cleanup, no acknowledgement
    # Nothing but the reaper can tell that the worker is gone: the row still says running.
    assert api.get(f"/v1/jobs/{job['id']}", headers=alice).json()["status"] == "running"
    worker.start()
    done = wait_job(api, job["id"], alice, finished, "the job to finish after the restart")
    assert done["status"] == "succeeded", (done, worker.log_tail())
    assert done["attempts"] == 2
    events = events_of(api, job["id"], alice)
    assert any(e["message"].startswith("worker lost; queued again, to start over") for e in events)
    assert {e["attempt"] for e in events if e["kind"] == "progress"} == {1, 2}
    assert len(api.get(f"/v1/jobs/{job['id']}/artifacts", headers=alice).json()["data"]) >= 6


def test_a_job_that_cannot_load_its_model_fails_with_a_clear_error(
    api: TestClient, keys: dict[str, dict[str, str]], worker: WorkerProcess
) -> None:
    alice = keys["alice"]
    # Offline (HF_HUB_OFFLINE=1) and not cached: casp_core cannot find it.
    job = api.post("/v1/jobs", json={**SMALL_JOB, "model": "casp-tests/no-such-model"}, headers=alice).json()
    done = wait_job(api, job["id"], alice, finished, "the job to fail")
    assert done["status"] == "failed" and done["error"]["code"] == "model_not_found", done
    assert done["result"] is None and done["attempts"] == 1
