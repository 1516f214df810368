"""A job with recovery through the real service (PostgreSQL, Redis, a Celery worker process, S3): its worker is
killed mid-training, its local work folder is removed (the retry might run on another machine), and the retry
resumes from what the job's storage kept: the pruned model (no pruning again) and the last training save."""

import re
import shutil
from typing import Any

import pytest
from fastapi.testclient import TestClient

from casp_core.artifacts.snapshot import SNAPSHOT_FILE
from casp_core.recovery.train import STATE_FILE
from service.settings import Settings
from service.storage import S3Storage, make_storage
from tests.service_fixtures import SMALL_JOB, WorkerProcess, finished, wait_for, wait_job
from tests.worker.test_jobs_e2e import events_of

pytestmark = pytest.mark.service

STEPS = 40
RECOVERY_JOB: dict[str, Any] = {
    **SMALL_JOB,
    "ratio": 0.5,
    "recovery": {
        "method": "lora",
        "dataset": "ptb:validation",
        "max_steps": STEPS,
        "batch_size": 2,
        "grad_accum": 1,
        "max_seq_len": 64,
        "lr": 1e-3,
        "save_every": 2,
    },
}
STEP = re.compile(r"^step (\d+)/")


def steps_reported(api: TestClient, job_id: str, headers: dict[str, str]) -> int:
    found = [STEP.match(e["message"] or "") for e in events_of(api, job_id, headers)]
    return max((int(match.group(1)) for match in found if match), default=0)


def work_keys(storage: S3Storage, job_id: str) -> list[str]:
    listed = storage.client.list_objects_v2(Bucket=storage.bucket, Prefix=storage.key(job_id, folder="work") + "/")
    return [item["Key"] for item in listed.get("Contents", [])]


@pytest.mark.slow
def test_a_killed_worker_resumes_recovery_from_its_last_save(
    api: TestClient, keys: dict[str, dict[str, str]], worker: WorkerProcess, distributed_settings: Settings
) -> None:
    alice = keys["alice"]
    storage = make_storage(distributed_settings)
    assert isinstance(storage, S3Storage)
    job = api.post("/v1/jobs", json=RECOVERY_JOB, headers=alice).json()
    wait_for(lambda: steps_reported(api, job["id"], alice) >= 5, 300, "the recovery stage to train")
    worker.kill()  # SIGKILL to the worker and its pool child, mid-stage
    assert sorted(work_keys(storage, job["id"])) == sorted(
        storage.key(job["id"], name, "work") for name in (SNAPSHOT_FILE, STATE_FILE)
    )
    # The retry finds nothing on this disk, as on another machine: only the stored state can resume it.
    local_work = distributed_settings.home / "work" / job["id"]
    assert local_work.is_dir()
    shutil.rmtree(local_work)
    worker.start()
    done = wait_job(api, job["id"], alice, finished, "the job to finish after the restart")
    assert done["status"] == "succeeded", (done, worker.log_tail())
    assert done["attempts"] == 2
    recovery = done["result"]["recovery"]
    # Saved every 2 steps: the retry starts from an even step at least 4, where the first attempt had reached.
    resumed = recovery["resumed_from_step"]
    assert resumed is not None and resumed % 2 == 0 and resumed >= 4, recovery
    assert recovery["steps"] == STEPS and recovery["final_loss"] > 0
    events = events_of(api, job["id"], alice)
    retried = [e for e in events if e["attempt"] == 2]
    messages = [e["message"] for e in retried]
    assert f"resumed from step {resumed} of {STEPS}" in messages
    # The retry loaded the pruned model the first attempt saved: it neither pruned nor evaluated before training.
    assert any(message.startswith("resumed after pruning (snapshot saved ") for message in messages), messages
    assert not {"allocation", "pruning", "verification"} & {e["stage"] for e in retried}
    assert {"allocation", "pruning", "verification"} <= {e["stage"] for e in events if e["attempt"] == 1}
    # The report is whole: the figures and the pruning section come from the snapshot.
    result = done["result"]
    assert 0.4 < result["achieved_ratio"] < 0.6
    assert result["params"]["pruned"] < result["params"]["dense"]
    wikitext = result["perplexity"]["wikitext2"]
    assert {"dense", "pruned", "recovered"} <= set(wikitext)
    assert wikitext["dense"] < wikitext["pruned"], wikitext
    names = {a["name"] for a in api.get(f"/v1/jobs/{job['id']}/artifacts", headers=alice).json()["data"]}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "plots/recovery_loss.png"} <= names
    assert not any(name.startswith("recovery-state") for name in names)
    assert work_keys(storage, job["id"]) == []  # the job has ended: its work in progress is gone
